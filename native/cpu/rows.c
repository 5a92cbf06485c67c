/* rows.c: get_rows (embedding lookup) and its backward (scatter-add into the
 * table's gradient). The backward splits the table's columns across threads,
 * so no two threads ever add into the same element and every element adds its
 * rows in index order: bit-identical for any thread count. */
#include "internal.h"
#include "simd.h"

#define LANES 16
#define COL_BLOCK 16   /* columns per unit of work in get_rows_bwd (one cache line) */

/* idx (N...) i32 contiguous with dst (N..., C), or g for the backward. */
static int check_idx(const gt_tensor *idx, const gt_tensor *rows, const char *op, const char *rows_name) {
    char a[128], b[128];
    GT_TRY(gt_check_i32(idx, op, "idx"));
    GT_TRY(gt_check_contig(idx, op, "idx"));
    int ok = rows->ndim == idx->ndim + 1;
    for (int i = 0; ok && i < idx->ndim; i++) ok = rows->shape[i] == idx->shape[i];
    if (!ok)
        return GT_FAIL(GT_ERR_SHAPE, "%s: expected %s of shape idx.shape + (C,) for idx %s, got %s", op,
                       rows_name, gt_shape_str(idx, a, sizeof a), gt_shape_str(rows, b, sizeof b));
    return GT_OK;
}

static int bad_index(const char *op, int64_t n, int32_t v, int64_t V) {
    return GT_FAIL(GT_ERR_INVALID, "%s: idx[%lld] (flat) is %d, expected 0 <= index < V = %lld", op,
                   (long long)n, (int)v, (long long)V);
}

/* get_rows: dst (N..., C) f32 = the rows of table (V, C) at idx (N...), i32 of
 * any shape (contiguous); dst contiguous. An f32 table may have any row stride
 * (its rows of stride 1); a stored table (f16, bf16 or a ggml block type, dtype
 * wtype) is a whole contiguous matrix of whole blocks, and each row is
 * dequantized whole (gt_dequantizer_: the values gguf.quants.dequantize gives;
 * for f32 a copy). An index outside [0, V) is GT_ERR_INVALID. */
static int get_rows(const gt_node *node, const gt_ctx *ctx, int32_t wtype) {
    const char *op = "get_rows";
    const gt_tensor *d = &node->dst, *w = &node->src[0], *idx = &node->src[1];
    const gt_dtype_traits *t = gt_dtype_find_(wtype), *wt = gt_dtype_find_(w->dtype);
    char a[128];
    GT_TRY(gt_check_n_src(node, 2, op));
    GT_CHECK_F32(d, op, "dst");
    GT_TRY(gt_check_contig(d, op, "dst"));
    if (w->dtype != wtype)
        return GT_FAIL(GT_ERR_DTYPE, "%s: expected a table of dtype %s, got %s", op, t->name,
                       wt ? wt->name : "an unknown dtype");
    if (w->ndim != 2)
        return GT_FAIL(GT_ERR_SHAPE, "%s: expected table (V, C), got %s", op, gt_shape_str(w, a, sizeof a));
    const int64_t V = w->shape[0], C = w->shape[1];
    if (C > 1 && w->strides[1] != 1)
        return GT_FAIL(GT_ERR_INVALID, "%s: expected table rows of stride 1, got column stride %lld", op,
                       (long long)w->strides[1]);
    if (wtype != GT_F32 && V > 1 && w->strides[0] != C)
        return GT_FAIL(GT_ERR_INVALID, "%s: a %s table must be a whole stored matrix, strides (%lld, 1); "
                       "got strides (%lld, %lld)", op, t->name, (long long)C, (long long)w->strides[0],
                       (long long)w->strides[1]);
    if (C % t->block)
        return GT_FAIL(GT_ERR_SHAPE, "%s: a %s table stores rows of whole %d-element blocks, got C = %lld",
                       op, t->name, (int)t->block, (long long)C);
    GT_TRY(check_idx(idx, d, op, "dst"));
    if (gt_ncols(d) != C)
        return GT_FAIL(GT_ERR_SHAPE, "%s: expected dst rows of C = %lld (table %s), got %lld", op, (long long)C,
                       gt_shape_str(w, a, sizeof a), (long long)gt_ncols(d));
    const int64_t N = gt_numel(idx);
    const int64_t row_bytes = wtype == GT_F32 ? w->strides[0] * (int64_t)sizeof(float)
                                              : C / t->block * t->block_bytes;
    if (N && C && !w->data) return GT_FAIL(GT_ERR_INVALID, "%s: table has no data pointer", op);
    const gt_dequant_fn deq = gt_dequantizer_(wtype);
    const int32_t *id = idx->data;
    const uint8_t *wd = w->data;
    float *dd = d->data;
    int64_t lo, hi;
    gt_split(N, ctx, &lo, &hi);
    for (int64_t n = lo; n < hi; n++) {
        const int32_t v = id[n];
        if (v < 0 || v >= V) return bad_index(op, n, v, V);
        deq(dd + n * C, wd + v * row_bytes, C / t->block);
    }
    return GT_OK;
}

