/* rowops.cu: reductions, rms_norm, softmax (with masks), cross-entropy and rope. A row is
 * one block of threads; sums go through gtc_block_sum, in a fixed order. */
#include "common.cuh"
#include "kernels.h"

#define ROW_THREADS 256

/* ---- sum, sumsq (all of src, any strides), sum_rows, repeat, repeat_bwd ------------------------ */

/* Partial sums (in double, as the CPU's) of SUM_BLOCKS fixed slices, then one block adds
 * them in order: deterministic, and every SM reads. */
#define SUM_BLOCKS 256

template <bool SQ>
__global__ void sum_partial(double *part, GTC_PARAM gt_tensor s, int64_t n) {
    __shared__ double sh[32];
    const float *sd = (const float *)s.data;
    const bool contig = gtc_contiguous(s);
    const int64_t per = (n + gridDim.x - 1) / gridDim.x, lo = blockIdx.x * per, hi = lo + per < n ? lo + per : n;
    double acc = 0.0;
    for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const double v = sd[contig ? i : gtc_offset(s, s, i)];
        acc += SQ ? v * v : v;
    }
    acc = gtc_block_sum(acc, sh);
    if (threadIdx.x == 0) part[blockIdx.x] = acc;
}

__global__ void sum_final(float *d, const double *part, int nparts) {
    __shared__ double sh[32];
    double acc = threadIdx.x < nparts ? part[threadIdx.x] : 0.0;
    acc = gtc_block_sum(acc, sh);
    if (threadIdx.x == 0) *d = (float)acc;
}

template <bool SQ>
static int launch_sum(const gt_node *node, const char *op) {
    GTC_TRY(gtc_check_n_src_(node, 1, 1, op));
    GTC_F32(&node->dst, op, "dst");
    GTC_F32(&node->src[0], op, "src");
    if (gtc_numel(node->dst) != 1) return GTC_FAIL(GT_ERR_SHAPE, "%s: dst must be a scalar", op);
    if (node->scratch_size < SUM_BLOCKS * (int64_t)sizeof(double))
        return GTC_FAIL(GT_ERR_INVALID, "%s: scratch must hold %d doubles", op, SUM_BLOCKS);
    double *part = (double *)node->scratch;
    sum_partial<SQ><<<SUM_BLOCKS, 256, 0, gtc_stream_()>>>(part, node->src[0], gtc_numel(node->src[0]));
    sum_final<<<1, SUM_BLOCKS, 0, gtc_stream_()>>>((float *)node->dst.data, part, SUM_BLOCKS);
    return GTC_LAUNCHED(op);
}

GTC_LAUNCHER(sum_fwd_f32) { (void)ctx; return launch_sum<false>(node, "sum"); }
GTC_LAUNCHER(sumsq_fwd_f32) { (void)ctx; return launch_sum<true>(node, "sumsq"); }
GTC_SIZES(sum_fwd_f32) {
    (void)node;
    *scratch = SUM_BLOCKS * (int64_t)sizeof(double);
    *work = 0;
    return GT_OK;
}
GTC_SIZES(sumsq_fwd_f32) { return gtc_s_sum_fwd_f32(node, scratch, work); }

__global__ void sum_rows(float *d, GTC_PARAM gt_tensor s, int64_t N) {
    __shared__ double sh[32];
    const int64_t r = blockIdx.x;
    const float *row = (const float *)s.data + gtc_row_offset(s, r);
    const int64_t st = s.ndim ? s.strides[s.ndim - 1] : 1;
    double acc = 0.0;
    for (int64_t j = threadIdx.x; j < N; j += blockDim.x) acc += row[j * st];
    acc = gtc_block_sum(acc, sh);
    if (threadIdx.x == 0) d[r] = (float)acc;
}

GTC_LAUNCHER(sum_rows_fwd_f32) {
    (void)ctx;
    const char *op = "sum_rows";
    GTC_TRY(gtc_check_n_src_(node, 1, 1, op));
    GTC_F32(&node->dst, op, "dst");
    GTC_F32(&node->src[0], op, "src");
    GTC_TRY(gtc_check_contig_(&node->dst, op, "dst"));
    const int64_t rows = gtc_nrows(node->src[0]);
    if (gtc_numel(node->dst) != rows) return GTC_FAIL(GT_ERR_SHAPE, "%s: dst must hold one value a row", op);
    if (rows == 0) return GT_OK;
    sum_rows<<<(unsigned)rows, ROW_THREADS, 0, gtc_stream_()>>>((float *)node->dst.data, node->src[0],
                                                                 gtc_ncols(node->src[0]));
    return GTC_LAUNCHED(op);
}

