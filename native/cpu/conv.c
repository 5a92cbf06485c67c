/* conv.c: im2col over NHWC (a convolution is im2col then matmul) and its
 * backward, and max_pool2d with its backward. Each output row (pixel) belongs
 * to one thread; the backward kernels gather every contribution to a dx element
 * in a fixed order and write every element of dx (zeros included). */
#include "internal.h"
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

/* One output pixel's patch row[c*KH*KW + kh*KW + kw] = src[kh*WC + kw*C + c]
 * over kh in [kh0, kh1), kw in [kw0, kw1) (src at the window origin, which may
 * lie in the padding: only the in-image offsets are formed); the rest of the row
 * is already 0 or fully covered. */
static inline void patch_copy(float *restrict row, const float *restrict xd, int64_t origin, int64_t WC, int64_t C,
                              int64_t KH, int64_t KW, int64_t kh0, int64_t kh1, int64_t kw0, int64_t kw1) {
    for (int64_t c = 0; c < C; c++)
        for (int64_t kh = kh0; kh < kh1; kh++) {
            const int64_t at = origin + kh * WC + c;
            float *out = row + (c * KH + kh) * KW;
            for (int64_t kw = kw0; kw < kw1; kw++) out[kw] = xd[at + kw * C];
        }
}

/* An interior 3x3 patch (the common case, written out): row[c*9 + kh*3 + kw] =
 * src[kh*WC + kw*C + c]. */
static inline void patch_copy33(float *restrict row, const float *restrict src, int64_t WC, int64_t C) {
    const float *r0 = src, *r1 = src + WC, *r2 = src + 2 * WC;
    if (C == 1) {
        const float a0 = r0[0], a1 = r0[1], a2 = r0[2], b0 = r1[0], b1 = r1[1], b2 = r1[2];
        const float c0 = r2[0], c1 = r2[1], c2 = r2[2];
        row[0] = a0, row[1] = a1, row[2] = a2, row[3] = b0, row[4] = b1, row[5] = b2;
        row[6] = c0, row[7] = c1, row[8] = c2;
        return;
    }
    const int64_t C2 = 2 * C;
    for (int64_t c = 0; c < C; c++, row += 9) {
        const float a0 = r0[c], a1 = r0[C + c], a2 = r0[C2 + c], b0 = r1[c], b1 = r1[C + c], b2 = r1[C2 + c];
        const float c0 = r2[c], c1 = r2[C + c], c2 = r2[C2 + c];
        row[0] = a0, row[1] = a1, row[2] = a2, row[3] = b0, row[4] = b1, row[5] = b2;
        row[6] = c0, row[7] = c1, row[8] = c2;
    }
}

/* im2col: src x (N, H, W, C) f32 contiguous -> dst (N, OH, OW, C*KH*KW) f32
 * contiguous, dst[n, oh, ow, c*KH*KW + kh*KW + kw] = x[n, oh*s - pad + kh,
 * ow*s - pad + kw, c], 0 outside the image. ip = {KH, KW, stride, pad};
 * OH = (H + 2 pad - KH) / stride + 1 (floor), OW alike. Output pixels (rows of
 * dst) are split across threads; each is written contiguously, windows wholly
 * inside the image without bounds checks, border windows zeroed then filled. */
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
    const int64_t H = cd.H, W = cd.W, C = cd.C, KH = cd.KH, KW = cd.KW, S = cd.S, P = cd.P;
    const int64_t OH = cd.OH, OW = cd.OW, K = cd.K, WC = W * C;
    const int is33 = KH == 3 && KW == 3;
    const float *xd = x->data;
    float *dd = d->data;
    int64_t lo, hi;
    gt_split(cd.N * OH * OW, ctx, &lo, &hi);
    for (int64_t r = lo; r < hi;) {
        /* the run of pixels [r, r + len) of output row (n, oh) */
        const int64_t orow = r / OW, ow_a = r - orow * OW;
        const int64_t len = OW - ow_a < hi - r ? OW - ow_a : hi - r;
        const int64_t n = orow / OH, oh = orow - n * OH;
        const int64_t ih0 = oh * S - P;
        const int64_t kh0 = ih0 < 0 ? -ih0 : 0, kh1 = H - ih0 < KH ? H - ih0 : KH;
        const int full_h = kh0 == 0 && kh1 == KH;
        float *row = dd + r * K;
        for (int64_t ow = ow_a; ow < ow_a + len; ow++, row += K) {
            const int64_t iw0 = ow * S - P;
            const int64_t kw0 = iw0 < 0 ? -iw0 : 0, kw1 = W - iw0 < KW ? W - iw0 : KW;
            const int64_t origin = ((n * H + ih0) * W + iw0) * C;   /* may be negative or past the image */
            if (full_h && kw0 == 0 && kw1 == KW) {
                if (is33) patch_copy33(row, xd + origin, WC, C);
                else patch_copy(row, xd, origin, WC, C, KH, KW, 0, KH, 0, KW);
                continue;
            }
            memset(row, 0, (size_t)K * sizeof(float));
            if (kh0 < kh1 && kw0 < kw1) patch_copy(row, xd, origin, WC, C, KH, KW, kh0, kh1, kw0, kw1);
        }
        r += len;
    }
    return GT_OK;
}

