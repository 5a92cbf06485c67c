/* deltachunk.c: the gated delta rule (deltarule.c's op) in its chunked form, forward and
 * backward: rows in chunks of GT_DR_BLOCK, within a chunk matrix products (gt_gemm_small_),
 * across chunks the state carried (the gated DeltaNet paper's WY / UT form, as
 * flash-linear-attention's chunk_gated_delta_rule). Per head, with S0 the state entering a
 * chunk of L rows, G the cumulative sum of g from the chunk's first row (double),
 *     D_t[s] = exp(G_t - G_s) for s <= t in t's segment (<= 1 where g <= 0: nothing overflows),
 *     gam_t = exp(G_t) where row t still carries S0 (no segment start in the chunk up to t),
 *     (I + A) delta = beta (v - gam K S0),  A[t, s] = beta_t (k_t . k_s) D_t[s] for s < t,
 *     o = scale (gam Q S0 + ((Q K^T) .* D) delta),  S_end = gam_last S0 + K^T (w .* delta),
 * w_s = D_last[s]; which is the step-by-step recurrence exactly (in real arithmetic).
 * Packed samples: a segment start inside a chunk masks D, gam and w (the chunk grid stays
 * fixed, so memory does not depend on the segments). The backward recomputes the chunk states
 * forward, then takes the chunks back in reverse order through the same products. */
#include <math.h>

#include "internal.h"
#include "../deltarule.h"

#define Q_AT(p, b, t, h, H, D) ((p) + (((b) * T + (t)) * (H) + (h)) * (D))

/* A chunk's buffers, carved from a thread's work (chunk_floats floats). */
typedef struct {
    double *G;
    float *gam, *w, *dG, *beta;
    int32_t *st;   /* st[t]: the chunk row where row t's segment starts (0: before the chunk or at it) */
    float *Kt, *Dt, *KK, *QK, *Dm, *E, *X, *dDm, *KS, *QS, *U, *D, *dD, *dO, *tmp, *dQ, *dK, *S0t, *dSt;
} chunk_ws;

static int64_t chunk_floats(int64_t Dk, int64_t Dv) {
    const int64_t C = GT_DR_BLOCK;
    return 2 * C + 5 * C + (Dk + Dv) * C + 6 * C * C + 7 * C * Dv + 2 * C * Dk + 2 * Dv * Dk;
}

static chunk_ws carve(float *p, int64_t Dk, int64_t Dv) {
    const int64_t C = GT_DR_BLOCK;
    chunk_ws s;
    s.G = (double *)(void *)p, p += 2 * C;
    s.gam = p, p += C;
    s.w = p, p += C;
    s.dG = p, p += C;
    s.beta = p, p += C;
    s.st = (int32_t *)(void *)p, p += C;
    s.Kt = p, p += Dk * C;
    s.Dt = p, p += Dv * C;
    float **cc[] = {&s.KK, &s.QK, &s.Dm, &s.E, &s.X, &s.dDm};
    for (int i = 0; i < 6; i++) *cc[i] = p, p += C * C;
    float **cv[] = {&s.KS, &s.QS, &s.U, &s.D, &s.dD, &s.dO, &s.tmp};
    for (int i = 0; i < 7; i++) *cv[i] = p, p += C * Dv;
    s.dQ = p, p += C * Dk;
    s.dK = p, p += C * Dk;
    s.S0t = p, p += Dv * Dk;
    s.dSt = p;
    return s;
}

/* One head's rows of a chunk: q, k rows ldk apart, v (and o, go) rows ldv apart, g and beta
 * ldg apart; seg (or NULL) at the chunk's first row. */
typedef struct {
    const float *q, *k, *v, *g, *beta;
    const int32_t *seg;
    int64_t L, ldk, ldv, ldg, Dk, Dv, first;   /* first: the chunk's first row is the window's */
} chunk_in;

static void transpose(float *dst, int64_t ldd, const float *src, int64_t lds, int64_t rows, int64_t cols) {
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++) dst[j * ldd + i] = src[i * lds + j];
}

/* the row operations, on rows that never overlap (restrict: the compiler's vectors) */
static float dot(const float *x, const float *y, int64_t n) { return gt_dr_dot(x, 1.0f, y, n); }

