/* conv.c: im2col over NHWC (a convolution is im2col then matmul) and its
 * backward, and max_pool2d with its backward. Each output row (pixel) belongs
 * to one thread; the backward kernels gather every contribution to a dx element
 * in a fixed order and write every element of dx (zeros included). */
#include "internal.h"
#include "shape.h"
#include "simd.h"

#define LANES 16

/* ---- im2col ------------------------------------------------------------------ */

typedef struct conv_dims {
    int64_t N, H, W, C, KH, KW, S, P, OH, OW, K;   /* K = C * KH * KW */
} conv_dims;

/* Checks ip = {KH, KW, stride, pad} and the image x (N, H, W, C); fills cd. */
static int conv_params(const gt_node *node, const gt_tensor *x, const char *op, const char *xname, conv_dims *cd) {
    char a[128];
    const int64_t KH = node->ip[0], KW = node->ip[1], S = node->ip[2], P = node->ip[3];
    if (KH < 1 || KW < 1 || S < 1 || P < 0)
        return GT_FAIL(GT_ERR_INVALID, "%s: expected ip = {KH >= 1, KW >= 1, stride >= 1, pad >= 0}, got {%lld, %lld, %lld, %lld}",
                       op, (long long)KH, (long long)KW, (long long)S, (long long)P);
    if (x->ndim != 4)
        return GT_FAIL(GT_ERR_SHAPE, "%s: expected %s (N, H, W, C), got %s", op, xname, gt_shape_str(x, a, sizeof a));
    cd->N = x->shape[0], cd->H = x->shape[1], cd->W = x->shape[2], cd->C = x->shape[3];
    cd->KH = KH, cd->KW = KW, cd->S = S, cd->P = P;
    if (cd->H + 2 * P < KH || cd->W + 2 * P < KW)
        return GT_FAIL(GT_ERR_SHAPE, "%s: kernel %lldx%lld larger than padded image %s (pad %lld)", op,
                       (long long)KH, (long long)KW, gt_shape_str(x, a, sizeof a), (long long)P);
    cd->OH = (cd->H + 2 * P - KH) / S + 1;
    cd->OW = (cd->W + 2 * P - KW) / S + 1;
    cd->K = cd->C * KH * KW;
    return GT_OK;
}

static int check_cols(const gt_tensor *t, const conv_dims *cd, const char *op, const char *what) {
    if (t->ndim == 4 && t->shape[0] == cd->N && t->shape[1] == cd->OH && t->shape[2] == cd->OW && t->shape[3] == cd->K)
        return GT_OK;
    char a[128];
    return GT_FAIL(GT_ERR_SHAPE, "%s: expected %s (N, OH, OW, C*KH*KW) = (%lld, %lld, %lld, %lld), got %s", op, what,
                   (long long)cd->N, (long long)cd->OH, (long long)cd->OW, (long long)cd->K, gt_shape_str(t, a, sizeof a));
}

/* im2col: src x (N, H, W, C) f32 contiguous -> dst (N, OH, OW, C*KH*KW) f32
 * contiguous, dst[n, oh, ow, c*KH*KW + kh*KW + kw] = x[n, oh*s - pad + kh,
 * ow*s - pad + kw, c], 0 outside the image. ip = {KH, KW, stride, pad};
 * OH = (H + 2 pad - KH) / stride + 1 (floor), OW alike. Output pixels (rows of
 * dst) are split across threads. */