/* im2col_bwd: src g (N, OH, OW, C*KH*KW) f32 contiguous -> dst dx (N, H, W, C)
 * f32 contiguous (its shape gives H and W): dx[n, ih, iw, c] = sum of
 * g[n, oh, ow, c*KH*KW + kh*KW + kw] over the (oh, ow) whose window covers
 * (ih, iw), summed from 0 in order of increasing oh then ow. ip as in im2col.
 * Each thread owns whole pixels of dx, gathered 8 channels at a time in
 * registers; pixels no window covers get 0. */
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
    const int64_t H = cd.H, W = cd.W, C = cd.C, KH = cd.KH, KW = cd.KW, KK = KH * KW, S = cd.S, P = cd.P;
    const int64_t OH = cd.OH, OW = cd.OW, K = cd.K;
    const float *gd = g->data;
    float *dd = d->data;
    int64_t lo, hi;
    gt_split(cd.N * H * W, ctx, &lo, &hi);
    for (int64_t r = lo; r < hi;) {
        /* the run of pixels [r, r + len) of image row (n, ih) */
        const int64_t irow = r / W, iw_a = r - irow * W;
        const int64_t len = W - iw_a < hi - r ? W - iw_a : hi - r;
        const int64_t n = irow / H, ih = irow - n * H;
        /* windows covering ih: oh*S - P <= ih <= oh*S - P + KH - 1 */
        const int64_t ah = ih + P - KH + 1;
        const int64_t oh0 = ah <= 0 ? 0 : (ah + S - 1) / S;
        const int64_t oh1 = (ih + P) / S < OH - 1 ? (ih + P) / S : OH - 1;
        const float *gimg = gd + n * OH * OW * K;
        float *out = dd + r * C;
        for (int64_t iw = iw_a; iw < iw_a + len; iw++, out += C) {
            const int64_t aw = iw + P - KW + 1;
            int64_t ow0, ow1;
            if (S == 1) {
                ow0 = aw <= 0 ? 0 : aw;
                ow1 = iw + P < OW - 1 ? iw + P : OW - 1;
            } else {
                ow0 = aw <= 0 ? 0 : (aw + S - 1) / S;
                ow1 = (iw + P) / S < OW - 1 ? (iw + P) / S : OW - 1;
            }
            int64_t c0 = 0;
            for (; c0 + 8 <= C; c0 += 8) {
                float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f, a4 = 0.0f, a5 = 0.0f, a6 = 0.0f, a7 = 0.0f;
                for (int64_t oh = oh0; oh <= oh1; oh++) {
                    const int64_t at = oh * OW * K + c0 * KK + (ih + P - oh * S) * KW + iw + P;
                    for (int64_t ow = ow0; ow <= ow1; ow++) {
                        const float *p = gimg + (at + ow * (K - S));   /* pixel (oh, ow), kw = iw + P - ow*S */
                        a0 += p[0], a1 += p[KK], a2 += p[2 * KK], a3 += p[3 * KK];
                        a4 += p[4 * KK], a5 += p[5 * KK], a6 += p[6 * KK], a7 += p[7 * KK];
                    }
                }
                float *o = out + c0;
                o[0] = a0, o[1] = a1, o[2] = a2, o[3] = a3, o[4] = a4, o[5] = a5, o[6] = a6, o[7] = a7;
            }
            for (; c0 < C; c0++) {
                float acc = 0.0f;
                for (int64_t oh = oh0; oh <= oh1; oh++) {
                    const int64_t at = oh * OW * K + c0 * KK + (ih + P - oh * S) * KW + iw + P;
                    for (int64_t ow = ow0; ow <= ow1; ow++) acc += gimg[at + ow * (K - S)];
                }
                out[c0] = acc;
            }
        }
        r += len;
    }
    return GT_OK;
}

/* ---- max_pool2d ---------------------------------------------------------------- */

/* d[c] = max(d[c], x[c]); a NaN in x is skipped (comparison false) */
GT_CLONES static void max_into(float *restrict d, const float *restrict x, int64_t n) {
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int k = 0; k < LANES; k++) d[i + k] = x[i + k] > d[i + k] ? x[i + k] : d[i + k];
    for (; i < n; i++) d[i] = x[i] > d[i] ? x[i] : d[i];
}

/* max_pool2d of len consecutive output pixels of one row, C a multiple of 8:
 * out[i, c] = max over the k x k window at win + i*k*C (image rows WC floats
 * apart), starting from its first element, later elements in row-major order
 * replacing it when greater (as max_into: a NaN after the first is skipped). */
