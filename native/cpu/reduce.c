/* reduce.c: sum and sumsq (to a scalar), sum_rows, repeat (broadcast copy) and its
 * backward repeat_bwd (sum over broadcast dims). All reductions run in a fixed
 * order that does not depend on the thread count. */
#include "internal.h"
#include "simd.h"

#define SUM_CHUNK 4096
#define REDUCE_BLOCK 256   /* rows per partial sum in repeat_bwd */

/* Partial sums of sum and sumsq: one per SUM_CHUNK elements of a contiguous src,
 * one per row of a strided one. */
static int64_t sum_parts(const gt_tensor *a) {
    return gt_is_contiguous(a) ? (gt_numel(a) + SUM_CHUNK - 1) / SUM_CHUNK : gt_nrows(a);
}

static int sum_sizes(const gt_node *node, int64_t *scratch, int64_t *work) {
    const int64_t parts = sum_parts(&node->src[0]);
    *scratch = (parts > 1 ? parts : 1) * (int64_t)sizeof(double);
    *work = 0;
    return GT_OK;
}

int gt_sum_fwd_f32_sizes(const gt_node *node, int64_t *scratch, int64_t *work) {
    return sum_sizes(node, scratch, work);
}

int gt_sumsq_fwd_f32_sizes(const gt_node *node, int64_t *scratch, int64_t *work) {
    return sum_sizes(node, scratch, work);
}

#define SUM_LANES 16

/* Sum of x[0..n) (sq: of x[i]^2, exact in double), in double: SUM_LANES interleaved
 * partial sums added in lane order, then the tail. A fixed order, vectorized. */
GT_CLONES static double sum_chunk(const float *restrict x, int64_t n, int sq) {
    double acc[SUM_LANES] = {0};
    int64_t i = 0;
    if (sq) {
        for (; i + SUM_LANES <= n; i += SUM_LANES)
            for (int k = 0; k < SUM_LANES; k++) {
                const double v = x[i + k];
                acc[k] += v * v;
            }
    } else {
        for (; i + SUM_LANES <= n; i += SUM_LANES)
            for (int k = 0; k < SUM_LANES; k++) acc[k] += (double)x[i + k];
    }
    double s = 0.0;
    for (int k = 0; k < SUM_LANES; k++) s += acc[k];
    for (; i < n; i++) s += sq ? (double)x[i] * x[i] : (double)x[i];
    return s;
}

/* sum (sq = 0) / sumsq (sq = 1): dst scalar = the sum of every element of src0 (or
 * of its squares), any strides. A contiguous src is cut into SUM_CHUNK-element
 * chunks, a non-contiguous one into rows; threads fill per-chunk partial sums
 * (double) in node scratch, thread 0 adds them in order. */
static int sum_run(const gt_node *node, const gt_ctx *ctx, const char *op, int sq) {
    const gt_tensor *d = &node->dst, *a = &node->src[0];
    GT_CHECK_F32(d, op, "dst");
    GT_CHECK_F32(a, op, "src0");
    if (gt_numel(d) != 1) return GT_FAIL(GT_ERR_SHAPE, "%s: dst must hold one element", op);
    const int contig = gt_is_contiguous(a);
    const int64_t n = gt_numel(a);
    const int64_t ncols = gt_ncols(a);
    const int64_t nparts = sum_parts(a);
    double *part = node->scratch;
    if (nparts > 0 && (!part || node->scratch_size < nparts * (int64_t)sizeof(double)))
        return GT_FAIL(GT_ERR_INVALID, "%s: scratch too small (%lld bytes, need %lld)", op,
                       (long long)node->scratch_size, (long long)(nparts * sizeof(double)));
    const float *ad = a->data;
    const int64_t sa = a->ndim ? a->strides[a->ndim - 1] : 1;
    int64_t lo, hi;
    gt_split(nparts, ctx, &lo, &hi);
    for (int64_t p = lo; p < hi; p++) {
        double s = 0.0;
        if (contig) {
            const int64_t end = (p + 1) * SUM_CHUNK < n ? (p + 1) * SUM_CHUNK : n;
            s = sum_chunk(ad + p * SUM_CHUNK, end - p * SUM_CHUNK, sq);
        } else if (sa == 1) {
            s = sum_chunk(ad + gt_row_offset(a, p), ncols, sq);
        } else {
            const float *row = ad + gt_row_offset(a, p);
            for (int64_t i = 0; i < ncols; i++) s += sq ? (double)row[i * sa] * row[i * sa] : (double)row[i * sa];
        }
        part[p] = s;
    }
    gt_barrier(ctx);
    if (ctx->ith == 0) {
        double s = 0.0;
        for (int64_t p = 0; p < nparts; p++) s += part[p];
        *(float *)d->data = (float)s;
    }
    return GT_OK;
}

