/* checks.h: tensor layout helpers and the argument checks both backends' kernels make
 * (native/cpu and native/cuda), written once so a bad input gets the same words from
 * either (not part of the C API; cffi never reads it). Include after gt_core.h, with
 * GT_FAIL(code, fmt, ...) defined: it records the message in the including library and
 * returns code. The layout helpers run on the host and, built by nvcc, on the device. */
#ifndef GT_CHECKS_H
#define GT_CHECKS_H

#include <math.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>

#include "elementmath.h"     /* GT_HD */

#define GT_MAX_DIMS 6

GT_HD static inline int64_t gt_numel(const gt_tensor *t) {
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
    return n;
}

/* Row-major with no gaps; a tensor of no elements has no layout and counts as contiguous. */
GT_HD static inline int gt_is_contiguous(const gt_tensor *t) {
    if (gt_numel(t) == 0) return 1;
    int64_t s = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        if (t->shape[i] != 1 && t->strides[i] != s) return 0;
        s *= t->shape[i];
    }
    return 1;
}

/* Size of the last dim (1 for a scalar) and the number of rows before it. */
GT_HD static inline int64_t gt_ncols(const gt_tensor *t) {
    return t->ndim ? t->shape[t->ndim - 1] : 1;
}
GT_HD static inline int64_t gt_nrows(const gt_tensor *t) {
    int64_t n = 1;
    for (int i = 0; i + 1 < t->ndim; i++) n *= t->shape[i];
    return n;
}

/* Element offset of the first element of row `row` (row-major order over all dims but the
 * last), using t's strides: works for any strided view. */
GT_HD static inline int64_t gt_row_offset(const gt_tensor *t, int64_t row) {
    int64_t off = 0;
    for (int i = t->ndim - 2; i >= 0; i--) {
        int64_t n = t->shape[i];
        off += (row % n) * t->strides[i];
        row /= n;
    }
    return off;
}

/* "(2, 7, 64)" into buf (a scalar is "()"); returns buf. */
static inline const char *gt_shape_str(const gt_tensor *t, char *buf, size_t n) {
    size_t k = 0;
    k += (size_t)snprintf(buf + k, n - k, "(");
    for (int i = 0; i < t->ndim && i < GT_MAX_DIMS && k < n; i++)
        k += (size_t)snprintf(buf + k, n - k, i ? ", %lld" : "%lld", (long long)t->shape[i]);
    if (t->ndim == 1 && k < n) k += (size_t)snprintf(buf + k, n - k, ",");
    if (k < n) snprintf(buf + k, n - k, ")");
    return buf;
}

static inline int gt_same_shape(const gt_tensor *a, const gt_tensor *b) {
    if (a->ndim != b->ndim) return 0;
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] != b->shape[i]) return 0;
    return 1;
}

/* `what` of `op` must have the shape of `like` (named `like_name`). */
static inline int gt_check_same_shape(const gt_tensor *t, const gt_tensor *like, const char *op,
                                      const char *what, const char *like_name) {
    if (gt_same_shape(t, like)) return GT_OK;
    char a[128], b[128];
    return GT_FAIL(GT_ERR_SHAPE, "%s: expected %s of shape %s (like %s), got %s", op, what,
                   gt_shape_str(like, b, sizeof b), like_name, gt_shape_str(t, a, sizeof a));
}

static inline int gt_check_contig(const gt_tensor *t, const char *op, const char *what) {
    if (gt_is_contiguous(t)) return GT_OK;
    char a[128];
    return GT_FAIL(GT_ERR_INVALID, "%s: expected %s contiguous, got strides of a view of shape %s",
                   op, what, gt_shape_str(t, a, sizeof a));
}

static inline int gt_check_i32(const gt_tensor *t, const char *op, const char *what) {
    if (!t->data && gt_numel(t) > 0) return GT_FAIL(GT_ERR_INVALID, "%s: %s has no data pointer", op, what);
    if (t->dtype != GT_I32) return GT_FAIL(GT_ERR_DTYPE, "%s: expected %s i32, got dtype %d", op, what, t->dtype);
    if (t->ndim < 0 || t->ndim > GT_MAX_DIMS)
        return GT_FAIL(GT_ERR_SHAPE, "%s: %s has %d dims (max %d)", op, what, t->ndim, GT_MAX_DIMS);
    return GT_OK;
}

static inline int gt_check_f32_(const gt_tensor *t, const char *op, const char *what) {
    if (t->ndim < 0 || t->ndim > GT_MAX_DIMS)
        return GT_FAIL(GT_ERR_SHAPE, "%s: %s has %d dims (max %d)", op, what, t->ndim, GT_MAX_DIMS);
    if (!t->data && gt_numel(t) > 0) return GT_FAIL(GT_ERR_INVALID, "%s: %s has no data pointer", op, what);
    if (t->dtype != GT_F32) return GT_FAIL(GT_ERR_DTYPE, "%s: %s must be f32 (dtype %d)", op, what, t->dtype);
    return GT_OK;
}
#define GT_CHECK_F32(t, op, what) do { int rc_ = gt_check_f32_((t), (op), (what)); if (rc_) return rc_; } while (0)
/* Propagate a failure: `GT_TRY(check(...));` */
#define GT_TRY(expr) do { int rc_ = (expr); if (rc_) return rc_; } while (0)

static inline int gt_check_n_src(const gt_node *node, int n, const char *op) {
    if (node->n_src < n)
        return GT_FAIL(GT_ERR_INVALID, "%s: expected %d inputs, got %d", op, n, node->n_src);
    return GT_OK;
}

/* The types a frozen weight may be stored in besides f32 (the dtype table's DEQUANTIZE
 * types): X(name, id) for each, to define one kernel per type on each backend. */
#define GT_WEIGHT_TYPES(X)                                                                    \
    X(f16, GT_F16) X(bf16, GT_BF16) X(q4_0, GT_Q4_0) X(q4_1, GT_Q4_1) X(q5_0, GT_Q5_0)         \
    X(q5_1, GT_Q5_1) X(q8_0, GT_Q8_0) X(q2_k, GT_Q2_K) X(q3_k, GT_Q3_K) X(q4_k, GT_Q4_K)      \
    X(q5_k, GT_Q5_K) X(q6_k, GT_Q6_K) X(mxfp4, GT_MXFP4)

