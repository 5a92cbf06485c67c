/* optim.c: optimizer steps as plan kernels (in place on the parameter and its
 * state). The hyper vector is laid out as enum gt_hyper (gt_core.h), which the
 * host reads through cffi. */
#include <math.h>

#include "internal.h"
#include "simd.h"

static int check_step(const gt_node *node, int n_src, const char *op) {
    if (node->n_src != n_src) return GT_FAIL(GT_ERR_INVALID, "%s: needs %d inputs", op, n_src);
    const int64_t n = gt_numel(&node->src[0]);
    for (int i = 0; i < n_src; i++) {
        const gt_tensor *t = &node->src[i];
        GT_CHECK_F32(t, op, "input");
        if (!gt_is_contiguous(t)) return GT_FAIL(GT_ERR_INVALID, "%s: input %d not contiguous", op, i);
        if (i == 2) {
            if (gt_numel(t) < GT_HYPER_COUNT) return GT_FAIL(GT_ERR_SHAPE, "%s: hyper vector too short", op);
        } else if (i == 3) {
            if (gt_numel(t) != 1) return GT_FAIL(GT_ERR_SHAPE, "%s: grad norm must be a scalar", op);
        } else if (gt_numel(t) != n) {
            return GT_FAIL(GT_ERR_SHAPE, "%s: input %d has %lld elements, param has %lld", op, i,
                           (long long)gt_numel(t), (long long)n);
        }
    }
    if (node->dst.data != node->src[0].data)
        return GT_FAIL(GT_ERR_INVALID, "%s: dst must alias the parameter (in-place step)", op);
    return GT_OK;
}

/* Global-norm clipping factor: min(1, max_norm / norm), 1 when disabled. */
static float clip_scale(const float *h, float norm) {
    const float max_norm = h[GT_HYPER_MAX_NORM];
    if (max_norm > 0.0f && norm > max_norm) return max_norm / (norm + 1e-6f);
    return 1.0f;
}

/* The AdamW update of n elements (below). Compiled per SIMD level: the scalar
 * build's SSE code was bound by its divisions. Same bits at every level (IEEE
 * division and square root, no contraction). */
GT_CLONES static void adamw_range(float *restrict p, const float *restrict g, float *restrict m, float *restrict v,
                                  int64_t n, float scale, float lr, float b1, float b2, float eps, float decay,
                                  float bc1, float bc2) {
    for (int64_t i = 0; i < n; i++) gt_adamw_1(&p[i], g[i] * scale, &m[i], &v[i], lr, b1, b2, eps, decay, bc1, bc2);
}

/* AdamW with decoupled weight decay (Loshchilov & Hutter), bias-corrected:
 *   g = clip * grad;  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
 *   p -= lr * (m / bc1) / (sqrt(v / bc2) + eps) + lr * wd * fp[0] * p      */
int gt_adamw_step_fwd_f32(const gt_node *node, const gt_ctx *ctx) {
    int rc = check_step(node, 6, "adamw_step");
    if (rc) return rc;
    float *p = node->src[0].data, *m = node->src[4].data, *v = node->src[5].data;
    const float *g = node->src[1].data, *h = node->src[2].data;
    const float scale = clip_scale(h, *(const float *)node->src[3].data);
    const float lr = h[GT_HYPER_LR], b1 = h[GT_HYPER_BETA1], b2 = h[GT_HYPER_BETA2], eps = h[GT_HYPER_EPS];
    const float decay = lr * h[GT_HYPER_WD] * node->fp[0];
    const float bc1 = h[GT_HYPER_BC1], bc2 = h[GT_HYPER_BC2];
    if (!(bc1 > 0.0f) || !(bc2 > 0.0f)) return GT_FAIL(GT_ERR_INVALID, "adamw_step: bias corrections must be > 0 (step count 0?)");
    int64_t lo, hi;
    gt_split(gt_numel(&node->src[0]), ctx, &lo, &hi);
    adamw_range(p + lo, g + lo, m + lo, v + lo, hi - lo, scale, lr, b1, b2, eps, decay, bc1, bc2);
    return GT_OK;
}

/* SGD with optional momentum and coupled (L2) weight decay, as PyTorch:
 *   g = clip * grad + wd * fp[0] * p;  buf = mu buf + g (if mu > 0);  p -= lr * buf */
int gt_sgd_step_fwd_f32(const gt_node *node, const gt_ctx *ctx) {
    int rc = check_step(node, 5, "sgd_step");
    if (rc) return rc;
    float *p = node->src[0].data, *buf = node->src[4].data;
    const float *g = node->src[1].data, *h = node->src[2].data;
    const float scale = clip_scale(h, *(const float *)node->src[3].data);
    const float lr = h[GT_HYPER_LR], wd = h[GT_HYPER_WD] * node->fp[0], mu = h[GT_HYPER_MOMENTUM];
    int64_t lo, hi;
    gt_split(gt_numel(&node->src[0]), ctx, &lo, &hi);
    for (int64_t i = lo; i < hi; i++) {
        float gi = g[i] * scale + wd * p[i];
        if (mu != 0.0f) {
            gi = mu * buf[i] + gi;
            buf[i] = gi;
        }
        p[i] -= lr * gi;
    }
    return GT_OK;
}
