/* elementmath.h: per-element formulas the CPU kernels (native/cpu) and the CUDA kernels
 * (native/cuda) must compute alike, written once (not part of the C API; cffi never reads
 * it): dropout's hash (its bits decide the mask on both backends) and the AdamW update. */
#ifndef GT_ELEMENTMATH_H
#define GT_ELEMENTMATH_H

#include <math.h>
#include <stdint.h>

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

#endif