/* The weight types whose products with activations quantized to 8 bits (llama.cpp's
 * numerics, generation and evaluation) have a CPU kernel, matmul_q8_fwd_f32_<name>. */
#define GT_ACT8_TYPES(X)                                                                      \
    X(q4_0, GT_Q4_0) X(q4_1, GT_Q4_1) X(q5_0, GT_Q5_0) X(q5_1, GT_Q5_1) X(q8_0, GT_Q8_0) X(q4_k, GT_Q4_K) \
    X(q5_k, GT_Q5_K) X(q6_k, GT_Q6_K) X(mxfp4, GT_MXFP4)

/* A dtype's name in messages: f32, i32 or one of GT_WEIGHT_TYPES. */
static inline const char *gt_type_name(int32_t dtype) {
#define GT_TYPE_NAME_(name, id) if (dtype == id) return #name;
    GT_WEIGHT_TYPES(GT_TYPE_NAME_)
#undef GT_TYPE_NAME_
    return dtype == GT_F32 ? "f32" : dtype == GT_I32 ? "i32" : "an unknown dtype";
}

/* src1 of a matmul over a stored weight W (R, C) of type wtype (blocks of `block`
 * elements), whole, as the view W^T (shape (C, R), strides (1, C)) or W (shape (R, C),
 * strides (C, 1)); *trans: the view is W^T. op names the kernel in messages; data 0: sizing,
 * before memory exists. */
static inline int gt_weight_view_check(const gt_tensor *b, int32_t wtype, int block, const char *op, int data,
                                       int *trans) {
    const char *tn = gt_type_name(wtype);
    if (b->dtype != wtype)
        return GT_FAIL(GT_ERR_DTYPE, "%s: expected src1 (the weight) of dtype %s, got %s", op, tn,
                       gt_type_name(b->dtype));
    if (data && !b->data) return GT_FAIL(GT_ERR_INVALID, "%s: src1 has no data pointer", op);
    if (b->ndim != 2)
        return GT_FAIL(GT_ERR_INVALID, "%s: a %s src1 must be a 2-D stored weight or its transpose, got %d dims", op,
                       tn, b->ndim);
    const int64_t K = b->shape[0], N = b->shape[1], s0 = b->strides[0], s1 = b->strides[1];
    /* a stride of a size-1 dim is never stepped; where both views fit (N == 1 or K == 1 with
     * f16/bf16: the same bytes either way) take W itself */
    const int plain = (N == 1 || s1 == 1) && (K == 1 || s0 == N) && N % block == 0;
    *trans = !plain && (K == 1 || s0 == 1) && (N == 1 || s1 == K) && K % block == 0;
    if (*trans || plain) return GT_OK;
    if ((K == 1 || s0 == 1) && (N == 1 || s1 == K))
        return GT_FAIL(GT_ERR_SHAPE, "%s: a transposed %s src1 (K, N) = (%lld, %lld) needs K, the stored rows' "
                       "length, to be a multiple of its %d-element blocks", op, tn, (long long)K, (long long)N,
                       block);
    if ((N == 1 || s1 == 1) && (K == 1 || s0 == N))
        return GT_FAIL(GT_ERR_SHAPE, "%s: a %s src1 (K, N) = (%lld, %lld) needs N, the stored rows' length, to be "
                       "a multiple of its %d-element blocks", op, tn, (long long)K, (long long)N, block);
    return GT_FAIL(GT_ERR_INVALID, "%s: a %s src1 must be a whole stored matrix W (R, C) with strides (C, 1) or "
                   "its transpose with strides (1, C); got shape (%lld, %lld) strides (%lld, %lld)", op, tn,
                   (long long)K, (long long)N, (long long)s0, (long long)s1);
}

/* ---- whole checks of one op's node, made by both backends' kernels ------------------------- */

/* max_pool2d (bwd 0: src x, dst pooled) and its backward (bwd 1: src x, g pooled, dst x's
 * shape): f32, x (N, H, W, C), window ip[0] = k >= 1, pooled (N, H/k, W/k, C), contiguous. */
static inline int gt_max_pool2d_check(const gt_node *node, int bwd, const char *op, int64_t *k) {
    const gt_tensor *d = &node->dst, *x = &node->src[0], *pooled = bwd ? &node->src[1] : &node->dst;
    char a[128], b[128];
    GT_TRY(gt_check_n_src(node, bwd ? 2 : 1, op));
    GT_CHECK_F32(d, op, "dst");
    GT_CHECK_F32(x, op, "x");
    if (bwd) GT_CHECK_F32(pooled, op, "g");
    *k = node->ip[0];
    if (*k < 1) return GT_FAIL(GT_ERR_INVALID, "%s: expected window ip[0] >= 1, got %lld", op, (long long)*k);
    if (x->ndim != 4)
        return GT_FAIL(GT_ERR_SHAPE, "%s: expected x (N, H, W, C), got %s", op, gt_shape_str(x, a, sizeof a));
    if (bwd) GT_TRY(gt_check_same_shape(d, x, op, "dst", "x"));
    const int64_t N = x->shape[0], OH = x->shape[1] / *k, OW = x->shape[2] / *k, C = x->shape[3];
    const gt_tensor *t = pooled;
    if (!(t->ndim == 4 && t->shape[0] == N && t->shape[1] == OH && t->shape[2] == OW && t->shape[3] == C))
        return GT_FAIL(GT_ERR_SHAPE,
                       "%s: expected %s (N, H/k, W/k, C) = (%lld, %lld, %lld, %lld) for x %s and k %lld, got %s", op,
                       bwd ? "g" : "dst", (long long)N, (long long)OH, (long long)OW, (long long)C,
                       gt_shape_str(x, a, sizeof a), (long long)*k, gt_shape_str(t, b, sizeof b));
    GT_TRY(gt_check_contig(x, op, "x"));
    if (bwd) GT_TRY(gt_check_contig(pooled, op, "g"));
    GT_TRY(gt_check_contig(d, op, "dst"));
    return GT_OK;
}

/* softmax: src (..., T_q, T_k) f32 and dst of its shape, contiguous; mask ip[0]: 0 none,
 * 1 causal (src of 2+ dims), 2 by position (src1 pos: T_q i32), 3 by segment (src of 3+
 * dims (B, ..., T, T), src1 seg (B, T) i32, contiguous). */
