/* ggmlnum.h: the float order of llama.cpp's CPU dot products, for the kernels' llama.cpp
 * modes (the decoder's act8 mode: attention.c's ggml rows, matmul_ggml.c's products).
 * As its AVX-512 build computes them (on every CPU here: same bits at every SIMD level):
 *   gt_ggml_dot (ggml_vec_dot_f32): 64 lanes, element i in lane i % 64, each lane an fma
 *     chain over i / 64; lanes l, l + 16, l + 32, l + 48 summed as (a_l + a_l+32) +
 *     (a_l+16 + a_l+48); those 16 by _mm512_reduce_add_ps's tree (gt_ggml_reduce16); then
 *     the n % 64 left over, as its compiler vectorized that loop: the first whole 8s'
 *     products rounded and added one by one, the last n % 8 fma'd (read from its machine
 *     code; its C is `sumf += x[i]*y[i]`);
 *   gt_ggml_dot_f16 (ggml_vec_dot_f16, its operands f16 values): the same 64 lanes, the
 *     leftovers' (exact) products added in double;
 *   gt_ggml_dot16 (tinyBLAS, its GEMM of 2 or more rows when k % 16 == 0): 16 fma lanes,
 *     then gt_ggml_reduce16. */
#ifndef GT_GGMLNUM_H
#define GT_GGMLNUM_H

#include <math.h>
#include <stdint.h>

static inline float gt_ggml_reduce16(const float v[16]) {
    float t3[8], t6[4];
    for (int i = 0; i < 8; i++) t3[i] = v[8 + i] + v[i];
    for (int i = 0; i < 4; i++) t6[i] = t3[4 + i] + t3[i];
    return (t6[0] + t6[2]) + (t6[1] + t6[3]);
}

static inline __attribute__((always_inline)) float gt_ggml_dot(const float *x, const float *y, int64_t n) {
    float a[64] = {0};
    const int64_t np = n & ~(int64_t)63;
    for (int64_t i = 0; i < np; i += 64)
        for (int l = 0; l < 64; l++) a[l] = fmaf(x[i + l], y[i + l], a[l]);
    float v[16];
    for (int l = 0; l < 16; l++) v[l] = (a[l] + a[l + 32]) + (a[l + 16] + a[l + 48]);
    float s = gt_ggml_reduce16(v);
    const int64_t n8 = np + ((n - np) & ~(int64_t)7);
    int64_t i = np;
    for (; i < n8; i++) {       /* (C11 mode: GCC contracts nothing unasked, so two roundings) */
        const float p = x[i] * y[i];
        s = s + p;
    }
    for (; i < n; i++) s = fmaf(x[i], y[i], s);
    return s;
}

static inline __attribute__((always_inline)) float gt_ggml_dot_f16(const float *x, const float *y, int64_t n) {
    const int64_t np = n & ~(int64_t)63;
    double s = (double)gt_ggml_dot(x, y, np);
    for (int64_t i = np; i < n; i++) s += (double)(x[i] * y[i]);
    return (float)s;
}

static inline __attribute__((always_inline)) float gt_ggml_dot16(const float *x, const float *y, int64_t n) {
    float a[16] = {0};
    for (int64_t i = 0; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++) a[l] = fmaf(x[i + l], y[i + l], a[l]);
    return gt_ggml_reduce16(a);
}

/* dst = src rounded to f16 and back (round to nearest even, as F16C converts: llama.cpp's
 * fp32-to-fp16 of activations meeting an f16 operand); matmul_ggml.c. */
void gt_round_f16_(float *dst, const float *src, int64_t n);

#endif