__global__ void repeat(float *d, GTC_PARAM gtc_reader s, GTC_PARAM gt_tensor like, int64_t n) {
    const float *sd = (const float *)s.t.data;
    GTC_FOR(i, n) d[i] = sd[gtc_at(s, like, i)];
}

GTC_LAUNCHER(repeat_fwd_f32) {
    (void)ctx;
    const char *op = "repeat";
    GTC_TRY(gtc_check_n_src_(node, 1, 1, op));
    GTC_F32(&node->dst, op, "dst");
    GTC_F32(&node->src[0], op, "src");
    GTC_TRY(gtc_check_contig_(&node->dst, op, "dst"));
    GTC_TRY(gtc_check_broadcast_(&node->src[0], &node->dst, op, "src"));
    const int64_t n = gtc_numel(node->dst);
    if (n == 0) return GT_OK;
    repeat<<<gtc_blocks(n), GTC_THREADS, 0, gtc_stream_()>>>((float *)node->dst.data,
                                                              gtc_reader_for(node->src[0], node->dst), node->dst, n);
    return GTC_LAUNCHED(op);
}

/* dst (dims of 1 where reduced; right-aligned, missing dims count as 1) = src summed over them:
 * each dst element sums its src elements in row-major order. */
__global__ void repeat_bwd(float *d, GTC_PARAM gt_tensor dst, GTC_PARAM gt_tensor s, int64_t n, int64_t per) {
    const float *sd = (const float *)s.data;
    const int off = s.ndim - dst.ndim;
    GTC_FOR(j, n) {
        /* dst's multi-index, in src's dims (missing leading dims: 0) */
        int64_t idx[GTC_MAX_DIMS] = {0, 0, 0, 0, 0, 0};
        int64_t r = j;
        for (int k = dst.ndim - 1; k >= 0; k--) {
            idx[k + off] = r % dst.shape[k];
            r /= dst.shape[k];
        }
        float acc = 0.0f;
        for (int64_t q = 0; q < per; q++) {
            int64_t rest = q, o = 0;
            for (int k = s.ndim - 1; k >= 0; k--) {
                const bool reduced = k < off || dst.shape[k - off] == 1;
                int64_t v = idx[k];
                if (reduced && s.shape[k] != 1) {
                    v = rest % s.shape[k];
                    rest /= s.shape[k];
                }
                o += v * s.strides[k];
            }
            acc += sd[o];
        }
        d[j] = acc;
    }
}

/* repeat_bwd over leading dims of a contiguous src (R, n) into dst (n): a block of 32 x 32
 * threads a run of 32 columns, thread (x, y) summing rows y, y + 32, ... of column x, then the
 * 32 partial sums of a column added in y order (a fixed order: the same bits every run). */
__global__ void col_sums(float *d, const float *s, int64_t R, int64_t n) {
    __shared__ float part[32][33];
    const int64_t c = (int64_t)blockIdx.x * 32 + threadIdx.x;
    float acc = 0.0f;
    if (c < n)
        for (int64_t r = threadIdx.y; r < R; r += 32) acc += s[r * n + c];
    part[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && c < n) {
        float sum = 0.0f;
        for (int y = 0; y < 32; y++) sum += part[y][threadIdx.x];
        d[c] = sum;
    }
}

/* dst sums src over a run of src's leading dims (dst's shape, leading 1s aside, is src's
 * trailing dims) of a contiguous src. */
static bool sums_leading_dims(const gt_tensor &d, const gt_tensor &s) {
    if (!gtc_contiguous(s)) return false;
    int lead = 0;
    while (lead < d.ndim && d.shape[lead] == 1) lead++;
    const int tail = d.ndim - lead;
    if (tail > s.ndim) return false;
    for (int k = 0; k < tail; k++)
        if (d.shape[lead + k] != s.shape[s.ndim - tail + k]) return false;
    return true;
}

