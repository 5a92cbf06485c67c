/* moe.c: mixture-of-experts routing (top-k of the router's logits, the gate weights and their
 * gradient) and the grouped expert product, ggml's mul_mat_id: each token's k experts' products
 * over only the tokens routed to each expert. Every output element belongs to one thread and
 * sums its terms in a fixed order, so every thread count gives the same bits. */
#include "ggmlnum.h"
#include "internal.h"
#include "simd.h"

#define ALIGN 64
#define GROUP GT_QDOT_MAX_M     /* routed rows a stored weight's row-dot call takes at once */

/* ---- routing ---------------------------------------------------------------------------------- */

/* The score moe_topk ranks expert e of a row by: its logit z (softmax gating, ip[1] = 0: the
 * softmax keeps the order), or sigmoid(z) plus the selection bias b[e] where the node has one
 * (src1; sigmoid gating, ip[1] = 1), in llama.cpp's f32 (1.f / (1.f + expf(-z)), then + b). */
static float topk_score(float z, const float *bias, int64_t e, int sigmoid) {
    if (!sigmoid) return z;
    const float p = 1.0f / (1.0f + expf(-z));
    return bias ? p + bias[e] : p;
}

/* ids[r] = the k experts of largest score in row r (topk_score), largest first (llama.cpp's
 * argsort_top_k, descending; of equal scores the lower index first). */
int gt_moe_topk_fwd_i32(const gt_node *node, const gt_ctx *ctx) {
    int64_t rows, E, k;
    GT_TRY(gt_moe_route_check(node, 0, "moe_topk", &rows, &E, &k));
    const float *z = (const float *)node->src[0].data;
    const float *bias = node->n_src > 1 ? (const float *)node->src[1].data : NULL;
    const int sigmoid = node->ip[1] != 0;
    int32_t *ids = (int32_t *)node->dst.data;
    int64_t lo, hi;
    gt_split(rows, ctx, &lo, &hi);
    for (int64_t r = lo; r < hi; r++) {
        const float *zr = z + r * E;
        int32_t *out = ids + r * k;
        for (int64_t s = 0; s < k; s++) {
            int64_t best = -1;
            float top = 0.0f;
            for (int64_t e = 0; e < E; e++) {
                int taken = 0;
                for (int64_t t = 0; t < s; t++) taken |= out[t] == e;
                const float v = topk_score(zr[e], bias, e, sigmoid);
                if (!taken && (best < 0 || v > top)) {
                    best = e;
                    top = v;
                }
            }
            out[s] = (int32_t)best;
        }
    }
    return GT_OK;
}

/* p = softmax(zr) over E (into p). llama: ggml_soft_max's numbers (exp by ggml_v_expf in
 * 16-lane blocks, each block's sum by _mm512_reduce_add_ps's tree added in double, the rest
 * by libm's expf one by one; the row scaled by (float)(1 / sum)); else exp from the max, summed
 * in double in order, each divided by the sum. */
static void softmax_row(float *p, const float *zr, int64_t E, int llama) {
    float max = -INFINITY;
    for (int64_t e = 0; e < E; e++) max = zr[e] > max ? zr[e] : max;
    double sum = 0.0;
    int64_t e = 0;
    if (llama) {
        for (; e + 16 <= E; e += 16) {
            for (int l = 0; l < 16; l++) p[e + l] = gt_ggml_expf_(zr[e + l] - max);
            sum += (double)gt_ggml_reduce16(p + e);
        }
        for (; e < E; e++) {
            p[e] = expf(zr[e] - max);
            sum += (double)p[e];
        }
        const float inv = (float)(1.0 / sum);
        for (e = 0; e < E; e++) p[e] *= inv;
        return;
    }
    for (; e < E; e++) {
        p[e] = gt_expf_(zr[e] - max);
        sum += (double)p[e];
    }
    for (e = 0; e < E; e++) p[e] = (float)((double)p[e] / sum);
}

/* p = sigmoid(zr) over E (into p): llama: ggml_sigmoid's 1.f / (1.f + expf(-z)); else in
 * double, rounded once. */
