/* elementwise.c: binary ops with broadcasting, unary ops, fill, and the fused
 * backward kernels of relu and silu. Rows of dst are split across threads. */
#include <math.h>
#include <pthread.h>

#include "internal.h"
#include "simd.h"

/* ---- binary: dst (contiguous) = src0 OP src1, numpy broadcasting ---------- */

#define BINARY_ROW(name, OP)                                                          \
    GT_CLONES static void name##_row(float *d, const float *a, int64_t sa,             \
                                     const float *b, int64_t sb, int64_t n) {          \
        if (sa == 1 && sb == 1) {                                                      \
            for (int64_t i = 0; i < n; i++) d[i] = a[i] OP b[i];                       \
        } else if (sa == 1 && sb == 0) {                                               \
            const float y = b[0];                                                      \
            for (int64_t i = 0; i < n; i++) d[i] = a[i] OP y;                          \
        } else if (sa == 0 && sb == 1) {                                               \
            const float x = a[0];                                                      \
            for (int64_t i = 0; i < n; i++) d[i] = x OP b[i];                          \
        } else {                                                                       \
            for (int64_t i = 0; i < n; i++) d[i] = a[i * sa] OP b[i * sb];             \
        }                                                                              \
    }

BINARY_ROW(add, +)
BINARY_ROW(sub, -)
BINARY_ROW(mul, *)
BINARY_ROW(div, /)

typedef void (*binary_row_fn)(float *, const float *, int64_t, const float *, int64_t, int64_t);

/* Stride of t's last dim when broadcast to like's last dim. */
static int64_t inner_stride(const gt_tensor *t) {
    if (t->ndim == 0 || t->shape[t->ndim - 1] == 1) return 0;
    return t->strides[t->ndim - 1];
}

#define ROW_TILE 1024

/* t has dst's shape and is contiguous. */
static int same_layout(const gt_tensor *t, const gt_tensor *d) {
    if (t->ndim != d->ndim) return 0;
    for (int i = 0; i < d->ndim; i++)
        if (t->shape[i] != d->shape[i]) return 0;
    return gt_is_contiguous(t);
}

/* t is a contiguous row of n elements, every other dim 1. */
static int is_row_vector(const gt_tensor *t, int64_t n) {
    if (t->ndim < 1 || t->shape[t->ndim - 1] != n || (n > 1 && t->strides[t->ndim - 1] != 1)) return 0;
    for (int i = 0; i + 1 < t->ndim; i++)
        if (t->shape[i] != 1) return 0;
    return 1;
}

static int check_bcast(const gt_tensor *t, const gt_tensor *d, const char *op, const char *what) {
    if (t->ndim > d->ndim) return GT_FAIL(GT_ERR_SHAPE, "%s: %s has more dims than dst", op, what);
    for (int i = 0; i < t->ndim; i++) {
        int64_t n = t->shape[t->ndim - 1 - i], m = d->shape[d->ndim - 1 - i];
        if (n != 1 && n != m)
            return GT_FAIL(GT_ERR_SHAPE, "%s: %s dim %d is %lld, cannot broadcast to %lld", op,
                           what, t->ndim - 1 - i, (long long)n, (long long)m);
    }
    return GT_OK;
}