int gt_im2col_fwd_f32(const gt_node *node, const gt_ctx *ctx) {
    const char *op = "im2col";
    const gt_tensor *d = &node->dst, *x = &node->src[0];
    conv_dims cd;
    GT_TRY(gt_check_n_src(node, 1, op));
    GT_CHECK_F32(d, op, "dst");
    GT_CHECK_F32(x, op, "x");
    GT_TRY(conv_params(node, x, op, "x", &cd));
    GT_TRY(check_cols(d, &cd, op, "dst"));
    GT_TRY(gt_check_contig(x, op, "x"));
    GT_TRY(gt_check_contig(d, op, "dst"));
    const int64_t C = cd.C, KH = cd.KH, KW = cd.KW, KK = KH * KW;
    const float *xd = x->data;
    float *dd = d->data;
    int64_t lo, hi;
    gt_split(cd.N * cd.OH * cd.OW, ctx, &lo, &hi);
    for (int64_t r = lo; r < hi; r++) {
        const int64_t ow = r % cd.OW, oh = (r / cd.OW) % cd.OH, n = r / (cd.OW * cd.OH);
        float *row = dd + r * cd.K;
        for (int64_t kh = 0; kh < KH; kh++) {
            const int64_t ih = oh * cd.S - cd.P + kh;
            for (int64_t kw = 0; kw < KW; kw++) {
                const int64_t iw = ow * cd.S - cd.P + kw;
                float *out = row + kh * KW + kw;
                if (ih < 0 || ih >= cd.H || iw < 0 || iw >= cd.W) {
                    for (int64_t c = 0; c < C; c++) out[c * KK] = 0.0f;
                } else {
                    const float *in = xd + ((n * cd.H + ih) * cd.W + iw) * C;
                    for (int64_t c = 0; c < C; c++) out[c * KK] = in[c];
                }
            }
        }
    }
    return GT_OK;
}

/* im2col_bwd: src g (N, OH, OW, C*KH*KW) f32 contiguous -> dst dx (N, H, W, C)
 * f32 contiguous (its shape gives H and W): dx[n, ih, iw, c] = sum of
 * g[n, oh, ow, c*KH*KW + kh*KW + kw] over the (oh, ow) whose window covers
 * (ih, iw), summed in order of increasing oh then ow. ip as in im2col. Each
 * thread owns whole pixels of dx; pixels no window covers get 0. */
int gt_im2col_bwd_f32(const gt_node *node, const gt_ctx *ctx) {
    const char *op = "im2col_bwd";
    const gt_tensor *d = &node->dst, *g = &node->src[0];
    conv_dims cd;
    GT_TRY(gt_check_n_src(node, 1, op));
    GT_CHECK_F32(d, op, "dst");
    GT_CHECK_F32(g, op, "g");
    GT_TRY(conv_params(node, d, op, "dst", &cd));
    GT_TRY(check_cols(g, &cd, op, "g"));
    GT_TRY(gt_check_contig(g, op, "g"));
    GT_TRY(gt_check_contig(d, op, "dst"));
    const int64_t C = cd.C, KW = cd.KW, KK = cd.KH * KW, S = cd.S, P = cd.P;
    const float *gd = g->data;
    float *dd = d->data;
    int64_t lo, hi;
    gt_split(cd.N * cd.H * cd.W, ctx, &lo, &hi);
    for (int64_t r = lo; r < hi; r++) {
        const int64_t iw = r % cd.W, ih = (r / cd.W) % cd.H, n = r / (cd.W * cd.H);
        float *out = dd + r * C;
        memset(out, 0, (size_t)C * sizeof(float));
        /* windows covering ih: oh*S - P <= ih <= oh*S - P + KH - 1 */
        const int64_t ah = ih + P - cd.KH + 1, aw = iw + P - KW + 1;
        const int64_t oh0 = ah <= 0 ? 0 : (ah + S - 1) / S, ow0 = aw <= 0 ? 0 : (aw + S - 1) / S;
        const int64_t oh1 = (ih + P) / S < cd.OH - 1 ? (ih + P) / S : cd.OH - 1;
        const int64_t ow1 = (iw + P) / S < cd.OW - 1 ? (iw + P) / S : cd.OW - 1;
        for (int64_t oh = oh0; oh <= oh1; oh++) {
            const int64_t kh = ih + P - oh * S;
            for (int64_t ow = ow0; ow <= ow1; ow++) {
                const int64_t kw = iw + P - ow * S;
                const float *in = gd + ((n * cd.OH + oh) * cd.OW + ow) * cd.K + kh * KW + kw;
                for (int64_t c = 0; c < C; c++) out[c] += in[c * KK];
            }
        }
    }
    return GT_OK;
}

/* ---- max_pool2d ---------------------------------------------------------------- */

static int pool_params(const gt_node *node, const gt_tensor *x, const char *op, int64_t *k) {
    char a[128];
    *k = node->ip[0];
    if (*k < 1) return GT_FAIL(GT_ERR_INVALID, "%s: expected window ip[0] >= 1, got %lld", op, (long long)*k);
    if (x->ndim != 4)
        return GT_FAIL(GT_ERR_SHAPE, "%s: expected x (N, H, W, C), got %s", op, gt_shape_str(x, a, sizeof a));
    return GT_OK;
}

