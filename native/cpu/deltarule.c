/* deltarule.c: the gated delta rule over time (Qwen3.5's gated DeltaNet layers, llama.cpp's
 * gated_delta_net), step by step, and its exact backward by the reverse recurrence. The step's
 * arithmetic is ../deltarule.h (shared with the CUDA kernels). Each (sample, head) belongs to
 * one thread, so every thread count gives the same bits. */
#include <math.h>

#include "internal.h"
#include "../deltarule.h"

#define Q_AT(p, b, t, h, H, D) ((p) + (((b) * T + (t)) * (H) + (h)) * (D))

/* ip[2] = 1 picks the chunked form (deltachunk.c; not with s0). */
static int chunked(const gt_node *node) { return node->ip[2] != 0 && node->ip[1] == 0; }

/* Work: one state (Dv x Dk floats) per thread, or the chunked form's. */
int gt_delta_rule_fwd_f32_sizes(const gt_node *node, int64_t *scratch, int64_t *work) {
    GT_TRY(gt_delta_rule_dims(node, "delta_rule"));
    const int64_t Dk = node->src[0].shape[3], Dv = node->src[2].shape[3];
    *scratch = 0;
    *work = (chunked(node) ? gt_dr_chunk_fwd_floats_(Dk, Dv) : Dk * Dv) * (int64_t)sizeof(float);
    return GT_OK;
}

/* o[b, t, h] = scale S_t^T q[b, t, h % Hk], S_t = the state after row t (../deltarule.h),
 * scale = 1 / sqrt(Dk). Threads split the (b, h) pairs; with s0, S starts from it and the last
 * state follows o in dst. */
int gt_delta_rule_fwd_f32(const gt_node *node, const gt_ctx *ctx) {
    int64_t n[6];
    const gt_tensor *sg, *s0;
    GT_TRY(gt_delta_rule_check(node, 0, "delta_rule", n, &sg, &s0));
    const int64_t B = n[0], T = n[1], Hk = n[2], Hv = n[3], Dk = n[4], Dv = n[5];
    const float *q = (const float *)node->src[0].data, *k = (const float *)node->src[1].data;
    const float *v = (const float *)node->src[2].data, *g = (const float *)node->src[3].data;
    const float *beta = (const float *)node->src[4].data;
    const int32_t *seg = sg ? (const int32_t *)sg->data : NULL;
    float *dst = (float *)node->dst.data, *m = (float *)ctx->wdata;
    const int64_t per_b = s0 ? T * Hv * Dv + Hv * Dv * Dk : T * Hv * Dv;
    const float scale = 1.0f / sqrtf((float)Dk);
    int64_t lo, hi;
    gt_split(B * Hv, ctx, &lo, &hi);
    if (chunked(node)) {
        gt_dr_chunk_fwd_(dst, m, q, k, v, g, beta, seg, lo, hi, T, Hk, Hv, Dk, Dv);
        return GT_OK;
    }
    for (int64_t r = lo; r < hi; r++) {
        const int64_t b = r / Hv, h = r % Hv, hk = h % Hk;
        if (s0) memcpy(m, (const float *)s0->data + (b * Hv + h) * Dv * Dk, (size_t)(Dv * Dk) * sizeof(float));
        for (int64_t t = 0; t < T; t++) {
            const int reset = s0 && t == 0 ? 0 : gt_dr_reset(seg, T, b, t);
            const int64_t bth = (b * T + t) * Hv + h;
            gt_dr_step(m, reset, Q_AT(q, b, t, hk, Hk, Dk), Q_AT(k, b, t, hk, Hk, Dk), Q_AT(v, b, t, h, Hv, Dv), g[bth],
                       beta[bth], dst + b * per_b + (t * Hv + h) * Dv, scale, Dk, Dv);
        }
        if (s0) memcpy(dst + b * per_b + T * Hv * Dv + h * Dv * Dk, m, (size_t)(Dv * Dk) * sizeof(float));
    }
    return GT_OK;
}

/* Work: the states at every GT_DR_CHUNK-th row, the chunk's states recomputed from them, the
 * gradient in S. */
static int64_t bwd_floats(int64_t T, int64_t Dk, int64_t Dv) {
    const int64_t chunks = (T + GT_DR_CHUNK - 1) / GT_DR_CHUNK;
    return (chunks + GT_DR_CHUNK + 2) * Dk * Dv;
}

int gt_delta_rule_bwd_f32_sizes(const gt_node *node, int64_t *scratch, int64_t *work) {
    GT_TRY(gt_delta_rule_dims(node, "delta_rule_bwd"));
    *scratch = 0;
    const int64_t T = node->src[0].shape[1], Dk = node->src[0].shape[3], Dv = node->src[2].shape[3];
    *work = (chunked(node) ? gt_dr_chunk_bwd_floats_(T, Dk, Dv) : bwd_floats(T, Dk, Dv)) * (int64_t)sizeof(float);
    return GT_OK;
}