static int binary(const gt_node *node, const gt_ctx *ctx, binary_row_fn fn, const char *op) {
    const gt_tensor *d = &node->dst, *a = &node->src[0], *b = &node->src[1];
    GT_CHECK_F32(d, op, "dst");
    GT_CHECK_F32(a, op, "src0");
    GT_CHECK_F32(b, op, "src1");
    if (node->n_src != 2) return GT_FAIL(GT_ERR_INVALID, "%s: needs 2 inputs", op);
    if (!gt_is_contiguous(d)) return GT_FAIL(GT_ERR_INVALID, "%s: dst must be contiguous", op);
    int rc = check_bcast(a, d, op, "src0");
    if (!rc) rc = check_bcast(b, d, op, "src1");
    if (rc) return rc;
    const int64_t ncols = gt_ncols(d), nrows = gt_nrows(d);
    const int64_t sa = inner_stride(a), sb = inner_stride(b);
    float *dd = d->data;
    const float *ad = a->data, *bd = b->data;
    int64_t lo, hi;
    /* Fast path for short rows: one operand is the full contiguous tensor, the
     * other a row vector broadcast over every leading dim (a bias). The row is
     * tiled on the stack so each call covers many rows at once. */
    if (ncols <= ROW_TILE / 4 && nrows > 1) {
        const int a_full = same_layout(a, d), b_full = same_layout(b, d);
        const int a_row = is_row_vector(a, ncols), b_row = is_row_vector(b, ncols);
        if ((a_full && b_row) || (a_row && b_full)) {
            float tile[ROW_TILE];
            const float *row = a_full ? bd : ad;
            const int64_t reps = ROW_TILE / ncols;
            for (int64_t r = 0; r < reps; r++) memcpy(tile + r * ncols, row, (size_t)ncols * sizeof(float));
            gt_split((nrows + reps - 1) / reps, ctx, &lo, &hi);
            for (int64_t blk = lo; blk < hi; blk++) {
                const int64_t r0 = blk * reps, nr = r0 + reps <= nrows ? reps : nrows - r0;
                const int64_t off = r0 * ncols, n = nr * ncols;
                if (a_full) fn(dd + off, ad + off, 1, tile, 1, n);
                else fn(dd + off, tile, 1, bd + off, 1, n);
            }
            return GT_OK;
        }
    }
    gt_split(nrows, ctx, &lo, &hi);
    for (int64_t r = lo; r < hi; r++) {
        fn(dd + r * ncols, ad + gt_row_offset_bcast(a, d, r), sa, bd + gt_row_offset_bcast(b, d, r),
           sb, ncols);
    }
    return GT_OK;
}

int gt_add_fwd_f32(const gt_node *node, const gt_ctx *ctx) { return binary(node, ctx, add_row, "add"); }
int gt_sub_fwd_f32(const gt_node *node, const gt_ctx *ctx) { return binary(node, ctx, sub_row, "sub"); }
int gt_mul_fwd_f32(const gt_node *node, const gt_ctx *ctx) { return binary(node, ctx, mul_row, "mul"); }
int gt_div_fwd_f32(const gt_node *node, const gt_ctx *ctx) { return binary(node, ctx, div_row, "div"); }

/* ---- unary: dst (contiguous) = f(src), src any strides, same shape ---------- */

typedef void (*unary_row_fn)(float *, const float *, int64_t, float, int64_t);

#define UNARY_ROW(name, EXPR)                                                            \
    GT_CLONES static void name##_row(float *d, const float *a, int64_t sa, float p,       \
                                     int64_t n) {                                         \
        (void)p;                                                                          \
        if (sa == 1) {                                                                    \
            for (int64_t i = 0; i < n; i++) { const float x = a[i]; d[i] = (EXPR); }      \
        } else {                                                                          \
            for (int64_t i = 0; i < n; i++) { const float x = a[i * sa]; d[i] = (EXPR); } \
        }                                                                                 \
    }

UNARY_ROW(scale, x * p)
UNARY_ROW(relu, x > 0.0f ? x : 0.0f)
UNARY_ROW(silu, x / (1.0f + gt_expf_(-x)))
UNARY_ROW(exp, expf(x))
UNARY_ROW(log, logf(x))
UNARY_ROW(sqrt, sqrtf(x))
UNARY_ROW(sqr, x * x)
UNARY_ROW(tanh, tanhf(x))
/* softplus(x) = log(1 + e^x) without overflow: x + log1p(e^-x) for x > 0. */
UNARY_ROW(softplus, x > 0.0f ? x + log1pf(expf(-x)) : log1pf(expf(x)))
/* log1mexp(x) = log(1 - e^x) for x < 0 (-inf at 0, NaN above): log(-expm1(x)) near 0,
 * where 1 - e^x cancels, log1p(-e^x) below -log 2 (Maechler's split). */
UNARY_ROW(log1mexp, x > -0.693147180559945f ? logf(-expm1f(x)) : log1pf(-expf(x)))

static int check_same_shape(const gt_tensor *a, const gt_tensor *b, const char *op) {
    if (a->ndim != b->ndim) goto bad;
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] != b->shape[i]) goto bad;
    return GT_OK;
bad:
    return GT_FAIL(GT_ERR_SHAPE, "%s: input and output shapes differ", op);
}

