/* shape.h: argument checks shared by the kernels of norm.c, softmax.c, rope.c,
 * rows.c and conv.c (not part of the C API). Each check records a message that
 * names the op and what was expected and received, and returns the status. */
#ifndef GT_SHAPE_H
#define GT_SHAPE_H

#include <stdio.h>

#include "internal.h"

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
    if (gt_is_contiguous(t) || gt_numel(t) == 0) return GT_OK;
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

static inline int gt_check_n_src(const gt_node *node, int n, const char *op) {
    if (node->n_src < n)
        return GT_FAIL(GT_ERR_INVALID, "%s: expected %d inputs, got %d", op, n, node->n_src);
    return GT_OK;
}


#endif