/* The reverse recurrence: per V head, a forward pass keeps the state before every
 * GT_DR_CHUNK-th row; then chunk by chunk from the last, the chunk's states are recomputed
 * and its rows taken back in reverse order (gt_dr_step_bwd). Threads split the (b, K head)
 * pairs: dq and dk of a K head sum its V heads h = hk, hk + Hk, ... in that order. */
int gt_delta_rule_bwd_f32(const gt_node *node, const gt_ctx *ctx) {
    int64_t n[6];
    const gt_tensor *sg, *s0;
    GT_TRY(gt_delta_rule_check(node, 1, "delta_rule_bwd", n, &sg, &s0));
    const int64_t B = n[0], T = n[1], Hk = n[2], Hv = n[3], Dk = n[4], Dv = n[5], S = Dk * Dv, C = GT_DR_CHUNK;
    const float *q = (const float *)node->src[0].data, *k = (const float *)node->src[1].data;
    const float *v = (const float *)node->src[2].data, *g = (const float *)node->src[3].data;
    const float *beta = (const float *)node->src[4].data, *go = (const float *)node->src[5].data;
    const int32_t *seg = sg ? (const int32_t *)sg->data : NULL;
    float *dst = (float *)node->dst.data;
    const int64_t W = 2 * Hk * Dk + Hv * Dv + 2 * Hv, chunks = (T + C - 1) / C;
    float *ck = (float *)ctx->wdata, *st = ck + chunks * S, *ds = st + (C + 1) * S;
    const float scale = 1.0f / sqrtf((float)Dk);
    int64_t lo, hi;
    gt_split(B * Hk, ctx, &lo, &hi);
    if (chunked(node)) {
        gt_dr_chunk_bwd_(dst, ck, q, k, v, g, beta, go, seg, lo, hi, T, Hk, Hv, Dk, Dv);
        return GT_OK;
    }
    for (int64_t r = lo; r < hi; r++) {
        const int64_t b = r / Hk, hk = r % Hk;
        gt_dr_zero_dqk(dst, b, hk, T, Hk, Dk, W);
        for (int64_t h = hk; h < Hv; h += Hk) {
            memset(st, 0, (size_t)S * sizeof(float));
            for (int64_t t = 0; t < T; t++) {
                if (t % C == 0) memcpy(ck + (t / C) * S, st, (size_t)S * sizeof(float));
                const int64_t bth = (b * T + t) * Hv + h;
                gt_dr_step(st, gt_dr_reset(seg, T, b, t), Q_AT(q, b, t, hk, Hk, Dk), Q_AT(k, b, t, hk, Hk, Dk),
                           Q_AT(v, b, t, h, Hv, Dv), g[bth], beta[bth], NULL, scale, Dk, Dv);
            }
            memset(ds, 0, (size_t)S * sizeof(float));
            for (int64_t c = chunks - 1; c >= 0; c--) {
                const int64_t t0 = c * C, t1 = t0 + C < T ? t0 + C : T;
                memcpy(st, ck + c * S, (size_t)S * sizeof(float));
                for (int64_t t = t0; t < t1; t++) {
                    float *m = st + (t - t0 + 1) * S;
                    const int64_t bth = (b * T + t) * Hv + h;
                    memcpy(m, m - S, (size_t)S * sizeof(float));
                    gt_dr_step(m, gt_dr_reset(seg, T, b, t), Q_AT(q, b, t, hk, Hk, Dk), Q_AT(k, b, t, hk, Hk, Dk),
                               Q_AT(v, b, t, h, Hv, Dv), g[bth], beta[bth], NULL, scale, Dk, Dv);
                }
                for (int64_t t = t1 - 1; t >= t0; t--) {
                    const int64_t bth = (b * T + t) * Hv + h;
                    float *row = dst + (b * T + t) * W;
                    gt_dr_step_bwd(st + (t - t0) * S, st + (t - t0 + 1) * S, ds, gt_dr_reset(seg, T, b, t),
                                   Q_AT(q, b, t, hk, Hk, Dk), Q_AT(k, b, t, hk, Hk, Dk), Q_AT(v, b, t, h, Hv, Dv),
                                   g[bth], beta[bth], Q_AT(go, b, t, h, Hv, Dv), scale, row + hk * Dk,
                                   row + Hk * Dk + hk * Dk, row + 2 * Hk * Dk + h * Dv,
                                   row + 2 * Hk * Dk + Hv * Dv + h, row + 2 * Hk * Dk + Hv * Dv + Hv + h, Dk, Dv);
                }
            }
        }
    }
    return GT_OK;
}