static int unary(const gt_node *node, const gt_ctx *ctx, unary_row_fn fn, const char *op) {
    const gt_tensor *d = &node->dst, *a = &node->src[0];
    GT_CHECK_F32(d, op, "dst");
    GT_CHECK_F32(a, op, "src0");
    if (!gt_is_contiguous(d)) return GT_FAIL(GT_ERR_INVALID, "%s: dst must be contiguous", op);
    int rc = check_same_shape(a, d, op);
    if (rc) return rc;
    const int64_t ncols = gt_ncols(d), nrows = gt_nrows(d);
    const int64_t sa = a->ndim ? a->strides[a->ndim - 1] : 1;
    float *dd = d->data;
    const float *ad = a->data;
    if (gt_is_contiguous(a)) {
        /* one flat range: better thread balance for few long rows */
        int64_t lo, hi, n = nrows * ncols;
        gt_split(n, ctx, &lo, &hi);
        if (hi > lo) fn(dd + lo, ad + lo, 1, node->fp[0], hi - lo);
        return GT_OK;
    }
    int64_t lo, hi;
    gt_split(nrows, ctx, &lo, &hi);
    for (int64_t r = lo; r < hi; r++) fn(dd + r * ncols, ad + gt_row_offset(a, r), sa, node->fp[0], ncols);
    return GT_OK;
}

int gt_scale_fwd_f32(const gt_node *n, const gt_ctx *c) { return unary(n, c, scale_row, "scale"); }
int gt_relu_fwd_f32(const gt_node *n, const gt_ctx *c) { return unary(n, c, relu_row, "relu"); }
int gt_silu_fwd_f32(const gt_node *n, const gt_ctx *c) { return unary(n, c, silu_row, "silu"); }
int gt_exp_fwd_f32(const gt_node *n, const gt_ctx *c) { return unary(n, c, exp_row, "exp"); }
int gt_log_fwd_f32(const gt_node *n, const gt_ctx *c) { return unary(n, c, log_row, "log"); }
int gt_sqrt_fwd_f32(const gt_node *n, const gt_ctx *c) { return unary(n, c, sqrt_row, "sqrt"); }
int gt_sqr_fwd_f32(const gt_node *n, const gt_ctx *c) { return unary(n, c, sqr_row, "sqr"); }
int gt_tanh_fwd_f32(const gt_node *n, const gt_ctx *c) { return unary(n, c, tanh_row, "tanh"); }
int gt_softplus_fwd_f32(const gt_node *n, const gt_ctx *c) { return unary(n, c, softplus_row, "softplus"); }
int gt_log1mexp_fwd_f32(const gt_node *n, const gt_ctx *c) { return unary(n, c, log1mexp_row, "log1mexp"); }

/* fill: every element of dst (contiguous) = fp[0]. */
int gt_fill_fwd_f32(const gt_node *node, const gt_ctx *ctx) {
    const gt_tensor *d = &node->dst;
    GT_CHECK_F32(d, "fill", "dst");
    if (!gt_is_contiguous(d)) return GT_FAIL(GT_ERR_INVALID, "fill: dst must be contiguous");
    int64_t lo, hi;
    gt_split(gt_numel(d), ctx, &lo, &hi);
    float *dd = d->data;
    const float v = node->fp[0];
    for (int64_t i = lo; i < hi; i++) dd[i] = v;
    return GT_OK;
}

/* ---- fused backward kernels: dst = dx from x (src0) and g (src1), contiguous -- */

GT_CLONES static void relu_bwd_row(float *d, const float *x, const float *g, int64_t n) {
    for (int64_t i = 0; i < n; i++) d[i] = x[i] > 0.0f ? g[i] : 0.0f;
}

GT_CLONES static void silu_bwd_row(float *d, const float *x, const float *g, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float s = 1.0f / (1.0f + gt_expf_(-x[i]));
        d[i] = g[i] * s * (1.0f + x[i] * (1.0f - s));
    }
}

