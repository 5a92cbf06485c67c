/* softmax.c: softmax (scaled, optionally masked) and its backward, and
 * cross_entropy with its backward. Rows are split across threads; every row is
 * reduced in a fixed order, and cross_entropy's mean over rows goes through
 * per-row scratch summed by thread 0, so results do not depend on the thread
 * count or the SIMD level. */
#include <math.h>

#include "internal.h"
#include "rowops.h"
#include "simd.h"

#define LANES GT_LANES

/* ---- row helpers (contiguous rows) --------------------------------------- */

/* d[j] = exp(s * x[j] - m); returns sum of d in a fixed order */
GT_CLONES static float exp_row(float *restrict d, const float *restrict x, float s, float m, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int k = 0; k < LANES; k++) {
            const float e = gt_expf_(s * x[i + k] - m);
            d[i + k] = e;
            acc[k] += e;
        }
    float sum = 0.0f;
    for (int k = 0; k < LANES; k++) sum += acc[k];
    for (; i < n; i++) {
        const float e = gt_expf_(s * x[i] - m);
        d[i] = e;
        sum += e;
    }
    return sum;
}

/* sum of exp(x[j] - m), x not written anywhere */
GT_CLONES static float sumexp_row(const float *x, float m, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int k = 0; k < LANES; k++) acc[k] += gt_expf_(x[i + k] - m);
    float sum = 0.0f;
    for (int k = 0; k < LANES; k++) sum += acc[k];
    for (; i < n; i++) sum += gt_expf_(x[i] - m);
    return sum;
}

/* Loops in blocks of LANES plus a scalar tail: see rowops.h's NOTE. */
/* d = c * y * (g - t) */
GT_CLONES static void softmax_bwd_row(float *restrict d, const float *restrict y, const float *restrict g,
                                      float c, float t, int64_t n) {
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int k = 0; k < LANES; k++) d[i + k] = c * y[i + k] * (g[i + k] - t);
    for (; i < n; i++) d[i] = c * y[i] * (g[i] - t);
}

/* ---- softmax --------------------------------------------------------------- */

/* One row of the segment mask: y (tk) = softmax of s * x over the columns
 * j <= i with sg[j] == sg[i], 0 elsewhere (sg: this batch row's seg, tk). */
GT_CLONES static void softmax_seg_row(float *y, const float *x, float s, const int32_t *sg, int64_t i, int64_t tk) {
    const int32_t me = sg[i];
    int64_t lo = i;
    while (lo > 0 && sg[lo - 1] == me) lo--;
    int64_t j = 0;
    while (j < lo && sg[j] != me) j++;
    if (j == lo) {   /* the visible columns are the run [lo, i] */
        const int64_t n = i - lo + 1;
        memset(y, 0, (size_t)lo * sizeof(float));
        const float m = scaled_max_row(x + lo, s, n);
        const float sum = exp_row(y + lo, x + lo, s, m, n);
        mul_row(y + lo, 1.0f / sum, n);
        memset(y + i + 1, 0, (size_t)(tk - i - 1) * sizeof(float));
        return;
    }
    /* the same value earlier too: mask column by column (j is the first one seen) */
    float m = s * x[j];
    for (int64_t k = j + 1; k <= i; k++)
        if (sg[k] == me && s * x[k] > m) m = s * x[k];
    float sum = 0.0f;
    for (int64_t k = 0; k < tk; k++) {
        const float e = k <= i && sg[k] == me ? gt_expf_(s * x[k] - m) : 0.0f;
        y[k] = e;
        sum += e;
    }
    const float inv = 1.0f / sum;
    for (int64_t k = 0; k <= i; k++) y[k] *= inv;
}

/* softmax: dst = softmax(fp[0] * src) over the last dim.
 * src (..., T_q, T_k) f32 contiguous, dst same shape contiguous; scale fp[0].
 * ip[0] is the mask: 0 none; 1 causal, row i (of the T_q dim) sees columns
 * j <= i + (T_k - T_q); 2 by position, src1 pos (T_q,) i32 and row i sees
 * columns j <= pos[i] (a KV cache holding positions 0..T_k-1, queried at
 * positions pos); 3 by segment (packed samples), src1 seg (B, T_k) i32
 * contiguous, src (B, ..., T_q, T_k) with T_q == T_k, and row i of batch b
 * (b = row / (rows per batch)) sees columns j <= i with seg[b, j] == seg[b, i].
 * Masked entries are exactly 0, and a row that sees no column is all 0. Needs
 * ndim >= 2 with a mask, 3 with mode 3 (ndim >= 1 otherwise).
 * Mode 3 finds the run of equal seg values ending at i; when no earlier column
 * shares its value (packed samples are contiguous runs) the row is the range
 * [start of the run, i] and goes through the vector helpers at that offset, so
 * a sample packed after others is computed as it would be alone; otherwise a
 * plain masked loop serves (any seg pattern is valid).
 * NOTE: the row max of the scaled values is subtracted before exp, so large
 * inputs do not overflow; the sum of exps is in float, 16 lanes, fixed order. */