static void sigmoid_row(float *p, const float *zr, int64_t E, int llama) {
    for (int64_t e = 0; e < E; e++)
        p[e] = llama ? 1.0f / (1.0f + expf(-zr[e])) : (float)(1.0 / (1.0 + exp(-(double)zr[e])));
}

/* The smallest sum of gate weights a renormalisation divides by (llama.cpp clamps it to the
 * smallest normal f16). */
#define MOE_MIN_SUM 6.103515625e-5f

static int check_ids(const int32_t *ids, int64_t n, int64_t E, const char *op) {
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= E)
            return GT_FAIL(GT_ERR_INVALID, "%s: expert id %d outside [0, %lld)", op, ids[i], (long long)E);
    return GT_OK;
}

/* w[r, s] = p(z[r])[ids[r, s]], divided by their sum over s (clamped below at MOE_MIN_SUM)
 * where ip[0] = 1; p softmax (ip[2] = 0) or sigmoid (ip[2] = 1). ip[1] = 1: llama.cpp's
 * numbers (softmax_row, sigmoid_row; the sum of the k in double, rounded to float). wdata: E
 * floats. */
int gt_moe_weights_fwd_f32(const gt_node *node, const gt_ctx *ctx) {
    static const char *op = "moe_weights";
    int64_t rows, E, k;
    GT_TRY(gt_moe_route_check(node, 1, op, &rows, &E, &k));
    if (!ctx->wdata || ctx->wsize < E * (int64_t)sizeof(float))
        return GT_FAIL(GT_ERR_INVALID, "%s: needs %lld bytes of per-thread scratch", op, (long long)(E * 4));
    const float *z = (const float *)node->src[0].data;
    const int32_t *ids = (const int32_t *)node->src[1].data;
    float *w = (float *)node->dst.data, *p = (float *)ctx->wdata;
    const int norm = node->ip[0] != 0, llama = node->ip[1] != 0, sigmoid = node->ip[2] != 0;
    int64_t lo, hi;
    gt_split(rows, ctx, &lo, &hi);
    GT_TRY(check_ids(ids + lo * k, (hi - lo) * k, E, op));
    for (int64_t r = lo; r < hi; r++) {
        if (sigmoid)
            sigmoid_row(p, z + r * E, E, llama);
        else
            softmax_row(p, z + r * E, E, llama);
        float *wr = w + r * k;
        double sum = 0.0;
        for (int64_t s = 0; s < k; s++) {
            wr[s] = p[ids[r * k + s]];
            sum += (double)wr[s];
        }
        if (!norm) continue;
        float S = (float)sum;
        S = S < MOE_MIN_SUM ? MOE_MIN_SUM : S;
        for (int64_t s = 0; s < k; s++) wr[s] = wr[s] / S;
    }
    return GT_OK;
}

int gt_moe_weights_fwd_f32_sizes(const gt_node *node, int64_t *scratch, int64_t *work) {
    const gt_tensor *z = &node->src[0];
    *scratch = 0;
    *work = (z->ndim ? z->shape[z->ndim - 1] : 1) * (int64_t)sizeof(float);
    return GT_OK;
}

/* dz[r] of moe_weights' g[r]: with p = softmax(z[r]) or sigmoid(z[r]) (ip[1] = 1) and the
 * selected q_s = p[ids[r, s]], dq_s = g_s (ip[0] = 0), or (g_s - sum_t g_t w_t) / S with
 * S = sum_t q_t (ip[0] = 1; g_s / S where S is clamped); then dz_e = p_e (dq_e - sum_s q_s
 * dq_s) (softmax) or dq_e p_e (1 - p_e) (sigmoid), dq zero off the selected experts (the
 * selection itself is piecewise constant). wdata: E floats. */
