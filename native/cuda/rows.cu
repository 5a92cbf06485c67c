/* rows.cu: gathers and scatters (get_rows, its backward, set_rows, view_bwd) and the MNIST
 * CNN's im2col and max-pool. Scatters that may hit one row twice run one thread a column,
 * over the indices in order: deterministic, as the CPU's. */
#include "common.cuh"
#include "kernels.h"

__global__ void get_rows(float *d, const float *w, int64_t row_stride, const int32_t *idx, int64_t n, int64_t V,
                         int64_t C, GTC_ERR_ARGS) {
    GTC_FOR(i, n * C) {
        const int64_t r = i / C, c = i % C;
        const int32_t v = idx[r];
        if (v < 0 || v >= V) {
            GTC_RAISE(GTC_DEV_GET_ROWS, r, v, V);
            continue;
        }
        d[i] = w[v * row_stride + c];
    }
}

GTC_LAUNCHER(get_rows_fwd_f32) {
    (void)ctx;
    const char *op = "get_rows";
    GTC_TRY(gtc_check_n_src_(node, 2, 2, op));
    const gt_tensor *d = &node->dst, *w = &node->src[0], *ix = &node->src[1];
    GTC_F32(d, op, "dst");
    GTC_F32(w, op, "table");
    GTC_I32(ix, op, "idx");
    if (w->ndim != 2 || (w->strides[1] != 1 && w->shape[1] > 1))
        return GTC_FAIL(GT_ERR_INVALID, "%s: the table must be (V, C) with unit column stride", op);
    GTC_TRY(gtc_check_contig_(ix, op, "idx"));
    GTC_TRY(gtc_check_contig_(d, op, "dst"));
    const int64_t V = w->shape[0], C = w->shape[1], n = gtc_numel(*ix);
    if (gtc_numel(*d) != n * C) return GTC_FAIL(GT_ERR_SHAPE, "%s: dst must hold %lld rows", op, (long long)n);
    if (n * C == 0) return GT_OK;
    get_rows<<<gtc_blocks(n * C), GTC_THREADS, 0, gtc_stream_()>>>((float *)d->data, (const float *)w->data,
                                                                    w->strides[0], (const int32_t *)ix->data, n, V, C,
                                                                    GTC_ERR_PASS);
    return GTC_LAUNCHED(op);
}

/* Rows of g a scatter_add thread takes at once. */
#define SCATTER_BATCH 16

/* dst (V, C) = zeros, then g's rows added at their indices, in index order per column. A
 * thread takes its column's rows SCATTER_BATCH at a time: it reads the batch's rows of g and
 * its distinct dst rows together, adds each dst row's rows of the batch to it in order, and
 * writes them back: the same sums in the same order as one row at a time (each dst element
 * is summed by one thread, the rows in index order), with one wait on memory a batch instead
 * of one a row (a dst row's read waited on the last row's write: 4096 rows took 1.3 ms on an
 * H100). */
__global__ void scatter_add(float *d, const float *g, const int32_t *idx, int64_t n, int64_t V, int64_t C,
                            GTC_ERR_ARGS) {
    GTC_FOR(c, C) {
        for (int64_t r0 = 0; r0 < n; r0 += SCATTER_BATCH) {
            const int k = n - r0 < SCATTER_BATCH ? (int)(n - r0) : SCATTER_BATCH;
            int32_t v[SCATTER_BATCH];
            float sum[SCATTER_BATCH], gv[SCATTER_BATCH];
            bool first[SCATTER_BATCH];
#pragma unroll
            for (int j = 0; j < SCATTER_BATCH; j++) gv[j] = j < k ? g[(r0 + j) * C + c] : 0.0f;
#pragma unroll
            for (int j = 0; j < SCATTER_BATCH; j++) {
                v[j] = j < k ? idx[r0 + j] : -1;
                first[j] = j < k && v[j] >= 0 && v[j] < V;
                if (j < k && !first[j]) GTC_RAISE(GTC_DEV_GET_ROWS_BWD, r0 + j, v[j], V);
#pragma unroll
                for (int i = 0; i < j; i++)
                    if (first[i] && v[i] == v[j]) first[j] = false;
            }
#pragma unroll
            for (int j = 0; j < SCATTER_BATCH; j++)
                if (first[j]) sum[j] = d[(int64_t)v[j] * C + c];
#pragma unroll
            for (int j = 0; j < SCATTER_BATCH; j++) {
                if (!first[j]) continue;
#pragma unroll
                for (int i = j; i < SCATTER_BATCH; i++)
                    if (i < k && v[i] == v[j]) sum[j] += gv[i];
                d[(int64_t)v[j] * C + c] = sum[j];
            }
        }
    }
}