static int check_pooled(const gt_tensor *t, const gt_tensor *x, int64_t k, const char *op, const char *what) {
    const int64_t N = x->shape[0], OH = x->shape[1] / k, OW = x->shape[2] / k, C = x->shape[3];
    if (t->ndim == 4 && t->shape[0] == N && t->shape[1] == OH && t->shape[2] == OW && t->shape[3] == C) return GT_OK;
    char a[128], b[128];
    return GT_FAIL(GT_ERR_SHAPE, "%s: expected %s (N, H/k, W/k, C) = (%lld, %lld, %lld, %lld) for x %s and k %lld, got %s",
                   op, what, (long long)N, (long long)OH, (long long)OW, (long long)C, gt_shape_str(x, a, sizeof a),
                   (long long)k, gt_shape_str(t, b, sizeof b));
}

/* d[c] = max(d[c], x[c]); a NaN in x is skipped (comparison false) */
GT_CLONES static void max_into(float *restrict d, const float *restrict x, int64_t n) {
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int k = 0; k < LANES; k++) d[i + k] = x[i + k] > d[i + k] ? x[i + k] : d[i + k];
    for (; i < n; i++) d[i] = x[i] > d[i] ? x[i] : d[i];
}

/* max_pool2d: src x (N, H, W, C) f32 contiguous -> dst (N, H/k, W/k, C) f32
 * contiguous, the max over each k x k window (window = stride = k = ip[0], no
 * padding, rows/columns past the last full window dropped). Output pixels are
 * split across threads. */
int gt_max_pool2d_fwd_f32(const gt_node *node, const gt_ctx *ctx) {
    const char *op = "max_pool2d";
    const gt_tensor *d = &node->dst, *x = &node->src[0];
    int64_t k;
    GT_TRY(gt_check_n_src(node, 1, op));
    GT_CHECK_F32(d, op, "dst");
    GT_CHECK_F32(x, op, "x");
    GT_TRY(pool_params(node, x, op, &k));
    GT_TRY(check_pooled(d, x, k, op, "dst"));
    GT_TRY(gt_check_contig(x, op, "x"));
    GT_TRY(gt_check_contig(d, op, "dst"));
    const int64_t H = x->shape[1], W = x->shape[2], C = x->shape[3];
    const int64_t OH = d->shape[1], OW = d->shape[2];
    const float *xd = x->data;
    float *dd = d->data;
    int64_t lo, hi;
    gt_split(x->shape[0] * OH * OW, ctx, &lo, &hi);
    for (int64_t r = lo; r < hi; r++) {
        const int64_t ow = r % OW, oh = (r / OW) % OH, n = r / (OW * OH);
        const float *win = xd + ((n * H + oh * k) * W + ow * k) * C;
        float *out = dd + r * C;
        if (C < LANES) {   /* few channels: one at a time, no calls */
            for (int64_t c = 0; c < C; c++) {
                float best = win[c];
                for (int64_t kh = 0; kh < k; kh++)
                    for (int64_t kw = kh ? 0 : 1; kw < k; kw++) {
                        const float v = win[(kh * W + kw) * C + c];
                        best = v > best ? v : best;
                    }
                out[c] = best;
            }
            continue;
        }
        memcpy(out, win, (size_t)C * sizeof(float));
        for (int64_t kh = 0; kh < k; kh++)
            for (int64_t kw = kh ? 0 : 1; kw < k; kw++) max_into(out, win + (kh * W + kw) * C, C);
    }
    return GT_OK;
}

/* at[c] = off where x[c] == m[c] */
GT_CLONES static void mark_max(int64_t *restrict at, const float *restrict x, const float *restrict m, int64_t off,
                               int64_t n) {
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int k = 0; k < LANES; k++) at[i + k] = x[i + k] == m[i + k] ? off : at[i + k];
    for (; i < n; i++) at[i] = x[i] == m[i] ? off : at[i];
}

#define POOL_CBLOCK 64   /* channels whose running max and argmax live on the stack */