static int unary_bwd(const gt_node *node, const gt_ctx *ctx,
                     void (*fn)(float *, const float *, const float *, int64_t), const char *op) {
    const gt_tensor *d = &node->dst, *x = &node->src[0], *g = &node->src[1];
    GT_CHECK_F32(d, op, "dst");
    GT_CHECK_F32(x, op, "x");
    GT_CHECK_F32(g, op, "g");
    int rc = check_same_shape(x, d, op);
    if (!rc) rc = check_same_shape(g, d, op);
    if (rc) return rc;
    if (!gt_is_contiguous(d) || !gt_is_contiguous(x) || !gt_is_contiguous(g))
        return GT_FAIL(GT_ERR_INVALID, "%s: tensors must be contiguous", op);
    int64_t lo, hi;
    gt_split(gt_numel(d), ctx, &lo, &hi);
    if (hi > lo) fn((float *)d->data + lo, (const float *)x->data + lo, (const float *)g->data + lo, hi - lo);
    return GT_OK;
}

int gt_relu_bwd_f32(const gt_node *n, const gt_ctx *c) { return unary_bwd(n, c, relu_bwd_row, "relu_bwd"); }
int gt_silu_bwd_f32(const gt_node *n, const gt_ctx *c) { return unary_bwd(n, c, silu_bwd_row, "silu_bwd"); }

/* ---- swiglu: silu(g) * u (the llama FFN's gate), and its backward -------------------- */

/* The expressions (and so the bits) of silu then mul, and of their backward rules (mul's
 * g * b and g * a, silu_bwd's), in one pass: no silu(g) tensor in memory. */
GT_CLONES static void swiglu_row(float *restrict d, const float *restrict g, const float *restrict u, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float x = g[i];
        d[i] = x / (1.0f + gt_expf_(-x)) * u[i];
    }
}

GT_CLONES static void swiglu_bwd_row(float *restrict dg, float *restrict du, const float *restrict g,
                                     const float *restrict u, const float *restrict dy, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float x = g[i], e = gt_expf_(-x);
        const float s = 1.0f / (1.0f + e), gs = dy[i] * u[i];
        du[i] = dy[i] * (x / (1.0f + e));
        dg[i] = gs * s * (1.0f + x * (1.0f - s));
    }
}

static int glu_check(const gt_node *node, int n_src, const char *op) {
    GT_TRY(gt_check_n_src(node, n_src, op));
    const gt_tensor *d = &node->dst;
    GT_CHECK_F32(d, op, "dst");
    static const char *names[] = {"g", "u", "dy"};
    for (int i = 0; i < n_src; i++) {
        const gt_tensor *t = &node->src[i];
        GT_CHECK_F32(t, op, names[i]);
        GT_TRY(check_same_shape(&node->src[0], t, op));
        GT_TRY(gt_check_contig(t, op, names[i]));
    }
    GT_TRY(gt_check_contig(d, op, "dst"));
    const int64_t want = (n_src == 2 ? 1 : 2) * gt_numel(&node->src[0]);
    if (gt_numel(d) != want) {
        char a[128];
        return GT_FAIL(GT_ERR_SHAPE, "%s: expected dst of %lld elements, got %s", op, (long long)want,
                       gt_shape_str(d, a, sizeof a));
    }
    return GT_OK;
}

/* ---- geglu: gelu_tanh(g) * u (Gemma's FFN gate), and its backward ----------------------
 * gelu_tanh(x) = x / 2 (1 + tanh(z)), z = sqrt(2/pi) (x + 0.044715 x^3), the approximation
 * Gemma was trained with; its derivative is (1 + t) / 2 + x / 2 (1 - t^2) dz/dx with
 * t = tanh(z), dz/dx = sqrt(2/pi) (1 + 3 * 0.044715 x^2). tanh through the shared exp:
 * 1 - 2 / (exp(2z) + 1), exact at both ends (exp overflowing to inf gives 1). */

GT_CLONES static void geglu_row(float *restrict d, const float *restrict g, const float *restrict u, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float x = g[i];
        d[i] = 0.5f * x * (1.0f + gt_gelu_tanh_t_(x)) * u[i];
    }
}

/* llama.cpp's CPU geglu (GGML_GELU_FP16): a table of the f16 rounding of gelu at every f16
 * value, indexed by x rounded to f16, for -10 < x < 10; 0 below, x above. The gelu here is
 * ggml's own expression with libm's tanhf, 1 + 0.044715 x x fused as its build compiles it
 * (fma(0.044715 x, x, 1)): the f16 rounding after it hides the last bits but not always
 * (x = -1.9988 rounds apart). Filled once (256 KiB), on first use. Inference with
 * llama.cpp's numbers only. */
