/* quant_k.c: writers of ggml's super-block types Q2_K .. Q6_K (256 elements a block), the
 * way llama.cpp's quantizer writes them without an importance matrix (ggml's reference
 * quantizers, which llama_model_quantize runs): each sub-block's scale (and min) is chosen by
 * a small search for the least weighted squared (Q2_K: absolute) error, the sub-block scales
 * are quantized to 4, 6 or 8 bits against one f16 super-block scale, and the values are then
 * rounded against the stored scales. Block layouts are in quant.c's top comment.
 *
 * Byte identity with llama.cpp needs its float arithmetic operation for operation: every
 * product and sum below is written in ggml's order (a * b * c is (a * b) * c), one rounding
 * each (C11 mode: no FMA contraction), the same strict comparisons in the searches, and
 * gt_nearest_int_'s magic-number rounding (ggml's nearest_int) where ggml uses it.
 *
 * The writers that weight columns by an importance matrix (quant_imatrix.c) search scales
 * differently but share the searches' building blocks and each type's last step (the values
 * rounded against the stored scales, and packed): quant_k.h.
 */
#include <math.h>

#include "quant_k.h"

/* Four 2-bit values of L (32 apart) in each byte: Q2_K's and Q3_K's low bits, 128 values into
 * 32 bytes, twice. */
static void pack_2bit(uint8_t *qs, const uint8_t *L) {
    for (int j = 0; j < QK_K; j += 128)
        for (int l = 0; l < 32; l++)
            qs[j / 4 + l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) | (L[j + l + 96] << 6));
}

/* The scale and min (returned, and *neg_min = -min) of x (n) as scale * L + min with L in
 * [0, nmax], min <= 0: start from the range, then try nstep + 1 other scales
 * (rmin + rdelta * is + nmax) / range, each with the least-squares scale and min of the levels
 * it rounds to under `weights`, and keep the least weighted error (absolute with use_mad,
 * else squared). L gets the levels; Laux is scratch of n. (ggml's make_qkx2_quants; its
 * make_qkx3_quants, given weights, differs only in returning early for max < min too, which
 * cannot happen: min <= x[0] <= max.) */