/* max_pool2d_bwd: src0 x (N, H, W, C), src1 g (N, H/k, W/k, C), dst dx (N, H, W, C),
 * all f32 contiguous; k = ip[0]. Each window's gradient goes to the FIRST
 * maximum of the window in row-major (kh, kw) order; every other element of dx
 * (including rows/columns past the last full window) is 0. Threads own blocks
 * of k image rows (the last block may be the partial rows no window covers). */
int gt_max_pool2d_bwd_f32(const gt_node *node, const gt_ctx *ctx) {
    const char *op = "max_pool2d_bwd";
    const gt_tensor *d = &node->dst, *x = &node->src[0], *g = &node->src[1];
    int64_t k;
    GT_TRY(gt_check_n_src(node, 2, op));
    GT_CHECK_F32(d, op, "dst");
    GT_CHECK_F32(x, op, "x");
    GT_CHECK_F32(g, op, "g");
    GT_TRY(pool_params(node, x, op, &k));
    GT_TRY(gt_check_same_shape(d, x, op, "dst", "x"));
    GT_TRY(check_pooled(g, x, k, op, "g"));
    GT_TRY(gt_check_contig(x, op, "x"));
    GT_TRY(gt_check_contig(g, op, "g"));
    GT_TRY(gt_check_contig(d, op, "dst"));
    const int64_t N = x->shape[0], H = x->shape[1], W = x->shape[2], C = x->shape[3];
    const int64_t OH = H / k, OW = W / k, nb = (H + k - 1) / k;
    const float *xd = x->data, *gd = g->data;
    float *dd = d->data;
    float m[POOL_CBLOCK];
    int64_t at[POOL_CBLOCK];
    int64_t lo, hi;
    gt_split(N * nb, ctx, &lo, &hi);
    for (int64_t u = lo; u < hi; u++) {
        const int64_t n = u / nb, b = u - n * nb;
        const int64_t h0 = b * k, h1 = h0 + k < H ? h0 + k : H;
        memset(dd + (n * H + h0) * W * C, 0, (size_t)((h1 - h0) * W * C) * sizeof(float));
        if (b >= OH) continue;
        for (int64_t ow = 0; ow < OW; ow++) {
            const int64_t base = ((n * H + h0) * W + ow * k) * C;   /* window origin in x and dx */
            const float *gr = gd + ((n * OH + b) * OW + ow) * C;
            for (int64_t c0 = 0; c0 < C; c0 += POOL_CBLOCK) {
                const int64_t cn = C - c0 < POOL_CBLOCK ? C - c0 : POOL_CBLOCK;
                const float *w0 = xd + base + c0;
                float *o = dd + base + c0;
                if (cn < LANES) {
                    /* few channels: one channel at a time, first strict max wins */
                    for (int64_t c = 0; c < cn; c++) {
                        float best = w0[c];
                        int64_t arg = 0;
                        for (int64_t kh = 0; kh < k; kh++)
                            for (int64_t kw = kh ? 0 : 1; kw < k; kw++) {
                                const int64_t off = (kh * W + kw) * C;
                                const int gt = w0[off + c] > best;
                                best = gt ? w0[off + c] : best;
                                arg = gt ? off : arg;
                            }
                        o[arg + c] = gr[c0 + c];
                    }
                    continue;
                }
                /* vectorized over channels: the max first (as the forward computes
                 * it), then the first (kh, kw) holding it: scanning the window
                 * backwards, the last match wins. A NaN first element stays the
                 * max and the argmax (NaN elsewhere is skipped, as in the forward). */
                memcpy(m, w0, (size_t)cn * sizeof(float));
                for (int64_t kh = 0; kh < k; kh++)
                    for (int64_t kw = kh ? 0 : 1; kw < k; kw++) max_into(m, w0 + (kh * W + kw) * C, cn);
                memset(at, 0, (size_t)cn * sizeof at[0]);
                for (int64_t kh = k - 1; kh >= 0; kh--)
                    for (int64_t kw = k - 1; kw >= 0; kw--) {
                        const int64_t off = (kh * W + kw) * C;
                        mark_max(at, w0 + off, m, off, cn);
                    }
                for (int64_t c = 0; c < cn; c++) o[at[c] + c] = gr[c0 + c];
            }
        }
    }
    return GT_OK;
}