GTC_LAUNCHER(get_rows_bwd_f32) {
    (void)ctx;
    const char *op = "get_rows_bwd";
    GTC_TRY(gtc_check_n_src_(node, 2, 2, op));
    const gt_tensor *d = &node->dst, *g = &node->src[0], *ix = &node->src[1];
    GTC_F32(d, op, "dst");
    GTC_F32(g, op, "g");
    GTC_I32(ix, op, "idx");
    GTC_TRY(gtc_check_contig_(d, op, "dst"));
    GTC_TRY(gtc_check_contig_(g, op, "g"));
    GTC_TRY(gtc_check_contig_(ix, op, "idx"));
    if (d->ndim != 2) return GTC_FAIL(GT_ERR_SHAPE, "%s: dst must be (V, C)", op);
    const int64_t V = d->shape[0], C = d->shape[1], n = gtc_numel(*ix);
    if (gtc_numel(*g) != n * C) return GTC_FAIL(GT_ERR_SHAPE, "%s: g must hold a row per index", op);
    GTC_TRY(GTC_CUDA(cudaMemsetAsync(d->data, 0, (size_t)(V * C) * sizeof(float), gtc_stream_()), op));
    if (n * C == 0) return GT_OK;
    scatter_add<<<gtc_blocks(C), GTC_THREADS, 0, gtc_stream_()>>>((float *)d->data, (const float *)g->data,
                                                                   (const int32_t *)ix->data, n, V, C,
                                                                   GTC_ERR_PASS);
    return GTC_LAUNCHED(op);
}

/* set_rows, in place: row idx[t] of dst becomes values[t], t in order (the last one wins). */
__global__ void set_rows(float *d, const float *values, const int32_t *idx, int64_t T, int64_t S, int64_t C,
                         GTC_ERR_ARGS) {
    GTC_FOR(c, C) {
        /* every index is checked before any row is written, as on the CPU: each thread reads
         * them all, so no thread writes when one is bad */
        bool ok = true;
        for (int64_t t = 0; t < T && ok; t++) {
            const int32_t r = idx[t];
            if (r < 0 || r >= S) {
                GTC_RAISE(GTC_DEV_SET_ROWS, t, r, S);
                ok = false;
            }
        }
        if (!ok) continue;
        for (int64_t t = 0; t < T; t++) d[(int64_t)idx[t] * C + c] = values[t * C + c];
    }
}

GTC_LAUNCHER(set_rows_fwd_f32) {
    (void)ctx;
    const char *op = "set_rows";
    GTC_TRY(gtc_check_n_src_(node, 3, 3, op));
    const gt_tensor *d = &node->dst, *vals = &node->src[1], *ix = &node->src[2];
    GTC_F32(d, op, "dst");
    GTC_F32(vals, op, "values");
    GTC_I32(ix, op, "idx");
    if (d->data != node->src[0].data) return GTC_FAIL(GT_ERR_INVALID, "%s: dst must alias src0", op);
    GTC_TRY(gtc_check_contig_(d, op, "dst"));
    GTC_TRY(gtc_check_contig_(vals, op, "values"));
    GTC_TRY(gtc_check_contig_(ix, op, "idx"));
    const int64_t C = gtc_ncols(*d), S = gtc_nrows(*d), T = gtc_numel(*ix);
    if (gtc_numel(*vals) != T * C) return GTC_FAIL(GT_ERR_SHAPE, "%s: values must be (T, C)", op);
    if (T * C == 0) return GT_OK;
    set_rows<<<gtc_blocks(C), GTC_THREADS, 0, gtc_stream_()>>>((float *)d->data, (const float *)vals->data,
                                                                (const int32_t *)ix->data, T, S, C,
                                                                GTC_ERR_PASS);
    return GTC_LAUNCHED(op);
}

