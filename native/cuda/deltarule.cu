/* deltarule.cu: the gated delta rule over time and its backward by the reverse recurrence, as
 * native/cpu/deltarule.c computes them (the step's arithmetic: ../deltarule.h, shared). A first
 * version: one thread walks one (sample, V head) forward, one (sample, K head) backward, its
 * states in node scratch; the time loop is serial as the recurrence is (a chunked form would
 * put a block of threads on a head). */
#include "common.cuh"
#include "kernels.h"
#include "../deltarule.h"

#define DR_AT(p, b, t, h, H, D) ((p) + (((b) * T + (t)) * (H) + (h)) * (D))

__global__ void delta_rule_fwd(float *dst, float *work, const float *q, const float *k, const float *v,
                               const float *g, const float *beta, const int32_t *seg, const float *s0, int64_t B,
                               int64_t T, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv) {
    const float scale = 1.0f / sqrtf((float)Dk);
    const int64_t per_b = s0 ? T * Hv * Dv + Hv * Dv * Dk : T * Hv * Dv;
    GTC_FOR(r, B * Hv) {
        const int64_t b = r / Hv, h = r % Hv, hk = h % Hk;
        float *m = work + r * Dk * Dv;
        if (s0)
            for (int64_t i = 0; i < Dk * Dv; i++) m[i] = s0[(b * Hv + h) * Dv * Dk + i];
        for (int64_t t = 0; t < T; t++) {
            const int reset = s0 && t == 0 ? 0 : gt_dr_reset(seg, T, b, t);
            const int64_t bth = (b * T + t) * Hv + h;
            gt_dr_step(m, reset, DR_AT(q, b, t, hk, Hk, Dk), DR_AT(k, b, t, hk, Hk, Dk), DR_AT(v, b, t, h, Hv, Dv),
                       g[bth], beta[bth], dst + b * per_b + (t * Hv + h) * Dv, scale, Dk, Dv);
        }
        if (s0)
            for (int64_t i = 0; i < Dk * Dv; i++) dst[b * per_b + T * Hv * Dv + h * Dv * Dk + i] = m[i];
    }
}

__global__ void delta_rule_bwd(float *dst, float *work, const float *q, const float *k, const float *v,
                               const float *g, const float *beta, const float *go, const int32_t *seg, int64_t B,
                               int64_t T, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv) {
    const int64_t S = Dk * Dv, C = GT_DR_CHUNK, chunks = (T + C - 1) / C, W = 2 * Hk * Dk + Hv * Dv + 2 * Hv;
    const float scale = 1.0f / sqrtf((float)Dk);
    GTC_FOR(r, B * Hk) {
        const int64_t b = r / Hk, hk = r % Hk;
        float *ck = work + r * (chunks + C + 2) * S, *st = ck + chunks * S, *ds = st + (C + 1) * S;
        gt_dr_zero_dqk(dst, b, hk, T, Hk, Dk, W);
        for (int64_t h = hk; h < Hv; h += Hk) {
            for (int64_t i = 0; i < S; i++) st[i] = 0.0f;
            for (int64_t t = 0; t < T; t++) {
                if (t % C == 0)
                    for (int64_t i = 0; i < S; i++) ck[(t / C) * S + i] = st[i];
                const int64_t bth = (b * T + t) * Hv + h;
                gt_dr_step(st, gt_dr_reset(seg, T, b, t), DR_AT(q, b, t, hk, Hk, Dk), DR_AT(k, b, t, hk, Hk, Dk),
                           DR_AT(v, b, t, h, Hv, Dv), g[bth], beta[bth], nullptr, scale, Dk, Dv);
            }
            for (int64_t i = 0; i < S; i++) ds[i] = 0.0f;
            for (int64_t c = chunks - 1; c >= 0; c--) {
                const int64_t t0 = c * C, t1 = t0 + C < T ? t0 + C : T;
                for (int64_t i = 0; i < S; i++) st[i] = ck[c * S + i];
                for (int64_t t = t0; t < t1; t++) {
                    float *m = st + (t - t0 + 1) * S;
                    const int64_t bth = (b * T + t) * Hv + h;
                    for (int64_t i = 0; i < S; i++) m[i] = m[i - S];
                    gt_dr_step(m, gt_dr_reset(seg, T, b, t), DR_AT(q, b, t, hk, Hk, Dk), DR_AT(k, b, t, hk, Hk, Dk),
                               DR_AT(v, b, t, h, Hv, Dv), g[bth], beta[bth], nullptr, scale, Dk, Dv);
                }
                for (int64_t t = t1 - 1; t >= t0; t--) {
                    const int64_t bth = (b * T + t) * Hv + h;
                    float *row = dst + (b * T + t) * W;
                    gt_dr_step_bwd(st + (t - t0) * S, st + (t - t0 + 1) * S, ds, gt_dr_reset(seg, T, b, t),
                                   DR_AT(q, b, t, hk, Hk, Dk), DR_AT(k, b, t, hk, Hk, Dk), DR_AT(v, b, t, h, Hv, Dv),
                                   g[bth], beta[bth], DR_AT(go, b, t, h, Hv, Dv), scale, row + hk * Dk,
                                   row + Hk * Dk + hk * Dk, row + 2 * Hk * Dk + h * Dv,
                                   row + 2 * Hk * Dk + Hv * Dv + h, row + 2 * Hk * Dk + Hv * Dv + Hv + h, Dk, Dv);
                }
            }
        }
    }
}

