/* moe.c: mixture-of-experts routing (top-k of the router's logits, the gate weights and their
 * gradient) and the grouped expert product, ggml's mul_mat_id: each token's k experts' products
 * over only the tokens routed to each expert (in exact numerics each expert's routed rows as one
 * block through the matmul's GEMM; in llama.cpp's, one dot a routed row and output row). Every
 * output element belongs to one thread and sums its terms in a fixed order, so every thread
 * count gives the same bits. */
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
 * where ip[0] = 1; p softmax (ip[2] = 0) or sigmoid (ip[2] = 1); ip[2] = 2: the softmax of the
 * k chosen logits (llama.cpp's SOFTMAX_WEIGHT; exactly, softmax's over E divided by the chosen's
 * sum, as with ip[0]). ip[1] = 1: llama.cpp's numbers (softmax_row over E or, ip[2] = 2, over
 * the k chosen logits in slot order; sigmoid_row; the sum of the k in double, rounded to
 * float). wdata: E floats. */
int gt_moe_weights_fwd_f32(const gt_node *node, const gt_ctx *ctx) {
    static const char *op = "moe_weights";
    int64_t rows, E, k;
    GT_TRY(gt_moe_route_check(node, 1, op, &rows, &E, &k));
    if (!ctx->wdata || ctx->wsize < E * (int64_t)sizeof(float))
        return GT_FAIL(GT_ERR_INVALID, "%s: needs %lld bytes of per-thread scratch", op, (long long)(E * 4));
    const float *z = (const float *)node->src[0].data;
    const int32_t *ids = (const int32_t *)node->src[1].data;
    float *w = (float *)node->dst.data, *p = (float *)ctx->wdata;
    if (node->ip[2] < 0 || node->ip[2] > 2)
        return GT_FAIL(GT_ERR_INVALID, "%s: expected gating ip[2] 0 (softmax), 1 (sigmoid) or 2 (softmax of the "
                       "chosen), got %lld", op, (long long)node->ip[2]);
    const int llama = node->ip[1] != 0, sigmoid = node->ip[2] == 1, chosen = node->ip[2] == 2;
    const int norm = node->ip[0] != 0 || (chosen && !llama);
    int64_t lo, hi;
    gt_split(rows, ctx, &lo, &hi);
    GT_TRY(check_ids(ids + lo * k, (hi - lo) * k, E, op));
    for (int64_t r = lo; r < hi; r++) {
        float *wr = w + r * k;
        if (chosen && llama) {      /* ggml_soft_max of the k chosen logits, then as the others */
            for (int64_t s = 0; s < k; s++) p[s] = z[r * E + ids[r * k + s]];
            softmax_row(wr, p, k, 1);
            for (int64_t s = 0; s < k; s++) p[ids[r * k + s]] = wr[s];
        } else if (sigmoid)
            sigmoid_row(p, z + r * E, E, llama);
        else
            softmax_row(p, z + r * E, E, llama);
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
    return (GROUP * (K + M) + K) * (int64_t)sizeof(float) + 2 * ALIGN;
}

static float *aligned(void *p) { return (float *)(((uintptr_t)p + ALIGN - 1) & ~(uintptr_t)(ALIGN - 1)); }

/* ---- grouped products: each expert's routed rows as one block through the matmul's GEMM ---- */

/* Exact numerics (ip[0] = 0) and every gradient: each expert's routed rows are gathered, GB at
 * a time, into one contiguous block and multiplied by the expert's slice of w through
 * gt_gemm_ (the packed GEMM of gt_matmul_fwd_f32; a stored w dequantized while its panels are
 * packed), the block's products then scattered back; a stored w an expert with at most GROUP
 * rows takes instead the row-dot kernel (gt_qdot_rows_), as the matmul does for a few rows.
 * Threads split the columns of the output (fwd: the M of y, input_bwd: the K of dx, in units of
 * GT_GEMM_COL_UNIT) or its rows (weight_bwd: the E M rows of dw), so every thread works however
 * few experts are hit; each element is one GEMM chain over k in order (weight_bwd: over the
 * expert's tokens in order, blocks continuing it), and dx's sum over an X == 1 token's slots
 * runs in expert order: the same bits at every thread count. The per-row dot products above
 * stay for llama.cpp's numbers (ip[0] = 1), whose order they match. */
#define GB 256

/* per thread: the routed lists (N k i32 and E + 1 offsets), two blocks of GB rows of the wider
 * of K and M, the GEMM's or the row-dot kernel's scratch */
static int64_t grouped_work(int64_t N, int64_t K, int64_t E, int64_t M, int64_t k, int32_t wtype) {
    const int64_t wide = K > M ? K : M, gw = gt_gemm_work_bytes_(wtype),
                  qw = GT_QDOT_SCRATCH_FLOATS * (int64_t)sizeof(float);
    return N * k * 4 + (E + 1) * 8 + 2 * GB * wide * (int64_t)sizeof(float) + (gw > qw ? gw : qw) + 4 * ALIGN;
}

typedef struct grouped {
    int32_t *list;      /* the routed (n, s), as n * k + s, expert by expert, each in order */
    int64_t *off;       /* expert e's in list[off[e] .. off[e + 1]) */
    float *a, *c;       /* GB rows each */
    void *work;
} grouped;

static grouped grouped_lists(const gt_ctx *ctx, const int32_t *ids, int64_t nk, int64_t E, int64_t wide) {
    grouped g;
    g.off = (int64_t *)aligned(ctx->wdata);
    g.list = (int32_t *)(g.off + E + 1);
    g.a = aligned(g.list + nk);
    g.c = aligned(g.a + GB * wide);
    g.work = g.c + GB * wide;
    for (int64_t e = 0; e <= E; e++) g.off[e] = 0;
    for (int64_t i = 0; i < nk; i++) g.off[ids[i] + 1]++;
    for (int64_t e = 0; e < E; e++) g.off[e + 1] += g.off[e];
    for (int64_t i = 0; i < nk; i++) g.list[g.off[ids[i]]++] = (int32_t)i;
    for (int64_t e = E; e > 0; e--) g.off[e] = g.off[e - 1];
    g.off[0] = 0;
    return g;
}

/* [c0, c1): this thread's columns of n, in units of GT_GEMM_COL_UNIT, nearest to equal shares */
static void split_cols(int64_t n, const gt_ctx *ctx, int64_t *c0, int64_t *c1) {
    const int64_t u = GT_GEMM_COL_UNIT, units = (n + u - 1) / u;
    *c0 = units * ctx->ith / ctx->nth * u;
    *c1 = units * (ctx->ith + 1) / ctx->nth * u;
    *c0 = *c0 < n ? *c0 : n;
    *c1 = *c1 < n ? *c1 : n;
}

static int grouped_need(const gt_ctx *ctx, int64_t need, const char *op) {
    if (!ctx->wdata || ctx->wsize < need)
        return GT_FAIL(GT_ERR_INVALID, "%s: needs %lld bytes of per-thread scratch", op, (long long)need);
    return GT_OK;
}

/* the row a routed slot i = n k + s reads of a source with X rows a token: row n X + s (X == 1:
 * row n, the token's one row, shared by its k slots); y and its gradient g have a row a slot (X = k) */
static int64_t routed_row(int64_t i, int64_t k, int64_t X) {
    const int64_t n = i / k, s = i % k;
    return n * X + (X == 1 ? 0 : s);
}

/* dst (nb, W) = the rows of src (rows of W floats, X a token) that the routed slots q[0..nb) read */
static void gather_rows(float *dst, const float *src, const int32_t *q, int64_t nb, int64_t W, int64_t k,
                        int64_t X) {
    for (int64_t r = 0; r < nb; r++) memcpy(dst + r * W, src + routed_row(q[r], k, X) * W, (size_t)W * sizeof(float));
}

/* moe_matmul, exact numerics: y rows of expert e = its gathered x rows @ w[e]^T. */
static int grouped_fwd(const gt_node *node, const gt_ctx *ctx, int32_t wtype, const int64_t *dm, int64_t rb) {
    const int64_t N = dm[0], X = dm[1], K = dm[2], E = dm[3], M = dm[4], k = dm[5], wide = K > M ? K : M;
    GT_TRY(grouped_need(ctx, grouped_work(N, K, E, M, k, wtype), "moe_matmul"));
    const float *x = (const float *)node->src[0].data;
    const uint8_t *w = (const uint8_t *)node->src[1].data;
    const int32_t *ids = (const int32_t *)node->src[2].data;
    float *y = (float *)node->dst.data;
    int64_t c0, c1;
    split_cols(M, ctx, &c0, &c1);
    if (c0 >= c1) return GT_OK;
    grouped g = grouped_lists(ctx, ids, N * k, E, wide);
    for (int64_t e = 0; e < E; e++) {
        const uint8_t *we = w + e * M * rb;
        const int64_t ne = g.off[e + 1] - g.off[e];
        for (int64_t b0 = 0; b0 < ne; b0 += GB) {
            const int64_t nb = ne - b0 < GB ? ne - b0 : GB;
            const int32_t *q = g.list + g.off[e] + b0;
            gather_rows(g.a, x, q, nb, K, k, X);
            if (wtype != GT_F32 && ne <= GROUP)
                gt_qdot_rows_(g.c, M, g.a, K, (int)nb, we, rb, wtype, K, c0, c1, aligned(g.work));
            else
                gt_gemm_(g.c, M, g.a, K, 1, we, wtype, 1, K, nb, M, K, c0, c1, 0, g.work);
            for (int64_t r = 0; r < nb; r++)
                memcpy(y + (int64_t)q[r] * M + c0, g.c + r * M + c0, (size_t)(c1 - c0) * sizeof(float));
        }
    }
    return GT_OK;
}

/* moe_matmul_input_bwd: dx rows += the gathered g rows of expert e @ w[e], expert by expert. */
static int grouped_input_bwd(const gt_node *node, const gt_ctx *ctx, int32_t wtype, const int64_t *dm, int64_t rb) {
    const int64_t N = dm[0], X = dm[1], K = dm[2], E = dm[3], M = dm[4], k = dm[5], wide = K > M ? K : M;
    GT_TRY(grouped_need(ctx, grouped_work(N, K, E, M, k, wtype), "moe_matmul_input_bwd"));
    const uint8_t *w = (const uint8_t *)node->src[0].data;
    const int32_t *ids = (const int32_t *)node->src[1].data;
    const float *gr = (const float *)node->src[2].data;
    float *dx = (float *)node->dst.data;
    int64_t c0, c1;
    split_cols(K, ctx, &c0, &c1);
    if (c0 >= c1) return GT_OK;
    for (int64_t i = 0; i < N * X; i++) memset(dx + i * K + c0, 0, (size_t)(c1 - c0) * sizeof(float));
    grouped g = grouped_lists(ctx, ids, N * k, E, wide);
    for (int64_t e = 0; e < E; e++) {
        const uint8_t *we = w + e * M * rb;
        const int64_t ne = g.off[e + 1] - g.off[e];
        for (int64_t b0 = 0; b0 < ne; b0 += GB) {
            const int64_t nb = ne - b0 < GB ? ne - b0 : GB;
            const int32_t *q = g.list + g.off[e] + b0;
            gather_rows(g.a, gr, q, nb, M, k, k);
            gt_gemm_(g.c, K, g.a, M, 1, we, wtype, K, 1, nb, K, M, c0, c1, 0, g.work);
            for (int64_t r = 0; r < nb; r++) {
                float *dr = dx + routed_row(q[r], k, X) * K;
                const float *cr = g.c + r * K;
                for (int64_t c = c0; c < c1; c++) dr[c] += cr[c];
            }
        }
    }
    return GT_OK;
}

/* moe_matmul_weight_bwd: dw[e] rows = (expert e's gathered g rows)^T @ its gathered x rows. */
static int grouped_weight_bwd(const gt_node *node, const gt_ctx *ctx, const int64_t *dm) {
    const int64_t N = dm[0], X = dm[1], K = dm[2], E = dm[3], M = dm[4], k = dm[5], wide = K > M ? K : M;
    GT_TRY(grouped_need(ctx, grouped_work(N, K, E, M, k, GT_F32), "moe_matmul_weight_bwd"));
    const float *x = (const float *)node->src[0].data, *gr = (const float *)node->src[2].data;
    const int32_t *ids = (const int32_t *)node->src[1].data;
    float *dw = (float *)node->dst.data;
    int64_t lo, hi;
    gt_split(E * M, ctx, &lo, &hi);
    if (lo >= hi) return GT_OK;
    grouped g = grouped_lists(ctx, ids, N * k, E, wide);
    for (int64_t e = lo / M; e < E && e * M < hi; e++) {
        const int64_t r0 = e * M > lo ? 0 : lo - e * M, r1 = (e + 1) * M < hi ? M : hi - e * M;
        const int64_t ne = g.off[e + 1] - g.off[e];
        float *de = dw + (e * M + r0) * K;
        if (ne == 0) memset(de, 0, (size_t)((r1 - r0) * K) * sizeof(float));
        for (int64_t b0 = 0; b0 < ne; b0 += GB) {
            const int64_t nb = ne - b0 < GB ? ne - b0 : GB;
            const int32_t *q = g.list + g.off[e] + b0;
            gather_rows(g.a, gr, q, nb, M, k, k);
            gather_rows(g.c, x, q, nb, K, k, X);
            /* A = the g block transposed (rows r0..r1 of M), B = the x block (nb, K) */
            gt_gemm_(de, K, g.a + r0, 1, M, g.c, GT_F32, K, 1, r1 - r0, K, nb, 0, K, b0 > 0, g.work);
        }
    }
    return GT_OK;
}

/* y[n, s] = w[e] @ x[n, X == 1 ? 0 : s] for the tokens with ids[n, s] = e, expert by expert.
 * Exact numerics (ip[0] = 0): grouped_fwd. llama.cpp's numbers (ip[0] = 1), one routed row at
 * a time, threads splitting each expert's M output rows: an f32 w, each element one dot in
 * ggml's vec_dot_f32 order (gt_ggml_dot: 64 fma lanes, as its mul_mat_id runs f32 experts);
 * an f16 w, x rounded to f16, gt_ggml_dot_f16; the 32-element types of GT_ACT8_TYPES, the
 * routed rows quantized to 8 bits as llama.cpp's mul_mat_id quantizes them (gt_act8_quantize_),
 * GROUP at a time, into the 8-bit row-dot kernel (gt_qdot8_rows_ over an expert's M rows: its
 * vec_dot, or the repacked GEMV's chain, which llama.cpp's mul_mat_id runs a routed row at a
 * time). Another stored w (the K-quants) in llama's numbers is GT_ERR_UNSUPPORTED. */
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
    if (!llama) return grouped_fwd(node, ctx, wtype, dm, rb);
    if (wtype != GT_F32 && (!ctx->wdata || ctx->wsize < fwd_work(K, M)))
        return GT_FAIL(GT_ERR_INVALID, "%s: needs %lld bytes of per-thread scratch", op, (long long)fwd_work(K, M));
    float *xs = wtype != GT_F32 ? aligned(ctx->wdata) : NULL, *ys = xs ? xs + GROUP * K : NULL;
    float *xr = ys ? aligned(ys + GROUP * M) : NULL;    /* an f16 expert's input row, rounded */
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
                const float *xrow = x + routed_row(q[r], k, X) * K;
                float *yrow = y + q[r] * M;
                if (wtype == GT_F32) {
                    dots_f32(yrow, xrow, we, rb, K, m0, m1);
                } else if (act8) {          /* x's row in 8 bits, in the room of GROUP f32 rows */
                    gt_act8_quantize_((gt_act8 *)xs + r * (K / 32), xrow, K);
                } else {                    /* f16 */
                    gt_round_f16_(xr, xrow, K);
                    dots_f16(yrow, xr, we, rb, K, m0, m1, xs);
                }
            }
            if (act8) {
                gt_qdot8_rows_(ys, M, (const gt_act8 *)xs, K / 32, nq, we, rb, wtype, K, M, m0, m1);
                for (int r = 0; r < nq; r++) memcpy(y + q[r] * M + m0, ys + r * M + m0, (size_t)(m1 - m0) * sizeof(float));
            }
            nq = 0;
        }
    }
    return GT_OK;
}