static inline int gt_softmax_check(const gt_node *node, const char *op) {
    const gt_tensor *d = &node->dst, *x = &node->src[0];
    char a[128], b[128];
    GT_TRY(gt_check_n_src(node, 1, op));
    GT_CHECK_F32(d, op, "dst");
    GT_CHECK_F32(x, op, "src");
    GT_TRY(gt_check_same_shape(x, d, op, "src", "dst"));
    GT_TRY(gt_check_contig(x, op, "src"));
    GT_TRY(gt_check_contig(d, op, "dst"));
    const int64_t mask = node->ip[0];
    if (mask < 0 || mask > 3)
        return GT_FAIL(GT_ERR_INVALID, "%s: expected mask ip[0] 0, 1, 2 or 3, got %lld", op, (long long)mask);
    if (x->ndim < (mask == 3 ? 3 : mask ? 2 : 1))
        return GT_FAIL(GT_ERR_SHAPE, "%s: expected src (..., T_q, T_k)%s, got %s", op,
                       mask == 3 ? " with 3+ dims (B, ..., T_q, T_k) for the segment mask"
                       : mask ? " with 2+ dims for the mask" : "", gt_shape_str(x, a, sizeof a));
    const int64_t tk = gt_ncols(x), tq = mask ? x->shape[x->ndim - 2] : 1;
    if (mask == 2) {
        const gt_tensor *p = &node->src[1];
        GT_TRY(gt_check_n_src(node, 2, op));
        GT_TRY(gt_check_i32(p, op, "pos"));
        GT_TRY(gt_check_contig(p, op, "pos"));
        if (gt_numel(p) != tq)
            return GT_FAIL(GT_ERR_SHAPE, "%s: expected pos of T_q = %lld positions for src %s, got %s", op,
                           (long long)tq, gt_shape_str(x, a, sizeof a), gt_shape_str(p, b, sizeof b));
    }
    if (mask == 3) {
        const gt_tensor *sg = &node->src[1];
        GT_TRY(gt_check_n_src(node, 2, op));
        GT_TRY(gt_check_i32(sg, op, "seg"));
        if (tq != tk)
            return GT_FAIL(GT_ERR_SHAPE, "%s: the segment mask needs T_q == T_k, got src %s", op,
                           gt_shape_str(x, a, sizeof a));
        if (sg->ndim != 2 || sg->shape[0] != x->shape[0] || sg->shape[1] != tk)
            return GT_FAIL(GT_ERR_SHAPE, "%s: expected seg (%lld, %lld) (B, T_k) for src %s, got %s", op,
                           (long long)x->shape[0], (long long)tk, gt_shape_str(x, a, sizeof a),
                           gt_shape_str(sg, b, sizeof b));
        GT_TRY(gt_check_contig(sg, op, "seg"));
    }
    return GT_OK;
}

/* cross_entropy and its backward (n_src 2 or 3): logits (N, V) f32 contiguous, targets (N,)
 * i32 (their values, < V, are checked where they are read), row count ip[0] >= 0. */
static inline int gt_cross_entropy_check(const gt_node *node, const char *op, int n_src) {
    const gt_tensor *x = &node->src[0], *t = &node->src[1];
    char a[128], b[128];
    GT_TRY(gt_check_n_src(node, n_src, op));
    GT_CHECK_F32(&node->dst, op, "dst");
    GT_CHECK_F32(x, op, "logits");
    GT_TRY(gt_check_i32(t, op, "targets"));
    if (x->ndim != 2)
        return GT_FAIL(GT_ERR_SHAPE, "%s: expected logits (N, V), got %s", op, gt_shape_str(x, a, sizeof a));
    if (t->ndim != 1 || t->shape[0] != x->shape[0])
        return GT_FAIL(GT_ERR_SHAPE, "%s: expected targets (%lld,) for logits %s, got %s", op,
                       (long long)x->shape[0], gt_shape_str(x, a, sizeof a), gt_shape_str(t, b, sizeof b));
    GT_TRY(gt_check_contig(x, op, "logits"));
    if (node->ip[0] < 0)
        return GT_FAIL(GT_ERR_INVALID, "%s: expected row count ip[0] >= 0, got %lld", op, (long long)node->ip[0]);
    return GT_OK;
}

/* cross_entropy: dst one element and scratch of N floats (the row losses), or with ip[1] = 1
 * (the rows' losses) dst (N,) contiguous and no scratch. */
static inline int gt_cross_entropy_fwd_check(const gt_node *node, const char *op) {
    GT_TRY(gt_cross_entropy_check(node, op, 2));
    const gt_tensor *d = &node->dst;
    const int64_t nrows = node->src[0].shape[0];
    char a[128];
    if (!node->ip[1] && gt_numel(d) != 1)
        return GT_FAIL(GT_ERR_SHAPE, "%s: expected dst of one element, got %s", op, gt_shape_str(d, a, sizeof a));
    if (node->ip[1] && (gt_numel(d) != nrows || !gt_is_contiguous(d)))
        return GT_FAIL(GT_ERR_SHAPE, "%s: expected contiguous dst (%lld,) of per-row losses, got %s", op,
                       (long long)nrows, gt_shape_str(d, a, sizeof a));
    if (!node->ip[1] && nrows > 0 && (!node->scratch || node->scratch_size < nrows * (int64_t)sizeof(float)))
        return GT_FAIL(GT_ERR_INVALID, "%s: expected scratch of %lld bytes (4 * N), got %lld", op,
                       (long long)(nrows * (int64_t)sizeof(float)), (long long)node->scratch_size);
    return GT_OK;
}

/* cross_entropy_bwd: src2 g of one element (N with ip[1] = 1), dst (N, V) contiguous. */
static inline int gt_cross_entropy_bwd_check(const gt_node *node, const char *op) {
    GT_TRY(gt_cross_entropy_check(node, op, 3));
    const gt_tensor *d = &node->dst, *x = &node->src[0], *g = &node->src[2];
    const int64_t nrows = x->shape[0];
    char a[128];
    GT_CHECK_F32(g, op, "g");
    if (node->ip[1] ? g->ndim != 1 || g->shape[0] != nrows : gt_numel(g) != 1)
        return GT_FAIL(GT_ERR_SHAPE, "%s: expected g of %lld element(s), got %s", op,
                       (long long)(node->ip[1] ? nrows : 1), gt_shape_str(g, a, sizeof a));
    GT_TRY(gt_check_same_shape(d, x, op, "dst", "logits"));
    GT_TRY(gt_check_contig(d, op, "dst"));
    return GT_OK;
}