float gt_fit_scale_min_(int n, int nmax, const float *x, const float *weights, uint8_t *L, float *neg_min,
                        uint8_t *Laux, float rmin, float rdelta, int nstep, int use_mad) {
    float min = x[0], max = x[0];
    float sum_w = weights[0];
    float sum_x = sum_w * x[0];
    for (int i = 1; i < n; i++) {
        if (x[i] < min) min = x[i];
        if (x[i] > max) max = x[i];
        const float w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if (min > 0) min = 0;
    if (max == min) {
        memset(L, 0, (size_t)n);
        *neg_min = -min;
        return 0.0f;
    }
    float iscale = (float)nmax / (max - min);
    float scale = 1 / iscale;
    float best_error = 0;
    for (int i = 0; i < n; i++) {
        L[i] = (uint8_t)gt_clampi_(gt_nearest_int_(iscale * (x[i] - min)), 0, nmax);
        float diff = scale * (float)L[i] + min - x[i];
        diff = use_mad ? fabsf(diff) : diff * diff;
        best_error += weights[i] * diff;
    }
    if (nstep < 1) {
        *neg_min = -min;
        return scale;
    }
    for (int is = 0; is <= nstep; is++) {
        iscale = (rmin + rdelta * (float)is + (float)nmax) / (max - min);
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < n; i++) {
            const int l = gt_clampi_(gt_nearest_int_(iscale * (x[i] - min)), 0, nmax);
            Laux[i] = (uint8_t)l;
            const float w = weights[i];
            sum_l += w * (float)l;
            sum_l2 += w * (float)l * (float)l;
            sum_xl += w * (float)l * x[i];
        }
        const float D = sum_w * sum_l2 - sum_l * sum_l;
        if (D > 0) {
            float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
            float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
            if (this_min > 0) {
                this_min = 0;
                this_scale = sum_xl / sum_l2;
            }
            float cur_error = 0;
            for (int i = 0; i < n; i++) {
                float diff = this_scale * (float)Laux[i] + this_min - x[i];
                diff = use_mad ? fabsf(diff) : diff * diff;
                cur_error += weights[i] * diff;
            }
            if (cur_error < best_error) {
                memcpy(L, Laux, (size_t)n);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    *neg_min = -min;
    return scale;
}

/* The symmetric scale of x (n) as scale * (L - nmax) with L - nmax in [-nmax, nmax - 1],
 * weights qw (x^2 where qw is NULL): from the element of largest magnitude, then 18 nearby
 * scales -(nmax + 0.1 is) / max, keeping the one of largest (sum w x l)^2 / sum w l^2 (its
 * least-squares fit). L gets the levels plus nmax. (ggml's make_qx_quants, rmse_type 1.) */
float gt_fit_scale_sym_(int n, int nmax, const float *x, const float *qw, int8_t *L) {
    float max = 0, amax = 0;
    for (int i = 0; i < n; i++) {
        const float ax = fabsf(x[i]);
        if (ax > amax) {
            amax = ax;
            max = x[i];
        }
    }
    if (amax < GT_ZERO_GROUP) {
        memset(L, 0, (size_t)n);
        return 0.0f;
    }
    float iscale = (float)-nmax / max;
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; i++) {
        const int l = gt_clampi_(gt_nearest_int_(iscale * x[i]), -nmax, nmax - 1);
        L[i] = (int8_t)(l + nmax);
        const float w = qw ? qw[i] : x[i] * x[i];
        sumlx += w * x[i] * (float)l;
        suml2 += w * (float)l * (float)l;
    }
    float scale = suml2 != 0 ? sumlx / suml2 : 0.0f;
    float best = scale * sumlx;
    for (int is = -9; is <= 9; is++) {
        if (is == 0) continue;
        iscale = -((float)nmax + 0.1f * (float)is) / max;
        sumlx = suml2 = 0;
        for (int i = 0; i < n; i++) {
            const int l = gt_clampi_(gt_nearest_int_(iscale * x[i]), -nmax, nmax - 1);
            const float w = qw ? qw[i] : x[i] * x[i];
            sumlx += w * x[i] * (float)l;
            suml2 += w * (float)l * (float)l;
        }
        if (suml2 > 0 && sumlx * sumlx > best * suml2) {
            for (int i = 0; i < n; i++)
                L[i] = (int8_t)(nmax + gt_clampi_(gt_nearest_int_(iscale * x[i]), -nmax, nmax - 1));
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}

/* Q3_K's sub-block fit: levels l in [-nmax, nmax - 1] from the largest magnitude, then up to
 * five sweeps that move one level at a time to its least-squares value under weights x^2
 * while that raises (sum w x l)^2 / sum w l^2. L gets l + nmax; returns the least-squares
 * scale. (ggml's make_q3_quants with do_rmse.) */
static float fit_scale_q3(int n, int nmax, const float *x, int8_t *L) {
    float max = 0, amax = 0;
    for (int i = 0; i < n; i++) {
        const float ax = fabsf(x[i]);
        if (ax > amax) {
            amax = ax;
            max = x[i];
        }
    }
    if (amax < GT_ZERO_GROUP) {
        memset(L, 0, (size_t)n);
        return 0.0f;
    }
    const float iscale = (float)-nmax / max;
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; i++) {
        const int l = gt_clampi_(gt_nearest_int_(iscale * x[i]), -nmax, nmax - 1);
        L[i] = (int8_t)l;
        const float w = x[i] * x[i];
        sumlx += w * x[i] * (float)l;
        suml2 += w * (float)l * (float)l;
    }
    for (int itry = 0; itry < 5; itry++) {
        int n_changed = 0;
        for (int i = 0; i < n; i++) {
            const float w = x[i] * x[i];
            float slx = sumlx - w * x[i] * (float)L[i];
            if (slx > 0) {
                float sl2 = suml2 - w * (float)L[i] * (float)L[i];
                const int new_l = gt_clampi_(gt_nearest_int_(x[i] * sl2 / slx), -nmax, nmax - 1);
                if (new_l != L[i]) {
                    slx += w * x[i] * (float)new_l;
                    sl2 += w * (float)new_l * (float)new_l;
                    if (sl2 > 0 && slx * slx * suml2 > sumlx * sumlx * sl2) {
                        L[i] = (int8_t)new_l;
                        sumlx = slx;
                        suml2 = sl2;
                        n_changed++;
                    }
                }
            }
        }
        if (!n_changed) break;
    }
    for (int i = 0; i < n; i++) L[i] = (int8_t)(L[i] + nmax);
    return suml2 > 0.0f ? sumlx / suml2 : 0.0f;
}

/* Q2_K: 16 sub-blocks of 16, 2-bit levels, each with a 4-bit scale and 4-bit min against the
 * f16 d and dmin. Fit by absolute error weighted by |x|. */
void gt_quant_q2_k_(uint8_t *b, const float *x, int64_t nb) {
    uint8_t L[QK_K], Laux[16];
    float weights[16], mins[16], scales[16];
    for (int64_t i = 0; i < nb; i++, b += 84, x += QK_K) {
        uint8_t *sc = b;
        float max_scale = 0, max_min = 0;
        for (int j = 0; j < 16; j++) {
            for (int l = 0; l < 16; l++) weights[l] = fabsf(x[16 * j + l]);
            scales[j] = gt_fit_scale_min_(16, 3, x + 16 * j, weights, L + 16 * j, &mins[j], Laux, -0.5f, 0.1f, 15, 1);
            if (scales[j] > max_scale) max_scale = scales[j];
            if (mins[j] > max_min) max_min = mins[j];
        }
        if (max_scale > 0) {
            const float iscale = 15.0f / max_scale;
            for (int j = 0; j < 16; j++) sc[j] = (uint8_t)gt_nearest_int_(iscale * scales[j]);
            gt_put_half_(b + 80, max_scale / 15.0f);
        } else {
            memset(sc, 0, 16);
            gt_put_half_(b + 80, 0.0f);
        }
        if (max_min > 0) {
            const float iscale = 15.0f / max_min;
            for (int j = 0; j < 16; j++) sc[j] = (uint8_t)(sc[j] | (gt_nearest_int_(iscale * mins[j]) << 4));
            gt_put_half_(b + 82, max_min / 15.0f);
        } else {
            gt_put_half_(b + 82, 0.0f);
        }
        gt_q2_k_finish_(b, L, x);
    }
}

void gt_q2_k_finish_(uint8_t *b, uint8_t *L, const float *x) {
    const uint8_t *sc = b;
    const float d_all = gt_half_at_(b + 80), dmin_all = gt_half_at_(b + 82);
    for (int j = 0; j < 16; j++) {
        const float d = d_all * (float)(sc[j] & 0x0f);
        if (d == 0) continue;
        const float dm = dmin_all * (float)(sc[j] >> 4);
        for (int ii = 0; ii < 16; ii++)
            L[16 * j + ii] = (uint8_t)gt_clampi_(gt_nearest_int_((x[16 * j + ii] + dm) / d), 0, 3);
    }
    pack_2bit(b + 16, L);
}

/* Q3_K: 16 sub-blocks of 16, 3-bit levels (low 2 bits in qs, the high bit in hmask), signed
 * 6-bit scales (stored plus 32: low nibbles in bytes 0..7, high 2 bits in bytes 8..11) against
 * the f16 d. */
void gt_quant_q3_k_(uint8_t *b, const float *x, int64_t nb) {
    int8_t L[QK_K];
    float scales[16];
    uint8_t ls[16];
    for (int64_t i = 0; i < nb; i++, b += 110, x += QK_K) {
        float max_scale = 0, amax = 0;
        for (int j = 0; j < 16; j++) {
            scales[j] = fit_scale_q3(16, 4, x + 16 * j, L + 16 * j);
            const float a = fabsf(scales[j]);
            if (a > amax) {
                amax = a;
                max_scale = scales[j];
            }
        }
        memset(ls, 0, sizeof ls);
        float d = 0.0f;
        if (max_scale != 0) {
            const float iscale = -32.0f / max_scale;
            /* NOTE: ggml keeps the rounded scale in an int8 before clamping it */
            for (int j = 0; j < 16; j++)
                ls[j] = (uint8_t)(gt_clampi_((int8_t)gt_nearest_int_(iscale * scales[j]), -32, 31) + 32);
            d = 1 / iscale;
        }
        gt_q3_k_finish_(b, L, x, ls, d);
    }
}

void gt_q3_k_finish_(uint8_t *b, int8_t *L, const float *x, const uint8_t *ls, float d) {
    uint8_t *hmask = b, *qs = b + 32, *sc = b + 96;
    memset(sc, 0, 12);
    for (int j = 0; j < 16; j++) {
        const int l = ls[j];
        if (j < 8) sc[j] = (uint8_t)(l & 0x0f);
        else sc[j - 8] = (uint8_t)(sc[j - 8] | ((l & 0x0f) << 4));
        sc[8 + j % 4] = (uint8_t)(sc[8 + j % 4] | ((l >> 4) << (2 * (j / 4))));
    }
    gt_put_half_(b + 108, d);
    const float d_all = gt_half_at_(b + 108);
    for (int j = 0; j < 16; j++) {
        const int lo = j < 8 ? (sc[j] & 0x0f) : (sc[j - 8] >> 4);
        const int s = (lo | (((sc[8 + j % 4] >> (2 * (j / 4))) & 3) << 4)) - 32;
        const float dj = d_all * (float)s;
        if (dj == 0) continue;
        for (int ii = 0; ii < 16; ii++)
            L[16 * j + ii] = (int8_t)(gt_clampi_(gt_nearest_int_(x[16 * j + ii] / dj), -4, 3) + 4);
    }
    /* the high bit of the first 32 values in bit 0 of hmask[0..31], the next 32 in bit 1, ... */
    memset(hmask, 0, 32);
    uint8_t low[QK_K];
    for (int j = 0; j < QK_K; j++) {
        int l = L[j];
        if (l > 3) {
            hmask[j % 32] = (uint8_t)(hmask[j % 32] | (1 << (j / 32)));
            l -= 4;
        }
        low[j] = (uint8_t)l;
    }
    pack_2bit(qs, low);
}

/* Q4_K and Q5_K's first half: 8 sub-blocks of 32 fit by squared error weighted by
 * rms(x) + |x|, their scales and mins quantized to 6 bits against the largest of each
 * (d = max scale / 63, dmin = max min / 63). L: the 256 levels. */
static void quant_k4_scales(uint8_t *b, uint8_t *L, const float *x, int nmax, float rmin, int nstep) {
    uint8_t Laux[32], ls[8], lm[8];
    float weights[32], mins[8], scales[8];
    float max_scale = 0, max_min = 0;
    for (int j = 0; j < 8; j++) {
        float sum_x2 = 0;
        for (int l = 0; l < 32; l++) sum_x2 += x[32 * j + l] * x[32 * j + l];
        const float av_x = sqrtf(sum_x2 / 32);
        for (int l = 0; l < 32; l++) weights[l] = av_x + fabsf(x[32 * j + l]);
        scales[j] = gt_fit_scale_min_(32, nmax, x + 32 * j, weights, L + 32 * j, &mins[j], Laux, rmin, 0.1f, nstep, 0);
        if (scales[j] > max_scale) max_scale = scales[j];
        if (mins[j] > max_min) max_min = mins[j];
    }
    const float inv_scale = max_scale > 0 ? 63.0f / max_scale : 0.0f;
    const float inv_min = max_min > 0 ? 63.0f / max_min : 0.0f;
    for (int j = 0; j < 8; j++) {
        /* NOTE: ggml keeps the rounded values in a uint8 before taking the min with 63 */
        ls[j] = (uint8_t)gt_imin_(63, (uint8_t)gt_nearest_int_(inv_scale * scales[j]));
        lm[j] = (uint8_t)gt_imin_(63, (uint8_t)gt_nearest_int_(inv_min * mins[j]));
    }
    gt_k4_finish_(b, L, x, nmax, ls, lm, max_scale / 63.0f, max_min / 63.0f);
}

/* b: the block (d, dmin, scales[12], then Q4_K's qs or Q5_K's qh and qs). The scales and mins
 * are packed in 12 bytes as gt_k4_scale_min_ reads them; Q4_K puts values l and l + 32 of
 * each 64 in one byte (low, high nibble); Q5_K the same for the low 4 bits, the fifth bit of
 * value j + 64 k (+ 32) in bit 2k (2k + 1) of qh[j]. */
void gt_k4_finish_(uint8_t *b, uint8_t *L, const float *x, int nmax, const uint8_t *ls, const uint8_t *lm,
                   float d, float dmin) {
    uint8_t *sc = b + 4;
    for (int j = 0; j < 8; j++) {
        if (j < 4) {
            sc[j] = ls[j];
            sc[j + 4] = lm[j];
        } else {
            sc[j + 4] = (uint8_t)((ls[j] & 0x0f) | ((lm[j] & 0x0f) << 4));
            sc[j - 4] = (uint8_t)(sc[j - 4] | ((ls[j] >> 4) << 6));
            sc[j] = (uint8_t)(sc[j] | ((lm[j] >> 4) << 6));
        }
    }
    gt_put_half_(b, d);
    gt_put_half_(b + 2, dmin);
    const float d_all = gt_half_at_(b), dmin_all = gt_half_at_(b + 2);
    for (int j = 0; j < 8; j++) {
        int s, m;
        gt_k4_scale_min_(sc, j, &s, &m);
        const float dj = d_all * (float)s;
        if (dj == 0) continue;
        const float dm = dmin_all * (float)m;
        for (int ii = 0; ii < 32; ii++)
            L[32 * j + ii] = (uint8_t)gt_clampi_(gt_nearest_int_((x[32 * j + ii] + dm) / dj), 0, nmax);
    }
    if (nmax == 15) {
        uint8_t *q = b + 16;
        for (int j = 0; j < QK_K; j += 64, q += 32)
            for (int l = 0; l < 32; l++) q[l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 4));
        return;
    }
    uint8_t *qh = b + 16, *ql = b + 48;
    memset(qh, 0, 32);
    for (int n = 0, k = 0; n < QK_K; n += 64, k++, ql += 32) {
        for (int j = 0; j < 32; j++) {
            int l1 = L[n + j], l2 = L[n + j + 32];
            if (l1 > 15) {
                l1 -= 16;
                qh[j] = (uint8_t)(qh[j] | (1 << (2 * k)));
            }
            if (l2 > 15) {
                l2 -= 16;
                qh[j] = (uint8_t)(qh[j] | (2 << (2 * k)));
            }
            ql[j] = (uint8_t)(l1 | (l2 << 4));
        }
    }
}

/* Q4_K: 4-bit levels. */
void gt_quant_q4_k_(uint8_t *b, const float *x, int64_t nb) {
    uint8_t L[QK_K];
    for (int64_t i = 0; i < nb; i++, b += 144, x += QK_K) quant_k4_scales(b, L, x, 15, -1.0f, 20);
}

/* Q5_K: 5-bit levels. */
void gt_quant_q5_k_(uint8_t *b, const float *x, int64_t nb) {
    uint8_t L[QK_K];
    for (int64_t i = 0; i < nb; i++, b += 176, x += QK_K) quant_k4_scales(b, L, x, 31, -0.5f, 15);
}

/* Q6_K: 16 sub-blocks of 16, 6-bit levels (low 4 bits in ql, high 2 in qh), signed 8-bit
 * scales against the f16 d. */
void gt_quant_q6_k_(uint8_t *b, const float *x, int64_t nb) { gt_quant_q6_k_weighted_(b, x, nb, NULL); }

void gt_quant_q6_k_weighted_(uint8_t *b, const float *x, int64_t nb, const float *qw) {
    int8_t L[QK_K];
    float scales[16];
    for (int64_t i = 0; i < nb; i++, b += 210, x += QK_K, qw = qw ? qw + QK_K : NULL) {
        uint8_t *ql = b, *qh = b + 128;
        int8_t *sc = (int8_t *)(b + 192);
        float max_scale = 0, max_abs_scale = 0;
        for (int ib = 0; ib < 16; ib++) {
            scales[ib] = gt_fit_scale_sym_(16, 32, x + 16 * ib, qw ? qw + 16 * ib : NULL, L + 16 * ib);
            const float a = fabsf(scales[ib]);
            if (a > max_abs_scale) {
                max_abs_scale = a;
                max_scale = scales[ib];
            }
        }
        if (max_abs_scale < GT_ZERO_GROUP) {
            memset(b, 0, 210);
            continue;
        }
        const float iscale = -128.0f / max_scale;
        gt_put_half_(b + 208, 1 / iscale);
        for (int ib = 0; ib < 16; ib++) sc[ib] = (int8_t)gt_imin_(127, gt_nearest_int_(iscale * scales[ib]));
        const float d_all = gt_half_at_(b + 208);
        for (int j = 0; j < 16; j++) {
            const float d = d_all * (float)sc[j];
            if (d == 0) continue;
            for (int ii = 0; ii < 16; ii++)
                L[16 * j + ii] = (int8_t)(gt_clampi_(gt_nearest_int_(x[16 * j + ii] / d), -32, 31) + 32);
        }
        for (int j = 0; j < QK_K; j += 128, ql += 64, qh += 32) {
            for (int l = 0; l < 32; l++) {
                const int v0 = L[j + l], v1 = L[j + l + 32], v2 = L[j + l + 64], v3 = L[j + l + 96];
                ql[l] = (uint8_t)((v0 & 0x0f) | ((v2 & 0x0f) << 4));
                ql[l + 32] = (uint8_t)((v1 & 0x0f) | ((v3 & 0x0f) << 4));
                qh[l] = (uint8_t)((v0 >> 4) | ((v1 >> 4) << 2) | ((v2 >> 4) << 4) | ((v3 >> 4) << 6));
            }
        }
    }
}