GT_CLONES static void pool_fwd_run8(float *restrict out, const float *restrict win, int64_t len, int64_t k,
                                    int64_t WC, int64_t C) {
    for (int64_t i = 0; i < len; i++, out += C, win += k * C)
        for (int64_t c0 = 0; c0 < C; c0 += 8) {
            const float *w = win + c0;
            float m[8];
            for (int c = 0; c < 8; c++) m[c] = w[c];
            for (int64_t kh = 0; kh < k; kh++)
                for (int64_t kw = kh ? 0 : 1; kw < k; kw++) {
                    const float *v = w + kh * WC + kw * C;
                    for (int c = 0; c < 8; c++) m[c] = v[c] > m[c] ? v[c] : m[c];
                }
            for (int c = 0; c < 8; c++) out[c0 + c] = m[c];
        }
}

/* max_pool2d: src x (N, H, W, C) f32 contiguous -> dst (N, H/k, W/k, C) f32
 * contiguous, the max over each k x k window (window = stride = k = ip[0], no
 * padding, rows/columns past the last full window dropped). Output pixels are
 * split across threads; C a multiple of 8 goes 8 channels at a time, whole
 * runs of a row per call. */
int gt_max_pool2d_fwd_f32(const gt_node *node, const gt_ctx *ctx) {
    const char *op = "max_pool2d";
    const gt_tensor *d = &node->dst, *x = &node->src[0];
    int64_t k;
    GT_TRY(gt_max_pool2d_check(node, 0, op, &k));
    const int64_t H = x->shape[1], W = x->shape[2], C = x->shape[3];
    const int64_t OH = d->shape[1], OW = d->shape[2];
    const float *xd = x->data;
    float *dd = d->data;
    int64_t lo, hi;
    gt_split(x->shape[0] * OH * OW, ctx, &lo, &hi);
    if (C % 8 == 0) {   /* channels in blocks of 8, runs of a row at a time */
        for (int64_t r = lo; r < hi;) {
            const int64_t orow = r / OW, ow_a = r - orow * OW;
            const int64_t len = OW - ow_a < hi - r ? OW - ow_a : hi - r;
            const int64_t n = orow / OH, oh = orow - n * OH;
            pool_fwd_run8(dd + r * C, xd + ((n * H + oh * k) * W + ow_a * k) * C, len, k, W * C, C);
            r += len;
        }
        return GT_OK;
    }
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

/* max_pool2d_bwd of one row of windows, C a multiple of 8: o and w at the
 * window row's first image row of dx and x (image rows WC floats apart), gr the
 * row of g. Writes the OW*k columns of the k rows: g to the first maximum of
 * each window, 0 elsewhere. The max m as the forward computes it; the first
 * element equal to it takes g (the rest `rem` becomes 0); the first element
 * takes it when not below m, i.e. also when it is NaN (then m is NaN). */
GT_CLONES static void pool_bwd_row8(float *restrict o, const float *restrict w, const float *restrict gr, int64_t OW,
                                    int64_t k, int64_t WC, int64_t C) {
    for (int64_t ow = 0; ow < OW; ow++)
        for (int64_t c0 = 0; c0 < C; c0 += 8) {
            const int64_t at = ow * k * C + c0;
            const float *w0 = w + at, *g0 = gr + ow * C + c0;
            float *o0 = o + at;
            float m[8], rem[8];
            for (int c = 0; c < 8; c++) m[c] = w0[c];
            for (int64_t kh = 0; kh < k; kh++)
                for (int64_t kw = kh ? 0 : 1; kw < k; kw++) {
                    const float *v = w0 + kh * WC + kw * C;
                    for (int c = 0; c < 8; c++) m[c] = v[c] > m[c] ? v[c] : m[c];
                }
            for (int c = 0; c < 8; c++) {
                const int below = w0[c] < m[c];
                o0[c] = below ? 0.0f : g0[c];
                rem[c] = below ? g0[c] : 0.0f;
            }
            for (int64_t kh = 0; kh < k; kh++)
                for (int64_t kw = kh ? 0 : 1; kw < k; kw++) {
                    const float *v = w0 + kh * WC + kw * C;
                    float *ov = o0 + kh * WC + kw * C;
                    for (int c = 0; c < 8; c++) {
                        const int eq = v[c] == m[c];
                        ov[c] = eq ? rem[c] : 0.0f;
                        rem[c] = eq ? 0.0f : rem[c];
                    }
                }
        }
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
    GT_TRY(gt_max_pool2d_check(node, 1, op, &k));
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
        if (C % 8 == 0 && b < OH) {   /* whole window rows written directly; then the columns past them */
            const int64_t o = (n * H + h0) * W * C, tail = (W - OW * k) * C;
            pool_bwd_row8(dd + o, xd + o, gd + (n * OH + b) * OW * C, OW, k, W * C, C);
            for (int64_t h = 0; tail && h < k; h++)
                memset(dd + o + h * W * C + OW * k * C, 0, (size_t)tail * sizeof(float));
            continue;
        }
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