int gt_softmax_fwd_f32(const gt_node *node, const gt_ctx *ctx) {
    const char *op = "softmax";
    const gt_tensor *d = &node->dst, *x = &node->src[0];
    GT_TRY(gt_softmax_check(node, op));
    const int64_t mask = node->ip[0];
    const int64_t tk = gt_ncols(x), nrows = gt_nrows(x);
    const int64_t tq = mask ? x->shape[x->ndim - 2] : 1;
    const int32_t *pos = mask == 2 ? (const int32_t *)node->src[1].data : NULL;
    const int32_t *seg = mask == 3 ? (const int32_t *)node->src[1].data : NULL;
    const int64_t rows_per_batch = mask == 3 && x->shape[0] ? nrows / x->shape[0] : 0;
    const float s = node->fp[0];
    float *dd = d->data;
    const float *xd = x->data;
    int64_t lo, hi;
    gt_split(nrows, ctx, &lo, &hi);
    for (int64_t r = lo; r < hi; r++) {
        float *y = dd + r * tk;
        const float *xr = xd + r * tk;
        if (mask == 3) {
            softmax_seg_row(y, xr, s, seg + (r / rows_per_batch) * tk, r % tq, tk);
            continue;
        }
        int64_t n = tk;
        if (mask) {
            const int64_t i = r % tq;
            n = (mask == 1 ? i + (tk - tq) : (int64_t)pos[i]) + 1;
            n = n < 0 ? 0 : n > tk ? tk : n;
        }
        if (n > 0) {
            const float m = scaled_max_row(xr, s, n);
            const float sum = exp_row(y, xr, s, m, n);
            mul_row(y, 1.0f / sum, n);
        }
        if (n < tk) memset(y + n, 0, (size_t)(tk - n) * sizeof(float));
    }
    return GT_OK;
}

/* softmax_bwd: dx = scale * y * (g - sum(g * y)) per row of the last dim.
 * src0 y (softmax output), src1 g, dst dx: (..., T_k) f32 contiguous, same
 * shape; scale fp[0]. Masked entries (y = 0) get 0, so no causal flag. */
int gt_softmax_bwd_f32(const gt_node *node, const gt_ctx *ctx) {
    const char *op = "softmax_bwd";
    const gt_tensor *d = &node->dst, *y = &node->src[0], *g = &node->src[1];
    GT_TRY(gt_check_n_src(node, 2, op));
    GT_CHECK_F32(d, op, "dst");
    GT_CHECK_F32(y, op, "y");
    GT_CHECK_F32(g, op, "g");
    GT_TRY(gt_check_same_shape(y, d, op, "y", "dst"));
    GT_TRY(gt_check_same_shape(g, d, op, "g", "dst"));
    GT_TRY(gt_check_contig(d, op, "dst"));
    GT_TRY(gt_check_contig(y, op, "y"));
    GT_TRY(gt_check_contig(g, op, "g"));
    const int64_t n = gt_ncols(d), nrows = gt_nrows(d);
    const float s = node->fp[0];
    float *dd = d->data;
    const float *yd = y->data, *gd = g->data;
    int64_t lo, hi;
    gt_split(nrows, ctx, &lo, &hi);
    for (int64_t r = lo; r < hi; r++) {
        const float *yr = yd + r * n, *gr = gd + r * n;
        softmax_bwd_row(dd + r * n, yr, gr, s, dot_row(gr, yr, n), n);
    }
    return GT_OK;
}

/* ---- cross_entropy ---------------------------------------------------------- */

/* The node's checks (checks.h), then every target (< V) and the number of counted
 * rows in *count; the same on every thread, so either every thread fails before the
 * forward's barrier or none does. */
static int check_ce(const gt_node *node, const char *op, int n_src, int64_t *count) {
    GT_TRY(gt_cross_entropy_check(node, op, n_src));
    const gt_tensor *x = &node->src[0], *t = &node->src[1];
    const int64_t nrows = x->shape[0], v = x->shape[1];
    const int32_t *td = t->data;
    const int64_t ts = t->strides[0];
    int64_t cnt = 0;
    for (int64_t r = 0; r < nrows; r++) {
        const int32_t tr = td[r * ts];
        if (tr >= v)
            return GT_FAIL(GT_ERR_INVALID, "%s: target of row %lld is %d, expected < V = %lld (or < 0 to ignore the row)",
                           op, (long long)r, (int)tr, (long long)v);
        cnt += tr >= 0;
    }
    *count = node->ip[0] ? node->ip[0] : cnt;
    return GT_OK;
}

