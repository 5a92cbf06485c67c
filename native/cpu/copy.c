/* copy.c: copy (strided copy with dtype conversion: ops cont and cast), view_bwd, set_rows
 * (rows written in place at run-time indices), and the direct f16/bf16
 * conversion helpers. */
#include <math.h>

#include "internal.h"

/* IEEE half <-> float, round to nearest even; NaN stays NaN, overflow -> inf. */
float gt_f16_to_f32_1(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) bits = sign;
        else {  /* subnormal: normalise */
            int e = -1;
            do { e++; man <<= 1; } while (!(man & 0x400));
            bits = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) bits = sign | 0x7f800000u | (man << 13);
    else bits = sign | ((exp + 112) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

uint16_t gt_f32_to_f16_1(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000;
    uint32_t absx = x & 0x7fffffffu;
    if (absx >= 0x7f800000u) return (uint16_t)(sign | 0x7c00 | (absx > 0x7f800000u ? 0x200 : 0));
    if (absx >= 0x477ff000u) return (uint16_t)(sign | 0x7c00);   /* rounds to inf */
    if (absx < 0x38800000u) {                                     /* subnormal half or zero */
        if (absx < 0x33000000u) return (uint16_t)sign;            /* below half of the smallest */
        uint32_t man = (absx & 0x7fffff) | 0x800000;
        int shift = 113 - (int)(absx >> 23) + 13;                 /* 14..24 */
        uint32_t r = man >> shift, rem = man & ((1u << shift) - 1), halfway = 1u << (shift - 1);
        if (rem > halfway || (rem == halfway && (r & 1))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = ((absx >> 13) - (112u << 10));
    uint32_t rem = absx & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (r & 1))) r++;
    return (uint16_t)(sign | r);
}

float gt_bf16_to_f32_1(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

uint16_t gt_f32_to_bf16_1(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40);  /* quiet NaN */
    x += 0x7fff + ((x >> 16) & 1);
    return (uint16_t)(x >> 16);
}

static inline float load_as_f32(const void *base, int dtype, int64_t i) {
    switch (dtype) {
    case GT_F16: return gt_f16_to_f32_1(((const uint16_t *)base)[i]);
    case GT_BF16: return gt_bf16_to_f32_1(((const uint16_t *)base)[i]);
    default: return ((const float *)base)[i];
    }
}

/* dst (contiguous, dtype `to`) = src (any strides, f32/f16/bf16) converted: the kernel of the
 * ops cont (a contiguous copy, the same dtype) and cast (another dtype). */
static int copy_converted(const gt_node *node, const gt_ctx *ctx, int to, const char *op) {
    const gt_tensor *d = &node->dst, *a = &node->src[0];
    if (!d->data || !a->data) return GT_FAIL(GT_ERR_INVALID, "%s: missing data pointer", op);
    if (d->dtype != to) return GT_FAIL(GT_ERR_DTYPE, "%s: dst dtype %d, kernel writes %d", op, d->dtype, to);
    if (a->dtype != GT_F32 && a->dtype != GT_F16 && a->dtype != GT_BF16)
        return GT_FAIL(GT_ERR_DTYPE, "%s: cannot convert from dtype %d", op, a->dtype);
    if (!gt_is_contiguous(d)) return GT_FAIL(GT_ERR_INVALID, "%s: dst must be contiguous", op);
    if (gt_numel(a) != gt_numel(d) || a->ndim != d->ndim)
        return GT_FAIL(GT_ERR_SHAPE, "%s: src and dst shapes differ", op);
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] != d->shape[i]) return GT_FAIL(GT_ERR_SHAPE, "%s: src and dst shapes differ", op);
    const int64_t ncols = gt_ncols(d), nrows = gt_nrows(d);
    const int64_t sa = a->ndim ? a->strides[a->ndim - 1] : 1;
    int64_t lo, hi;
    gt_split(nrows, ctx, &lo, &hi);
    for (int64_t r = lo; r < hi; r++) {
        const int64_t so = gt_row_offset(a, r);
        const int64_t dof = r * ncols;
        if (a->dtype == to && sa == 1) {
            size_t esz = to == GT_F32 ? 4 : 2;
            memcpy((char *)d->data + dof * esz, (const char *)a->data + so * esz, (size_t)ncols * esz);
            continue;
        }
        for (int64_t i = 0; i < ncols; i++) {
            const float v = load_as_f32(a->data, a->dtype, so + i * sa);
            switch (to) {
            case GT_F16: ((uint16_t *)d->data)[dof + i] = gt_f32_to_f16_1(v); break;
            case GT_BF16: ((uint16_t *)d->data)[dof + i] = gt_f32_to_bf16_1(v); break;
            default: ((float *)d->data)[dof + i] = v; break;
            }
        }
    }
    return GT_OK;
}

