/* internal.h: helpers shared by the CPU kernels (not part of the C API). */
#ifndef GT_INTERNAL_H
#define GT_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "../gt_core.h"
#include "../ggtrain.h"
#include "../elementmath.h"

/* Records a formatted message with file and line for gt_last_error() and
 * returns `code`, so kernels write `return GT_FAIL(GT_ERR_SHAPE, "...", ...)`. */
int gt_set_error_(int code, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
#define GT_FAIL(code, ...) gt_set_error_((code), __FILE__, __LINE__, __VA_ARGS__)

/* numel, contiguity, rows and the argument checks, shared with the CUDA kernels */
#include "../checks.h"

/* Dispatch level chosen at run time: 0 scalar, 1 AVX2+FMA, 2 AVX-512F. */
int gt_simd_level_(void);

/* Same for a tensor broadcast to `like`'s shape (right-aligned dims; dims
 * of size 1 in t, or missing, contribute stride 0). */
static inline int64_t gt_row_offset_bcast(const gt_tensor *t, const gt_tensor *like, int64_t row) {
    int64_t off = 0;
    int d = t->ndim - 2;
    for (int i = like->ndim - 2; i >= 0; i--, d--) {
        int64_t n = like->shape[i];
        int64_t idx = row % n;
        row /= n;
        if (d >= 0 && t->shape[d] != 1) off += idx * t->strides[d];
    }
    return off;
}

/* Thread ith's share [lo, hi) of n items, split in contiguous blocks. */
static inline void gt_split(int64_t n, const gt_ctx *ctx, int64_t *lo, int64_t *hi) {
    int64_t per = (n + ctx->nth - 1) / ctx->nth;
    int64_t a = per * ctx->ith;
    int64_t b = a + per;
    *lo = a < n ? a : n;
    *hi = b < n ? b : n;
}

#include <math.h>

/* gt_expf_, the exp of softmax, silu, GELU's tanh and attention: ../elementmath.h (the CUDA
 * kernels compute it too). */


/* llama.cpp's CPU exp (ggml_v_expf of an AVX-512 build, lane by lane), for its numbers
 * (softmax in attention, silu): 2^n p(b), n = x / ln 2 rounded by the 1.5 * 2^23 trick,
 * b = x - n ln 2 in two parts, p of degree 5 (fmaf as its fused multiply-adds), 2^n applied by
 * scalef; |n| > 192 gives 0 or inf. gt_ggml_expf_fast_ is the same for |x| < 87 (|n| <= 126:
 * 2^n a normal float built in the exponent bits, so p * 2^n rounds once, as scalef does),
 * branch-free so that loops over it vectorize; callers redo |x| >= 87 by gt_ggml_expf_. */
static inline float gt_ggml_expf_poly_(float x, float *n_out) {
    const float r = 0x1.8p23f, z = fmaf(x, 0x1.715476p+0f, r), n = z - r;
    const float b = fmaf(-n, 0x1.7f7d1cp-20f, fmaf(-n, 0x1.62e4p-1f, x)), u = b * b;
    *n_out = n;
    return fmaf(fmaf(fmaf(0x1.0e4020p-7f, b, 0x1.573e2ep-5f), u, fmaf(0x1.555e66p-3f, b, 0x1.fffdb6p-2f)), u,
                fmaf(0x1.ffffecp-1f, b, 1.0f));
}

static inline float gt_ggml_expf_(float x) {
    float n;
    const float j = gt_ggml_expf_poly_(x, &n);
    if (!(fabsf(n) <= 192.0f)) return n > 0.0f ? INFINITY : 0.0f;
    return ldexpf(j, (int)n);
}

static inline float gt_ggml_expf_fast_(float x) {
    const float xc = x < -87.0f ? -87.0f : x > 87.0f ? 87.0f : x;
    float n;
    const float j = gt_ggml_expf_poly_(xc, &n);
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float p2;
    memcpy(&p2, &bits, sizeof p2);
    return j * p2;
}


/* The dtype table's entry for a type id, or NULL (dtype.c). */
const gt_dtype_traits *gt_dtype_find_(int32_t id);

/* Dequantize nb blocks (elements, for element types) of a type to f32, or NULL
 * for a type without a dequantizer (quant.c). */
typedef void (*gt_dequant_fn)(float *y, const uint8_t *b, int64_t nb);
gt_dequant_fn gt_dequantizer_(int32_t dtype);

/* y[r * ldy + n] = sum over k < K of x[r * ldx + k] * W[n, k] for r < m and n in
 * [n0, n1): a few rows of x times rows of a stored weight W of type dtype (not
 * f32), row n at w + n * row_bytes (qdot.c; its top comment gives the summation
 * order). m <= GT_QDOT_MAX_M; K a whole number of blocks; scratch: 64-byte
 * alignable room for GT_QDOT_SCRATCH_FLOATS floats. */
#define GT_QDOT_MAX_M 32
/* The row-dot kernels read W once, row after row, and fetch the rows this far ahead (the
 * hardware prefetcher alone left the 30 MB output projection at half the speed of an
 * L2-resident W). Harmless past the end (prefetches do not fault). */
#define GT_QDOT_PREFETCH_ROWS 8
/* Prefetch of the weight rows GT_QDOT_PREFETCH_ROWS ahead of the `rows` a row-dot kernel
 * reads at once (w: its first row), the stretch its step i (step_bytes of each row) spans:
 * those rows lie in one run of memory, and this walks it in order as the rows are read, so
 * the run comes in as one stream. Prefetching each row's own step (a line every row_bytes)
 * made eight rows (Q4_0's chain) or two (the pairs) so many short streams, and a core read
 * 10-12 GB/s from memory instead of 22-27 (a 178 MB Q8_0 head, Q4_0 FFN matrices). to_l2:
 * into L2 only (prefetcht1), for kernels that read several lines of each of their rows a
 * step (f16 and f32 weights' 4 rows of 64 elements): prefetched into L1 as well, SmolLM2's
 * 49152 x 576 F16 head came at 10.5 GB/s, into L2 at 24-30; the block kernels read 20 and 28
 * GB/s with L1, 16 and 24 with L2. */
static inline void gt_prefetch_ahead_(const uint8_t *w, int64_t row_bytes, int rows, int64_t i,
                                      int64_t step_bytes, int to_l2) {
    const char *p = (const char *)w + GT_QDOT_PREFETCH_ROWS * row_bytes + i * rows * step_bytes;
    for (int64_t off = 0; off < rows * step_bytes; off += 64) {
        if (to_l2) __builtin_prefetch(p + off, 0, 2);
        else __builtin_prefetch(p + off, 0, 3);
    }
}
#define GT_QDOT_SCRATCH_FLOATS 512
void gt_qdot_rows_(float *y, int64_t ldy, const float *x, int64_t ldx, int m, const uint8_t *w,
                   int64_t row_bytes, int32_t dtype, int64_t K, int64_t n0, int64_t n1, float *scratch);

/* Q4_K/Q5_K: the j-th of eight 6-bit (scale, min) pairs packed in 12 bytes. */
static inline void gt_k4_scale_min_(const uint8_t *q, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
        *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* A block of 32 activations quantized to 8 bits as llama.cpp's quantize_row_q8_0/q8_1 do
 * (qdot8.c): q = x * 127 / amax rounded to nearest even, d = amax / 127 and s = d * sum(q),
 * each kept as its f16 rounding (here as the f32 value of that f16); sum: the exact sum of q. */
typedef struct gt_act8 {
    float d, s;
    int32_t sum;
    int8_t q[32];
} gt_act8;

/* y[b] for the K / 32 blocks of x (K a multiple of 32). */
void gt_act8_quantize_(gt_act8 *y, const float *x, int64_t K);
/* A super-block of 256 activations quantized as llama.cpp's quantize_row_q8_K (its reference
 * code, which x86 runs): max = the element of largest magnitude (the first), iscale = -127 /
 * max, q = min(127, iscale * x rounded to nearest even), d = 1 / iscale (f32), and the sums of
 * q over each 16 elements. For the K-quant weights. */
typedef struct gt_act8k {
    float d;
    int8_t q[256];
    int16_t bsums[16];
} gt_act8k;

void gt_act8k_quantize_(gt_act8k *y, const float *x, int64_t K);
/* gt_qdot8_rows_ for the K-quant types of GT_ACT8_TYPES, x in gt_act8k super-blocks: the m
 * rows are rows m0.. of an M-row product, whose place in it picks llama.cpp's float order
 * (its one-row, repacked 4-row or tiled kernels: qdot8k.c's top comment). */
void gt_qdot8k_rows_(float *y, int64_t ldy, const gt_act8k *x, int64_t ldx, int m, int64_t M, int64_t m0,
                     const uint8_t *w, int64_t row_bytes, int32_t dtype, int64_t K, int64_t N, int64_t n0, int64_t n1);

/* 1 for the weight types the 8-bit path multiplies (GT_ACT8_TYPES), else 0. */
int gt_act8_supports_(int32_t dtype);
/* y[r * ldy + n] = the dot of x row r (K / 32 blocks, rows ldx blocks apart) with W row n,
 * for r < m and n in [n0, n1), W (N rows) of a GT_ACT8_TYPES type with rows row_bytes apart;
 * qdot8.c's top comment gives the integer and float order (which for Q4_0 depends on N). */
void gt_qdot8_rows_(float *y, int64_t ldy, const gt_act8 *x, int64_t ldx, int m, const uint8_t *w,
                    int64_t row_bytes, int32_t dtype, int64_t K, int64_t N, int64_t n0, int64_t n1);

/* C (M x N, row stride ldc) = (acc ? C : 0) + A @ B for the small products inside fused
 * kernels (matmul.c, the skinny path's register tiles): A[m, k] at a[m*ars + k*acs] (any
 * strides, read one element at a time), row k of B at b + k*ldb (N contiguous floats,
 * read only within them), C written only within its N columns. Each element is one chain
 * fma(A[m, k], B[k, n], acc) over k in order, as in gt_matmul_fwd_f32 (multiply-then-add
 * at SIMD level 0), so results do not depend on how a caller splits M or N. */
void gt_gemm_small_(float *c, int64_t ldc, const float *a, int64_t ars, int64_t acs, const float *b,
                    int64_t ldb, int64_t M, int64_t N, int64_t K, int acc);

/* C[0:M, n0:n1] (row stride ldc) = (acc ? C : 0) + A[0:M, 0:K] @ B[0:K, n0:n1] through
 * gt_matmul_fwd_f32's packed GEMM (the same fma chain per element, over k in order, so the
 * bits do not depend on M, on n0 and n1, or on how a caller blocks its rows; acc continues
 * each chain from C). A[m, k] at a[m*ars + k*acs], ars or acs 1. B f32 (btype GT_F32):
 * B[k, n] at b[k*brs + n*bcs], brs or bcs 1; else a whole stored weight of type btype, with
 * the strides its dequantized f32 copy would have: B = W^T (W (N, K): brs 1, bcs K) or
 * B = W (W (K, N): brs N, bcs 1), K (resp. N) whole blocks. n0 a multiple of
 * GT_GEMM_COL_UNIT. work: gt_gemm_work_bytes_(btype) bytes, any alignment. */
#define GT_GEMM_COL_UNIT 64
int64_t gt_gemm_work_bytes_(int32_t btype);
void gt_gemm_(float *c, int64_t ldc, const float *a, int64_t ars, int64_t acs, const void *b, int32_t btype,
              int64_t brs, int64_t bcs, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1, int acc,
              void *work);

/* deltachunk.c: delta_rule's chunked form (see there). Work: the _floats counts per thread.
 * fwd: o of the V heads r in [lo, hi) (b = r / Hv) without a carried state; bwd: dq | dk | dv |
 * dg | dbeta of the K heads r in [lo, hi) (b = r / Hk), as deltarule.c's kernels. */
int64_t gt_dr_chunk_fwd_floats_(int64_t Dk, int64_t Dv);
void gt_dr_chunk_fwd_(float *dst, float *work, const float *q, const float *k, const float *v, const float *g,
                      const float *beta, const int32_t *seg, int64_t lo, int64_t hi, int64_t T, int64_t Hk,
                      int64_t Hv, int64_t Dk, int64_t Dv);
int64_t gt_dr_chunk_bwd_floats_(int64_t T, int64_t Dk, int64_t Dv);
void gt_dr_chunk_bwd_(float *dst, float *work, const float *q, const float *k, const float *v, const float *g,
                      const float *beta, const float *go, const int32_t *seg, int64_t lo, int64_t hi, int64_t T,
                      int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv);

/* quant_k.c: nb super-blocks of 256 values of x written to b as Q2_K .. Q6_K the way ggml's
 * reference quantizers write them (no importance matrix). */
void gt_quant_q2_k_(uint8_t *b, const float *x, int64_t nb);
void gt_quant_q3_k_(uint8_t *b, const float *x, int64_t nb);
void gt_quant_q4_k_(uint8_t *b, const float *x, int64_t nb);
void gt_quant_q5_k_(uint8_t *b, const float *x, int64_t nb);
void gt_quant_q6_k_(uint8_t *b, const float *x, int64_t nb);

float gt_f16_to_f32_1(uint16_t h);
/* the f16 at p (little-endian) as f32: a block's scale */
static inline float gt_half_at_(const uint8_t *p) { return gt_f16_to_f32_1((uint16_t)(p[0] | (p[1] << 8))); }
uint16_t gt_f32_to_f16_1(float f);
float gt_bf16_to_f32_1(uint16_t h);
uint16_t gt_f32_to_bf16_1(float f);

#endif
