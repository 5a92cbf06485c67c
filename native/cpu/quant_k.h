/* quant_k.h: the pieces of ggml's block writers that its two ways of quantizing share (not part
 * of the C API): the reference writers without an importance matrix (quant_k.c, quant.c) and
 * the writers that weight each column by one (quant_imatrix.c). The scale searches and the
 * packing of sub-block scales and values are defined once, in quant_k.c. */
#ifndef GT_QUANT_K_H
#define GT_QUANT_K_H

#include "internal.h"

#define QK_K 256
/* sub-blocks whose largest magnitude is below this are all zeros (ggml's GROUP_MAX_EPS) */
#define GT_ZERO_GROUP 1e-15f

static inline int gt_imin_(int a, int b) { return a < b ? a : b; }
static inline int gt_clampi_(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

/* f rounded to the nearest integer, ties to even, by adding 1.5 * 2^23 (ggml's nearest_int:
 * the same bits for any input, also outside the |f| < 2^22 it is meant for). */
static inline int gt_nearest_int_(float f) {
    const float v = f + 12582912.0f;
    int32_t bits;
    memcpy(&bits, &v, sizeof bits);
    return (bits & 0x007fffff) - 0x00400000;
}

/* f as the f16 at p (little-endian): a block's scale */
static inline void gt_put_half_(uint8_t *p, float f) {
    const uint16_t h = gt_f32_to_f16_1(f);
    p[0] = (uint8_t)(h & 0xff);
    p[1] = (uint8_t)(h >> 8);
}

/* The scale and min (returned, and *neg_min = -min) of x (n) as scale * L + min, L in
 * [0, nmax], min <= 0, the least weighted error (absolute with use_mad, else squared) of
 * the range's scale and nstep + 1 others (ggml's make_qkx2_quants, and make_qkx3_quants with
 * weights: their arithmetic is the same). L: the levels; Laux: scratch of n. */
float gt_fit_scale_min_(int n, int nmax, const float *x, const float *weights, uint8_t *L, float *neg_min,
                        uint8_t *Laux, float rmin, float rdelta, int nstep, int use_mad);
/* The symmetric scale of x (n) as scale * (L - nmax), L - nmax in [-nmax, nmax - 1], of the
 * largest weighted (sum w x l)^2 / sum w l^2 over 19 candidate scales; weights qw, or x^2 where
 * qw is NULL (ggml's make_qx_quants, rmse_type 1). L: the levels plus nmax. */
float gt_fit_scale_sym_(int n, int nmax, const float *x, const float *qw, int8_t *L);

/* Q2_K: values rounded against the block's stored scales, mins, d and dmin (b: the block,
 * its scales and d/dmin already written), then packed. L: 256 levels in and out. */
void gt_q2_k_finish_(uint8_t *b, uint8_t *L, const float *x);
/* Q3_K: the sixteen 6-bit scales ls (stored values, 0..63) and d written, the values rounded
 * against them (sub-blocks of zero scale keep L, levels plus 4) and packed. */
void gt_q3_k_finish_(uint8_t *b, int8_t *L, const float *x, const uint8_t *ls, float d);
/* Q4_K and Q5_K: the eight 6-bit scales ls and mins lm (0..63), d and dmin written, the values
 * rounded to [0, nmax] against them (sub-blocks of zero scale keep L), and packed (nmax 15:
 * Q4_K's layout, 31: Q5_K's). */
void gt_k4_finish_(uint8_t *b, uint8_t *L, const float *x, int nmax, const uint8_t *ls, const uint8_t *lm,
                   float d, float dmin);
/* Q6_K, nb blocks: gt_quant_q6_k_'s writer with the sub-block fits weighted by qw (256 a block,
 * the block's own) or by x^2 where qw is NULL. */
void gt_quant_q6_k_weighted_(uint8_t *b, const float *x, int64_t nb, const float *qw);

/* Q5_0/Q5_1: 32 levels q (0..31), the low nibbles into qs (value j and j + 16 in byte j), the
 * fifth bits into the u32 qh (quant.c). */
void gt_pack_5bit_(uint8_t *qh, uint8_t *qs, const int *q);

#endif