int gt_copy_fwd_f32(const gt_node *n, const gt_ctx *c) { return copy_converted(n, c, GT_F32, "copy"); }
int gt_copy_fwd_f16(const gt_node *n, const gt_ctx *c) { return copy_converted(n, c, GT_F16, "copy"); }
int gt_copy_fwd_bf16(const gt_node *n, const gt_ctx *c) { return copy_converted(n, c, GT_BF16, "copy"); }

/* view_bwd: dst (contiguous f32, the base's shape) = 0 everywhere, then src (the
 * gradient of a view, contiguous) is written where the view lies: element
 * ip[0] + sum_i idx_i * ip[1 + i] of dst for view index idx. Two phases. */
int gt_view_bwd_f32(const gt_node *node, const gt_ctx *ctx) {
    const gt_tensor *d = &node->dst, *g = &node->src[0];
    GT_CHECK_F32(d, "view_bwd", "dst");
    GT_CHECK_F32(g, "view_bwd", "src0");
    if (!gt_is_contiguous(d) || !gt_is_contiguous(g))
        return GT_FAIL(GT_ERR_INVALID, "view_bwd: tensors must be contiguous");
    const int64_t nd = gt_numel(d), ng = gt_numel(g);
    /* bounds: the furthest element the view reaches must lie inside dst */
    int64_t reach = node->ip[0];
    for (int i = 0; i < g->ndim; i++) {
        if (node->ip[1 + i] < 0) return GT_FAIL(GT_ERR_INVALID, "view_bwd: negative view stride");
        reach += (g->shape[i] - 1) * node->ip[1 + i];
    }
    if (ng > 0 && (node->ip[0] < 0 || reach >= nd))
        return GT_FAIL(GT_ERR_SHAPE, "view_bwd: view reaches element %lld of a %lld-element base",
                       (long long)reach, (long long)nd);
    float *dd = d->data;
    const float *gd = g->data;
    int64_t lo, hi;
    gt_split(nd, ctx, &lo, &hi);
    if (hi > lo) memset(dd + lo, 0, (size_t)(hi - lo) * sizeof(float));
    gt_barrier(ctx);
    const int64_t ncols = gt_ncols(g), nrows = gt_nrows(g);
    const int64_t sc = g->ndim ? node->ip[g->ndim] : 1;
    gt_split(nrows, ctx, &lo, &hi);
    for (int64_t r = lo; r < hi; r++) {
        int64_t off = node->ip[0], rem = r;
        for (int i = g->ndim - 2; i >= 0; i--) {
            off += (rem % g->shape[i]) * node->ip[1 + i];
            rem /= g->shape[i];
        }
        for (int64_t i = 0; i < ncols; i++) dd[off + i * sc] = gd[r * ncols + i];
    }
    return GT_OK;
}