/* view_bwd: dst zeros, then src (g of the view) at the view's place: element offset ip[0],
 * strides ip[1..] (src's dims). */
__global__ void view_place(float *d, const float *g, GTC_PARAM gt_tensor view, int64_t n) {
    GTC_FOR(i, n) d[gtc_offset(view, view, i)] = g[i];
}

GTC_LAUNCHER(view_bwd_f32) {
    (void)ctx;
    const char *op = "view_bwd";
    GTC_TRY(gtc_check_n_src_(node, 1, 1, op));
    const gt_tensor *d = &node->dst, *g = &node->src[0];
    GTC_F32(d, op, "dst");
    GTC_F32(g, op, "g");
    GTC_TRY(gtc_check_contig_(d, op, "dst"));
    GTC_TRY(gtc_check_contig_(g, op, "g"));
    GTC_TRY(GTC_CUDA(cudaMemsetAsync(d->data, 0, (size_t)gtc_numel(*d) * sizeof(float), gtc_stream_()), op));
    gt_tensor view = *g;
    view.data = NULL;
    int64_t reach = node->ip[0];
    for (int i = 0; i < g->ndim; i++) {
        view.strides[i] = node->ip[1 + i];
        if (g->shape[i] > 1 && view.strides[i] <= 0)   /* (a repeated place would race on the device) */
            return GTC_FAIL(GT_ERR_INVALID, "%s: view strides must be > 0, got %lld at dim %d", op,
                            (long long)view.strides[i], i);
        if (g->shape[i] > 0) reach += (g->shape[i] - 1) * (view.strides[i] > 0 ? view.strides[i] : 0);
    }
    const int64_t n = gtc_numel(*g);
    if (n == 0) return GT_OK;
    if (node->ip[0] < 0 || reach >= gtc_numel(*d))
        return GTC_FAIL(GT_ERR_INVALID, "%s: the view (offset %lld, last element %lld) is outside the base of %lld", op,
                        (long long)node->ip[0], (long long)reach, (long long)gtc_numel(*d));
    view_place<<<gtc_blocks(n), GTC_THREADS, 0, gtc_stream_()>>>((float *)d->data + node->ip[0],
                                                                  (const float *)g->data, view, n);
    return GTC_LAUNCHED(op);
}

/* ---- im2col over NHWC (column c*KH*KW + kh*KW + kw), zero padding ------------------------------ */

__global__ void im2col(float *d, const float *x, int64_t N, int64_t H, int64_t W, int64_t C, int64_t KH, int64_t KW,
                       int64_t stride, int64_t pad, int64_t OH, int64_t OW) {
    const int64_t cols = C * KH * KW;
    GTC_FOR(i, N * OH * OW * cols) {
        const int64_t col = i % cols, pix = i / cols;
        const int64_t ow = pix % OW, oh = (pix / OW) % OH, n = pix / (OW * OH);
        const int64_t c = col / (KH * KW), kh = (col / KW) % KH, kw = col % KW;
        const int64_t h = oh * stride - pad + kh, w = ow * stride - pad + kw;
        d[i] = h >= 0 && h < H && w >= 0 && w < W ? x[((n * H + h) * W + w) * C + c] : 0.0f;
    }
}

/* im2col_bwd: each input element sums the columns that read it, from 0 in order of increasing
 * (oh, ow), as the CPU kernel does (kh and kw descending give oh and ow ascending): its bits. */