/* rms_norm (n_src 1: x) and its backward (2: x, g): f32, contiguous, dst x's shape, eps fp[0] >= 0. */
static inline int gt_rms_norm_check(const gt_node *node, const char *op, int n_src) {
    const gt_tensor *d = &node->dst;
    GT_TRY(gt_check_n_src(node, n_src, op));
    GT_CHECK_F32(d, op, "dst");
    GT_TRY(gt_check_contig(d, op, "dst"));
    const char *names[2] = {"x", "g"};
    for (int i = 0; i < n_src; i++) {
        GT_CHECK_F32(&node->src[i], op, names[i]);
        GT_TRY(gt_check_same_shape(&node->src[i], d, op, names[i], "dst"));
        GT_TRY(gt_check_contig(&node->src[i], op, names[i]));
    }
    if (!(node->fp[0] >= 0.0f))
        return GT_FAIL(GT_ERR_INVALID, "%s: expected eps (fp[0]) >= 0, got %g", op, (double)node->fp[0]);
    if (node->ip[0] != 0 && (node->ip[0] != 1 || n_src != 1))
        return GT_FAIL(GT_ERR_INVALID, "%s: expected ip[0] 0 or, forward only, 1 (llama.cpp's sum), got %lld", op,
                       (long long)node->ip[0]);
    return GT_OK;
}

/* rope (bwd 0: src x) and its backward (bwd 1: src g): (..., T, H, D) f32 contiguous, dst
 * its shape; src1 positions i32, (T,) shared by every row or x's leading dims (..., T)
 * contiguous (*per_row_out 1); optional src2 factors (n_dims / 2,) f32; ip n_dims (even,
 * 2..D), mode 0 or 2, llama.cpp's numbers 0 or (forward) 1; fp freq_base, freq_scale,
 * attn_factor > 0 and finite. */
static inline int gt_rope_check(const gt_node *node, const char *op, int bwd, int *per_row_out) {
    const gt_tensor *d = &node->dst, *x = &node->src[0], *p = &node->src[1];
    const char *xname = bwd ? "g" : "x";
    char a[128];
    if (node->n_src != 2 && node->n_src != 3)
        return GT_FAIL(GT_ERR_INVALID, "%s: expected 2 or 3 sources (x, positions[, factors]), got %d", op,
                       (int)node->n_src);
    const gt_tensor *ff = node->n_src == 3 ? &node->src[2] : NULL;
    GT_CHECK_F32(d, op, "dst");
    GT_CHECK_F32(x, op, xname);
    GT_TRY(gt_check_i32(p, op, "positions"));
    if (x->ndim < 3)
        return GT_FAIL(GT_ERR_SHAPE, "%s: expected %s (..., T, H, D), got %s", op, xname, gt_shape_str(x, a, sizeof a));
    GT_TRY(gt_check_same_shape(x, d, op, xname, "dst"));
    GT_TRY(gt_check_contig(x, op, xname));
    GT_TRY(gt_check_contig(d, op, "dst"));
    const int64_t D = x->shape[x->ndim - 1], T = x->shape[x->ndim - 3];
    /* positions (T,) shared by every row, or one per row: x's leading dims (..., T) */
    int per_row = p->ndim == x->ndim - 2 && p->ndim > 1;
    for (int i = 0; per_row && i < p->ndim; i++) per_row = p->shape[i] == x->shape[i];
    *per_row_out = per_row;
    if (!per_row && (p->ndim != 1 || p->shape[0] != T)) {
        char b[128], c[128];
        gt_tensor lead = *x;
        lead.ndim = x->ndim - 2;
        return GT_FAIL(GT_ERR_SHAPE, "%s: expected positions (%lld,) or %s for %s %s, got %s", op, (long long)T,
                       gt_shape_str(&lead, c, sizeof c), xname, gt_shape_str(x, a, sizeof a),
                       gt_shape_str(p, b, sizeof b));
    }
    if (per_row) GT_TRY(gt_check_contig(p, op, "positions"));
    const int64_t n_dims = node->ip[0];
    if (n_dims < 2 || n_dims % 2 || n_dims > D)
        return GT_FAIL(GT_ERR_INVALID, "%s: expected n_dims (ip[0]) even and in 2..D = %lld, got %lld", op,
                       (long long)D, (long long)n_dims);
    const int64_t mode = node->ip[1];
    if (mode != 0 && mode != 2)
        return GT_FAIL(GT_ERR_INVALID, "%s: expected mode (ip[1]) 0 (normal) or 2 (neox), got %lld", op,
                       (long long)mode);
    if (node->ip[2] != 0 && (node->ip[2] != 1 || bwd))
        return GT_FAIL(GT_ERR_INVALID,
                       "%s: expected ip[2] 0 (exact angles) or, forward only, 1 (llama.cpp's), got %lld", op,
                       (long long)node->ip[2]);
    const float base = node->fp[0], fscale = node->fp[1], mscale = node->fp[2];
    if (!(base > 0.0f) || isinf(base))
        return GT_FAIL(GT_ERR_INVALID, "%s: expected freq_base (fp[0]) > 0 and finite, got %g", op, (double)base);
    if (!(fscale > 0.0f) || isinf(fscale))
        return GT_FAIL(GT_ERR_INVALID, "%s: expected freq_scale (fp[1]) > 0 and finite, got %g", op,
                       (double)fscale);
    if (!(mscale > 0.0f) || isinf(mscale))
        return GT_FAIL(GT_ERR_INVALID, "%s: expected attn_factor (fp[2]) > 0 and finite, got %g", op,
                       (double)mscale);
    if (ff) {
        GT_CHECK_F32(ff, op, "factors");
        if (ff->ndim != 1 || ff->shape[0] != n_dims / 2)
            return GT_FAIL(GT_ERR_SHAPE, "%s: expected factors (%lld,) (n_dims / 2), got %s", op,
                           (long long)(n_dims / 2), gt_shape_str(ff, a, sizeof a));
    }
    return GT_OK;
}

/* conv2d's output (as forward dst, or a backward's `out`): (N, OH, OW, CO) when pool == 1,
 * else (2, N, PH, PW, CO) (PH = OH / pool: values then argmax codes). */
