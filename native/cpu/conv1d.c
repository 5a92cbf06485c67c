/* conv1d.c: the causal depthwise convolution over time (LFM2's short convolution, ggml's
 * ssm_conv) and its two gradients. Each output element belongs to one thread and sums its
 * terms in a fixed order, so every thread count gives the same bits. */
#include "internal.h"

/* Whether x's row s (time) of sample b is in the window of row t (s <= t is the caller's):
 * always without segments, else only within t's segment. */
static inline int same_segment(const int32_t *seg, int64_t T, int64_t b, int64_t s, int64_t t) {
    return seg == NULL || seg[b * T + s] == seg[b * T + t];
}

/* y[b, t, c] = sum over k < L of w[c, k] x[b, t - L + 1 + k, c], rows before 0 (or in an
 * earlier segment) zero, summed from 0.0f in k order. NOTE: with ip[0] = 1 (llama.cpp's
 * numbers) each step is a fused multiply-add, as its ssm_conv loop compiles (C++ contracts
 * sumf += s * c where the CPU has FMA); else a product then a sum. Threads split the (b, t)
 * rows. */
int gt_causal_conv1d_fwd_f32(const gt_node *node, const gt_ctx *ctx) {
    int64_t n[4] = {0, 0, 0, 0};
    const gt_tensor *sg = NULL;
    GT_TRY(gt_causal_conv1d_check(node, 0, "causal_conv1d", n, &sg));
    const int64_t B = n[0], T = n[1], C = n[2], L = n[3];
    const float *x = (const float *)node->src[0].data, *w = (const float *)node->src[1].data;
    const int32_t *seg = sg ? (const int32_t *)sg->data : NULL;
    float *y = (float *)node->dst.data;
    const int llama = node->ip[0] != 0;
    int64_t lo, hi;
    gt_split(B * T, ctx, &lo, &hi);
    for (int64_t r = lo; r < hi; r++) {
        const int64_t b = r / T, t = r % T;
        float *yr = y + r * C;
        for (int64_t c = 0; c < C; c++) yr[c] = 0.0f;
        for (int64_t k = 0; k < L; k++) {
            const int64_t s = t - L + 1 + k;
            if (s < 0 || !same_segment(seg, T, b, s, t)) continue;
            const float *xr = x + (b * T + s) * C;
            if (llama)
                for (int64_t c = 0; c < C; c++) yr[c] = fmaf(xr[c], w[c * L + k], yr[c]);
            else
                for (int64_t c = 0; c < C; c++) yr[c] += xr[c] * w[c * L + k];
        }
    }
    return GT_OK;
}

/* dx[b, s, c] = sum over k < L of w[c, k] g[b, s + L - 1 - k, c] over the rows t = s + L - 1
 * - k < T whose windows hold s (the same segment). Threads split the (b, s) rows. */
int gt_causal_conv1d_input_bwd_f32(const gt_node *node, const gt_ctx *ctx) {
    int64_t n[4] = {0, 0, 0, 0};
    const gt_tensor *sg = NULL;
    GT_TRY(gt_causal_conv1d_check(node, 1, "causal_conv1d_input_bwd", n, &sg));
    const int64_t B = n[0], T = n[1], C = n[2], L = n[3];
    const float *w = (const float *)node->src[0].data, *g = (const float *)node->src[1].data;
    const int32_t *seg = sg ? (const int32_t *)sg->data : NULL;
    float *dx = (float *)node->dst.data;
    int64_t lo, hi;
    gt_split(B * T, ctx, &lo, &hi);
    for (int64_t r = lo; r < hi; r++) {
        const int64_t b = r / T, s = r % T;
        float *dr = dx + r * C;
        for (int64_t c = 0; c < C; c++) dr[c] = 0.0f;
        for (int64_t k = 0; k < L; k++) {
            const int64_t t = s + L - 1 - k;
            if (t >= T || !same_segment(seg, T, b, s, t)) continue;
            const float *gr = g + (b * T + t) * C;
            for (int64_t c = 0; c < C; c++) dr[c] += gr[c] * w[c * L + k];
        }
    }
    return GT_OK;
}

/* dw[c, k] = sum over b, t of g[b, t, c] x[b, t - L + 1 + k, c] (the terms the forward
 * took), summed over (b, t) in order. Threads split the channels. */
int gt_causal_conv1d_weight_bwd_f32(const gt_node *node, const gt_ctx *ctx) {
    int64_t n[4] = {0, 0, 0, 0};
    const gt_tensor *sg = NULL;
    GT_TRY(gt_causal_conv1d_check(node, 2, "causal_conv1d_weight_bwd", n, &sg));
    const int64_t B = n[0], T = n[1], C = n[2], L = n[3];
    const float *x = (const float *)node->src[0].data, *g = (const float *)node->src[1].data;
    const int32_t *seg = sg ? (const int32_t *)sg->data : NULL;
    float *dw = (float *)node->dst.data;
    int64_t lo, hi;
    gt_split(C, ctx, &lo, &hi);
    for (int64_t i = lo * L; i < hi * L; i++) dw[i] = 0.0f;
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++) {
            const float *gr = g + (b * T + t) * C;
            for (int64_t k = 0; k < L; k++) {
                const int64_t s = t - L + 1 + k;
                if (s < 0 || !same_segment(seg, T, b, s, t)) continue;
                const float *xr = x + (b * T + s) * C;
                for (int64_t c = lo; c < hi; c++) dw[c * L + k] += gr[c] * xr[c];
            }
        }
    return GT_OK;
}