GTC_LAUNCHER(repeat_bwd_f32) {
    (void)ctx;
    const char *op = "repeat_bwd";
    GTC_TRY(gtc_check_n_src_(node, 1, 1, op));
    const gt_tensor *d = &node->dst, *s = &node->src[0];
    GTC_F32(d, op, "dst");
    GTC_F32(s, op, "src");
    GTC_TRY(gtc_check_contig_(d, op, "dst"));
    GTC_TRY(gtc_check_broadcast_(d, s, op, "dst"));   /* dst's dims: 1 (summed) or src's */
    const int64_t n = gtc_numel(*d);
    if (n == 0) return GT_OK;
    if (sums_leading_dims(*d, *s)) {
        col_sums<<<(unsigned)((n + 31) / 32), dim3(32, 32), 0, gtc_stream_()>>>((float *)d->data,
                                                                                (const float *)s->data,
                                                                                gtc_numel(*s) / n, n);
        return GTC_LAUNCHED(op);
    }
    repeat_bwd<<<gtc_blocks(n), GTC_THREADS, 0, gtc_stream_()>>>((float *)d->data, *d, *s, n, gtc_numel(*s) / n);
    return GTC_LAUNCHED(op);
}

/* ---- rms_norm ---------------------------------------------------------------------------------- */

__global__ void rms_norm(float *d, const float *x, const float *g, int64_t N, float eps) {
    __shared__ float sh[32];
    const int64_t r = blockIdx.x;
    const float *xr = x + r * N;
    float ss = 0.0f, sg = 0.0f;
    for (int64_t j = threadIdx.x; j < N; j += blockDim.x) {
        ss += xr[j] * xr[j];
        if (g) sg += g[r * N + j] * xr[j];
    }
    ss = gtc_block_sum(ss, sh);
    if (g) sg = gtc_block_sum(sg, sh);
    const float inv = 1.0f / sqrtf(ss / (float)N + eps);
    float *dr = d + r * N;
    if (!g) {
        for (int64_t j = threadIdx.x; j < N; j += blockDim.x) dr[j] = xr[j] * inv;
    } else {    /* dx = inv g - inv^3 x (sum g x) / N */
        const float k = inv * inv * inv * sg / (float)N;
        for (int64_t j = threadIdx.x; j < N; j += blockDim.x) dr[j] = inv * g[r * N + j] - k * xr[j];
    }
}

static int launch_rms(const gt_node *node, bool backward, const char *op) {
    GTC_TRY(gt_rms_norm_check(node, op, backward ? 2 : 1));
    const gt_tensor *d = &node->dst;
    const int64_t rows = gtc_nrows(*d);
    if (rows == 0) return GT_OK;
    rms_norm<<<(unsigned)rows, ROW_THREADS, 0, gtc_stream_()>>>(
        (float *)d->data, (const float *)node->src[0].data, backward ? (const float *)node->src[1].data : NULL,
        gtc_ncols(*d), node->fp[0]);
    return GTC_LAUNCHED(op);
}

GTC_LAUNCHER(rms_norm_fwd_f32) { (void)ctx; return launch_rms(node, false, "rms_norm"); }
GTC_LAUNCHER(rms_norm_bwd_f32) { (void)ctx; return launch_rms(node, true, "rms_norm_bwd"); }

/* ---- softmax over the last dim, masks as ggtrain.h's ----------------------------------------- */

/* Whether row r (of rows = numel / Tk) sees column j. */
__device__ inline bool sees(int mask, int64_t r, int64_t j, int64_t Tq, int64_t Tk, int64_t rows_per_b,
                            const int32_t *m) {
    const int64_t i = r % Tq;
    switch (mask) {
    case 1: return j <= i + (Tk - Tq);
    case 2: return j <= m[i];
    case 3: {
        const int64_t b = r / rows_per_b;
        return j <= i && m[b * Tk + j] == m[b * Tk + i];
    }
    default: return true;
    }
}

__global__ void softmax(float *d, const float *x, int64_t Tq, int64_t Tk, int mask, const int32_t *m,
                        int64_t rows_per_b, float scale) {
    __shared__ float sh[32];
    const int64_t r = blockIdx.x;
    const float *xr = x + r * Tk;
    float *dr = d + r * Tk;
    float mx = -INFINITY;
    for (int64_t j = threadIdx.x; j < Tk; j += blockDim.x)
        if (sees(mask, r, j, Tq, Tk, rows_per_b, m)) mx = fmaxf(mx, scale * xr[j]);
    mx = gtc_block_max(mx, sh);
    float sum = 0.0f;
    for (int64_t j = threadIdx.x; j < Tk; j += blockDim.x)
        if (sees(mask, r, j, Tq, Tk, rows_per_b, m)) sum += gt_expf_(scale * xr[j] - mx);
    sum = gtc_block_sum(sum, sh);
    for (int64_t j = threadIdx.x; j < Tk; j += blockDim.x)
        dr[j] = mx != -INFINITY && sees(mask, r, j, Tq, Tk, rows_per_b, m) ? gt_expf_(scale * xr[j] - mx) / sum : 0.0f;
}