/* scratch: see gt_sum_fwd_f32_sizes. */
int gt_sum_fwd_f32(const gt_node *node, const gt_ctx *ctx) { return sum_run(node, ctx, "sum", 0); }

int gt_sumsq_fwd_f32(const gt_node *node, const gt_ctx *ctx) { return sum_run(node, ctx, "sumsq", 1); }

/* sum_rows: dst (..., 1) contiguous = sum over the last dim of src (..., N). */
int gt_sum_rows_fwd_f32(const gt_node *node, const gt_ctx *ctx) {
    const gt_tensor *d = &node->dst, *a = &node->src[0];
    GT_CHECK_F32(d, "sum_rows", "dst");
    GT_CHECK_F32(a, "sum_rows", "src0");
    const int64_t nrows = gt_nrows(a), ncols = gt_ncols(a);
    if (gt_numel(d) != nrows || !gt_is_contiguous(d))
        return GT_FAIL(GT_ERR_SHAPE, "sum_rows: dst must be contiguous with %lld elements", (long long)nrows);
    const int64_t sa = a->ndim ? a->strides[a->ndim - 1] : 1;
    float *dd = d->data;
    const float *ad = a->data;
    int64_t lo, hi;
    gt_split(nrows, ctx, &lo, &hi);
    for (int64_t r = lo; r < hi; r++) {
        const float *row = ad + gt_row_offset(a, r);
        double s = 0.0;
        for (int64_t i = 0; i < ncols; i++) s += row[i * sa];
        dd[r] = (float)s;
    }
    return GT_OK;
}

/* repeat: dst (contiguous) = src broadcast numpy-style to dst's shape. */
int gt_repeat_fwd_f32(const gt_node *node, const gt_ctx *ctx) {
    const gt_tensor *d = &node->dst, *a = &node->src[0];
    GT_CHECK_F32(d, "repeat", "dst");
    GT_CHECK_F32(a, "repeat", "src0");
    if (!gt_is_contiguous(d)) return GT_FAIL(GT_ERR_INVALID, "repeat: dst must be contiguous");
    if (a->ndim > d->ndim) return GT_FAIL(GT_ERR_SHAPE, "repeat: src has more dims than dst");
    for (int i = 0; i < a->ndim; i++) {
        int64_t n = a->shape[a->ndim - 1 - i], m = d->shape[d->ndim - 1 - i];
        if (n != 1 && n != m) return GT_FAIL(GT_ERR_SHAPE, "repeat: src dim %lld cannot broadcast to %lld",
                                             (long long)n, (long long)m);
    }
    const int64_t ncols = gt_ncols(d), nrows = gt_nrows(d);
    const int64_t sa = (a->ndim == 0 || a->shape[a->ndim - 1] == 1) ? 0 : a->strides[a->ndim - 1];
    float *dd = d->data;
    const float *ad = a->data;
    int64_t lo, hi;
    gt_split(nrows, ctx, &lo, &hi);
    for (int64_t r = lo; r < hi; r++) {
        const float *src = ad + gt_row_offset_bcast(a, d, r);
        float *dst = dd + r * ncols;
        for (int64_t i = 0; i < ncols; i++) dst[i] = src[i * sa];
    }
    return GT_OK;
}

