/* elementmath.h: per-element formulas the CPU kernels (native/cpu) and the CUDA kernels
 * (native/cuda) must compute alike, written once (not part of the C API; cffi never reads
 * it): dropout's hash (its bits decide the mask on both backends), the AdamW update and exp. */
#ifndef GT_ELEMENTMATH_H
#define GT_ELEMENTMATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define GT_HD __host__ __device__
#else
#define GT_HD
#endif

GT_HD static inline uint32_t gt_rotl32(uint32_t x, int r) { return (x << r) | (x >> (32 - r)); }

/* One 4-byte block of MurmurHash3_x86_32 (Austin Appleby, SMHasher) mixed into h. */
GT_HD static inline uint32_t gt_murmur3_block(uint32_t h, uint32_t k) {
    k *= 0xcc9e2d51u;
    k = gt_rotl32(k, 15);
    k *= 0x1b873593u;
    h ^= k;
    h = gt_rotl32(h, 13);
    return h * 5u + 0xe6546b64u;
}

/* MurmurHash3_x86_32's finaliser (fmix32), applied after the length is xored in. */
GT_HD static inline uint32_t gt_murmur3_fmix(uint32_t h) {
    h ^= h >> 16;
    h *= 0x85ebca6bu;
    h ^= h >> 13;
    h *= 0xc2b2ae35u;
    h ^= h >> 16;
    return h;
}

/* dropout's hash of flat index (lo, hi words) from h1, the state after the seed and salt
 * blocks: the 12-byte key's last two blocks, the length, fmix. */
GT_HD static inline uint32_t gt_dropout_hash(uint32_t h1, uint32_t lo, uint32_t hi) {
    return gt_murmur3_fmix(gt_murmur3_block(gt_murmur3_block(h1, lo), hi) ^ 12u);
}

/* One AdamW element, in place: gradient g (already clipped by scale), moments m and v,
 * decoupled decay (decay = lr * wd), bias corrections bc1, bc2. */
GT_HD static inline void gt_adamw_1(float *p, float g, float *m, float *v, float lr, float b1, float b2, float eps,
                                    float decay, float bc1, float bc2) {
    const float mi = b1 * *m + (1.0f - b1) * g;
    const float vi = b2 * *v + (1.0f - b2) * g * g;
    *m = mi;
    *v = vi;
    const float mhat = mi / bc1, vhat = vi / bc2;
    *p = *p - decay * *p - lr * mhat / (sqrtf(vhat) + eps);
}

/* NOTE: exp without libm, so that GCC vectorizes the loops that call it (libm's
 * expf is a scalar call), and the same function on the GPU (nvcc -fmad=false: no
 * contraction there either), so both backends' softmax, silu, GELU and attention take
 * one exp's bits. Cephes' expf: x = n ln2 + r with |r| <= ln2/2 (ln2 in
 * two parts so n ln2 is exact), exp(r) by a degree-7 polynomial, 2^n built in
 * the exponent bits. n is rounded with the 1.5 * 2^23 trick and read back from
 * the float's bits (no float -> int conversion, so no UB for NaN). The reduction
 * and the polynomial's Horner steps are explicit fmaf (one rounding each): 9
 * vector instructions fewer than a multiply and an add apiece (the exp was a
 * quarter of the fused attention's forward time at head size 32), and the error falls from 1.4 to
 * 1.0 ulp on [-87.3, 88.3] (91% correctly rounded); x < -87.34 (results below
 * FLT_MIN) gives 0, x > 88.376 gives inf (true overflow is at 88.72; here arguments
 * are <= 0 after the max is subtracted; silu tolerates it), NaN stays NaN. No other
 * contraction (-std=c11; nvcc -fmad=false), and fmaf is exact wherever it runs (an
 * FMA instruction in the AVX2 and AVX-512 clones and on the GPU, libm's fmaf in a
 * baseline clone), so every SIMD clone and both backends give the same bits. */
/* its constants (simd.h's 16-lane twin reads the same ones) */
#define GT_EXPF_LO -87.336544f          /* below: 0 (n stays in [-126, 127]) */
#define GT_EXPF_HI 88.3762626f          /* above: inf */
#define GT_EXPF_LOG2E 1.44269504088896341f
#define GT_EXPF_ROUND 12582912.0f       /* 1.5 * 2^23 */
#define GT_EXPF_LN2_HI -0.693359375f    /* -ln2 in two parts */
#define GT_EXPF_LN2_LO 2.12194440e-4f
#define GT_EXPF_P0 1.9875691500e-4f     /* the polynomial, highest power first */
#define GT_EXPF_P1 1.3981999507e-3f
#define GT_EXPF_P2 8.3334519073e-3f
#define GT_EXPF_P3 4.1665795894e-2f
#define GT_EXPF_P4 1.6666665459e-1f
#define GT_EXPF_P5 5.0000001201e-1f
GT_HD static inline float gt_expf_(float x) {
    const float lo = GT_EXPF_LO, hi = GT_EXPF_HI;
    float xc = x < lo ? lo : x;
    xc = xc > hi ? hi : xc;
    const float kf = fmaf(xc, GT_EXPF_LOG2E, GT_EXPF_ROUND);   /* 1.5 * 2^23 + n */
    uint32_t kb;
    memcpy(&kb, &kf, sizeof kb);
    const float n = kf - GT_EXPF_ROUND;
    float r = fmaf(n, GT_EXPF_LN2_HI, xc);
    r = fmaf(n, GT_EXPF_LN2_LO, r);
    float p = GT_EXPF_P0;
    p = fmaf(p, r, GT_EXPF_P1);
    p = fmaf(p, r, GT_EXPF_P2);
    p = fmaf(p, r, GT_EXPF_P3);
    p = fmaf(p, r, GT_EXPF_P4);
    p = fmaf(p, r, GT_EXPF_P5);
    p = fmaf(p, r * r, r) + 1.0f;
    const uint32_t bits = (kb - 0x4B400000u + 127u) << 23;    /* 2^n */
    float s;
    memcpy(&s, &bits, sizeof s);
    float y = p * s;
    y = x < lo ? 0.0f : y;
    y = x > hi ? INFINITY : y;
    return y;
}

/* tanh(z) of gelu_tanh, z = sqrt(2/pi) x (1 + 0.044715 x^2), through the shared exp:
 * 1 - 2 / (exp(2z) + 1), exact at both ends (exp overflowing to inf gives 1). */
#define GT_GELU_K 0.7978845608028654f      /* sqrt(2 / pi) */
#define GT_GELU_A 0.044715f
GT_HD static inline float gt_gelu_tanh_t_(float x) {
    const float z = GT_GELU_K * x * (1.0f + GT_GELU_A * x * x);
    return 1.0f - 2.0f / (gt_expf_(2.0f * z) + 1.0f);
}

#endif