int gt_moe_weights_bwd_f32(const gt_node *node, const gt_ctx *ctx) {
    static const char *op = "moe_weights_bwd";
    int64_t rows, E, k;
    GT_TRY(gt_moe_route_check(node, 2, op, &rows, &E, &k));
    if (!ctx->wdata || ctx->wsize < E * (int64_t)sizeof(float))
        return GT_FAIL(GT_ERR_INVALID, "%s: needs %lld bytes of per-thread scratch", op, (long long)(E * 4));
    const float *z = (const float *)node->src[0].data, *g = (const float *)node->src[2].data;
    const int32_t *ids = (const int32_t *)node->src[1].data;
    float *dz = (float *)node->dst.data, *p = (float *)ctx->wdata;
    const int norm = node->ip[0] != 0, sigmoid = node->ip[1] != 0;
    int64_t lo, hi;
    gt_split(rows, ctx, &lo, &hi);
    GT_TRY(check_ids(ids + lo * k, (hi - lo) * k, E, op));
    for (int64_t r = lo; r < hi; r++) {
        if (sigmoid)
            sigmoid_row(p, z + r * E, E, 0);
        else
            softmax_row(p, z + r * E, E, 0);
        const int32_t *ir = ids + r * k;
        const float *gr = g + r * k;
        double S = 0.0, gw = 0.0;
        for (int64_t s = 0; s < k; s++) S += (double)p[ir[s]];
        const int clamped = norm && (float)S < MOE_MIN_SUM;
        if (clamped) S = MOE_MIN_SUM;
        for (int64_t s = 0; s < k; s++) gw += (double)gr[s] * (double)p[ir[s]] / S;
        double dot = 0.0;       /* sum_s q_s dq_s */
        float *dr = dz + r * E;
        for (int64_t e = 0; e < E; e++) dr[e] = 0.0f;
        for (int64_t s = 0; s < k; s++) {
            const double dq = !norm ? gr[s] : clamped ? gr[s] / S : (gr[s] - gw) / S;
            dr[ir[s]] = (float)dq;
            dot += (double)p[ir[s]] * dq;
        }
        for (int64_t e = 0; e < E; e++)
            dr[e] = sigmoid ? (float)((double)dr[e] * (double)p[e] * (1.0 - (double)p[e]))
                            : (float)((double)p[e] * ((double)dr[e] - dot));
    }
    return GT_OK;
}

int gt_moe_weights_bwd_f32_sizes(const gt_node *node, int64_t *scratch, int64_t *work) {
    return gt_moe_weights_fwd_f32_sizes(node, scratch, work);
}

/* ---- the grouped expert product (ggml's mul_mat_id) ------------------------------------------ */

/* The bytes of one row of K elements of type dtype. */
static int64_t row_bytes_of(int32_t dtype, int64_t K) {
    const gt_dtype_traits *t = gt_dtype_find_(dtype);
    return K / t->block * t->block_bytes;
}

static int block_of(int32_t dtype) { return gt_dtype_find_(dtype)->block; }

/* per thread: GROUP gathered x rows and their GROUP products (M each), the row-dot kernels'
 * scratch, and one row of K (an x row rounded to f16, llama's f16 products) */
/* y[m] = gt_ggml_dot(x, w row m) for m in [m0, m1), f32 rows rb bytes apart: cloned per SIMD
 * level, so its fmaf are instructions (the same bits at every level: fmaf rounds once) */
GT_CLONES static void dots_f32(float *y, const float *x, const uint8_t *w, int64_t rb, int64_t K, int64_t m0,
                               int64_t m1) {
    for (int64_t m = m0; m < m1; m++) y[m] = gt_ggml_dot(x, (const float *)(w + m * rb), K);
}

/* the same for f16 rows (x already rounded to f16), each dequantized into buf first */
GT_CLONES static void dots_f16(float *y, const float *x, const uint8_t *w, int64_t rb, int64_t K, int64_t m0,
                               int64_t m1, float *buf) {
    const gt_dequant_fn deq = gt_dequantizer_(GT_F16);
    for (int64_t m = m0; m < m1; m++) {
        deq(buf, w + m * rb, K);
        y[m] = gt_ggml_dot_f16(x, buf, K);
    }
}

