/* norm.c: rms_norm and its fused backward (no weight: the weight multiply is a
 * separate broadcast mul). Rows (all dims but the last) are split across
 * threads; each row is reduced in a fixed order, so results do not depend on
 * the thread count or the SIMD level. */
#include <math.h>

#include "internal.h"
#include "rowops.h"
#include "simd.h"

/* Row reductions keep LANES independent float partial sums (which GCC turns
 * into vector registers without reassociating anything), then add the lanes
 * and the tail in a fixed order. */
#define LANES GT_LANES

GT_CLONES static float sumsq_row(const float *x, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int k = 0; k < LANES; k++) acc[k] += x[i + k] * x[i + k];
    float s = 0.0f;
    for (int k = 0; k < LANES; k++) s += acc[k];
    for (; i < n; i++) s += x[i] * x[i];
    return s;
}

/* sum(x^2) and sum(x * g) of one row in one pass. */
GT_CLONES static void sumsq_dot_row(const float *x, const float *g, int64_t n, float *sxx, float *sxg) {
    float a[LANES] = {0}, b[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int k = 0; k < LANES; k++) {
            a[k] += x[i + k] * x[i + k];
            b[k] += x[i + k] * g[i + k];
        }
    float s = 0.0f, t = 0.0f;
    for (int k = 0; k < LANES; k++) { s += a[k]; t += b[k]; }
    for (; i < n; i++) { s += x[i] * x[i]; t += x[i] * g[i]; }
    *sxx = s;
    *sxg = t;
}

/* Loops in blocks of LANES plus a scalar tail: see rowops.h's NOTE. */
/* d = r * (g - c * x) */
GT_CLONES static void rms_bwd_row(float *restrict d, const float *restrict x, const float *restrict g,
                                  float r, float c, int64_t n) {
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int k = 0; k < LANES; k++) d[i + k] = r * (g[i + k] - c * x[i + k]);
    for (; i < n; i++) d[i] = r * (g[i] - c * x[i]);
}

/* llama.cpp's CPU order: each x^2 rounded to float, summed in double in order; the mean
 * (sum / C) rounded to float */
static float ggml_mean_sq(const float *x, int64_t n) {
    double s = 0.0;
    for (int64_t i = 0; i < n; i++) s += (double)(x[i] * x[i]);
    return (float)(s / (double)n);
}

/* rms_norm: dst = x / sqrt(mean(x^2) + eps), mean over the last dim.
 * x (..., C) f32 contiguous, dst same shape contiguous, eps = fp[0].
 * The row's sum of squares is accumulated in float (16 lanes, fixed order); with ip[0] = 1
 * as llama.cpp's CPU build does (ggml_mean_sq: its bits, for inference in its numerics).
 * A scalar x (ndim 0) is one row of one element. */
int gt_rms_norm_fwd_f32(const gt_node *node, const gt_ctx *ctx) {
    GT_TRY(gt_rms_norm_check(node, "rms_norm", 1));
    const gt_tensor *d = &node->dst;
    const int64_t ncols = gt_ncols(d), nrows = gt_nrows(d);
    const float eps = node->fp[0];
    float *dd = d->data;
    const float *xd = node->src[0].data;
    int64_t lo, hi;
    gt_split(nrows, ctx, &lo, &hi);
    for (int64_t r = lo; r < hi; r++) {
        const float *x = xd + r * ncols;
        const float ms = node->ip[0] ? ggml_mean_sq(x, ncols) : sumsq_row(x, ncols) / (float)ncols;
        scale_row(dd + r * ncols, x, 1.0f / sqrtf(ms + eps), ncols);
    }
    return GT_OK;
}

/* rms_norm_bwd: dx from x (src0) and the upstream gradient g (src1) of
 * y = x * r, r = (mean(x^2) + eps)^-1/2:
 *     dx = r * (g - x * r^2 * sum(x * g) / C)
 * x, g, dst (..., C) f32 contiguous, same shape; eps = fp[0]. */
int gt_rms_norm_bwd_f32(const gt_node *node, const gt_ctx *ctx) {
    GT_TRY(gt_rms_norm_check(node, "rms_norm_bwd", 2));
    const gt_tensor *d = &node->dst;
    const int64_t ncols = gt_ncols(d), nrows = gt_nrows(d);
    const float eps = node->fp[0];
    float *dd = d->data;
    const float *xd = node->src[0].data, *gd = node->src[1].data;
    int64_t lo, hi;
    gt_split(nrows, ctx, &lo, &hi);
    for (int64_t r = lo; r < hi; r++) {
        const float *x = xd + r * ncols, *g = gd + r * ncols;
        float sxx, sxg;
        sumsq_dot_row(x, g, ncols, &sxx, &sxg);
        const float rr = 1.0f / (sxx / (float)ncols + eps);   /* r^2 */
        const float rs = sqrtf(rr);
        rms_bwd_row(dd + r * ncols, x, g, rs, rr * sxg / (float)ncols, ncols);
    }
    return GT_OK;
}
