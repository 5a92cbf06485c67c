/* moe.cu: mixture-of-experts routing and the grouped expert product (ggml's mul_mat_id) and
 * their gradients, as native/cpu/moe.c computes them: one thread a row (routing) or an output
 * element (the products), its terms summed in the CPU's order, except the forward product's
 * dot (the CPU's in ggml's 64 lanes, this one in order: f32 rounding apart). A stored expert
 * tensor is first decoded whole into the node's work memory (as matmul.cu does a stored
 * weight). llama.cpp's CPU numbers (ip flags) are the CPU kernels'. Expert ids come from
 * moe_topk (in range). */
#include "common.cuh"
#include "kernels.h"
#include "quant.cuh"

#define MOE_MIN_SUM 6.103515625e-5f

/* the score an expert is ranked by: its logit (softmax gating), or sigmoid(z) in f32 plus the
 * selection bias where there is one (sigmoid gating), as the CPU's topk_score */
__device__ inline float moe_topk_score(float z, const float *bias, int64_t e, bool sigmoid) {
    if (!sigmoid) return z;
    const float p = 1.0f / (1.0f + expf(-z));
    return bias ? p + bias[e] : p;
}

__global__ void moe_topk(int32_t *ids, const float *z, const float *bias, int64_t rows, int64_t E, int64_t k,
                         bool sigmoid) {
    GTC_FOR(r, rows) {
        const float *zr = z + r * E;
        int32_t *out = ids + r * k;
        for (int64_t s = 0; s < k; s++) {
            int64_t best = -1;
            float top = 0.0f;
            for (int64_t e = 0; e < E; e++) {
                bool taken = false;
                for (int64_t t = 0; t < s; t++) taken |= out[t] == e;
                const float v = moe_topk_score(zr[e], bias, e, sigmoid);
                if (!taken && (best < 0 || v > top)) {
                    best = e;
                    top = v;
                }
            }
            out[s] = (int32_t)best;
        }
    }
}

/* the row's max and the sum (in double, in order) of exp(z - max) */
__device__ inline void moe_softmax_sums(const float *zr, int64_t E, float *max, double *sum) {
    float m = -INFINITY;
    for (int64_t e = 0; e < E; e++) m = zr[e] > m ? zr[e] : m;
    double s = 0.0;
    for (int64_t e = 0; e < E; e++) s += (double)gt_expf_(zr[e] - m);
    *max = m;
    *sum = s;
}

/* expert e's gate probability: softmax (from the row's max and sum) or sigmoid (in double,
 * rounded once, as the CPU's sigmoid_row) */
__device__ inline float moe_p(const float *zr, int64_t e, float max, double sum, bool sigmoid) {
    if (sigmoid) return (float)(1.0 / (1.0 + exp(-(double)zr[e])));
    return (float)((double)gt_expf_(zr[e] - max) / sum);
}

__global__ void moe_weights(float *w, const float *z, const int32_t *ids, int64_t rows, int64_t E, int64_t k,
                            bool norm, bool sigmoid) {
    GTC_FOR(r, rows) {
        const float *zr = z + r * E;
        float max = 0.0f;
        double sum = 1.0, wsum = 0.0;
        if (!sigmoid) moe_softmax_sums(zr, E, &max, &sum);
        float *wr = w + r * k;
        for (int64_t s = 0; s < k; s++) {
            wr[s] = moe_p(zr, ids[r * k + s], max, sum, sigmoid);
            wsum += (double)wr[s];
        }
        if (!norm) continue;
        float S = (float)wsum;
        S = S < MOE_MIN_SUM ? MOE_MIN_SUM : S;
        for (int64_t s = 0; s < k; s++) wr[s] = wr[s] / S;
    }
}

__global__ void moe_weights_bwd(float *dz, const float *z, const int32_t *ids, const float *g, int64_t rows,
                                int64_t E, int64_t k, bool norm, bool sigmoid) {
    GTC_FOR(r, rows) {
        const float *zr = z + r * E, *gr = g + r * k;
        const int32_t *ir = ids + r * k;
        float max = 0.0f;
        double sum = 1.0, S = 0.0, gw = 0.0, dot = 0.0;
        if (!sigmoid) moe_softmax_sums(zr, E, &max, &sum);
        for (int64_t s = 0; s < k; s++) S += (double)moe_p(zr, ir[s], max, sum, sigmoid);
        const bool clamped = norm && (float)S < MOE_MIN_SUM;
        if (clamped) S = MOE_MIN_SUM;
        for (int64_t s = 0; s < k; s++) gw += (double)gr[s] * (double)moe_p(zr, ir[s], max, sum, sigmoid) / S;
        float *dr = dz + r * E;
        for (int64_t e = 0; e < E; e++) dr[e] = 0.0f;
        for (int64_t s = 0; s < k; s++) {
            const double dq = !norm ? gr[s] : clamped ? gr[s] / S : (gr[s] - gw) / S;
            dr[ir[s]] = (float)dq;
            dot += (double)moe_p(zr, ir[s], max, sum, sigmoid) * dq;
        }
        for (int64_t e = 0; e < E; e++) {
            const double p = (double)moe_p(zr, e, max, sum, sigmoid);
            dr[e] = sigmoid ? (float)((double)dr[e] * p * (1.0 - p)) : (float)(p * ((double)dr[e] - dot));
        }
    }
}

