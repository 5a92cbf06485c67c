/* quant_imatrix.c: ggml's block writers that weight each column by an importance matrix (one
 * value per column, llama-imatrix's mean squared activation entering it), as llama.cpp's
 * quantizer runs them when it is given one (ggml's quantize_row_*_impl with quant_weights):
 *
 *   Q2_K, Q4_K, Q5_K: each sub-block's scale and min by the weighted least-squares search
 *       (make_qkx3_quants: rmin -0.9, 36 steps of 0.05), weights w_i = imatrix_i
 *       * sqrt(sigma2 + x_i^2), sigma2 the block's mean x^2 (Q4_K, Q5_K: twice it); the
 *       sub-block scales and mins then quantized against d and dmin by a weighted search too
 *       (make_qp_quants, weighted by the sub-blocks' summed w);
 *   Q3_K: the symmetric weighted search (make_qx_quants) for the sub-blocks, and again for
 *       their 6-bit scales; Q6_K: make_qx_quants weighted by the imatrix values alone;
 *   Q4_0, Q5_0 (symmetric) and Q4_1, Q5_1 (scale and min): the same searches per 32-block,
 *       sigma2 the mean x^2 of the whole row, and no rounding against the f16 scale after it.
 *
 * Every sum and product is in ggml's order, as quant_k.c's top comment says; the types ggml
 * does not weight (F32, F16, BF16, Q8_0, MXFP4) are written as gt_quantize_row writes them.
 */
#include <math.h>

#include "quant_k.h"

/* The positive scale of x (n, >= 0 in use: sub-block scales or mins) as scale * L,
 * L in [0, nmax]: the range's scale and 8 nearby ones (nmax + 0.1 is) / max, the least
 * qw-weighted squared error, then up to five sweeps moving one level at a time to its
 * least-squares value while that raises (sum w x l)^2 / sum w l^2. (ggml's make_qp_quants.)
 * NOTE: ggml keeps levels in a uint8 without a lower clamp; a negative x would wrap, and so
 * does L here, so that the same bytes come out. */
static float fit_scale_pos(int n, int nmax, const float *x, uint8_t *L, const float *qw) {
    float max = 0;
    for (int i = 0; i < n; i++) max = max > x[i] ? max : x[i];
    if (max < GT_ZERO_GROUP) {
        memset(L, 0, (size_t)n);
        return 0.0f;
    }
    float iscale = (float)nmax / max;
    for (int i = 0; i < n; i++) L[i] = (uint8_t)gt_nearest_int_(iscale * x[i]);
    const float scale = 1 / iscale;
    float best_mse = 0;
    for (int i = 0; i < n; i++) {
        const float diff = x[i] - scale * (float)L[i];
        best_mse += qw[i] * diff * diff;
    }
    for (int is = -4; is <= 4; is++) {
        if (is == 0) continue;
        const float iscale_is = (0.1f * (float)is + (float)nmax) / max;
        const float scale_is = 1 / iscale_is;
        float mse = 0;
        for (int i = 0; i < n; i++) {
            const int l = gt_imin_(nmax, gt_nearest_int_(iscale_is * x[i]));
            const float diff = x[i] - scale_is * (float)l;
            mse += qw[i] * diff * diff;
        }
        if (mse < best_mse) {
            best_mse = mse;
            iscale = iscale_is;
        }
    }
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; i++) {
        const int l = gt_imin_(nmax, gt_nearest_int_(iscale * x[i]));
        L[i] = (uint8_t)l;
        sumlx += qw[i] * x[i] * (float)l;
        suml2 += qw[i] * (float)l * (float)l;
    }
    for (int itry = 0; itry < 5; itry++) {
        int n_changed = 0;
        for (int i = 0; i < n; i++) {
            const float w = qw[i];
            float slx = sumlx - w * x[i] * (float)L[i];
            float sl2 = suml2 - w * (float)L[i] * (float)L[i];
            if (slx > 0 && sl2 > 0) {
                const int new_l = gt_imin_(nmax, gt_nearest_int_(x[i] * sl2 / slx));
                if (new_l != L[i]) {
                    slx += w * x[i] * (float)new_l;
                    sl2 += w * (float)new_l * (float)new_l;
                    if (slx * slx * suml2 > sumlx * sumlx * sl2) {
                        L[i] = (uint8_t)new_l;
                        sumlx = slx;
                        suml2 = sl2;
                        n_changed++;
                    }
                }
            }
        }
        if (!n_changed) break;
    }
    return suml2 > 0.0f ? sumlx / suml2 : 0.0f;
}