static void axpy(float *restrict y, float a, const float *restrict x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

static void scale_to(float *restrict y, float a, const float *restrict x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = a * x[i];
}

static void scale_by(float *restrict y, float a, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] *= a;
}

/* y = x .* z (rows of L x L products) */
static void mul_to(float *restrict y, const float *restrict x, const float *restrict z, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = x[i] * z[i];
}

/* The chunk's gates, masks and products, delta solved; with S0 (the entering state, Dk x Dv;
 * NULL or a segment start at the chunk's first row: none) its terms too. Returns whether S0
 * reaches the chunk. qk: also Q K^T and Q S0 (for o). */
static int prep(chunk_ws *s, const chunk_in *in, const float *S0, int qk) {
    const int64_t C = GT_DR_BLOCK, L = in->L, Dk = in->Dk, Dv = in->Dv;
    const int has0 = S0 != NULL && !in->first && !(in->seg && in->seg[0] != in->seg[-1]);
    double acc = 0.0;
    for (int64_t t = 0; t < L; t++) {
        acc += (double)in->g[t * in->ldg];
        s->G[t] = acc;
        s->beta[t] = in->beta[t * in->ldg];
        s->st[t] = t > 0 && in->seg && in->seg[t] != in->seg[t - 1] ? (int32_t)t : t > 0 ? s->st[t - 1] : 0;
        s->gam[t] = has0 && s->st[t] == 0 ? expf((float)s->G[t]) : 0.0f;
    }
    for (int64_t t = 0; t < L; t++) {
        s->w[t] = t >= s->st[L - 1] ? expf((float)(s->G[L - 1] - s->G[t])) : 0.0f;
        float *dm = s->Dm + t * C;
        for (int64_t j = 0; j < L; j++) dm[j] = j <= t && j >= s->st[t] ? expf((float)(s->G[t] - s->G[j])) : 0.0f;
    }
    transpose(s->Kt, C, in->k, in->ldk, L, Dk);
    gt_gemm_small_(s->KK, C, in->k, in->ldk, 1, s->Kt, C, L, L, Dk, 0);
    if (qk) gt_gemm_small_(s->QK, C, in->q, in->ldk, 1, s->Kt, C, L, L, Dk, 0);
    for (int64_t t = 0; t < L; t++) {
        mul_to(s->E + t * C, s->KK + t * C, s->Dm + t * C, t);
        memset(s->E + t * C + t, 0, (size_t)(L - t) * sizeof(float));
    }
    if (has0) {
        gt_gemm_small_(s->KS, Dv, in->k, in->ldk, 1, S0, Dv, L, Dv, Dk, 0);
        if (qk) gt_gemm_small_(s->QS, Dv, in->q, in->ldk, 1, S0, Dv, L, Dv, Dk, 0);
    }
    /* U = v - gam K S0; delta = (I + A)^-1 beta U by forward substitution */
    for (int64_t t = 0; t < L; t++) {
        const float *vr = in->v + t * in->ldv;
        float *u = s->U + t * Dv, *d = s->D + t * Dv;
        memcpy(u, vr, (size_t)Dv * sizeof(float));
        if (has0) axpy(u, -s->gam[t], s->KS + t * Dv, Dv);
        scale_to(d, s->beta[t], u, Dv);
        for (int64_t r = s->st[t]; r < t; r++) axpy(d, -(s->beta[t] * s->E[t * C + r]), s->D + r * Dv, Dv);
    }
    return has0;
}

/* S <- gam_last S + K^T (w .* delta) (S = 0 first when S0 did not reach the chunk). */
static void carry(chunk_ws *s, const chunk_in *in, float *S, int has0) {
    const int64_t L = in->L, Dk = in->Dk, Dv = in->Dv;
    for (int64_t i = 0; i < Dk * Dv; i++) S[i] = has0 ? S[i] * s->gam[L - 1] : 0.0f;
    for (int64_t t = 0; t < L; t++)
        scale_to(s->tmp + t * Dv, s->w[t], s->D + t * Dv, Dv);
    gt_gemm_small_(S, Dv, in->k, 1, in->ldk, s->tmp, Dv, Dk, Dv, L, 1);
}