static inline int gt_conv2d_out_check(const gt_tensor *t, int64_t N, int64_t OH, int64_t OW, int64_t CO, int64_t pool,
                                      const char *op, const char *what) {
    const int64_t PH = OH / pool, PW = OW / pool;
    int ok;
    if (pool == 1)
        ok = t->ndim == 4 && t->shape[0] == N && t->shape[1] == OH && t->shape[2] == OW && t->shape[3] == CO;
    else
        ok = t->ndim == 5 && t->shape[0] == 2 && t->shape[1] == N && t->shape[2] == PH && t->shape[3] == PW &&
             t->shape[4] == CO;
    if (ok) return GT_OK;
    char a[128];
    if (pool == 1)
        return GT_FAIL(GT_ERR_SHAPE, "%s: expected %s (N, OH, OW, CO) = (%lld, %lld, %lld, %lld), got %s", op, what,
                       (long long)N, (long long)OH, (long long)OW, (long long)CO, gt_shape_str(t, a, sizeof a));
    return GT_FAIL(GT_ERR_SHAPE, "%s: expected %s (2, N, OH/pool, OW/pool, CO) = (2, %lld, %lld, %lld, %lld), got %s",
                   op, what, (long long)N, (long long)PH, (long long)PW, (long long)CO, gt_shape_str(t, a, sizeof a));
}

/* conv2d's upstream gradient: (N, OH/pool, OW/pool, CO). */
static inline int gt_conv2d_grad_check(const gt_tensor *t, int64_t N, int64_t OH, int64_t OW, int64_t CO,
                                       int64_t pool, const char *op) {
    const int64_t PH = OH / pool, PW = OW / pool;
    if (t->ndim == 4 && t->shape[0] == N && t->shape[1] == PH && t->shape[2] == PW && t->shape[3] == CO)
        return GT_OK;
    char a[128];
    return GT_FAIL(GT_ERR_SHAPE, "%s: expected g (N, OH/pool, OW/pool, CO) = (%lld, %lld, %lld, %lld), got %s", op,
                   (long long)N, (long long)PH, (long long)PW, (long long)CO, gt_shape_str(t, a, sizeof a));
}

/* attention's q, k, v (src 0..2): (B, T, heads, D) with unit stride along D (f32 when
 * data; without, sizing before memory exists, the shapes alone), k (B, T_k, H_kv, D) with
 * H_kv dividing q's heads, v of k's shape. */
static inline int gt_attention_qkv_check(const gt_node *node, const char *op, int data) {
    const gt_tensor *q = &node->src[0], *k = &node->src[1], *v = &node->src[2];
    const char *names[3] = {"q", "k", "v"};
    char a[128], b[128];
    GT_TRY(gt_check_n_src(node, 3, op));
    for (int i = 0; i < 3; i++) {
        const gt_tensor *t = &node->src[i];
        if (data) GT_CHECK_F32(t, op, names[i]);
        if (t->ndim != 4)
            return GT_FAIL(GT_ERR_SHAPE, "%s: expected %s (B, T, heads, D), got %s", op, names[i],
                           gt_shape_str(t, a, sizeof a));
        if (t->shape[3] > 1 && t->strides[3] != 1)
            return GT_FAIL(GT_ERR_INVALID, "%s: expected %s with unit stride along D, got stride %lld", op,
                           names[i], (long long)t->strides[3]);
    }
    if (k->shape[0] != q->shape[0] || k->shape[3] != q->shape[3] || k->shape[2] < 1 ||
        q->shape[2] % k->shape[2] != 0)
        return GT_FAIL(GT_ERR_SHAPE, "%s: expected k (%lld, T_k, H_kv, %lld) with H_kv dividing the %lld heads "
                       "of q %s, got %s", op, (long long)q->shape[0], (long long)q->shape[3],
                       (long long)q->shape[2], gt_shape_str(q, a, sizeof a), gt_shape_str(k, b, sizeof b));
    if (!gt_same_shape(v, k))
        return GT_FAIL(GT_ERR_SHAPE, "%s: expected v of k's shape %s, got %s", op, gt_shape_str(k, a, sizeof a),
                       gt_shape_str(v, b, sizeof b));
    return GT_OK;
}

/* attention's llama.cpp order: ip[2] 1 (with allowed: the CPU forward) computes as llama.cpp's
 * CPU build does, ip[3] 1 then scales q before the dots (else their results), ip[4] 1 rounds
 * as its F16 KV cache does, ip[5] 1 takes a sink logit a head (the input after the mask's) into
 * each softmax as its soft_max does; all 0 otherwise. */
static inline int gt_attention_ggml_check(const gt_node *node, const char *op, int allowed) {
    const int64_t g = node->ip[2], sq = node->ip[3], f16 = node->ip[4], sk = node->ip[5];
    if ((g != 0 && (g != 1 || !allowed)) || (sq != 0 && (sq != 1 || g != 1)) ||
        (f16 != 0 && (f16 != 1 || g != 1)) || (sk != 0 && (sk != 1 || g != 1)))
        return GT_FAIL(GT_ERR_INVALID, "%s: expected ip[2] (llama.cpp's order%s), ip[3] (scale q), ip[4] (an F16 "
                       "cache) and ip[5] (sinks), the last three with the first, 0%s, got %lld, %lld, %lld and %lld",
                       op, allowed ? "" : ": the CPU forward's", allowed ? " or 1" : "", (long long)g, (long long)sq,
                       (long long)f16, (long long)sk);
    return GT_OK;
}

/* attention's mask: ip[0] 0 none, 1 causal, 2 by position (src[im] pos (T_q,) i32), 3 by
 * segment (src[im] seg (B, T) i32, T_q == T_k), 4 by segment and parent (seg, then src[im + 1]
 * parent (B, T) i32: the segment whose keys each row also sees), all contiguous; window
 * ip[1] >= 0 (0: none; only with a mask). After gt_attention_qkv_check. */