/* w (n) = qw * sqrt(sigma2 + x^2), and their sum */
static float importance(float *w, int n, const float *x, const float *qw, float sigma2) {
    float sum = 0;
    for (int l = 0; l < n; l++) w[l] = qw[l] * sqrtf(sigma2 + x[l] * x[l]);
    for (int l = 0; l < n; l++) sum += w[l];
    return sum;
}

static float sum_squares(const float *x, int64_t n) {
    float s = 0;
    for (int64_t j = 0; j < n; j++) s += x[j] * x[j];
    return s;
}

/* One row of nb super-blocks each: b the row's blocks, x its values, qw its importance. */
static void q2_k_row(uint8_t *b, const float *x, int64_t nb, const float *qw) {
    uint8_t L[QK_K], Laux[16], Ls[16], Lm[16];
    float weight[16], sw[16], mins[16], scales[16];
    for (int64_t i = 0; i < nb; i++, b += 84, x += QK_K, qw += QK_K) {
        const float sigma2 = sum_squares(x, QK_K) / QK_K;
        for (int j = 0; j < 16; j++) {
            sw[j] = importance(weight, 16, x + 16 * j, qw + 16 * j, sigma2);
            scales[j] = gt_fit_scale_min_(16, 3, x + 16 * j, weight, L + 16 * j, &mins[j], Laux, -0.9f, 0.05f, 36, 0);
        }
        const float dm = fit_scale_pos(16, 15, scales, Ls, sw);
        const float mm = fit_scale_pos(16, 15, mins, Lm, sw);
        gt_put_half_(b + 80, dm);
        gt_put_half_(b + 82, mm);
        for (int j = 0; j < 16; j++) b[j] = (uint8_t)(Ls[j] | (Lm[j] << 4));
        gt_q2_k_finish_(b, L, x);
    }
}

static void q3_k_row(uint8_t *b, const float *x, int64_t nb, const float *qw) {
    int8_t L[QK_K], Ls[16];
    uint8_t ls[16];
    float weight[16], sw[16], scales[16];
    for (int64_t i = 0; i < nb; i++, b += 110, x += QK_K, qw += QK_K) {
        const float sigma2 = 2 * sum_squares(x, QK_K) / QK_K;
        for (int j = 0; j < 16; j++) {
            sw[j] = importance(weight, 16, x + 16 * j, qw + 16 * j, sigma2);
            scales[j] = gt_fit_scale_sym_(16, 4, x + 16 * j, weight, L + 16 * j);
        }
        const float d = gt_fit_scale_sym_(16, 32, scales, sw, Ls);
        for (int j = 0; j < 16; j++) ls[j] = (uint8_t)Ls[j];
        gt_q3_k_finish_(b, L, x, ls, d);
    }
}

/* Q4_K (nmax 15) and Q5_K (31) */
static void k4_row(uint8_t *b, const float *x, int64_t nb, const float *qw, int nmax, int64_t block_bytes) {
    uint8_t L[QK_K], Laux[32], Ls[8], Lm[8];
    float weight[32], sw[8], mins[8], scales[8];
    for (int64_t i = 0; i < nb; i++, b += block_bytes, x += QK_K, qw += QK_K) {
        const float sigma2 = 2 * sum_squares(x, QK_K) / QK_K;
        for (int j = 0; j < 8; j++) {
            sw[j] = importance(weight, 32, x + 32 * j, qw + 32 * j, sigma2);
            scales[j] = gt_fit_scale_min_(32, nmax, x + 32 * j, weight, L + 32 * j, &mins[j], Laux, -0.9f, 0.05f, 36, 0);
        }
        const float d = fit_scale_pos(8, 63, scales, Ls, sw);
        const float dmin = fit_scale_pos(8, 63, mins, Lm, sw);
        if (nmax == 31) {   /* NOTE: ggml clamps Q5_K's 6-bit scales to 63, not Q4_K's */
            for (int j = 0; j < 8; j++) {
                Ls[j] = (uint8_t)gt_imin_(63, Ls[j]);
                Lm[j] = (uint8_t)gt_imin_(63, Lm[j]);
            }
        }
        gt_k4_finish_(b, L, x, nmax, Ls, Lm, d, dmin);
    }
}

