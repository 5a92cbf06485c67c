/* deltarule.h: one step of the gated delta rule (Qwen3.5's gated DeltaNet layers, llama.cpp's
 * gated_delta_net) forward and backward, and the backward's zeroed dq, dk, written once for the
 * CPU kernels (native/cpu/deltarule.c, deltachunk.c) and the CUDA kernels
 * (native/cuda/deltarule.cu), so all compute the same terms in the same order (not part of the
 * C API; cffi never reads it).
 *
 * Per head the state S is (Dk, Dv), stored as Dv rows of Dk floats: m[j * Dk + i] = S[i][j]
 * (llama.cpp's layout: row j is column j of S). One step with decay a = exp(g):
 *     P = a S_prev (S_prev = 0 at a sample's first row)
 *     u = P^T k,  delta = beta (v - u),  S = P + k delta^T,  o = scale S^T q
 * each dot product in 8 partial sums (gt_dr_dot; llama.cpp's SIMD dot products add their lanes
 * in another order: ~1 ulp apart). */
#ifndef GT_DELTARULE_H
#define GT_DELTARULE_H

#include "elementmath.h"

/* sum over i < n of (x[i] * a) * y[i] in 8 partial sums (lane l takes i = l mod 8, the
 * compiler's vectors), added pairwise, then the tail: the order of every dot product here. */
GT_HD static inline float gt_dr_dot(const float *x, float a, const float *y, int64_t n) {
    float s[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) s[l] += (x[i + l] * a) * y[i + l];
    float t = 0.0f;
    for (; i < n; i++) t += (x[i] * a) * y[i];
    return (((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]))) + t;
}

/* The backward's start for one (sample b, K head hk): zero its dq and dk columns in b's T rows
 * of dst (rows of W floats, dq | dk | dv | dg | dbeta, Hk K heads of Dk), which its V heads
 * hk, hk + Hk, ... then add to. */
GT_HD static inline void gt_dr_zero_dqk(float *dst, int64_t b, int64_t hk, int64_t T, int64_t Hk, int64_t Dk,
                                        int64_t W) {
    for (int64_t t = 0; t < T; t++) {
        float *dq = dst + (b * T + t) * W + hk * Dk, *dk = dq + Hk * Dk;
        for (int64_t i = 0; i < Dk; i++) dq[i] = 0.0f;
        for (int64_t i = 0; i < Dk; i++) dk[i] = 0.0f;
    }
}

/* The forward step: m holds S_prev (reset: ignored, taken as 0) and becomes S; o (may be
 * NULL) gets scale S^T q. */
GT_HD static inline void gt_dr_step(float *m, int reset, const float *q, const float *k, const float *v, float g,
                                    float beta, float *o, float scale, int64_t Dk, int64_t Dv) {
    const float a = gt_expf_(g);
    for (int64_t j = 0; j < Dv; j++) {
        float *row = m + j * Dk;
        if (reset)
            for (int64_t i = 0; i < Dk; i++) row[i] = 0.0f;
        else
            for (int64_t i = 0; i < Dk; i++) row[i] *= a;
        const float d = (v[j] - gt_dr_dot(row, 1.0f, k, Dk)) * beta;
        for (int64_t i = 0; i < Dk; i++) row[i] += k[i] * d;
        if (o) o[j] = gt_dr_dot(row, 1.0f, q, Dk) * scale;
    }
}

/* The backward of one step. prev: S_prev (unused when reset), cur: S after the step, ds: the
 * gradient of the loss in S (from the later rows; on return the gradient in S_prev, 0 when
 * reset), go: the gradient in o. Adds to dq, dk (a K head's gradient sums over its V heads);
 * writes dv and returns dg and dbeta through *dg, *db. */
GT_HD static inline void gt_dr_step_bwd(const float *prev, const float *cur, float *ds, int reset, const float *q,
                                        const float *k, const float *v, float g, float beta, const float *go,
                                        float scale, float *dq, float *dk, float *dv, float *dg, float *db,
                                        int64_t Dk, int64_t Dv) {
    const float a = reset ? 0.0f : gt_expf_(g);   /* P = a S_prev, 0 at a sample's first row */
    float sg = 0.0f, sb = 0.0f;
    for (int64_t j = 0; j < Dv; j++) {
        const float *cr = cur + j * Dk, *pr = reset ? cr : prev + j * Dk;   /* (times a = 0 when reset) */
        float *dr = ds + j * Dk;
        const float goj = go[j] * scale;
        for (int64_t i = 0; i < Dk; i++) {
            dr[i] += q[i] * goj;           /* o = scale S^T q */
            dq[i] += cr[i] * goj;
        }
        const float r = v[j] - gt_dr_dot(pr, a, k, Dk), d = r * beta;
        for (int64_t i = 0; i < Dk; i++) dk[i] += dr[i] * d;   /* S = P + k delta^T */
        const float dd = gt_dr_dot(dr, 1.0f, k, Dk);
        sb += dd * r;
        dv[j] = dd * beta;
        const float du = -dd * beta;        /* delta = beta (v - u), u = P^T k */
        for (int64_t i = 0; i < Dk; i++) {
            dk[i] += (pr[i] * a) * du;
            dr[i] += k[i] * du;             /* dP */
        }
        sg += gt_dr_dot(pr, a, dr, Dk);     /* P = a S_prev: dg = sum P dP */
        for (int64_t i = 0; i < Dk; i++) dr[i] *= a;
    }
    *dg = sg;
    *db = sb;
}

#endif