static inline int gt_attention_mask_check(const gt_node *node, const char *op, int im) {
    const int64_t mode = node->ip[0], window = node->ip[1];
    const int64_t B = node->src[0].shape[0], Tq = node->src[0].shape[1], Tk = node->src[1].shape[1];
    char a[128], b[128];
    if (mode < 0 || mode > 4)
        return GT_FAIL(GT_ERR_INVALID, "%s: expected mask ip[0] 0, 1, 2, 3 or 4, got %lld", op, (long long)mode);
    if (window < 0 || (window > 0 && mode == 0))
        return GT_FAIL(GT_ERR_INVALID, "%s: expected window ip[1] >= 0 (0: none; only with a mask), got %lld", op,
                       (long long)window);
    if (mode < 2) return GT_OK;
    GT_TRY(gt_check_n_src(node, im + 1, op));
    const gt_tensor *m = &node->src[im];
    const char *what = mode == 2 ? "pos" : "seg";
    GT_TRY(gt_check_i32(m, op, what));
    GT_TRY(gt_check_contig(m, op, what));
    if (mode == 2) {
        if (m->ndim != 1 || m->shape[0] != Tq)
            return GT_FAIL(GT_ERR_SHAPE, "%s: expected pos (%lld,) (T_q), got %s", op, (long long)Tq,
                           gt_shape_str(m, a, sizeof a));
        return GT_OK;
    }
    if (Tq != Tk)
        return GT_FAIL(GT_ERR_SHAPE, "%s: the segment mask needs T_q == T_k, got %lld and %lld", op, (long long)Tq,
                       (long long)Tk);
    for (int i = 0; i < (mode == 4 ? 2 : 1); i++) {
        const char *name = i ? "parent" : "seg";
        if (i) {
            GT_TRY(gt_check_n_src(node, im + 2, op));
            m = &node->src[im + 1];
            GT_TRY(gt_check_i32(m, op, name));
            GT_TRY(gt_check_contig(m, op, name));
        }
        if (m->ndim != 2 || m->shape[0] != B || m->shape[1] != Tk)
            return GT_FAIL(GT_ERR_SHAPE, "%s: expected %s (%lld, %lld) (B, T), got %s for q %s", op, name,
                           (long long)B, (long long)Tk, gt_shape_str(m, a, sizeof a),
                           gt_shape_str(&node->src[0], b, sizeof b));
    }
    return GT_OK;
}

/* causal_conv1d (kind 0: src0 x (B, T, C), src1 w (C, L); dst y (B, T, C)), its input
 * gradient (kind 1: src0 w, src1 g (B, T, C); dst dx (B, T, C)) and its weight gradient
 * (kind 2: src0 x, src1 g; dst dw (C, L)); an optional last src seg (B, T) i32 (packed
 * samples: a window never reaches into another segment). All f32 but seg, all contiguous.
 * Fills B, T, C, L and *seg (NULL without one). */
static inline int gt_causal_conv1d_check(const gt_node *node, int kind, const char *op, int64_t dims[4],
                                         const gt_tensor **seg) {
    const gt_tensor *d = &node->dst, *w = kind == 1 ? &node->src[0] : &node->src[1];
    const gt_tensor *x = kind == 1 ? &node->src[1] : &node->src[0];     /* (B, T, C): x, or g */
    const gt_tensor *g = kind == 0 ? d : &node->src[1];
    char a[128], b[128];
    GT_TRY(gt_check_n_src(node, 2, op));
    if (node->n_src > 3) return GT_FAIL(GT_ERR_INVALID, "%s: expected 2 or 3 inputs, got %d", op, node->n_src);
    GT_CHECK_F32(d, op, "dst");
    GT_CHECK_F32(&node->src[0], op, "src0");
    GT_CHECK_F32(&node->src[1], op, "src1");
    if (kind == 2) w = d;
    if (x->ndim != 3 || w->ndim != 2 || w->shape[0] != x->shape[2] || w->shape[1] < 1)
        return GT_FAIL(GT_ERR_SHAPE, "%s: expected (B, T, C) and a kernel (C, L), got %s and %s", op,
                       gt_shape_str(x, a, sizeof a), gt_shape_str(w, b, sizeof b));
    if (!gt_same_shape(g, x))
        return GT_FAIL(GT_ERR_SHAPE, "%s: expected %s of shape %s, got %s", op, kind == 0 ? "dst" : "g",
                       gt_shape_str(x, a, sizeof a), gt_shape_str(g, b, sizeof b));
    if (kind == 1 && !gt_same_shape(d, x))
        return GT_FAIL(GT_ERR_SHAPE, "%s: expected dst of shape %s, got %s", op, gt_shape_str(x, a, sizeof a),
                       gt_shape_str(d, b, sizeof b));
    for (int i = 0; i < 2; i++) GT_TRY(gt_check_contig(&node->src[i], op, i ? "src1" : "src0"));
    GT_TRY(gt_check_contig(d, op, "dst"));
    dims[0] = x->shape[0], dims[1] = x->shape[1], dims[2] = x->shape[2], dims[3] = w->shape[1];
    *seg = NULL;
    if (node->n_src == 3) {
        const gt_tensor *m = &node->src[2];
        GT_TRY(gt_check_i32(m, op, "seg"));
        GT_TRY(gt_check_contig(m, op, "seg"));
        if (m->ndim != 2 || m->shape[0] != dims[0] || m->shape[1] != dims[1])
            return GT_FAIL(GT_ERR_SHAPE, "%s: expected seg (%lld, %lld) (B, T), got %s", op, (long long)dims[0],
                           (long long)dims[1], gt_shape_str(m, a, sizeof a));
        *seg = m;
    }
    return GT_OK;
}


/* ---- mixture-of-experts routing and the grouped expert product ------------------------------ */

/* moe_topk (kind 0: src0 logits (..., E) f32 [, src1 a selection bias (E,) f32 where ip[1] = 1,
 * sigmoid gating]; dst ids (..., k) i32, k = ip[0] <= E), moe_weights
 * (kind 1: src0 logits, src1 ids (..., k) i32; dst (..., k) f32) and moe_weights_bwd (kind 2:
 * src0 logits, src1 ids, src2 g (..., k) f32; dst (..., E) f32). All contiguous, the leading
 * dims the same. Fills rows (the product of the leading dims), E and k. */