__global__ void im2col_bwd(float *dx, const float *g, int64_t N, int64_t H, int64_t W, int64_t C, int64_t KH,
                           int64_t KW, int64_t stride, int64_t pad, int64_t OH, int64_t OW) {
    const int64_t cols = C * KH * KW;
    GTC_FOR(i, N * H * W * C) {
        const int64_t c = i % C, w = (i / C) % W, h = (i / (C * W)) % H, n = i / (C * W * H);
        float acc = 0.0f;
        for (int64_t kh = KH - 1; kh >= 0; kh--) {
            const int64_t oh_s = h + pad - kh;
            if (oh_s < 0 || oh_s % stride) continue;
            const int64_t oh = oh_s / stride;
            if (oh >= OH) continue;
            for (int64_t kw = KW - 1; kw >= 0; kw--) {
                const int64_t ow_s = w + pad - kw;
                if (ow_s < 0 || ow_s % stride) continue;
                const int64_t ow = ow_s / stride;
                if (ow >= OW) continue;
                acc += g[((n * OH + oh) * OW + ow) * cols + (c * KH + kh) * KW + kw];
            }
        }
        dx[i] = acc;
    }
}

static int im2col_dims(const gt_node *node, const gt_tensor *img, int64_t *OH, int64_t *OW, const char *op) {
    const int64_t KH = node->ip[0], KW = node->ip[1], stride = node->ip[2], pad = node->ip[3];
    if (img->ndim != 4 || KH < 1 || KW < 1 || stride < 1 || pad < 0)
        return GTC_FAIL(GT_ERR_INVALID, "%s: expected (N, H, W, C) and ip = {KH, KW, stride, pad}", op);
    if (img->shape[1] + 2 * pad < KH || img->shape[2] + 2 * pad < KW)
        return GTC_FAIL(GT_ERR_SHAPE, "%s: the kernel is larger than the padded image", op);
    *OH = (img->shape[1] + 2 * pad - KH) / stride + 1;
    *OW = (img->shape[2] + 2 * pad - KW) / stride + 1;
    return GT_OK;
}

GTC_LAUNCHER(im2col_fwd_f32) {
    (void)ctx;
    const char *op = "im2col";
    GTC_TRY(gtc_check_n_src_(node, 1, 1, op));
    const gt_tensor *d = &node->dst, *x = &node->src[0];
    GTC_F32(d, op, "dst");
    GTC_F32(x, op, "src");
    GTC_TRY(gtc_check_contig_(x, op, "src"));
    GTC_TRY(gtc_check_contig_(d, op, "dst"));
    int64_t OH = 0, OW = 0;
    GTC_TRY(im2col_dims(node, x, &OH, &OW, op));
    const int64_t N = x->shape[0], H = x->shape[1], W = x->shape[2], C = x->shape[3];
    const int64_t n = N * OH * OW * C * node->ip[0] * node->ip[1];
    if (gtc_numel(*d) != n) return GTC_FAIL(GT_ERR_SHAPE, "%s: dst has the wrong size", op);
    if (n == 0) return GT_OK;
    im2col<<<gtc_blocks(n), GTC_THREADS, 0, gtc_stream_()>>>((float *)d->data, (const float *)x->data, N, H, W, C,
                                                              node->ip[0], node->ip[1], node->ip[2], node->ip[3], OH,
                                                              OW);
    return GTC_LAUNCHED(op);
}

GTC_LAUNCHER(im2col_bwd_f32) {
    (void)ctx;
    const char *op = "im2col_bwd";
    GTC_TRY(gtc_check_n_src_(node, 1, 1, op));
    const gt_tensor *d = &node->dst, *g = &node->src[0];
    GTC_F32(d, op, "dst");
    GTC_F32(g, op, "g");
    GTC_TRY(gtc_check_contig_(g, op, "g"));
    GTC_TRY(gtc_check_contig_(d, op, "dst"));
    int64_t OH = 0, OW = 0;
    GTC_TRY(im2col_dims(node, d, &OH, &OW, op));
    const int64_t N = d->shape[0], H = d->shape[1], W = d->shape[2], C = d->shape[3];
    if (gtc_numel(*g) != N * OH * OW * C * node->ip[0] * node->ip[1])
        return GTC_FAIL(GT_ERR_SHAPE, "%s: g has the wrong size", op);
    const int64_t n = gtc_numel(*d);
    if (n == 0) return GT_OK;
    im2col_bwd<<<gtc_blocks(n), GTC_THREADS, 0, gtc_stream_()>>>((float *)d->data, (const float *)g->data, N, H, W, C,
                                                                  node->ip[0], node->ip[1], node->ip[2], node->ip[3],
                                                                  OH, OW);
    return GTC_LAUNCHED(op);
}