/* (llama's numbers: a routed row's K / 32 blocks of 8-bit activations take the room of its K floats) */
_Static_assert(sizeof(gt_act8) <= 32 * sizeof(float), "gt_act8 outgrows the f32 rows it replaces");

static int64_t fwd_work(int64_t K, int64_t M) {
    return (GROUP * (K + M) + GT_QDOT_SCRATCH_FLOATS + K) * (int64_t)sizeof(float) + 2 * ALIGN;
}

static float *aligned(void *p) { return (float *)(((uintptr_t)p + ALIGN - 1) & ~(uintptr_t)(ALIGN - 1)); }

/* y[n, s] = w[e] @ x[n, X == 1 ? 0 : s] for the tokens with ids[n, s] = e, expert by expert.
 * Threads split each expert's M output rows. An f32 w: each element one dot in ggml's
 * vec_dot_f32 order (gt_ggml_dot: 64 fma lanes, as its mul_mat_id runs f32 experts; llama's
 * numbers and exact f32 alike, ip[0] = 1 or 0); an f16
 * w in llama's numbers: x rounded to f16, gt_ggml_dot_f16; any other stored w: the routed rows
 * gathered GROUP at a time into the matmul's row-dot kernel (gt_qdot_rows_) over the expert's
 * slice of w, or in llama's numbers, for the 32-element types of GT_ACT8_TYPES, quantized to 8
 * bits as llama.cpp's mul_mat_id quantizes them (gt_act8_quantize_) into the 8-bit row-dot
 * kernel (gt_qdot8_rows_ over an expert's M rows: its vec_dot, or the repacked GEMV's chain,
 * which llama.cpp's mul_mat_id runs a routed row at a time). Another stored w (the K-quants) in
 * llama's numbers is GT_ERR_UNSUPPORTED. */
static int moe_matmul(const gt_node *node, const gt_ctx *ctx, int32_t wtype) {
    static const char *op = "moe_matmul";
    int64_t dm[6];
    GT_TRY(gt_moe_matmul_check(node, 0, op, wtype, wtype == GT_F32 ? 1 : block_of(wtype), dm));
    const int64_t N = dm[0], X = dm[1], K = dm[2], E = dm[3], M = dm[4], k = dm[5];
    const float *x = (const float *)node->src[0].data;
    const uint8_t *w = (const uint8_t *)node->src[1].data;
    const int32_t *ids = (const int32_t *)node->src[2].data;
    float *y = (float *)node->dst.data;
    const int llama = node->ip[0] != 0;
    const int act8 = llama && wtype != GT_F32 && wtype != GT_F16;
    if (act8 && !(gt_act8_supports_(wtype) && block_of(wtype) == 32))
        return GT_FAIL(GT_ERR_UNSUPPORTED, "%s: llama.cpp's numbers for %s expert weights are not implemented", op,
                       gt_type_name(wtype));
    GT_TRY(check_ids(ids, N * k, E, op));
    const int64_t rb = wtype == GT_F32 ? K * (int64_t)sizeof(float) : row_bytes_of(wtype, K);
    if (wtype != GT_F32 && (!ctx->wdata || ctx->wsize < fwd_work(K, M)))
        return GT_FAIL(GT_ERR_INVALID, "%s: needs %lld bytes of per-thread scratch", op, (long long)fwd_work(K, M));
    float *xs = wtype != GT_F32 ? aligned(ctx->wdata) : NULL, *ys = xs ? xs + GROUP * K : NULL;
    float *scratch = ys ? aligned(ys + GROUP * M) : NULL, *xr = scratch ? scratch + GT_QDOT_SCRATCH_FLOATS : NULL;
    int64_t m0, m1;
    gt_split(M, ctx, &m0, &m1);
    if (m0 >= m1) return GT_OK;
    for (int64_t e = 0; e < E; e++) {
        const uint8_t *we = w + e * M * rb;
        int64_t q[GROUP];          /* the routed (n, s) of this group, as n * k + s */
        int nq = 0;
        for (int64_t i = 0; i <= N * k; i++) {
            if (i < N * k && ids[i] == e) q[nq++] = i;
            if (nq == 0 || (nq < GROUP && i < N * k)) continue;
            for (int r = 0; r < nq; r++) {
                const int64_t n = q[r] / k, s = q[r] % k;
                const float *xrow = x + (n * X + (X == 1 ? 0 : s)) * K;
                float *yrow = y + q[r] * M;
                if (wtype == GT_F32) {
                    dots_f32(yrow, xrow, we, rb, K, m0, m1);
                } else if (act8) {          /* x's row in 8 bits, in the room of GROUP f32 rows */
                    gt_act8_quantize_((gt_act8 *)xs + r * (K / 32), xrow, K);
                } else if (llama) {         /* f16 */
                    gt_round_f16_(xr, xrow, K);
                    dots_f16(yrow, xr, we, rb, K, m0, m1, xs);
                } else {
                    memcpy(xs + r * K, xrow, (size_t)K * sizeof(float));
                }
            }
            if (act8 || (wtype != GT_F32 && !llama)) {
                if (act8) gt_qdot8_rows_(ys, M, (const gt_act8 *)xs, K / 32, nq, we, rb, wtype, K, M, m0, m1);
                else gt_qdot_rows_(ys, M, xs, K, nq, we, rb, wtype, K, m0, m1, scratch);
                for (int r = 0; r < nq; r++) memcpy(y + q[r] * M + m0, ys + r * M + m0, (size_t)(m1 - m0) * sizeof(float));
            }
            nq = 0;
        }
    }
    return GT_OK;
}

