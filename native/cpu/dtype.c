/* dtype.c: the one table of dtypes (element and ggml block types).
 *
 * Every fact about a type (its name, id, block size, bytes per block, and what
 * the core can do with it) is here; Python reads the table once at import
 * (ggtrain.native.dtypes) and computes every size from it. The block sizes are
 * ggml's (gguf-py's GGML_QUANT_SIZES is the test oracle). Types flagged
 * DEQUANTIZE are read by the kernels (frozen weights in matmul and get_rows);
 * the others can be parsed from and copied between GGUF files, nothing more.
 */
#include "internal.h"
#include "../mxfp4.h"

enum {
    F = GT_DTYPE_FLOAT, I = GT_DTYPE_INT, B = GT_DTYPE_BLOCK,
    D = GT_DTYPE_DEQUANTIZE, Q = GT_DTYPE_QUANTIZE
};

static const gt_dtype_traits TABLE[] = {
    {"f32", GT_F32, 1, 4, F | D | Q},
    {"f16", GT_F16, 1, 2, F | D | Q},
    {"q4_0", GT_Q4_0, 32, 18, B | D | Q},
    {"q4_1", GT_Q4_1, 32, 20, B | D | Q},
    {"q5_0", GT_Q5_0, 32, 22, B | D | Q},
    {"q5_1", GT_Q5_1, 32, 24, B | D | Q},
    {"q8_0", GT_Q8_0, 32, 34, B | D | Q},
    {"q8_1", 9, 32, 40, B},
    {"q2_k", GT_Q2_K, 256, 84, B | D | Q},
    {"q3_k", GT_Q3_K, 256, 110, B | D | Q},
    {"q4_k", GT_Q4_K, 256, 144, B | D | Q},
    {"q5_k", GT_Q5_K, 256, 176, B | D | Q},
    {"q6_k", GT_Q6_K, 256, 210, B | D | Q},
    {"q8_k", 15, 256, 292, B},
    {"iq2_xxs", 16, 256, 66, B},
    {"iq2_xs", 17, 256, 74, B},
    {"iq3_xxs", 18, 256, 98, B},
    {"iq1_s", 19, 256, 50, B},
    {"iq4_nl", 20, 32, 18, B},
    {"iq3_s", 21, 256, 110, B},
    {"iq2_s", 22, 256, 82, B},
    {"iq4_xs", 23, 256, 136, B},
    {"i8", 24, 1, 1, I},
    {"i16", 25, 1, 2, I},
    {"i32", GT_I32, 1, 4, I},
    {"i64", 27, 1, 8, I},
    {"f64", 28, 1, 8, F},
    {"iq1_m", 29, 256, 56, B},
    {"bf16", GT_BF16, 1, 2, F | D | Q},
    {"tq1_0", 34, 256, 54, B},
    {"tq2_0", 35, 256, 66, B},
    {"mxfp4", GT_MXFP4, GT_MXFP4_BLOCK, GT_MXFP4_BLOCK_BYTES, B | D | Q},
    {"nvfp4", 40, 64, 36, B},
    {"q1_0", 41, 128, 18, B},
};

int32_t gt_dtype_count(void) { return (int32_t)(sizeof TABLE / sizeof TABLE[0]); }

const gt_dtype_traits *gt_dtype_at(int32_t i) {
    return i >= 0 && i < gt_dtype_count() ? &TABLE[i] : NULL;
}

const gt_dtype_traits *gt_dtype_find_(int32_t id) {
    for (int32_t i = 0; i < gt_dtype_count(); i++)
        if (TABLE[i].id == id) return &TABLE[i];
    return NULL;
}