static int route_launch(const gt_node *node, int kind, const char *op) {
    int64_t rows = 0, E = 0, k = 0;
    GTC_TRY(gt_moe_route_check(node, kind, op, &rows, &E, &k));
    if (kind == 1 && node->ip[1])
        return GTC_FAIL(GT_ERR_INVALID, "%s: llama.cpp's CPU numbers (ip[1] = 1) are the CPU kernel's", op);
    if (kind == 1 && (node->ip[2] < 0 || node->ip[2] > 2))   /* 2: the chosen's softmax, softmax's renormalised */
        return GTC_FAIL(GT_ERR_INVALID, "%s: expected gating ip[2] 0 (softmax), 1 (sigmoid) or 2 (softmax of the "
                        "chosen), got %lld", op, (long long)node->ip[2]);
    if (rows == 0) return GT_OK;
    const float *z = (const float *)node->src[0].data;
    const int32_t *ids = kind ? (const int32_t *)node->src[1].data : nullptr;
    const unsigned nb = gtc_blocks(rows);
    if (kind == 0)
        moe_topk<<<nb, GTC_THREADS, 0, gtc_stream_()>>>((int32_t *)node->dst.data, z,
                                                        node->n_src > 1 ? (const float *)node->src[1].data : nullptr,
                                                        rows, E, k, node->ip[1] != 0);
    else if (kind == 1)
        moe_weights<<<nb, GTC_THREADS, 0, gtc_stream_()>>>((float *)node->dst.data, z, ids, rows, E, k,
                                                           node->ip[0] != 0 || node->ip[2] == 2, node->ip[2] == 1);
    else
        moe_weights_bwd<<<nb, GTC_THREADS, 0, gtc_stream_()>>>((float *)node->dst.data, z, ids,
                                                               (const float *)node->src[2].data, rows, E, k,
                                                               node->ip[0] != 0, node->ip[1] != 0);
    return GTC_LAUNCHED(op);
}

GTC_LAUNCHER(moe_topk_fwd_i32) {
    (void)ctx;
    return route_launch(node, 0, "moe_topk");
}

GTC_LAUNCHER(moe_weights_fwd_f32) {
    (void)ctx;
    return route_launch(node, 1, "moe_weights");
}

GTC_LAUNCHER(moe_weights_bwd_f32) {
    (void)ctx;
    return route_launch(node, 2, "moe_weights_bwd");
}

/* ---- the grouped expert product ------------------------------------------------------------- */

/* y[n, s, m] = w[ids[n, s], m] . x[n, 0 or s], in order */
__global__ void moe_matmul(float *y, const float *x, const float *w, const int32_t *ids, int64_t N, int64_t X,
                           int64_t K, int64_t M, int64_t k) {
    GTC_FOR(i, N * k * M) {
        const int64_t m = i % M, ns = i / M, n = ns / k, s = ns % k;
        const float *xr = x + (n * X + (X == 1 ? 0 : s)) * K, *wm = w + ((int64_t)ids[ns] * M + m) * K;
        float acc = 0.0f;
        for (int64_t c = 0; c < K; c++) acc += xr[c] * wm[c];
        y[i] = acc;
    }
}

/* dx[n, x, c] = sum over its slots s, then m, of g[n, s, m] w[ids[n, s], m, c] */
__global__ void moe_matmul_input_bwd(float *dx, const float *w, const int32_t *ids, const float *g, int64_t N,
                                     int64_t X, int64_t K, int64_t M, int64_t k) {
    GTC_FOR(i, N * X * K) {
        const int64_t c = i % K, nx = i / K, n = nx / X, xs = nx % X;
        float acc = 0.0f;
        for (int64_t s = 0; s < k; s++) {
            if (X != 1 && s != xs) continue;
            const float *gr = g + (n * k + s) * M, *we = w + (int64_t)ids[n * k + s] * M * K;
            for (int64_t m = 0; m < M; m++) acc += gr[m] * we[m * K + c];
        }
        dx[i] = acc;
    }
}

/* dw[e, m, c] = sum over the (n, s) routed to e, in order, of g[n, s, m] x[n, 0 or s, c] */
__global__ void moe_matmul_weight_bwd(float *dw, const float *x, const int32_t *ids, const float *g, int64_t N,
                                      int64_t X, int64_t K, int64_t E, int64_t M, int64_t k) {
    GTC_FOR(i, E * M * K) {
        const int64_t c = i % K, m = (i / K) % M, e = i / (K * M);
        float acc = 0.0f;
        for (int64_t ns = 0; ns < N * k; ns++) {
            if (ids[ns] != e) continue;
            const int64_t n = ns / k, s = ns % k;
            acc += g[ns * M + m] * x[(n * X + (X == 1 ? 0 : s)) * K + c];
        }
        dw[i] = acc;
    }
}

