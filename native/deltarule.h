/* deltarule.h: one step of the gated delta rule (Qwen3.5's gated DeltaNet layers, llama.cpp's
 * gated_delta_net) forward and backward, written once for the CPU kernels (native/cpu/
 * deltarule.c) and the CUDA kernels (native/cuda/deltarule.cu), so both compute the same terms
 * in the same order (not part of the C API; cffi never reads it).
 *
 * Per head the state S is (Dk, Dv), stored as Dv rows of Dk floats: m[j * Dk + i] = S[i][j]
 * (llama.cpp's layout: row j is column j of S). One step with decay a = exp(g):
 *     P = a S_prev (S_prev = 0 at a sample's first row)
 *     u = P^T k,  delta = beta (v - u),  S = P + k delta^T,  o = scale S^T q
 * summed, per row j, in i order from 0 as llama.cpp's CPU kernel does (its SIMD dot products
 * add lanes in another order: ~1 ulp apart). */
#ifndef GT_DELTARULE_H
#define GT_DELTARULE_H

#include "elementmath.h"

/* The forward step: m holds S_prev (reset: ignored, taken as 0) and becomes S; o (may be
 * NULL) gets scale S^T q. */
GT_HD static inline void gt_dr_step(float *m, int reset, const float *q, const float *k, const float *v, float g,
                                    float beta, float *o, float scale, int64_t Dk, int64_t Dv) {
    const float a = gt_expf_(g);
    for (int64_t j = 0; j < Dv; j++) {
        float *row = m + j * Dk;
        float u = 0.0f;
        for (int64_t i = 0; i < Dk; i++) {
            row[i] = reset ? 0.0f : row[i] * a;
            u += row[i] * k[i];
        }
        const float d = (v[j] - u) * beta;
        for (int64_t i = 0; i < Dk; i++) row[i] += k[i] * d;
        if (o) {
            float s = 0.0f;
            for (int64_t i = 0; i < Dk; i++) s += row[i] * q[i];
            o[j] = s * scale;
        }
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
    const float a = gt_expf_(g);
    float sg = 0.0f, sb = 0.0f;
    for (int64_t j = 0; j < Dv; j++) {
        const float *pr = prev + j * Dk, *cr = cur + j * Dk;
        float *dr = ds + j * Dk;
        const float goj = go[j] * scale;
        float u = 0.0f, dd = 0.0f;
        for (int64_t i = 0; i < Dk; i++) {
            dr[i] += q[i] * goj;           /* o = scale S^T q */
            dq[i] += cr[i] * goj;
            u += (reset ? 0.0f : pr[i] * a) * k[i];
        }
        const float r = v[j] - u, d = r * beta;
        for (int64_t i = 0; i < Dk; i++) {
            dk[i] += dr[i] * d;             /* S = P + k delta^T */
            dd += dr[i] * k[i];
        }
        sb += dd * r;
        dv[j] = dd * beta;
        const float du = -dd * beta;        /* delta = beta (v - u) */
        for (int64_t i = 0; i < Dk; i++) {
            const float p = reset ? 0.0f : pr[i] * a;
            const float dp = dr[i] + k[i] * du;  /* u = P^T k */
            dk[i] += p * du;
            sg += p * dp;                   /* P = a S_prev: dg = sum P dP */
            dr[i] = reset ? 0.0f : dp * a;
        }
    }
    *dg = sg;
    *db = sb;
}

#endif