/* ---- max_pool2d over NHWC, window and stride k, no padding; the gradient to the first maximum */

__device__ inline int64_t first_max(const float *x, int64_t n, int64_t oh, int64_t ow, int64_t c, int64_t H,
                                    int64_t W, int64_t C, int64_t k) {
    int64_t best = ((n * H + oh * k) * W + ow * k) * C + c;
    for (int64_t i = 0; i < k; i++)
        for (int64_t j = 0; j < k; j++) {
            const int64_t o = ((n * H + oh * k + i) * W + ow * k + j) * C + c;
            if (x[o] > x[best]) best = o;
        }
    return best;
}

__global__ void max_pool(float *d, const float *x, int64_t N, int64_t H, int64_t W, int64_t C, int64_t k) {
    const int64_t OH = H / k, OW = W / k;
    GTC_FOR(i, N * OH * OW * C) {
        const int64_t c = i % C, ow = (i / C) % OW, oh = (i / (C * OW)) % OH, n = i / (C * OW * OH);
        d[i] = x[first_max(x, n, oh, ow, c, H, W, C, k)];
    }
}

__global__ void max_pool_bwd(float *dx, const float *x, const float *g, int64_t N, int64_t H, int64_t W, int64_t C,
                             int64_t k) {
    const int64_t OH = H / k, OW = W / k;
    GTC_FOR(i, N * H * W * C) {
        const int64_t c = i % C, w = (i / C) % W, h = (i / (C * W)) % H, n = i / (C * W * H);
        const int64_t oh = h / k, ow = w / k;
        float v = 0.0f;
        if (oh < OH && ow < OW && first_max(x, n, oh, ow, c, H, W, C, k) == i)
            v = g[((n * OH + oh) * OW + ow) * C + c];
        dx[i] = v;
    }
}

GTC_LAUNCHER(max_pool2d_fwd_f32) {
    (void)ctx;
    const char *op = "max_pool2d";
    int64_t k = 0;
    GTC_TRY(gt_max_pool2d_check(node, 0, op, &k));
    const gt_tensor *x = &node->src[0];
    const int64_t N = x->shape[0], H = x->shape[1], W = x->shape[2], C = x->shape[3];
    const int64_t n = N * (H / k) * (W / k) * C;
    if (n == 0) return GT_OK;
    max_pool<<<gtc_blocks(n), GTC_THREADS, 0, gtc_stream_()>>>((float *)node->dst.data, (const float *)x->data, N, H,
                                                                W, C, k);
    return GTC_LAUNCHED(op);
}

GTC_LAUNCHER(max_pool2d_bwd_f32) {
    (void)ctx;
    const char *op = "max_pool2d_bwd";
    int64_t k = 0;
    GTC_TRY(gt_max_pool2d_check(node, 1, op, &k));
    const gt_tensor *x = &node->src[0];
    const int64_t N = x->shape[0], H = x->shape[1], W = x->shape[2], C = x->shape[3];
    const int64_t n = gtc_numel(*x);
    if (n == 0) return GT_OK;
    max_pool_bwd<<<gtc_blocks(n), GTC_THREADS, 0, gtc_stream_()>>>((float *)node->dst.data, (const float *)x->data,
                                                                    (const float *)node->src[1].data, N, H, W, C, k);
    return GTC_LAUNCHED(op);
}