GTC_LAUNCHER(softmax_fwd_f32) {
    (void)ctx;
    const char *op = "softmax";
    const gt_tensor *d = &node->dst, *x = &node->src[0];
    GTC_TRY(gt_softmax_check(node, op));
    const int mask = (int)node->ip[0];
    const int64_t Tk = gtc_ncols(*x), Tq = mask ? x->shape[x->ndim - 2] : 1, rows = gtc_nrows(*x);
    const int32_t *m = mask >= 2 ? (const int32_t *)node->src[1].data : NULL;
    const int64_t rows_per_b = mask == 3 ? (x->shape[0] ? rows / x->shape[0] : 1) : rows;
    if (rows == 0) return GT_OK;
    softmax<<<(unsigned)rows, ROW_THREADS, 0, gtc_stream_()>>>((float *)d->data, (const float *)x->data, Tq, Tk, mask,
                                                                m, rows_per_b, node->fp[0]);
    return GTC_LAUNCHED(op);
}

__global__ void softmax_bwd(float *d, const float *y, const float *g, int64_t N, float scale) {
    __shared__ float sh[32];
    const int64_t r = blockIdx.x;
    float dot = 0.0f;
    for (int64_t j = threadIdx.x; j < N; j += blockDim.x) dot += g[r * N + j] * y[r * N + j];
    dot = gtc_block_sum(dot, sh);
    for (int64_t j = threadIdx.x; j < N; j += blockDim.x) d[r * N + j] = scale * y[r * N + j] * (g[r * N + j] - dot);
}

GTC_LAUNCHER(softmax_bwd_f32) {
    (void)ctx;
    const char *op = "softmax_bwd";
    GTC_TRY(gtc_check_n_src_(node, 2, 2, op));
    const gt_tensor *d = &node->dst;
    GTC_F32(d, op, "dst");
    for (int i = 0; i < 2; i++) {
        GTC_F32(&node->src[i], op, "input");
        GTC_TRY(gtc_check_contig_(&node->src[i], op, "input"));
        GTC_TRY(gtc_check_same_shape_(&node->src[i], d, op, "input", "dst"));
    }
    GTC_TRY(gtc_check_contig_(d, op, "dst"));
    const int64_t rows = gtc_nrows(*d);
    if (rows == 0) return GT_OK;
    softmax_bwd<<<(unsigned)rows, ROW_THREADS, 0, gtc_stream_()>>>(
        (float *)d->data, (const float *)node->src[0].data, (const float *)node->src[1].data, gtc_ncols(*d),
        node->fp[0]);
    return GTC_LAUNCHED(op);
}

/* ---- cross-entropy ----------------------------------------------------------------------------- */

/* Each row's loss (0 on ignored rows) into loss[r]; counted[r] = 1 for a counted row. */
__global__ void ce_rows(float *loss, const float *x, const int32_t *t, int64_t V, GTC_ERR_ARGS) {
    __shared__ float sh[32];
    const int64_t r = blockIdx.x;
    const int32_t tr = t[r];
    if (tr < 0) {
        if (threadIdx.x == 0) loss[r] = 0.0f;
        return;
    }
    if (tr >= V) {
        if (threadIdx.x == 0) {
            GTC_RAISE(GTC_DEV_TARGET, r, tr, V);
            loss[r] = 0.0f;
        }
        return;
    }
    const float *xr = x + r * V;
    float mx = -INFINITY;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) mx = fmaxf(mx, xr[j]);
    mx = gtc_block_max(mx, sh);
    float sum = 0.0f;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) sum += gt_expf_(xr[j] - mx);
    sum = gtc_block_sum(sum, sh);
    if (threadIdx.x == 0) loss[r] = logf(sum) + mx - xr[tr];
}

/* dst = sum of the row losses / count (count: ip[0], or the targets >= 0; 0 gives 0). */
__global__ void ce_mean(float *d, const float *loss, const int32_t *t, int64_t N, int64_t count) {
    __shared__ double sh[32];
    double acc = 0.0, cnt = 0.0;
    for (int64_t r = threadIdx.x; r < N; r += blockDim.x) {
        acc += loss[r];
        cnt += t[r] >= 0 ? 1.0 : 0.0;
    }
    acc = gtc_block_sum(acc, sh);
    cnt = gtc_block_sum(cnt, sh);
    const double c = count > 0 ? (double)count : cnt;
    if (threadIdx.x == 0) *d = c > 0.0 ? (float)(acc / c) : 0.0f;
}