int gt_get_rows_fwd_f32(const gt_node *node, const gt_ctx *ctx) { return get_rows(node, ctx, GT_F32); }

#define GET_ROWS_WEIGHT(w, ID)                                                                 \
    int gt_get_rows_fwd_f32_##w(const gt_node *node, const gt_ctx *ctx) {                      \
        return get_rows(node, ctx, ID);                                                 \
    }
GT_WEIGHT_TYPES(GET_ROWS_WEIGHT)

GT_CLONES static void add_row(float *restrict acc, const float *restrict x, int64_t n) {
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int k = 0; k < LANES; k++) acc[i + k] += x[i + k];
    for (; i < n; i++) acc[i] += x[i];
}

/* get_rows_bwd: dst (V, C) = scatter-add of g: dst[idx[n]] += g[n] over n in
 * order; rows no index points to are 0. src0 g (N..., C) f32 contiguous, src1
 * idx (N...) i32 contiguous, dst contiguous (V comes from dst). Every thread
 * validates every index first (so all fail or none reaches the barrier). Two
 * phases: threads zero contiguous blocks of rows; barrier; threads own blocks
 * of COL_BLOCK columns of the whole table and add g's rows in index order. */
int gt_get_rows_bwd_f32(const gt_node *node, const gt_ctx *ctx) {
    const char *op = "get_rows_bwd";
    const gt_tensor *d = &node->dst, *g = &node->src[0], *idx = &node->src[1];
    char a[128], b[128];
    GT_TRY(gt_check_n_src(node, 2, op));
    GT_CHECK_F32(d, op, "dst");
    GT_CHECK_F32(g, op, "g");
    GT_TRY(gt_check_contig(d, op, "dst"));
    GT_TRY(gt_check_contig(g, op, "g"));
    GT_TRY(check_idx(idx, g, op, "g"));
    if (d->ndim != 2 || d->shape[1] != gt_ncols(g))
        return GT_FAIL(GT_ERR_SHAPE, "%s: expected dst (V, %lld) for g %s, got %s", op, (long long)gt_ncols(g),
                       gt_shape_str(g, a, sizeof a), gt_shape_str(d, b, sizeof b));
    const int64_t V = d->shape[0], C = d->shape[1], N = gt_numel(idx);
    const int32_t *id = idx->data;
    for (int64_t n = 0; n < N; n++)
        if (id[n] < 0 || id[n] >= V) return bad_index(op, n, id[n], V);
    const float *gd = g->data;
    float *dd = d->data;
    /* phase 1: zero the table, contiguous blocks of rows (one large memset each) */
    int64_t lo, hi;
    gt_split(V, ctx, &lo, &hi);
    if (hi > lo) memset(dd + lo * C, 0, (size_t)((hi - lo) * C) * sizeof(float));
    gt_barrier(ctx);
    /* phase 2: scatter-add, threads own column blocks */
    gt_split((C + COL_BLOCK - 1) / COL_BLOCK, ctx, &lo, &hi);
    const int64_t c0 = lo * COL_BLOCK, c1 = hi * COL_BLOCK < C ? hi * COL_BLOCK : C;
    if (c1 <= c0) return GT_OK;
    for (int64_t n = 0; n < N; n++) add_row(dd + id[n] * C + c0, gd + n * C + c0, c1 - c0);
    return GT_OK;
}