__global__ void moe_decode(float *y, const uint8_t *w, int32_t type, int64_t n_blocks, int be, int bb) {
    GTC_FOR(i, n_blocks) gtc_decode_block(type, w + i * bb, y + i * be);
}

/* The expert weights as f32: an f32 tensor's own memory, a stored one decoded into wdata. */
static int experts_f32(const gt_tensor *w, const gt_ctx *ctx, const float **out, const char *op) {
    if (w->dtype == GT_F32) {
        *out = (const float *)w->data;
        return GT_OK;
    }
    const int64_t n = gtc_numel(*w);
    if (!ctx->wdata || ctx->wsize < n * (int64_t)sizeof(float))
        return GTC_FAIL(GT_ERR_INVALID, "%s: needs %lld bytes of work (the decoded experts), got %lld", op,
                        (long long)(n * 4), (long long)ctx->wsize);
    const int be = gtc_block_elems(w->dtype), bb = gtc_block_bytes(w->dtype);
    moe_decode<<<gtc_blocks(n / be), GTC_THREADS, 0, gtc_stream_()>>>((float *)ctx->wdata, (const uint8_t *)w->data,
                                                                     w->dtype, n / be, be, bb);
    *out = (const float *)ctx->wdata;
    return GTC_LAUNCHED("decoding stored experts");
}

static int moe_launch(const gt_node *node, const gt_ctx *ctx, int kind, int32_t wtype, const char *op) {
    int64_t dm[6] = {0, 0, 0, 0, 0, 0};
    GTC_TRY(gt_moe_matmul_check(node, kind, op, wtype, gtc_block_elems(wtype), dm));
    if (kind == 0 && node->ip[0])
        return GTC_FAIL(GT_ERR_INVALID, "%s: llama.cpp's CPU numbers (ip[0] = 1) are the CPU kernel's", op);
    const int64_t N = dm[0], X = dm[1], K = dm[2], E = dm[3], M = dm[4], k = dm[5];
    const int32_t *ids = (const int32_t *)node->src[kind == 0 ? 2 : 1].data;
    float *d = (float *)node->dst.data;
    const int64_t n = gtc_numel(node->dst);
    if (n == 0) return GT_OK;
    const float *w = nullptr;
    if (kind == 0) {
        GTC_TRY(experts_f32(&node->src[1], ctx, &w, op));
        moe_matmul<<<gtc_blocks(n), GTC_THREADS, 0, gtc_stream_()>>>(d, (const float *)node->src[0].data, w, ids, N, X,
                                                                     K, M, k);
    } else if (kind == 1) {
        GTC_TRY(experts_f32(&node->src[0], ctx, &w, op));
        moe_matmul_input_bwd<<<gtc_blocks(n), GTC_THREADS, 0, gtc_stream_()>>>(
            d, w, ids, (const float *)node->src[2].data, N, X, K, M, k);
    } else {
        moe_matmul_weight_bwd<<<gtc_blocks(n), GTC_THREADS, 0, gtc_stream_()>>>(
            d, (const float *)node->src[0].data, ids, (const float *)node->src[2].data, N, X, K, E, M, k);
    }
    return GTC_LAUNCHED(op);
}

/* work: the decoded experts (src `at`) */
static int moe_sizes(const gt_node *node, int at, int64_t *scratch, int64_t *work) {
    *scratch = 0;
    *work = node->n_src > at ? gtc_numel(node->src[at]) * (int64_t)sizeof(float) : 0;
    return GT_OK;
}

GTC_LAUNCHER(moe_matmul_fwd_f32) { return moe_launch(node, ctx, 0, GT_F32, "moe_matmul"); }
GTC_LAUNCHER(moe_matmul_input_bwd_f32) { return moe_launch(node, ctx, 1, GT_F32, "moe_matmul_input_bwd"); }
GTC_LAUNCHER(moe_matmul_weight_bwd_f32) { return moe_launch(node, ctx, 2, GT_F32, "moe_matmul_weight_bwd"); }

#define MOE_WEIGHT(w, ID)                                                                                     \
    GTC_SIZES(moe_matmul_fwd_f32_##w) { return moe_sizes(node, 1, scratch, work); }                           \
    GTC_LAUNCHER(moe_matmul_fwd_f32_##w) { return moe_launch(node, ctx, 0, ID, "moe_matmul"); }              \
    GTC_SIZES(moe_matmul_input_bwd_f32_##w) { return moe_sizes(node, 0, scratch, work); }                     \
    GTC_LAUNCHER(moe_matmul_input_bwd_f32_##w) { return moe_launch(node, ctx, 1, ID, "moe_matmul_input_bwd"); }
GT_WEIGHT_TYPES(MOE_WEIGHT)