static inline int gt_moe_route_check(const gt_node *node, int kind, const char *op, int64_t *rows, int64_t *E,
                                     int64_t *k) {
    const gt_tensor *d = &node->dst, *z = &node->src[0];
    char a[128], b[128], c[128];
    GT_TRY(gt_check_n_src(node, kind + 1, op));
    GT_CHECK_F32(z, op, "src0");
    if (z->ndim < 1) return GT_FAIL(GT_ERR_SHAPE, "%s: logits need a dim of experts", op);
    *E = z->shape[z->ndim - 1];
    if (kind == 0 && node->n_src > 1) {     /* moe_topk's selection bias (E,), sigmoid gating only */
        const gt_tensor *bias = &node->src[1];
        GT_CHECK_F32(bias, op, "src1 (bias)");
        if (bias->ndim != 1 || bias->shape[0] != *E || !node->ip[1])
            return GT_FAIL(GT_ERR_SHAPE, "%s: a selection bias must be (%lld,) with sigmoid gating, got %s "
                           "(ip[1] = %lld)", op, (long long)*E, gt_shape_str(bias, a, sizeof a),
                           (long long)node->ip[1]);
    }
    const gt_tensor *ids = kind == 0 ? d : &node->src[1];
    GT_TRY(gt_check_i32(ids, op, kind == 0 ? "dst" : "src1 (ids)"));
    if (ids->ndim != z->ndim)
        return GT_FAIL(GT_ERR_SHAPE, "%s: ids %s do not match logits %s", op, gt_shape_str(ids, a, sizeof a),
                       gt_shape_str(z, b, sizeof b));
    *k = ids->shape[ids->ndim - 1];
    *rows = 1;
    for (int i = 0; i < z->ndim - 1; i++) {
        if (ids->shape[i] != z->shape[i])
            return GT_FAIL(GT_ERR_SHAPE, "%s: ids %s do not match logits %s", op, gt_shape_str(ids, a, sizeof a),
                           gt_shape_str(z, b, sizeof b));
        *rows *= z->shape[i];
    }
    if (*k < 1 || *k > *E || (kind == 0 && node->ip[0] != *k))
        return GT_FAIL(GT_ERR_SHAPE, "%s: expected 1 <= k <= %lld experts (k = %lld, ip[0] = %lld)", op,
                       (long long)*E, (long long)*k, (long long)node->ip[0]);
    if (kind >= 1) {
        const gt_tensor *want = kind == 1 ? ids : z, *g = kind == 2 ? &node->src[2] : d;
        GT_CHECK_F32(d, op, "dst");
        if (kind == 2) GT_CHECK_F32(g, op, "src2 (g)");
        if (!gt_same_shape(g, ids) || !gt_same_shape(d, want))
            return GT_FAIL(GT_ERR_SHAPE, "%s: expected dst %s, got %s (g %s)", op, gt_shape_str(want, a, sizeof a),
                           gt_shape_str(d, b, sizeof b), gt_shape_str(g, c, sizeof c));
    }
    for (int i = 0; i < node->n_src; i++) GT_TRY(gt_check_contig(&node->src[i], op, "an input"));
    return gt_check_contig(d, op, "dst");
}

/* moe_matmul, ggml's mul_mat_id (kind 0: src0 x (N, X, K) f32, src1 w (E, M, K) of type wtype
 * (blocks of `block` elements along K), src2 ids (N, k) i32; dst y (N, k, M) f32, y[n, s] =
 * w[ids[n, s]] @ x[n, X == 1 ? 0 : s]), its input gradient (kind 1: src0 w, src1 ids, src2 g
 * (N, k, M); dst dx (N, X, K)) and its weight gradient (kind 2: src0 x, src1 ids, src2 g; dst
 * dw (E, M, K) f32). X is 1 or k. All contiguous. dims: N, X, K, E, M, k. */
static inline int gt_moe_matmul_check(const gt_node *node, int kind, const char *op, int32_t wtype, int block,
                                      int64_t dims[6]) {
    const gt_tensor *d = &node->dst;
    const gt_tensor *w = kind == 0 ? &node->src[1] : kind == 1 ? &node->src[0] : d;
    const gt_tensor *x = kind == 1 ? d : &node->src[0];
    const gt_tensor *ids = kind == 0 ? &node->src[2] : &node->src[1];
    const gt_tensor *y = kind == 0 ? d : &node->src[2];
    char a[128], b[128], c[128];
    GT_TRY(gt_check_n_src(node, 3, op));
    GT_CHECK_F32(x, op, "x");
    GT_CHECK_F32(y, op, kind == 0 ? "dst" : "g");
    if (w->dtype != wtype)
        return GT_FAIL(GT_ERR_DTYPE, "%s: expected the expert weights in %s, got %s", op, gt_type_name(wtype),
                       gt_type_name(w->dtype));
    GT_TRY(gt_check_i32(ids, op, "ids"));
    if (x->ndim != 3 || w->ndim != 3 || ids->ndim != 2 || y->ndim != 3)
        return GT_FAIL(GT_ERR_SHAPE, "%s: expected x (N, X, K), w (E, M, K), ids (N, k), got %s, %s, %s", op,
                       gt_shape_str(x, a, sizeof a), gt_shape_str(w, b, sizeof b), gt_shape_str(ids, c, sizeof c));
    const int64_t N = ids->shape[0], k = ids->shape[1], X = x->shape[1], K = x->shape[2];
    const int64_t E = w->shape[0], M = w->shape[1];
    if (x->shape[0] != N || (X != 1 && X != k) || w->shape[2] != K || y->shape[0] != N || y->shape[1] != k ||
        y->shape[2] != M || k < 1 || k > E || K % block)
        return GT_FAIL(GT_ERR_SHAPE, "%s: x %s, w %s and ids %s do not fit (N, 1 or k, K), (E, M, K), (N, k <= E), "
                       "K a multiple of %d", op, gt_shape_str(x, a, sizeof a), gt_shape_str(w, b, sizeof b),
                       gt_shape_str(ids, c, sizeof c), block);
    for (int i = 0; i < 3; i++) GT_TRY(gt_check_contig(&node->src[i], op, "an input"));
    GT_TRY(gt_check_contig(d, op, "dst"));
    dims[0] = N, dims[1] = X, dims[2] = K, dims[3] = E, dims[4] = M, dims[5] = k;
    return GT_OK;
}