static float gelu_f16_table[65536];
static pthread_once_t gelu_f16_once = PTHREAD_ONCE_INIT;

static void gelu_f16_fill(void) {
    for (uint32_t h = 0; h < 65536; h++) {
        const float f = gt_f16_to_f32_1((uint16_t)h);
        const float gelu = 0.5f * f * (1.0f + tanhf(GT_GELU_K * f * fmaf(GT_GELU_A * f, f, 1.0f)));
        gelu_f16_table[h] = gt_f16_to_f32_1(gt_f32_to_f16_1(gelu));
    }
}

static void geglu_f16_row(float *restrict d, const float *restrict g, const float *restrict u, int64_t n) {
    pthread_once(&gelu_f16_once, gelu_f16_fill);
    for (int64_t i = 0; i < n; i++) {
        const float x = g[i];
        d[i] = x <= -10.0f ? 0.0f : x >= 10.0f ? x * u[i] : gelu_f16_table[gt_f32_to_f16_1(x)] * u[i];
    }
}

GT_CLONES static void geglu_bwd_row(float *restrict dg, float *restrict du, const float *restrict g,
                                    const float *restrict u, const float *restrict dy, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float x = g[i], t = gt_gelu_tanh_t_(x);
        const float dz = GT_GELU_K * (1.0f + 3.0f * GT_GELU_A * x * x);
        du[i] = dy[i] * (0.5f * x * (1.0f + t));
        dg[i] = dy[i] * u[i] * (0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * dz);
    }
}

typedef void (*glu_row_fn)(float *restrict, const float *restrict, const float *restrict, int64_t);
typedef void (*glu_bwd_row_fn)(float *restrict, float *restrict, const float *restrict, const float *restrict,
                               const float *restrict, int64_t);

/* A gated unit's forward: dst = act(src0) * src1, all of one shape, contiguous. */
static int glu_fwd(const gt_node *node, const gt_ctx *ctx, glu_row_fn fn, const char *op) {
    GT_TRY(glu_check(node, 2, op));
    int64_t lo, hi;
    gt_split(gt_numel(&node->dst), ctx, &lo, &hi);
    if (hi > lo)
        fn((float *)node->dst.data + lo, (const float *)node->src[0].data + lo,
           (const float *)node->src[1].data + lo, hi - lo);
    return GT_OK;
}

/* Its backward: src0 = g, src1 = u, src2 = dy (one shape, contiguous); dst (contiguous,
 * twice their size) = [dg | du]. */
static int glu_bwd(const gt_node *node, const gt_ctx *ctx, glu_bwd_row_fn fn, const char *op) {
    GT_TRY(glu_check(node, 3, op));
    const int64_t n = gt_numel(&node->src[0]);
    int64_t lo, hi;
    gt_split(n, ctx, &lo, &hi);
    float *dg = node->dst.data;
    if (hi > lo)
        fn(dg + lo, dg + n + lo, (const float *)node->src[0].data + lo, (const float *)node->src[1].data + lo,
           (const float *)node->src[2].data + lo, hi - lo);
    return GT_OK;
}

int gt_swiglu_fwd_f32(const gt_node *n, const gt_ctx *c) { return glu_fwd(n, c, swiglu_row, "swiglu"); }

/* ---- swiglu_oai: gpt-oss's clamped gate, as ggml_swiglu_oai ----------------------------------
 * x = min(g, limit), y = clamp(u, -limit, limit): x sigmoid(alpha x) (y + 1). The backward
 * passes no gradient through a clamped side (g > limit; |u| > limit), and
 * d/dx x s(alpha x) = s + alpha x s (1 - s). fp[0] = alpha, fp[1] = limit. */
