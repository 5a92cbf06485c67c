/* simd.h: GT_CLONES marks a plain-C loop to be compiled for AVX-512, AVX2 and
 * generic x86-64, the right one picked at load time (GCC function multiversioning).
 * Where that is unavailable it is a plain function. No -ffast-math anywhere, so
 * the clones compute exactly the same results as the plain loop. */
#ifndef GT_SIMD_H
#define GT_SIMD_H
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#define GT_CLONES __attribute__((target_clones("avx512f", "arch=x86-64-v3", "default")))
#else
#define GT_CLONES
#endif

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#include "../elementmath.h"
/* gt_expf_ (elementmath.h) on 16 lanes, its bits exactly, in fewer instructions than GCC
 * makes of the plain C (for loops where the exp is a large share: attention's softmax):
 * 2^n by vscalefps from n as a float rather than built in the exponent bits, so the clamp
 * of x to [lo, hi] that keeps those bits valid goes; both end cases are selected after, as
 * in gt_expf_ (x < lo: 0; x > hi: inf; NaN stays NaN). Same reduction, polynomial and
 * roundings: for x in [lo, hi], n is in [-126, 127] and p 2^n is the one rounding of the
 * product either way (scalef rounds a subnormal result as the multiply does). Checked bit for
 * bit against the plain C by tests/test_attention.py::test_avx512_exp_keeps_the_bits. */
static inline __attribute__((always_inline, target("avx512f"))) __m512 gt_expf16_(__m512 x) {
    const __m512 magic = _mm512_set1_ps(GT_EXPF_ROUND);
    const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(GT_EXPF_LOG2E), magic), magic);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(GT_EXPF_LN2_HI), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(GT_EXPF_LN2_LO), r);
    __m512 p = _mm512_set1_ps(GT_EXPF_P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(GT_EXPF_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(GT_EXPF_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(GT_EXPF_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(GT_EXPF_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(GT_EXPF_P5));
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    __m512 y = _mm512_scalef_ps(p, n);
    y = _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, _mm512_set1_ps(GT_EXPF_LO), _CMP_LT_OQ), _mm512_setzero_ps());
    return _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, _mm512_set1_ps(GT_EXPF_HI), _CMP_GT_OQ),
                              _mm512_set1_ps(INFINITY));
}
#endif
#endif