GT_CLONES static void add_into(float *acc, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) acc[i] += x[i];
}

/* Floats of node scratch repeat_bwd's blocked path uses: when every leading dim
 * of a contiguous src (more than one row) is reduced and its last dim kept (a
 * bias gradient), ceil(rows / REDUCE_BLOCK) * ncols partial column sums; else 0
 * (the other paths need none). */
static int64_t repeat_bwd_blocked(const gt_tensor *d, const gt_tensor *a) {
    const int nd = a->ndim, off = a->ndim - d->ndim;
    if (nd == 0 || off < 0 || !gt_is_contiguous(a) || gt_nrows(a) < 2) return 0;
    if ((d->ndim ? d->shape[d->ndim - 1] : 1) != gt_ncols(a)) return 0;
    for (int i = 0; i + 1 < nd; i++)
        if (i >= off && d->shape[i - off] != 1) return 0;
    return (gt_nrows(a) + REDUCE_BLOCK - 1) / REDUCE_BLOCK * gt_ncols(a);
}

int gt_repeat_bwd_f32_sizes(const gt_node *node, int64_t *scratch, int64_t *work) {
    *scratch = repeat_bwd_blocked(&node->dst, &node->src[0]) * (int64_t)sizeof(float);
    *work = 0;
    return GT_OK;
}

/* repeat_bwd: dst (contiguous, shape right-aligned to src's with 1 where src was
 * broadcast) = src summed over those dims, in index order.
 * Fast path: src contiguous and dst keeps src's last dim: threads own blocks of
 * columns and add rows in order. General path: one dst element per step. */