int gt_f32_to_f16(uint16_t *dst, const float *src, int64_t n) {
    if ((!dst || !src) && n > 0) return GT_FAIL(GT_ERR_INVALID, "gt_f32_to_f16: null pointer");
    for (int64_t i = 0; i < n; i++) dst[i] = gt_f32_to_f16_1(src[i]);
    return GT_OK;
}
int gt_f16_to_f32(float *dst, const uint16_t *src, int64_t n) {
    if ((!dst || !src) && n > 0) return GT_FAIL(GT_ERR_INVALID, "gt_f16_to_f32: null pointer");
    for (int64_t i = 0; i < n; i++) dst[i] = gt_f16_to_f32_1(src[i]);
    return GT_OK;
}
int gt_f32_to_bf16(uint16_t *dst, const float *src, int64_t n) {
    if ((!dst || !src) && n > 0) return GT_FAIL(GT_ERR_INVALID, "gt_f32_to_bf16: null pointer");
    for (int64_t i = 0; i < n; i++) dst[i] = gt_f32_to_bf16_1(src[i]);
    return GT_OK;
}
int gt_bf16_to_f32(float *dst, const uint16_t *src, int64_t n) {
    if ((!dst || !src) && n > 0) return GT_FAIL(GT_ERR_INVALID, "gt_bf16_to_f32: null pointer");
    for (int64_t i = 0; i < n; i++) dst[i] = gt_bf16_to_f32_1(src[i]);
    return GT_OK;
}

/* set_rows, in place: dst (S, C) aliases src0 (the target: persistent memory,
 * f32, contiguous); src1 values (T, C) f32 contiguous, src2 idx (T,) i32
 * contiguous: row idx[t] of dst becomes values[t], for t in order (a repeated
 * index keeps the last row); every other row is left as it was (the exception
 * to "kernels fill only dst", like the optimizer steps). An index outside
 * [0, S) is GT_ERR_INVALID (checked by every thread before any writes).
 * Threads own column blocks, so the result does not depend on their count. */
int gt_set_rows_fwd_f32(const gt_node *node, const gt_ctx *ctx) {
    const char *op = "set_rows";
    const gt_tensor *d = &node->dst, *v = &node->src[1], *idx = &node->src[2];
    char a[128], b[128];
    GT_TRY(gt_check_n_src(node, 3, op));
    GT_CHECK_F32(d, op, "dst");
    GT_CHECK_F32(v, op, "values");
    GT_TRY(gt_check_i32(idx, op, "idx"));
    GT_TRY(gt_check_contig(d, op, "dst"));
    GT_TRY(gt_check_contig(v, op, "values"));
    GT_TRY(gt_check_contig(idx, op, "idx"));
    if (d->data != node->src[0].data)
        return GT_FAIL(GT_ERR_INVALID, "%s: dst must alias the target (in-place write)", op);
    if (d->ndim != 2 || v->ndim != 2 || v->shape[1] != d->shape[1] || gt_numel(idx) != v->shape[0])
        return GT_FAIL(GT_ERR_SHAPE, "%s: expected target (S, C), values (T, C) and idx (T,), got target %s, "
                       "values %s and %lld indices", op, gt_shape_str(d, a, sizeof a),
                       gt_shape_str(v, b, sizeof b), (long long)gt_numel(idx));
    const int64_t S = d->shape[0], C = d->shape[1], T = v->shape[0];
    const int32_t *id = idx->data;
    for (int64_t t = 0; t < T; t++)
        if (id[t] < 0 || id[t] >= S)
            return GT_FAIL(GT_ERR_INVALID, "%s: idx[%lld] is %d, expected 0 <= index < S = %lld", op,
                           (long long)t, (int)id[t], (long long)S);
    int64_t lo, hi;
    gt_split((C + 15) / 16, ctx, &lo, &hi);
    const int64_t c0 = lo * 16, c1 = hi * 16 < C ? hi * 16 : C;
    float *dd = d->data;
    const float *vd = v->data;
    for (int64_t t = 0; c1 > c0 && t < T; t++)
        memcpy(dd + id[t] * C + c0, vd + t * C + c0, (size_t)(c1 - c0) * sizeof(float));
    return GT_OK;
}