static int moe_matmul_sizes(const gt_node *node, int64_t *scratch, int64_t *work, int32_t wtype) {
    const gt_tensor *x = &node->src[0], *w = &node->src[1], *ids = &node->src[2];
    *scratch = 0;
    *work = 0;
    if (x->ndim != 3 || w->ndim != 3 || ids->ndim != 2) return GT_OK;
    const int64_t K = x->shape[2], M = w->shape[1], grouped = grouped_work(x->shape[0], K, w->shape[0], M,
                                                                            ids->shape[1], wtype);
    *work = fwd_work(K, M) > grouped ? fwd_work(K, M) : grouped;     /* llama's numbers or exact ones */
    return GT_OK;
}

/* dx[n, X == 1 ? 0 : s] = sum over s (X = 1) of g[n, s] @ w[ids[n, s]]: grouped_input_bwd
 * (an X = 1 token's slots added in expert order). */
static int moe_matmul_input_bwd(const gt_node *node, const gt_ctx *ctx, int32_t wtype) {
    static const char *op = "moe_matmul_input_bwd";
    int64_t dm[6];
    GT_TRY(gt_moe_matmul_check(node, 1, op, wtype, wtype == GT_F32 ? 1 : block_of(wtype), dm));
    GT_TRY(check_ids((const int32_t *)node->src[1].data, dm[0] * dm[5], dm[3], op));
    const int64_t rb = wtype == GT_F32 ? dm[2] * (int64_t)sizeof(float) : row_bytes_of(wtype, dm[2]);
    return grouped_input_bwd(node, ctx, wtype, dm, rb);
}