/* The rows counted (targets >= 0), once, for the backward. */
__global__ void ce_count(float *out, const int32_t *t, int64_t N, int64_t count) {
    __shared__ double sh[32];
    double cnt = 0.0;
    for (int64_t r = threadIdx.x; r < N; r += blockDim.x) cnt += t[r] >= 0 ? 1.0 : 0.0;
    cnt = gtc_block_sum(cnt, sh);
    if (threadIdx.x == 0) *out = count > 0 ? (float)count : (float)cnt;
}

GTC_SIZES(cross_entropy_fwd_f32) {
    *work = 0;
    *scratch = node->ip[1] ? 0 : gtc_nrows(node->src[0]) * (int64_t)sizeof(float);
    return GT_OK;
}

/* The kernels read the targets as one run (the CPU's read any stride). */
static int targets_contig(const gt_node *node, const char *op) {
    return gt_check_contig(&node->src[1], op, "targets");
}

GTC_LAUNCHER(cross_entropy_fwd_f32) {
    (void)ctx;
    const char *op = "cross_entropy";
    GTC_TRY(gt_cross_entropy_fwd_check(node, op));
    GTC_TRY(targets_contig(node, op));
    const int64_t N = node->src[0].shape[0], V = node->src[0].shape[1];
    const bool rows = node->ip[1] != 0;
    float *loss = rows ? (float *)node->dst.data : (float *)node->scratch;
    if (N > 0)
        ce_rows<<<(unsigned)N, ROW_THREADS, 0, gtc_stream_()>>>(loss, (const float *)node->src[0].data,
                                                                 (const int32_t *)node->src[1].data, V,
                                                                 GTC_ERR_PASS);
    if (!rows)
        ce_mean<<<1, 1024, 0, gtc_stream_()>>>((float *)node->dst.data, loss, (const int32_t *)node->src[1].data, N,
                                               node->ip[0]);
    return GTC_LAUNCHED(op);
}

/* dlogits = g * (softmax - onehot) / count; 0 on ignored rows; in place allowed. */
__global__ void ce_bwd(float *d, const float *x, const int32_t *t, const float *g, const float *count, int64_t V,
                       int rows, GTC_ERR_ARGS) {
    __shared__ float sh[32];
    const int64_t r = blockIdx.x;
    const int32_t tr = t[r];
    const float *xr = x + r * V;
    float *dr = d + r * V;
    const float c = rows ? 1.0f : *count;
    if (tr >= V && threadIdx.x == 0) GTC_RAISE(GTC_DEV_TARGET_BWD, r, tr, V);
    if (tr < 0 || tr >= V || c == 0.0f) {
        for (int64_t j = threadIdx.x; j < V; j += blockDim.x) dr[j] = 0.0f;
        return;
    }
    float mx = -INFINITY;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) mx = fmaxf(mx, xr[j]);
    mx = gtc_block_max(mx, sh);
    float sum = 0.0f;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) sum += gt_expf_(xr[j] - mx);
    sum = gtc_block_sum(sum, sh);
    const float k = (rows ? g[r] : g[0]) / c;
    for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
        const float p = gt_expf_(xr[j] - mx) / sum;
        dr[j] = k * (p - (j == tr ? 1.0f : 0.0f));
    }
}

GTC_LAUNCHER(cross_entropy_bwd_f32) {
    (void)ctx;
    const char *op = "cross_entropy_bwd";
    GTC_TRY(gt_cross_entropy_bwd_check(node, op));
    GTC_TRY(targets_contig(node, op));
    GTC_TRY(gt_check_contig(&node->src[2], op, "g"));
    const int64_t N = node->src[0].shape[0], V = node->src[0].shape[1];
    const bool rows = node->ip[1] != 0;
    if (N == 0) return GT_OK;
    if (node->scratch_size < (int64_t)sizeof(float)) return GTC_FAIL(GT_ERR_INVALID, "%s: scratch of one float", op);
    float *count = (float *)node->scratch;
    if (!rows)
        ce_count<<<1, 1024, 0, gtc_stream_()>>>(count, (const int32_t *)node->src[1].data, N, node->ip[0]);
    ce_bwd<<<(unsigned)N, ROW_THREADS, 0, gtc_stream_()>>>((float *)node->dst.data, (const float *)node->src[0].data,
                                                            (const int32_t *)node->src[1].data,
                                                            (const float *)node->src[2].data, count, V, rows ? 1 : 0,
                                                            GTC_ERR_PASS);
    return GTC_LAUNCHED(op);
}

