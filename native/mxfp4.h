/* mxfp4.h: the facts of ggml's MXFP4 block (GGML_TYPE_MXFP4, 39), written once for the CPU
 * kernels (native/cpu) and the CUDA ones (native/cuda); not part of the C API (cffi never
 * reads it). A block holds 32 values in 17 bytes: one E8M0 scale byte e, then 16 bytes of
 * 4-bit E2M1 codes, byte j holding element j (low nibble) and j + 16 (high nibble):
 *     x = gt_mxfp4_value(code) * gt_e8m0_half(e)
 * where the E2M1 values are kept doubled (integers, ggml's kvalues_mxfp4) and the scale
 * halved to match (ggml's ggml_e8m0_to_fp32_half: 2^(e - 128), f32 denormals for e < 2), so
 * every decoded value is one exact product. */
#ifndef GT_MXFP4_H
#define GT_MXFP4_H

#include <stdint.h>

#ifdef __CUDACC__
#define GT_MXFP4_HD __host__ __device__
#else
#define GT_MXFP4_HD
#endif

enum { GT_MXFP4_BLOCK = 32, GT_MXFP4_BLOCK_BYTES = 1 + GT_MXFP4_BLOCK / 2 };

/* The 16 codes' E2M1 values, doubled: sign bit 3, magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6. */
#define GT_MXFP4_VALUES {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12}

GT_MXFP4_HD static inline int gt_mxfp4_value(unsigned code) {
    const int8_t v[16] = GT_MXFP4_VALUES;
    return v[code & 15];
}

/* 2^(e - 128) as f32: the E8M0 scale 2^(e - 127) halved. */
GT_MXFP4_HD static inline float gt_e8m0_half(uint8_t e) {
    union { uint32_t u; float f; } v;
    v.u = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    return v.f;
}

#endif