static int moe_matmul_sizes(const gt_node *node, int64_t *scratch, int64_t *work) {
    const gt_tensor *x = &node->src[0], *w = &node->src[1];
    *scratch = 0;
    *work = x->ndim == 3 && w->ndim == 3 ? fwd_work(x->shape[2], w->shape[1]) : 0;
    return GT_OK;
}

/* dx[n, X == 1 ? 0 : s] = sum over s (X = 1), m of g[n, s, m] w[ids[n, s], m, :], in that
 * order; threads split the tokens. A stored w's rows are dequantized one at a time (wdata: K
 * floats). */
static int moe_matmul_input_bwd(const gt_node *node, const gt_ctx *ctx, int32_t wtype) {
    static const char *op = "moe_matmul_input_bwd";
    int64_t dm[6];
    GT_TRY(gt_moe_matmul_check(node, 1, op, wtype, wtype == GT_F32 ? 1 : block_of(wtype), dm));
    const int64_t N = dm[0], X = dm[1], K = dm[2], E = dm[3], M = dm[4], k = dm[5];
    const uint8_t *w = (const uint8_t *)node->src[0].data;
    const int32_t *ids = (const int32_t *)node->src[1].data;
    const float *g = (const float *)node->src[2].data;
    float *dx = (float *)node->dst.data;
    const int64_t rb = wtype == GT_F32 ? K * (int64_t)sizeof(float) : row_bytes_of(wtype, K);
    const gt_dequant_fn deq = wtype == GT_F32 ? NULL : gt_dequantizer_(wtype);
    if (deq && (!ctx->wdata || ctx->wsize < K * (int64_t)sizeof(float)))
        return GT_FAIL(GT_ERR_INVALID, "%s: needs %lld bytes of per-thread scratch", op, (long long)(K * 4));
    float *buf = (float *)ctx->wdata;
    int64_t lo, hi;
    gt_split(N, ctx, &lo, &hi);
    GT_TRY(check_ids(ids + lo * k, (hi - lo) * k, E, op));
    for (int64_t n = lo; n < hi; n++) {
        for (int64_t i = n * X * K; i < (n + 1) * X * K; i++) dx[i] = 0.0f;
        for (int64_t s = 0; s < k; s++) {
            float *dr = dx + (n * X + (X == 1 ? 0 : s)) * K;
            const float *gr = g + (n * k + s) * M;
            const uint8_t *we = w + (int64_t)ids[n * k + s] * M * rb;
            for (int64_t m = 0; m < M; m++) {
                const float *wm = (const float *)(we + m * rb);
                if (deq) {
                    deq(buf, we + m * rb, K / block_of(wtype));
                    wm = buf;
                }
                const float gm = gr[m];
                for (int64_t c = 0; c < K; c++) dr[c] += gm * wm[c];
            }
        }
    }
    return GT_OK;
}