static int swiglu_oai(const gt_node *node, const gt_ctx *ctx, int bwd) {
    const char *op = bwd ? "swiglu_oai_bwd" : "swiglu_oai";
    GT_TRY(glu_check(node, bwd ? 3 : 2, op));
    const float alpha = node->fp[0], limit = node->fp[1];
    const int64_t n = gt_numel(&node->src[0]);
    const float *g = node->src[0].data, *u = node->src[1].data;
    const float *dy = bwd ? (const float *)node->src[2].data : NULL;
    float *d = node->dst.data;
    int64_t lo, hi;
    gt_split(n, ctx, &lo, &hi);
    for (int64_t i = lo; i < hi; i++) {
        const float x = g[i] < limit ? g[i] : limit;
        const float y = u[i] < -limit ? -limit : u[i] > limit ? limit : u[i];
        const float s = 1.0f / (1.0f + gt_expf_(-alpha * x)), glu = x * s;
        if (!bwd) {
            d[i] = glu * (y + 1.0f);
            continue;
        }
        d[i] = g[i] < limit ? dy[i] * (y + 1.0f) * (s + alpha * glu * (1.0f - s)) : 0.0f;
        d[n + i] = u[i] >= -limit && u[i] <= limit ? dy[i] * glu : 0.0f;
    }
    return GT_OK;
}

int gt_swiglu_oai_fwd_f32(const gt_node *n, const gt_ctx *c) { return swiglu_oai(n, c, 0); }
int gt_swiglu_oai_bwd_f32(const gt_node *n, const gt_ctx *c) { return swiglu_oai(n, c, 1); }
int gt_swiglu_bwd_f32(const gt_node *n, const gt_ctx *c) { return glu_bwd(n, c, swiglu_bwd_row, "swiglu_bwd"); }
int gt_geglu_fwd_f32(const gt_node *n, const gt_ctx *c) { return glu_fwd(n, c, geglu_row, "geglu"); }
int gt_geglu_bwd_f32(const gt_node *n, const gt_ctx *c) { return glu_bwd(n, c, geglu_bwd_row, "geglu_bwd"); }
int gt_geglu_f16_fwd_f32(const gt_node *n, const gt_ctx *c) { return glu_fwd(n, c, geglu_f16_row, "geglu_f16"); }

/* llama.cpp's CPU swiglu (ggml_vec_swiglu_f32, AVX-512 build), row by row: x / (1 + e) * u
 * with e its vector exp of -x, 16 columns at a time; the last C % 16 columns of a row by
 * libm's expf. Inference with llama.cpp's numbers. */
GT_CLONES static void swiglu_ggml_run(float *restrict d, const float *restrict g, const float *restrict u,
                                      int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float x = g[i];
        d[i] = x / (1.0f + gt_ggml_expf_fast_(0.0f - x)) * u[i];
    }
}

int gt_swiglu_ggml_fwd_f32(const gt_node *node, const gt_ctx *ctx) {
    GT_TRY(glu_check(node, 2, "swiglu_ggml"));
    const int64_t nc = gt_ncols(&node->dst), vec = nc - nc % 16;
    const float *g = node->src[0].data, *u = node->src[1].data;
    float *d = node->dst.data;
    int64_t lo, hi;
    gt_split(gt_numel(&node->dst), ctx, &lo, &hi);
    if (hi > lo) swiglu_ggml_run(d + lo, g + lo, u + lo, hi - lo);
    for (int64_t i = lo; i < hi; i++) {     /* the exp's far ends, and each row's tail (libm's expf) */
        const float x = g[i];
        if (i % nc >= vec) d[i] = x / (1.0f + expf(-x)) * u[i];
        else if (!(fabsf(x) < 87.0f)) d[i] = x / (1.0f + gt_ggml_expf_(0.0f - x)) * u[i];
    }
    return GT_OK;
}

/* llama.cpp's CPU swiglu_oai (ggml_compute_forward_swiglu_oai_f32): x = min(g, limit), y =
 * clamp(u, -limit, limit), x / (1 + expf(alpha * -x)) * (y + 1) with libm's expf, element by
 * element; fp[0] = alpha, fp[1] = limit. Inference with llama.cpp's numbers. */
int gt_swiglu_oai_ggml_fwd_f32(const gt_node *node, const gt_ctx *ctx) {
    GT_TRY(glu_check(node, 2, "swiglu_oai_ggml"));
    const float alpha = node->fp[0], limit = node->fp[1];
    const float *g = node->src[0].data, *u = node->src[1].data;
    float *d = node->dst.data;
    int64_t lo, hi;
    gt_split(gt_numel(&node->dst), ctx, &lo, &hi);
    for (int64_t i = lo; i < hi; i++) {
        const float x = limit < g[i] ? limit : g[i];
        const float y = u[i] < -limit ? -limit : limit < u[i] ? limit : u[i];
        d[i] = x / (1.0f + expf(alpha * (-x))) * (y + 1.0f);
    }
    return GT_OK;
}