/* delta_rule (kind 0): src0 q (B, T, Hk, Dk), src1 k (like q), src2 v (B, T, Hv, Dv), src3 g
 * (B, T, Hv), src4 beta (B, T, Hv), then seg (B, T) i32 when ip[0], then the initial state s0
 * (B, Hv, Dv, Dk) when ip[1]; dst o (B, T, Hv, Dv), or with a state (B, T*Hv*Dv + Hv*Dv*Dk): o,
 * then the last state. delta_rule_bwd (kind 1): src0..4 as the forward's, src5 go (B, T, Hv,
 * Dv), then seg when ip[0]; dst (B, T, W), W = 2 Hk Dk + Hv Dv + 2 Hv: dq | dk | dv | dg | dbeta.
 * Hv a multiple of Hk (V head h reads K head h % Hk, as llama.cpp's repeat). All f32 but seg,
 * all contiguous. Fills dims {B, T, Hk, Hv, Dk, Dv}, *seg and *s0 (NULL when absent). */
static inline int gt_delta_rule_check(const gt_node *node, int kind, const char *op, int64_t dims[6],
                                      const gt_tensor **seg, const gt_tensor **s0) {
    const int has_seg = node->ip[0] != 0, has_state = kind == 0 && node->ip[1] != 0;
    const int n = 5 + (kind == 1) + has_seg + has_state;
    char a[128], b[128];
    if (node->n_src != n) return GT_FAIL(GT_ERR_INVALID, "%s: expected %d inputs, got %d", op, n, node->n_src);
    const gt_tensor *q = &node->src[0], *k = &node->src[1], *v = &node->src[2], *d = &node->dst;
    GT_CHECK_F32(d, op, "dst");
    for (int i = 0; i < 5 + (kind == 1); i++) {
        GT_CHECK_F32(&node->src[i], op, "an input");
        GT_TRY(gt_check_contig(&node->src[i], op, "every input"));
    }
    GT_TRY(gt_check_contig(d, op, "dst"));
    if (q->ndim != 4 || v->ndim != 4 || !gt_same_shape(q, k) || v->shape[0] != q->shape[0] ||
        v->shape[1] != q->shape[1] || q->shape[2] < 1 || v->shape[2] % q->shape[2] != 0)
        return GT_FAIL(GT_ERR_SHAPE, "%s: expected q, k (B, T, Hk, Dk) and v (B, T, Hv, Dv) with Hv a multiple of Hk, "
                       "got q %s, v %s", op, gt_shape_str(q, a, sizeof a), gt_shape_str(v, b, sizeof b));
    const int64_t B = q->shape[0], T = q->shape[1], Hk = q->shape[2], Dk = q->shape[3], Hv = v->shape[2],
                  Dv = v->shape[3];
    for (int i = 3; i < 5; i++) {
        const gt_tensor *t = &node->src[i];
        if (t->ndim != 3 || t->shape[0] != B || t->shape[1] != T || t->shape[2] != Hv)
            return GT_FAIL(GT_ERR_SHAPE, "%s: expected %s (%lld, %lld, %lld), got %s", op, i == 3 ? "g" : "beta",
                           (long long)B, (long long)T, (long long)Hv, gt_shape_str(t, a, sizeof a));
    }
    if (kind == 1 && !gt_same_shape(&node->src[5], v))
        return GT_FAIL(GT_ERR_SHAPE, "%s: expected go of v's shape %s, got %s", op, gt_shape_str(v, a, sizeof a),
                       gt_shape_str(&node->src[5], b, sizeof b));
    const int64_t want = kind == 1 ? 2 * Hk * Dk + Hv * Dv + 2 * Hv : has_state ? T * Hv * Dv + Hv * Dv * Dk : 0;
    if (kind == 0 && !has_state ? !gt_same_shape(d, v)
                                : (d->ndim != (kind == 1 ? 3 : 2) || d->shape[0] != B ||
                                   (kind == 1 && d->shape[1] != T) || d->shape[d->ndim - 1] != want))
        return GT_FAIL(GT_ERR_SHAPE, "%s: dst %s does not fit q %s, v %s", op, gt_shape_str(d, a, sizeof a),
                       gt_shape_str(q, b, sizeof b), gt_shape_str(v, b, sizeof b));
    dims[0] = B, dims[1] = T, dims[2] = Hk, dims[3] = Hv, dims[4] = Dk, dims[5] = Dv;
    *seg = NULL;
    *s0 = NULL;
    int at = 5 + (kind == 1);
    if (has_seg) {
        const gt_tensor *m = &node->src[at++];
        GT_TRY(gt_check_i32(m, op, "seg"));
        GT_TRY(gt_check_contig(m, op, "seg"));
        if (m->ndim != 2 || m->shape[0] != B || m->shape[1] != T)
            return GT_FAIL(GT_ERR_SHAPE, "%s: expected seg (%lld, %lld) (B, T), got %s", op, (long long)B,
                           (long long)T, gt_shape_str(m, a, sizeof a));
        *seg = m;
    }
    if (has_state) {
        const gt_tensor *s = &node->src[at];
        GT_CHECK_F32(s, op, "s0");
        GT_TRY(gt_check_contig(s, op, "s0"));
        if (s->ndim != 4 || s->shape[0] != B || s->shape[1] != Hv || s->shape[2] != Dv || s->shape[3] != Dk)
            return GT_FAIL(GT_ERR_SHAPE, "%s: expected s0 (%lld, %lld, %lld, %lld) (B, Hv, Dv, Dk), got %s", op,
                           (long long)B, (long long)Hv, (long long)Dv, (long long)Dk, gt_shape_str(s, a, sizeof a));
        *s0 = s;
    }
    return GT_OK;
}

/* Enough of delta_rule's shapes to size its memory (before any data): q (B, T, Hk, Dk), v
 * (B, T, Hv, Dv). */
static inline int gt_delta_rule_dims(const gt_node *node, const char *op) {
    if (node->n_src < 5 || node->src[0].ndim != 4 || node->src[2].ndim != 4)
        return GT_FAIL(GT_ERR_SHAPE, "%s: expected q (B, T, Hk, Dk) and v (B, T, Hv, Dv) among 5 or more inputs", op);
    return GT_OK;
}

/* Whether row t of sample b starts a sample (the state resets): the first row, or a row whose
 * segment differs from the row before it (packed samples). */
GT_HD static inline int gt_dr_reset(const int32_t *seg, int64_t T, int64_t b, int64_t t) {
    return t == 0 || (seg != NULL && seg[b * T + t] != seg[b * T + t - 1]);
}

/* delta_rule_bwd's checkpoint interval (rows between the states it keeps while recomputing). */
#define GT_DR_CHUNK 32

/* The rows of a chunk in delta_rule's chunked form (native/cpu/deltachunk.c). */
#define GT_DR_BLOCK 64

#endif