static int moe_matmul_input_bwd_sizes(const gt_node *node, int64_t *scratch, int64_t *work) {
    const gt_tensor *d = &node->dst;
    *scratch = 0;
    *work = (d->ndim == 3 ? d->shape[2] : 0) * (int64_t)sizeof(float);
    return GT_OK;
}

/* dw[e, m] = sum over the (n, s) with ids[n, s] = e, in order, of g[n, s, m] x[n, X == 1 ? 0 :
 * s]; rows of experts no token chose are 0. Threads split the E M rows (the same terms in the
 * same order at every thread count). */
int gt_moe_matmul_weight_bwd_f32(const gt_node *node, const gt_ctx *ctx) {
    static const char *op = "moe_matmul_weight_bwd";
    int64_t dm[6];
    GT_TRY(gt_moe_matmul_check(node, 2, op, GT_F32, 1, dm));
    const int64_t N = dm[0], X = dm[1], K = dm[2], E = dm[3], M = dm[4], k = dm[5];
    const float *x = (const float *)node->src[0].data, *g = (const float *)node->src[2].data;
    const int32_t *ids = (const int32_t *)node->src[1].data;
    float *dw = (float *)node->dst.data;
    GT_TRY(check_ids(ids, N * k, E, op));
    int64_t lo, hi;
    gt_split(E * M, ctx, &lo, &hi);
    for (int64_t i = lo * K; i < hi * K; i++) dw[i] = 0.0f;
    /* this thread's rows, expert by expert: one pass over the ids an expert */
    for (int64_t e = lo / M; e < E && e * M < hi; e++) {
        const int64_t r0 = e * M > lo ? e * M : lo, r1 = (e + 1) * M < hi ? (e + 1) * M : hi;
        for (int64_t i = 0; i < N * k; i++) {
            if (ids[i] != e) continue;
            const int64_t n = i / k, s = i % k;
            const float *xr = x + (n * X + (X == 1 ? 0 : s)) * K, *gi = g + i * M;
            for (int64_t row = r0; row < r1; row++) {
                float *dr = dw + row * K;
                const float gm = gi[row - e * M];
                for (int64_t c = 0; c < K; c++) dr[c] += gm * xr[c];
            }
        }
    }
    return GT_OK;
}

int gt_moe_matmul_fwd_f32(const gt_node *node, const gt_ctx *ctx) { return moe_matmul(node, ctx, GT_F32); }
int gt_moe_matmul_input_bwd_f32(const gt_node *node, const gt_ctx *ctx) {
    return moe_matmul_input_bwd(node, ctx, GT_F32);
}

#define MOE_WEIGHT(w, ID)                                                                                  \
    int gt_moe_matmul_fwd_f32_##w(const gt_node *node, const gt_ctx *ctx) { return moe_matmul(node, ctx, ID); } \
    int gt_moe_matmul_fwd_f32_##w##_sizes(const gt_node *node, int64_t *scratch, int64_t *work) {           \
        return moe_matmul_sizes(node, scratch, work);                                                     \
    }                                                                                                      \
    int gt_moe_matmul_input_bwd_f32_##w(const gt_node *node, const gt_ctx *ctx) {                          \
        return moe_matmul_input_bwd(node, ctx, ID);                                                        \
    }                                                                                                      \
    int gt_moe_matmul_input_bwd_f32_##w##_sizes(const gt_node *node, int64_t *scratch, int64_t *work) {    \
        return moe_matmul_input_bwd_sizes(node, scratch, work);                                            \
    }
GT_WEIGHT_TYPES(MOE_WEIGHT)