static chunk_in chunk_at(const float *q, const float *k, const float *v, const float *g, const float *beta,
                         const int32_t *seg, int64_t b, int64_t t0, int64_t h, int64_t T, int64_t Hk, int64_t Hv,
                         int64_t Dk, int64_t Dv) {
    const int64_t C = GT_DR_BLOCK, hk = h % Hk;
    chunk_in in = {Q_AT(q, b, t0, hk, Hk, Dk), Q_AT(k, b, t0, hk, Hk, Dk), Q_AT(v, b, t0, h, Hv, Dv),
                   g + (b * T + t0) * Hv + h, beta + (b * T + t0) * Hv + h, seg ? seg + b * T + t0 : NULL,
                   T - t0 < C ? T - t0 : C, Hk * Dk, Hv * Dv, Hv, Dk, Dv, t0 == 0};
    return in;
}

int64_t gt_dr_chunk_fwd_floats_(int64_t Dk, int64_t Dv) { return Dk * Dv + chunk_floats(Dk, Dv); }

/* o of V heads (b, h) for r in [lo, hi), h = r % Hv, as gt_delta_rule_fwd_f32 without s0. */
void gt_dr_chunk_fwd_(float *dst, float *work, const float *q, const float *k, const float *v, const float *g,
                      const float *beta, const int32_t *seg, int64_t lo, int64_t hi, int64_t T, int64_t Hk,
                      int64_t Hv, int64_t Dk, int64_t Dv) {
    const int64_t C = GT_DR_BLOCK;
    const float scale = 1.0f / sqrtf((float)Dk);
    chunk_ws s = carve(work, Dk, Dv);
    float *S = work + chunk_floats(Dk, Dv);
    for (int64_t r = lo; r < hi; r++) {
        const int64_t b = r / Hv, h = r % Hv;
        for (int64_t t0 = 0; t0 < T; t0 += C) {
            const chunk_in in = chunk_at(q, k, v, g, beta, seg, b, t0, h, T, Hk, Hv, Dk, Dv);
            const int64_t L = in.L;
            const int has0 = prep(&s, &in, S, 1);
            float *o = dst + ((b * T + t0) * Hv + h) * Dv;
            if (has0) {
                gt_gemm_small_(o, in.ldv, in.q, in.ldk, 1, S, Dv, L, Dv, Dk, 0);
                for (int64_t t = 0; t < L; t++)
                    scale_by(o + t * in.ldv, scale * s.gam[t], Dv);
            }
            for (int64_t t = 0; t < L; t++)
                for (int64_t j = 0; j < L; j++) s.X[t * C + j] = scale * s.QK[t * C + j] * s.Dm[t * C + j];
            gt_gemm_small_(o, in.ldv, s.X, C, 1, s.D, Dv, L, Dv, L, has0);
            if (t0 + C < T) carry(&s, &in, S, has0);
        }
    }
}

int64_t gt_dr_chunk_bwd_floats_(int64_t T, int64_t Dk, int64_t Dv) {
    return ((T + GT_DR_BLOCK - 1) / GT_DR_BLOCK + 1) * Dk * Dv + chunk_floats(Dk, Dv);
}

/* One chunk back: dS (Dk x Dv) holds the gradient in the chunk's last state and becomes the
 * gradient in S0; dst's row gets dv, dg, dbeta and adds to dq, dk. */