/* ---- dropout ----------------------------------------------------------------- */

/* d[k] = x[k] * s where hash(index i0 + k) >= thr, else 0. h1 is the hash state
 * after the seed and the salt block, hi the index's high word (constant here).
 * Plain 32-bit integer arithmetic: the clones vectorize it and agree bit for bit. */
GT_CLONES static void dropout_row(float *restrict d, const float *restrict x, uint32_t h1, uint32_t hi,
                                  uint32_t i0, int64_t n, uint32_t thr, float s) {
    for (int64_t k = 0; k < n; k++) {
        d[k] = gt_dropout_hash(h1, i0 + (uint32_t)k, hi) >= thr ? x[k] * s : 0.0f;
    }
}

/* dropout: dst = src0 * keep / (1 - p) with keep[i] = hash(seed, salt, i) >= thr,
 * elementwise over the flat (row-major) index i. src0 x f32 contiguous, src1 seed
 * i32 (one element, set by the host each step), dst contiguous, x's shape.
 * fp[0] = p in [0, 1), ip[0] = salt in [0, 2^32) (distinct per dropout of a graph).
 * hash = MurmurHash3_x86_32 of the 12-byte key (salt, low word of i, high word
 * of i), u32 little-endian words, with murmur's seed = (uint32) seed; thr =
 * floor(p * 2^32) (p as float), so P(keep) = 1 - p to within 2^-32. Kept
 * elements are x * s, s = (float)(1 / (1 - (double)p)) (one float multiply);
 * dropped ones are exactly 0 (also for inf or NaN x). The mask depends only on
 * (seed, salt, p, i): the same for any thread count, in the backward (dropout
 * of g with the same seed, salt and p) and when checkpointing recomputes it. */
int gt_dropout_fwd_f32(const gt_node *node, const gt_ctx *ctx) {
    const char *op = "dropout";
    const gt_tensor *d = &node->dst, *x = &node->src[0], *sd = &node->src[1];
    GT_TRY(gt_check_n_src(node, 2, op));
    GT_CHECK_F32(d, op, "dst");
    GT_CHECK_F32(x, op, "x");
    GT_TRY(gt_check_i32(sd, op, "seed"));
    GT_TRY(gt_check_same_shape(x, d, op, "x", "dst"));
    GT_TRY(gt_check_contig(x, op, "x"));
    GT_TRY(gt_check_contig(d, op, "dst"));
    if (gt_numel(sd) != 1) {
        char a[128];
        return GT_FAIL(GT_ERR_SHAPE, "%s: expected seed of one element, () or (1,), got %s", op,
                       gt_shape_str(sd, a, sizeof a));
    }
    const float p = node->fp[0];
    if (!(p >= 0.0f && p < 1.0f))
        return GT_FAIL(GT_ERR_INVALID, "%s: expected p (fp[0]) in [0, 1), got %g", op, (double)p);
    const int64_t salt = node->ip[0];
    if (salt < 0 || salt > (int64_t)UINT32_MAX)
        return GT_FAIL(GT_ERR_INVALID, "%s: expected salt (ip[0]) in [0, 2^32), got %lld", op, (long long)salt);
    const uint32_t thr = (uint32_t)((double)p * 4294967296.0);
    const float s = (float)(1.0 / (1.0 - (double)p));
    const uint32_t h1 = gt_murmur3_block((uint32_t)*(const int32_t *)sd->data, (uint32_t)salt);
    float *dd = d->data;
    const float *xd = x->data;
    int64_t lo, hi;
    gt_split(gt_numel(d), ctx, &lo, &hi);
    while (lo < hi) {   /* in pieces that keep the index's high word constant */
        const int64_t end = (lo | (int64_t)UINT32_MAX) + 1;
        const int64_t n = (end < hi ? end : hi) - lo;
        dropout_row(dd + lo, xd + lo, h1, (uint32_t)((uint64_t)lo >> 32), (uint32_t)lo, n, thr, s);
        lo += n;
    }
    return GT_OK;
}
