/* act8.h: what the 8-bit-activation kernels (qdot8.c, qdot8k.c) share: a block's f16 field,
 * llama.cpp's order for the sum of eight float lanes, and an exact int32 horizontal sum. */
#ifndef GT_ACT8_H
#define GT_ACT8_H

#include "internal.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

/* hsum_float_8's order: ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)) */
static inline float gt_hsum8_(const float a[8]) {
    const float r0 = a[0] + a[4], r1 = a[1] + a[5], r2 = a[2] + a[6], r3 = a[3] + a[7];
    return (r0 + r2) + (r1 + r3);
}

#if defined(__x86_64__)
/* the f16 at p (little-endian), by F16C: the same value as gt_half_at_ */
static inline __attribute__((always_inline, target("f16c"))) float gt_half_at_f16c_(const uint8_t *p) {
    return _cvtsh_ss((uint16_t)(p[0] | p[1] << 8));
}

/* the sum of eight int32 lanes (exact in any order) */
static inline __attribute__((always_inline, target("avx2"))) int32_t gt_hsum_i32_(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_extracti128_si256(v, 1), _mm256_castsi256_si128(v));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}

static inline __attribute__((always_inline, target("avx2"))) float gt_hsum8_256_(__m256 a) {
    float t[8];
    _mm256_storeu_ps(t, a);
    return gt_hsum8_(t);
}
#endif

#endif
