/* matmul.c: placeholder plain triple loop until the packed kernel lands. */
#include "internal.h"

int64_t gt_matmul_work_size(void) { return 0; }

int gt_matmul_fwd_f32(const gt_node *node, const gt_ctx *ctx) {
    const gt_tensor *d = &node->dst, *a = &node->src[0], *b = &node->src[1];
    GT_CHECK_F32(d, "matmul", "dst");
    GT_CHECK_F32(a, "matmul", "src0");
    GT_CHECK_F32(b, "matmul", "src1");
    if (a->ndim < 2 || b->ndim < 2 || d->ndim < 2) return GT_FAIL(GT_ERR_SHAPE, "matmul: need 2 dims");
    const int64_t M = a->shape[a->ndim - 2], K = a->shape[a->ndim - 1], N = b->shape[b->ndim - 1];
    if (b->shape[b->ndim - 2] != K) return GT_FAIL(GT_ERR_SHAPE, "matmul: inner dims %lld vs %lld", (long long)K, (long long)b->shape[b->ndim - 2]);
    const int64_t nb = gt_numel(d) / (M * N > 0 ? M * N : 1);
    const int64_t as0 = a->strides[a->ndim - 2], as1 = a->strides[a->ndim - 1];
    const int64_t bs0 = b->strides[b->ndim - 2], bs1 = b->strides[b->ndim - 1];
    float *dd = d->data;
    int64_t lo, hi;
    gt_split(nb * M, ctx, &lo, &hi);
    for (int64_t r = lo; r < hi; r++) {
        int64_t bi = r / M, i = r % M, rem = bi, aoff = 0, boff = 0;
        for (int k = d->ndim - 3; k >= 0; k--) {
            int64_t idx = rem % d->shape[k];
            rem /= d->shape[k];
            int ka = k - (d->ndim - a->ndim), kb = k - (d->ndim - b->ndim);
            if (ka >= 0 && a->shape[ka] != 1) aoff += idx * a->strides[ka];
            if (kb >= 0 && b->shape[kb] != 1) boff += idx * b->strides[kb];
        }
        const float *ap = (const float *)a->data + aoff + i * as0;
        const float *bp = (const float *)b->data + boff;
        for (int64_t j = 0; j < N; j++) {
            float s = 0.0f;
            for (int64_t k = 0; k < K; k++) s += ap[k * as1] * bp[k * bs0 + j * bs1];
            dd[(bi * M + i) * N + j] = s;
        }
    }
    return GT_OK;
}