/* cross_entropy: dst scalar = sum over counted rows of
 *     -log softmax(logits[r])[targets[r]] = max + log(sum exp(logits[r] - max)) - logits[r, t]
 * divided by count. logits (N, V) f32 contiguous; targets (N,) i32 (any stride).
 * A negative target ignores its row (no loss, not counted); a target >= V is
 * GT_ERR_INVALID. count = ip[0] if > 0, else the number of targets >= 0; when
 * count is 0 the loss is 0. scratch: N floats (4 * N bytes), per-row losses;
 * after a barrier thread 0 adds them in row order (in double), so the result is
 * the same for any thread count. ip[1] = 1 (cross_entropy_rows): dst (N,) holds
 * the per-row losses themselves (0 on ignored rows), no scratch, no mean. */
int gt_cross_entropy_fwd_f32_sizes(const gt_node *node, int64_t *scratch, int64_t *work) {
    const gt_tensor *x = &node->src[0];
    const int64_t nrows = x->ndim >= 1 ? x->shape[0] : 1;
    *scratch = (nrows > 1 ? nrows : 1) * (int64_t)sizeof(float);
    *work = 0;
    return GT_OK;
}

int gt_cross_entropy_fwd_f32(const gt_node *node, const gt_ctx *ctx) {
    const char *op = "cross_entropy";
    int64_t count;
    GT_TRY(check_ce(node, op, 2, &count));
    GT_TRY(gt_cross_entropy_fwd_check(node, op));
    const gt_tensor *d = &node->dst, *x = &node->src[0], *t = &node->src[1];
    const int64_t nrows = x->shape[0], v = x->shape[1];
    const int per_row = node->ip[1] != 0;
    float *loss = per_row ? (float *)d->data : node->scratch;
    const float *xd = x->data;
    const int32_t *td = t->data;
    const int64_t ts = t->strides[0];
    int64_t lo, hi;
    gt_split(nrows, ctx, &lo, &hi);
    for (int64_t r = lo; r < hi; r++) {
        const int32_t tr = td[r * ts];
        if (tr < 0 || v == 0) { loss[r] = 0.0f; continue; }
        const float *xr = xd + r * v;
        const float m = scaled_max_row(xr, 1.0f, v);
        const double se = sumexp_row(xr, m, v);
        loss[r] = (float)((double)m + log(se) - (double)xr[tr]);
    }
    if (per_row) return GT_OK;
    gt_barrier(ctx);
    if (ctx->ith == 0) {
        double s = 0.0;
        for (int64_t r = 0; r < nrows; r++) s += loss[r];
        *(float *)d->data = count ? (float)(s / (double)count) : 0.0f;
    }
    return GT_OK;
}

/* cross_entropy_bwd: dlogits = g * (softmax(logits) - onehot(target)) / count,
 * zero rows for ignored (negative) targets. src0 logits (N, V) f32 contiguous,
 * src1 targets (N,) i32, src2 g f32 (one element); dst (N, V) contiguous.
 * ip[0] and count as in the forward (count 0: all zeros). */
int gt_cross_entropy_bwd_f32(const gt_node *node, const gt_ctx *ctx) {
    const char *op = "cross_entropy_bwd";
    int64_t count;
    GT_TRY(check_ce(node, op, 3, &count));
    GT_TRY(gt_cross_entropy_bwd_check(node, op));
    const gt_tensor *d = &node->dst, *x = &node->src[0], *t = &node->src[1], *g = &node->src[2];
    const int per_row = node->ip[1] != 0;
    const int64_t nrows = x->shape[0], v = x->shape[1];
    const float *gd = g->data;
    const int64_t gs = per_row ? g->strides[0] : 0;
    const float gc0 = per_row ? 0.0f : count ? gd[0] / (float)count : 0.0f;
    float *dd = d->data;
    const float *xd = x->data;
    const int32_t *td = t->data;
    const int64_t ts = t->strides[0];
    int64_t lo, hi;
    gt_split(nrows, ctx, &lo, &hi);
    for (int64_t r = lo; r < hi; r++) {
        const int32_t tr = td[r * ts];
        float *dr = dd + r * v;
        if (tr < 0 || v == 0) { memset(dr, 0, (size_t)v * sizeof(float)); continue; }
        const float *xr = xd + r * v;
        const float gc = per_row ? gd[r * gs] : gc0;
        const float m = scaled_max_row(xr, 1.0f, v);
        const float sum = dr == xr ? exp_row_inplace(dr, m, v) : exp_row(dr, xr, 1.0f, m, v);
        mul_row(dr, gc / sum, v);
        dr[tr] -= gc;
    }
    return GT_OK;
}