/* Scratch: a state per (sample, V head) forward; per (sample, K head) backward, the
 * checkpoints, a chunk's states and the gradient in S (as the CPU's work). */
GTC_SIZES(delta_rule_fwd_f32) {
    GTC_TRY(gt_delta_rule_dims(node, "delta_rule"));
    const gt_tensor *q = &node->src[0], *v = &node->src[2];
    *scratch = q->shape[0] * v->shape[2] * q->shape[3] * v->shape[3] * (int64_t)sizeof(float);
    *work = 0;
    return GT_OK;
}

GTC_SIZES(delta_rule_bwd_f32) {
    GTC_TRY(gt_delta_rule_dims(node, "delta_rule_bwd"));
    const gt_tensor *q = &node->src[0], *v = &node->src[2];
    const int64_t chunks = (q->shape[1] + GT_DR_CHUNK - 1) / GT_DR_CHUNK;
    *scratch = q->shape[0] * q->shape[2] * (chunks + GT_DR_CHUNK + 2) * q->shape[3] * v->shape[3] *
               (int64_t)sizeof(float);
    *work = 0;
    return GT_OK;
}

static int dr_launch(const gt_node *node, int kind, const char *op) {
    int64_t n[6] = {0, 0, 0, 0, 0, 0};
    const gt_tensor *sg = nullptr, *s0 = nullptr;
    GTC_TRY(gt_delta_rule_check(node, kind, op, n, &sg, &s0));
    const int64_t B = n[0], T = n[1], Hk = n[2], Hv = n[3], Dk = n[4], Dv = n[5];
    int64_t need = 0, unused = 0;
    GTC_TRY(kind == 0 ? gtc_s_delta_rule_fwd_f32(node, &need, &unused) : gtc_s_delta_rule_bwd_f32(node, &need, &unused));
    if (node->scratch_size < need)
        return GTC_FAIL(GT_ERR_INVALID, "%s: scratch must hold %lld bytes, got %lld", op, (long long)need,
                        (long long)node->scratch_size);
    const float *q = (const float *)node->src[0].data, *k = (const float *)node->src[1].data;
    const float *v = (const float *)node->src[2].data, *g = (const float *)node->src[3].data;
    const float *beta = (const float *)node->src[4].data;
    const int32_t *seg = sg ? (const int32_t *)sg->data : nullptr;
    float *d = (float *)node->dst.data, *w = (float *)node->scratch;
    if (kind == 0) {
        if (B * Hv == 0 || T == 0) return GT_OK;
        delta_rule_fwd<<<gtc_blocks(B * Hv), GTC_THREADS, 0, gtc_stream_()>>>(
            d, w, q, k, v, g, beta, seg, s0 ? (const float *)s0->data : nullptr, B, T, Hk, Hv, Dk, Dv);
    } else {
        if (B * Hk == 0 || T == 0) return GT_OK;
        delta_rule_bwd<<<gtc_blocks(B * Hk), GTC_THREADS, 0, gtc_stream_()>>>(
            d, w, q, k, v, g, beta, (const float *)node->src[5].data, seg, B, T, Hk, Hv, Dk, Dv);
    }
    return GTC_LAUNCHED(op);
}

GTC_LAUNCHER(delta_rule_fwd_f32) {
    (void)ctx;
    return dr_launch(node, 0, "delta_rule");
}

GTC_LAUNCHER(delta_rule_bwd_f32) {
    (void)ctx;
    return dr_launch(node, 1, "delta_rule_bwd");
}