int gt_repeat_bwd_f32(const gt_node *node, const gt_ctx *ctx) {
    const gt_tensor *d = &node->dst, *a = &node->src[0];
    GT_CHECK_F32(d, "repeat_bwd", "dst");
    GT_CHECK_F32(a, "repeat_bwd", "src0");
    if (!gt_is_contiguous(d)) return GT_FAIL(GT_ERR_INVALID, "repeat_bwd: dst must be contiguous");
    if (d->ndim > a->ndim) return GT_FAIL(GT_ERR_SHAPE, "repeat_bwd: dst has more dims than src");
    /* dst shape padded on the left to src's rank */
    int64_t dshape[GT_MAX_DIMS];
    const int nd = a->ndim, off = a->ndim - d->ndim;
    for (int i = 0; i < nd; i++) {
        dshape[i] = i < off ? 1 : d->shape[i - off];
        if (dshape[i] != 1 && dshape[i] != a->shape[i])
            return GT_FAIL(GT_ERR_SHAPE, "repeat_bwd: dst dim %d is %lld, src has %lld", i - off,
                           (long long)dshape[i], (long long)a->shape[i]);
    }
    float *dd = d->data;
    const float *ad = a->data;
    const int64_t ncols = gt_ncols(a);
    /* Every leading dim reduced, last dim kept (a bias gradient): rows are cut in
     * fixed blocks of REDUCE_BLOCK (not per thread), each block's column sums go
     * to node scratch, and the blocks are added in order: the same result for any
     * thread count. scratch: see repeat_bwd_blocked. */
    const int64_t nrows_all = gt_nrows(a);
    const int64_t nblk = (nrows_all + REDUCE_BLOCK - 1) / REDUCE_BLOCK;
    const int64_t blocked = repeat_bwd_blocked(d, a);
    if (blocked && (!node->scratch || node->scratch_size < blocked * (int64_t)sizeof(float)))
        return GT_FAIL(GT_ERR_INVALID, "repeat_bwd: expected %lld bytes of scratch, got %lld",
                       (long long)(blocked * (int64_t)sizeof(float)), (long long)node->scratch_size);
    if (blocked) {
        float *part = node->scratch;
        int64_t lo, hi;
        gt_split(nblk, ctx, &lo, &hi);
        for (int64_t b = lo; b < hi; b++) {
            const int64_t r0 = b * REDUCE_BLOCK;
            const int64_t r1 = r0 + REDUCE_BLOCK < nrows_all ? r0 + REDUCE_BLOCK : nrows_all;
            float *out = part + b * ncols;
            memcpy(out, ad + r0 * ncols, (size_t)ncols * sizeof(float));
            for (int64_t r = r0 + 1; r < r1; r++) add_into(out, ad + r * ncols, ncols);
        }
        gt_barrier(ctx);
        gt_split(ncols, ctx, &lo, &hi);
        if (hi > lo) {
            memcpy(dd + lo, part + lo, (size_t)(hi - lo) * sizeof(float));
            for (int64_t b = 1; b < nblk; b++) add_into(dd + lo, part + b * ncols + lo, hi - lo);
        }
        return GT_OK;
    }
    int leading_only = nd > 0 && dshape[nd - 1] == ncols;
    for (int i = 0; i + 1 < nd && leading_only; i++)
        if (dshape[i] != 1 && dshape[i] != a->shape[i]) leading_only = 0;
    if (nd > 0 && gt_is_contiguous(a) && leading_only) {
        /* Rows of src map onto rows of dst; sum per dst row over its src rows. */
        const int64_t nrows = gt_nrows(a), drows = gt_numel(d) / ncols;
        const int64_t ncb = (ncols + 63) / 64;   /* 64-column blocks */
        int64_t lo, hi;
        gt_split(ncb * drows, ctx, &lo, &hi);
        for (int64_t t = lo; t < hi; t++) {
            const int64_t dr = t / ncb, c0 = (t % ncb) * 64;
            const int64_t cn = c0 + 64 < ncols ? 64 : ncols - c0;
            float *out = dd + dr * ncols + c0;
            int first = 1;
            for (int64_t r = 0; r < nrows; r++) {
                /* map src row r to its dst row */
                int64_t rr = r, drow = 0, mul = 1;
                for (int i = nd - 2; i >= 0; i--) {
                    int64_t idx = rr % a->shape[i];
                    rr /= a->shape[i];
                    if (dshape[i] != 1) drow += idx * mul;
                    mul *= dshape[i];
                }
                if (drow != dr) continue;
                const float *src = ad + r * ncols + c0;
                if (first) { memcpy(out, src, (size_t)cn * sizeof(float)); first = 0; }
                else add_into(out, src, cn);
            }
            if (first) memset(out, 0, (size_t)cn * sizeof(float));
        }
        return GT_OK;
    }
    /* General: each dst element sums its src elements in row-major order. */
    const int64_t nout = gt_numel(d);
    int64_t lo, hi;
    gt_split(nout, ctx, &lo, &hi);
    for (int64_t o = lo; o < hi; o++) {
        int64_t base = 0, rem = o;
        int64_t rdims[GT_MAX_DIMS], rstr[GT_MAX_DIMS];
        int nr = 0;
        for (int i = nd - 1; i >= 0; i--) {
            int64_t idx = rem % dshape[i];
            rem /= dshape[i];
            base += idx * a->strides[i];
        }
        for (int i = 0; i < nd; i++)
            if (dshape[i] == 1 && a->shape[i] != 1) { rdims[nr] = a->shape[i]; rstr[nr] = a->strides[i]; nr++; }
        int64_t cnt[GT_MAX_DIMS] = {0};
        double s = 0.0;
        for (;;) {
            int64_t p = base;
            for (int k = 0; k < nr; k++) p += cnt[k] * rstr[k];
            s += ad[p];
            int k = nr - 1;
            while (k >= 0 && ++cnt[k] == rdims[k]) cnt[k--] = 0;
            if (k < 0) break;
        }
        dd[o] = (float)s;
    }
    return GT_OK;
}