static void chunk_bwd(chunk_ws *s, const chunk_in *in, const float *S0, float *dS, const float *go, float *row,
                      int64_t W, int64_t hk, int64_t h, int64_t Hk, int64_t Hv, float scale) {
    const int64_t C = GT_DR_BLOCK, L = in->L, Dk = in->Dk, Dv = in->Dv, ldk = in->ldk;
    const int has0 = prep(s, in, S0, 1);
    /* S_end = gam_last S0 + K^T (w .* delta) */
    gt_gemm_small_(s->dD, Dv, in->k, ldk, 1, dS, Dv, L, Dv, Dk, 0);   /* K dS */
    for (int64_t t = 0; t < L; t++) s->dG[t] = 0.0f;
    for (int64_t t = 0; t < L; t++) {
        float *dd = s->dD + t * Dv;
        const float dwt = dot(dd, s->D + t * Dv, Dv);
        scale_by(dd, s->w[t], Dv);
        s->dG[L - 1] += dwt * s->w[t];
        s->dG[t] -= dwt * s->w[t];
    }
    transpose(s->dSt, Dk, dS, Dv, Dk, Dv);
    gt_gemm_small_(s->dK, Dk, s->D, Dv, 1, s->dSt, Dk, L, Dk, Dv, 0);
    for (int64_t t = 0; t < L; t++)
        scale_by(s->dK + t * Dk, s->w[t], Dk);
    if (has0) {
        s->dG[L - 1] += s->gam[L - 1] * dot(dS, S0, Dk * Dv);
        for (int64_t i = 0; i < Dk * Dv; i++) dS[i] *= s->gam[L - 1];
        transpose(s->S0t, Dk, S0, Dv, Dk, Dv);
    } else {
        memset(dS, 0, (size_t)(Dk * Dv) * sizeof(float));
    }
    /* o = scale (gam Q S0 + ((Q K^T) .* D) delta) */
    for (int64_t t = 0; t < L; t++)
        scale_to(s->dO + t * Dv, scale, go + t * in->ldv, Dv);
    if (has0) {
        gt_gemm_small_(s->dQ, Dk, s->dO, Dv, 1, s->S0t, Dk, L, Dk, Dv, 0);
        for (int64_t t = 0; t < L; t++) {
            s->dG[t] += s->gam[t] * dot(s->dO + t * Dv, s->QS + t * Dv, Dv);
            scale_by(s->dQ + t * Dk, s->gam[t], Dk);
            scale_to(s->tmp + t * Dv, s->gam[t], s->dO + t * Dv, Dv);
        }
        gt_gemm_small_(dS, Dv, in->q, 1, ldk, s->tmp, Dv, Dk, Dv, L, 1);
    } else {
        for (int64_t i = 0; i < L * Dk; i++) s->dQ[i] = 0.0f;
    }
    for (int64_t t = 0; t < L; t++)
        mul_to(s->X + t * C, s->QK + t * C, s->Dm + t * C, L);
    gt_gemm_small_(s->dD, Dv, s->X, 1, C, s->dO, Dv, L, Dv, L, 1);
    transpose(s->Dt, C, s->D, Dv, L, Dv);
    gt_gemm_small_(s->X, C, s->dO, Dv, 1, s->Dt, C, L, L, Dv, 0);   /* dP */
    for (int64_t t = 0; t < L; t++)
        for (int64_t j = 0; j < L; j++) {
            const int64_t a = t * C + j;
            s->dDm[a] = s->X[a] * s->QK[a];
            s->X[a] *= s->Dm[a];   /* d(Q K^T) */
        }
    gt_gemm_small_(s->dQ, Dk, s->X, C, 1, in->k, ldk, L, Dk, L, 1);
    gt_gemm_small_(s->dK, Dk, s->X, 1, C, in->q, ldk, L, Dk, L, 1);
    /* (I + A) delta = beta U: back substitution for the gradient in beta U */
    float *dR = s->dD;
    for (int64_t t = L - 1; t >= 0; t--) {
        float *d = dR + t * Dv;
        for (int64_t r = t + 1; r < L; r++) {
            const float a = s->beta[r] * s->E[r * C + t], *dr = dR + r * Dv;
            if (a != 0.0f) axpy(d, -a, dr, Dv);
        }
    }
    gt_gemm_small_(s->X, C, dR, Dv, 1, s->Dt, C, L, L, Dv, 0);   /* -dA */
    float *dv = row + 2 * Hk * Dk + h * Dv;
    for (int64_t t = 0; t < L; t++) {
        float db = dot(dR + t * Dv, s->U + t * Dv, Dv);
        for (int64_t j = 0; j < L; j++) {
            const int64_t a = t * C + j;
            const float dA = j < t ? -s->X[a] : 0.0f;
            db += dA * s->E[a];
            s->dDm[a] += s->beta[t] * dA * s->KK[a];
            s->X[a] = s->beta[t] * dA * s->Dm[a];   /* d(K K^T), lower part */
        }
        row[t * W + 2 * Hk * Dk + Hv * Dv + Hv + h] = db;
        scale_to(dv + t * W, s->beta[t], dR + t * Dv, Dv);
    }
    gt_gemm_small_(s->dK, Dk, s->X, C, 1, in->k, ldk, L, Dk, L, 1);
    gt_gemm_small_(s->dK, Dk, s->X, 1, C, in->k, ldk, L, Dk, L, 1);
    if (has0) {   /* beta U = beta (v - gam K S0) */
        for (int64_t t = 0; t < L; t++) {
            const float c = -s->gam[t] * s->beta[t];
            s->dG[t] += c * dot(dR + t * Dv, s->KS + t * Dv, Dv);
            scale_to(s->tmp + t * Dv, c, dR + t * Dv, Dv);
        }
        gt_gemm_small_(s->dK, Dk, s->tmp, Dv, 1, s->S0t, Dk, L, Dk, Dv, 1);
        gt_gemm_small_(dS, Dv, in->k, 1, ldk, s->tmp, Dv, Dk, Dv, L, 1);
    }
    /* D_t[s] = exp(G_t - G_s) */
    for (int64_t t = 0; t < L; t++)
        for (int64_t j = 0; j <= t; j++) {
            const float x = s->dDm[t * C + j] * s->Dm[t * C + j];
            s->dG[t] += x;
            s->dG[j] -= x;
        }
    float acc = 0.0f;
    for (int64_t t = L - 1; t >= 0; t--) {
        acc += s->dG[t];
        const int reset = (t == 0 && in->first) || (in->seg && (t > 0 || !in->first) && in->seg[t] != in->seg[t - 1]);
        row[t * W + 2 * Hk * Dk + Hv * Dv + h] = reset ? 0.0f : acc;
        axpy(row + t * W + hk * Dk, 1.0f, s->dQ + t * Dk, Dk);
        axpy(row + t * W + Hk * Dk + hk * Dk, 1.0f, s->dK + t * Dk, Dk);
    }
}