static int moe_matmul_input_bwd_sizes(const gt_node *node, int64_t *scratch, int64_t *work, int32_t wtype) {
    const gt_tensor *d = &node->dst, *w = &node->src[0], *ids = &node->src[1];
    *scratch = 0;
    *work = d->ndim == 3 && w->ndim == 3 && ids->ndim == 2
                ? grouped_work(d->shape[0], d->shape[2], w->shape[0], w->shape[1], ids->shape[1], wtype)
                : 0;
    return GT_OK;
}

/* dw[e, m] = sum over the (n, s) with ids[n, s] = e, in order, of g[n, s, m] x[n, X == 1 ? 0 :
 * s]; rows of experts no token chose are 0: grouped_weight_bwd (threads split the E M rows). */
int gt_moe_matmul_weight_bwd_f32(const gt_node *node, const gt_ctx *ctx) {
    static const char *op = "moe_matmul_weight_bwd";
    int64_t dm[6];
    GT_TRY(gt_moe_matmul_check(node, 2, op, GT_F32, 1, dm));
    GT_TRY(check_ids((const int32_t *)node->src[1].data, dm[0] * dm[5], dm[3], op));
    return grouped_weight_bwd(node, ctx, dm);
}

int gt_moe_matmul_weight_bwd_f32_sizes(const gt_node *node, int64_t *scratch, int64_t *work) {
    const gt_tensor *x = &node->src[0], *d = &node->dst, *ids = &node->src[1];
    *scratch = 0;
    *work = x->ndim == 3 && d->ndim == 3 && ids->ndim == 2
                ? grouped_work(x->shape[0], x->shape[2], d->shape[0], d->shape[1], ids->shape[1], GT_F32)
                : 0;
    return GT_OK;
}