GTC_SIZES(cross_entropy_bwd_f32) {
    (void)node;
    *scratch = sizeof(float);
    *work = 0;
    return GT_OK;
}

/* ---- rope, modes 0 (adjacent pairs) and 2 (neox: halves) --------------------------------------- */

__global__ void rope(float *d, const float *x, const int32_t *pos, int per_row, int64_t pstride, const float *factors,
                     int64_t fstride, int64_t rows, int64_t T, int64_t H, int64_t D, int64_t n_dims, int mode,
                     double base, double fscale, double mscale, double sign, float ext, float low, float high) {
    const int64_t half = n_dims / 2;
    GTC_FOR(k, rows * T * H * (D - half)) {
        /* k enumerates (row, t, h) and, per head, half pairs then the D - n_dims passed through */
        const int64_t per = D - half, q = k % per, head = k / per;
        const int64_t h = head % H, bt = head / H, t = bt % T, b = bt / T;
        const int64_t off = ((b * T + t) * H + h) * D;
        if (q < half) {
            const int64_t p = per_row ? pos[b * T + t] : pos[t * pstride];
            /* YaRN: the pair's share of freq_scale, mixed with 1 by the ramp (the CPU's expressions) */
            double mix = 0.0;
            if (ext != 0.0f) {
                const float y = ((float)q - low) / fmaxf(0.001f, high - low);
                mix = (double)(1.0f - fminf(1.0f, fmaxf(0.0f, y))) * ext;
            }
            double freq = (fscale * (1.0 - mix) + mix) * pow(base, -2.0 * (double)q / (double)n_dims);
            if (factors) freq /= (double)factors[q * fstride];
            const double th = (double)p * freq;
            const float c = (float)(mscale * cos(th)), s = (float)(mscale * sign * sin(th));
            const int64_t i0 = mode == 2 ? q : 2 * q, i1 = mode == 2 ? q + half : 2 * q + 1;
            const float x0 = x[off + i0], x1 = x[off + i1];
            d[off + i0] = x0 * c - x1 * s;
            d[off + i1] = x0 * s + x1 * c;
        } else {
            const int64_t j = n_dims + (q - half);
            d[off + j] = x[off + j];
        }
    }
}

static int launch_rope(const gt_node *node, double sign, const char *op) {
    const gt_tensor *d = &node->dst, *x = &node->src[0], *p = &node->src[1];
    int per_row = 0;
    GTC_TRY(gt_rope_check(node, op, sign < 0, &per_row));
    if (node->ip[2])
        return GTC_FAIL(GT_ERR_INVALID, "%s: llama.cpp's CPU angles (ip[2] = 1) are the CPU kernel's", op);
    const int64_t D = x->shape[x->ndim - 1], H = x->shape[x->ndim - 2], T = x->shape[x->ndim - 3];
    const int64_t rows = T * H * D > 0 ? gtc_numel(*x) / (T * H * D) : 0;
    const int64_t n_dims = node->ip[0];
    const int mode = (int)node->ip[1];
    const float base = node->fp[0], fscale = node->fp[1], ext = node->fp[3];
    const float mscale = ext != 0.0f ? node->fp[2] * (1.0f + 0.1f * logf(1.0f / fscale)) : node->fp[2];
    const float *factors = NULL;
    int64_t fstride = 1;
    if (node->n_src == 3) {
        factors = (const float *)node->src[2].data;
        fstride = node->src[2].strides[0];
    }
    const int64_t n = rows * T * H * (D - n_dims / 2);
    if (n == 0) return GT_OK;
    rope<<<gtc_blocks(n), GTC_THREADS, 0, gtc_stream_()>>>((float *)d->data, (const float *)x->data,
                                                            (const int32_t *)p->data, per_row ? 1 : 0,
                                                            per_row ? 1 : p->strides[0], factors,
                                                            fstride, rows, T, H, D, n_dims, mode, base, fscale,
                                                            mscale, sign, ext, node->fp[4], node->fp[5]);
    return GTC_LAUNCHED(op);
}

GTC_LAUNCHER(rope_fwd_f32) { (void)ctx; return launch_rope(node, 1.0, "rope"); }
GTC_LAUNCHER(rope_bwd_f32) { (void)ctx; return launch_rope(node, -1.0, "rope_bwd"); }
