/* rowops.h: small vector loops over one row that several kernels share (attention,
 * softmax, cross-entropy, rms_norm), written once. Each includer compiles its own copy (static; a
 * call across files would go through an ifunc), per SIMD level (GT_CLONES).
 *
 * NOTE: plain `for i < n` loops are not vectorized at -O2 by GCC 12 (its "very cheap"
 * cost model refuses loops that need a scalar epilogue), so these run in blocks of
 * GT_LANES plus a scalar tail, on restrict pointers. Same arithmetic per element
 * either way, and a fixed order: the same bits at every SIMD level. */
#ifndef GT_ROWOPS_H
#define GT_ROWOPS_H
#include <stdint.h>

#include "internal.h"
#include "simd.h"

#define GT_LANES 16

/* d = x * c */
GT_CLONES __attribute__((unused)) static void scale_row(float *restrict d, const float *restrict x, float c,
                                                        int64_t n) {
    int64_t i = 0;
    for (; i + GT_LANES <= n; i += GT_LANES)
        for (int k = 0; k < GT_LANES; k++) d[i + k] = x[i + k] * c;
    for (; i < n; i++) d[i] = x[i] * c;
}

/* d = d * c */
GT_CLONES __attribute__((unused)) static void mul_row(float *restrict d, float c, int64_t n) {
    int64_t i = 0;
    for (; i + GT_LANES <= n; i += GT_LANES)
        for (int k = 0; k < GT_LANES; k++) d[i + k] *= c;
    for (; i < n; i++) d[i] *= c;
}

/* sum of a[i] * b[i]: GT_LANES partial sums, added in lane order, then the tail */
GT_CLONES __attribute__((unused)) static float dot_row(const float *a, const float *b, int64_t n) {
    float acc[GT_LANES] = {0};
    int64_t i = 0;
    for (; i + GT_LANES <= n; i += GT_LANES)
        for (int k = 0; k < GT_LANES; k++) acc[k] += a[i + k] * b[i + k];
    float s = 0.0f;
    for (int k = 0; k < GT_LANES; k++) s += acc[k];
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* max over j of s * x[j]; n >= 1 */
GT_CLONES __attribute__((unused)) static float scaled_max_row(const float *x, float s, int64_t n) {
    float acc[GT_LANES];
    for (int k = 0; k < GT_LANES; k++) acc[k] = s * x[0];
    int64_t i = 0;
    for (; i + GT_LANES <= n; i += GT_LANES)
        for (int k = 0; k < GT_LANES; k++) {
            const float v = s * x[i + k];
            acc[k] = v > acc[k] ? v : acc[k];
        }
    float m = acc[0];
    for (int k = 1; k < GT_LANES; k++) m = acc[k] > m ? acc[k] : m;
    for (; i < n; i++) {
        const float v = s * x[i];
        m = v > m ? v : m;
    }
    return m;
}

/* d[j] = exp(d[j] - m) in place; returns sum of d in the order softmax.c's exp_row sums
 * (exp_row_inplace below: with AVX-512 through gt_expf16_, the same bits) */
static inline __attribute__((always_inline, unused)) float exp_row_finish(const float *lanes, float *d, float m,
                                                                         int64_t i, int64_t n) {
    /* both ways' end: the GT_LANES lane sums added in lane order, then the tail d[i:n] */
    float sum = 0.0f;
    for (int k = 0; k < GT_LANES; k++) sum += lanes[k];
    for (; i < n; i++) {
        const float e = gt_expf_(d[i] - m);
        d[i] = e;
        sum += e;
    }
    return sum;
}

GT_CLONES __attribute__((unused)) static float exp_row_inplace_c(float *d, float m, int64_t n) {
    float acc[GT_LANES] = {0};
    int64_t i = 0;
    for (; i + GT_LANES <= n; i += GT_LANES)
        for (int k = 0; k < GT_LANES; k++) {
            const float e = gt_expf_(d[i + k] - m);
            d[i + k] = e;
            acc[k] += e;
        }
    return exp_row_finish(acc, d, m, i, n);
}

#if defined(__x86_64__) && defined(__GNUC__)
/* exp_row_inplace_c with gt_expf16_ (simd.h: the same bits in fewer instructions): the same
 * lane sums, added in lane order, then the tail. Measured: the exps of the vocabulary's logits
 * were 15% of linear_cross_entropy's time in evaluation (SmolLM2, 49,152 entries). */
__attribute__((target("avx512f"), unused)) static float exp_row_inplace_512(float *d, float m, int64_t n) {
    __m512 acc = _mm512_setzero_ps();
    const __m512 mv = _mm512_set1_ps(m);
    int64_t i = 0;
    for (; i + GT_LANES <= n; i += GT_LANES) {
        const __m512 e = gt_expf16_(_mm512_sub_ps(_mm512_loadu_ps(d + i), mv));
        _mm512_storeu_ps(d + i, e);
        acc = _mm512_add_ps(acc, e);
    }
    float lanes[GT_LANES];
    _mm512_storeu_ps(lanes, acc);
    return exp_row_finish(lanes, d, m, i, n);
}
#endif

__attribute__((unused)) static inline float exp_row_inplace(float *d, float m, int64_t n) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (gt_simd_level_() >= 2) return exp_row_inplace_512(d, m, n);
#endif
    return exp_row_inplace_c(d, m, n);
}

#endif