/* dq | dk | dv | dg | dbeta of the K heads (b, hk) for r in [lo, hi), as gt_delta_rule_bwd_f32. */
void gt_dr_chunk_bwd_(float *dst, float *work, const float *q, const float *k, const float *v, const float *g,
                      const float *beta, const float *go, const int32_t *seg, int64_t lo, int64_t hi, int64_t T,
                      int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv) {
    const int64_t C = GT_DR_BLOCK, S = Dk * Dv, chunks = (T + C - 1) / C, W = 2 * Hk * Dk + Hv * Dv + 2 * Hv;
    const float scale = 1.0f / sqrtf((float)Dk);
    chunk_ws s = carve(work, Dk, Dv);
    float *ck = work + chunk_floats(Dk, Dv), *dS = ck + chunks * S;
    for (int64_t r = lo; r < hi; r++) {
        const int64_t b = r / Hk, hk = r % Hk;
        gt_dr_zero_dqk(dst, b, hk, T, Hk, Dk, W);
        for (int64_t h = hk; h < Hv; h += Hk) {
            memset(ck, 0, (size_t)S * sizeof(float));
            for (int64_t c = 0; c + 1 < chunks; c++) {
                const chunk_in in = chunk_at(q, k, v, g, beta, seg, b, c * C, h, T, Hk, Hv, Dk, Dv);
                memcpy(ck + (c + 1) * S, ck + c * S, (size_t)S * sizeof(float));
                carry(&s, &in, ck + (c + 1) * S, prep(&s, &in, ck + c * S, 0));
            }
            memset(dS, 0, (size_t)S * sizeof(float));
            for (int64_t c = chunks - 1; c >= 0; c--) {
                const chunk_in in = chunk_at(q, k, v, g, beta, seg, b, c * C, h, T, Hk, Hv, Dk, Dv);
                chunk_bwd(&s, &in, ck + c * S, dS, go + ((b * T + c * C) * Hv + h) * Dv, dst + (b * T + c * C) * W,
                          W, hk, h, Hk, Hv, scale);
            }
        }
    }
}