int gt_moe_matmul_fwd_f32(const gt_node *node, const gt_ctx *ctx) { return moe_matmul(node, ctx, GT_F32); }
int gt_moe_matmul_fwd_f32_sizes(const gt_node *node, int64_t *scratch, int64_t *work) {
    return moe_matmul_sizes(node, scratch, work, GT_F32);
}
int gt_moe_matmul_input_bwd_f32(const gt_node *node, const gt_ctx *ctx) {
    return moe_matmul_input_bwd(node, ctx, GT_F32);
}
int gt_moe_matmul_input_bwd_f32_sizes(const gt_node *node, int64_t *scratch, int64_t *work) {
    return moe_matmul_input_bwd_sizes(node, scratch, work, GT_F32);
}

#define MOE_WEIGHT(w, ID)                                                                                  \
    int gt_moe_matmul_fwd_f32_##w(const gt_node *node, const gt_ctx *ctx) { return moe_matmul(node, ctx, ID); } \
    int gt_moe_matmul_fwd_f32_##w##_sizes(const gt_node *node, int64_t *scratch, int64_t *work) {           \
        return moe_matmul_sizes(node, scratch, work, ID);                                                     \
    }                                                                                                      \
    int gt_moe_matmul_input_bwd_f32_##w(const gt_node *node, const gt_ctx *ctx) {                          \
        return moe_matmul_input_bwd(node, ctx, ID);                                                        \
    }                                                                                                      \
    int gt_moe_matmul_input_bwd_f32_##w##_sizes(const gt_node *node, int64_t *scratch, int64_t *work) {    \
        return moe_matmul_input_bwd_sizes(node, scratch, work, ID);                                            \
    }
GT_WEIGHT_TYPES(MOE_WEIGHT)