/* Q4_0 (nmax 8) and Q5_0 (16): x = d * (L - nmax), d the weighted symmetric fit, per 32. */
static void q_0_row(uint8_t *b, const float *x, int64_t n, const float *qw, int nmax) {
    float weight[32];
    int8_t L[32];
    int q[32];
    const float sigma2 = sum_squares(x, n) / (float)n;
    for (int64_t ib = 0; ib < n / 32; ib++, x += 32, qw += 32) {
        importance(weight, 32, x, qw, sigma2);
        const float d = gt_fit_scale_sym_(32, nmax, x, weight, L);
        gt_put_half_(b, d);
        if (nmax == 8) {
            for (int j = 0; j < 16; j++) b[2 + j] = (uint8_t)(L[j] | (L[j + 16] << 4));
            b += 18;
        } else {
            for (int j = 0; j < 32; j++) q[j] = L[j];
            gt_pack_5bit_(b + 2, b + 6, q);
            b += 22;
        }
    }
}

/* Q4_1 (nmax 15) and Q5_1 (31): x = d * L + m, the weighted scale-and-min fit, per 32. */
static void q_1_row(uint8_t *b, const float *x, int64_t n, const float *qw, int nmax) {
    float weight[32];
    uint8_t L[32], Laux[32];
    int q[32];
    const float sigma2 = sum_squares(x, n) / (float)n;
    for (int64_t ib = 0; ib < n / 32; ib++, x += 32, qw += 32) {
        importance(weight, 32, x, qw, sigma2);
        float neg_min;
        const float d = gt_fit_scale_min_(32, nmax, x, weight, L, &neg_min, Laux, -0.9f, 0.05f, 36, 0);
        gt_put_half_(b, d);
        gt_put_half_(b + 2, -neg_min);
        if (nmax == 15) {
            for (int j = 0; j < 16; j++) b[4 + j] = (uint8_t)(L[j] | (L[j + 16] << 4));
            b += 20;
        } else {
            for (int j = 0; j < 32; j++) q[j] = L[j];
            gt_pack_5bit_(b + 4, b + 8, q);
            b += 24;
        }
    }
}

int gt_quantize_rows_imatrix(void *dst, const float *src, const float *imatrix, int32_t dtype, int64_t n_rows,
                             int64_t n_cols) {
    const gt_dtype_traits *t = gt_dtype_find_(dtype);
    if (!t) return GT_FAIL(GT_ERR_UNSUPPORTED, "quantize: unknown ggml type %d", (int)dtype);
    if (n_rows < 0 || n_cols < 0)
        return GT_FAIL(GT_ERR_INVALID, "quantize: negative shape (%lld, %lld)", (long long)n_rows, (long long)n_cols);
    if (n_cols % t->block)
        return GT_FAIL(GT_ERR_SHAPE, "quantize %s: rows of %lld are not a whole number of %d-element blocks",
                       t->name, (long long)n_cols, (int)t->block);
    if (n_rows == 0 || n_cols == 0) return GT_OK;
    if (!dst || !src || !imatrix) return GT_FAIL(GT_ERR_INVALID, "quantize: null pointer");
    const int64_t row_bytes = n_cols / t->block * t->block_bytes, nb = n_cols / QK_K;
    for (int64_t r = 0; r < n_rows; r++) {
        uint8_t *b = (uint8_t *)dst + r * row_bytes;
        const float *x = src + r * n_cols;
        switch (dtype) {
        case GT_Q2_K: q2_k_row(b, x, nb, imatrix); break;
        case GT_Q3_K: q3_k_row(b, x, nb, imatrix); break;
        case GT_Q4_K: k4_row(b, x, nb, imatrix, 15, 144); break;
        case GT_Q5_K: k4_row(b, x, nb, imatrix, 31, 176); break;
        case GT_Q6_K: gt_quant_q6_k_weighted_(b, x, nb, imatrix); break;
        case GT_Q4_0: q_0_row(b, x, n_cols, imatrix, 8); break;
        case GT_Q5_0: q_0_row(b, x, n_cols, imatrix, 16); break;
        case GT_Q4_1: q_1_row(b, x, n_cols, imatrix, 15); break;
        case GT_Q5_1: q_1_row(b, x, n_cols, imatrix, 31); break;
        default: return gt_quantize_row(dst, src, dtype, n_rows * n_cols);   /* not weighted */
        }
    }
    return GT_OK;
}
