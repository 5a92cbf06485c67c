/* internal.h: helpers shared by the CPU kernels (not part of the C API). */
#ifndef GT_INTERNAL_H
#define GT_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "../ggtrain.h"

#define GT_MAX_DIMS 6

/* Records a formatted message with file and line for gt_last_error() and
 * returns `code`, so kernels write `return GT_FAIL(GT_ERR_SHAPE, "...", ...)`. */
int gt_set_error_(int code, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
#define GT_FAIL(code, ...) gt_set_error_((code), __FILE__, __LINE__, __VA_ARGS__)

/* Dispatch level chosen at run time: 0 scalar, 1 AVX2+FMA, 2 AVX-512F. */
int gt_simd_level_(void);

static inline int64_t gt_numel(const gt_tensor *t) {
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
    return n;
}

static inline int gt_is_contiguous(const gt_tensor *t) {
    int64_t s = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        if (t->shape[i] != 1 && t->strides[i] != s) return 0;
        s *= t->shape[i];
    }
    return 1;
}

/* Size of the last dim (1 for a scalar) and the number of rows before it. */
static inline int64_t gt_ncols(const gt_tensor *t) {
    return t->ndim ? t->shape[t->ndim - 1] : 1;
}
static inline int64_t gt_nrows(const gt_tensor *t) {
    int64_t n = 1;
    for (int i = 0; i + 1 < t->ndim; i++) n *= t->shape[i];
    return n;
}

/* Element offset of the first element of row `row` (row-major order over all
 * dims but the last), using t's strides: works for any strided view. */
static inline int64_t gt_row_offset(const gt_tensor *t, int64_t row) {
    int64_t off = 0;
    for (int i = t->ndim - 2; i >= 0; i--) {
        int64_t n = t->shape[i];
        off += (row % n) * t->strides[i];
        row /= n;
    }
    return off;
}

/* Same for a tensor broadcast to `like`'s shape (right-aligned dims; dims
 * of size 1 in t, or missing, contribute stride 0). */
static inline int64_t gt_row_offset_bcast(const gt_tensor *t, const gt_tensor *like, int64_t row) {
    int64_t off = 0;
    int d = t->ndim - 2;
    for (int i = like->ndim - 2; i >= 0; i--, d--) {
        int64_t n = like->shape[i];
        int64_t idx = row % n;
        row /= n;
        if (d >= 0 && t->shape[d] != 1) off += idx * t->strides[d];
    }
    return off;
}

/* Thread ith's share [lo, hi) of n items, split in contiguous blocks. */
static inline void gt_split(int64_t n, const gt_ctx *ctx, int64_t *lo, int64_t *hi) {
    int64_t per = (n + ctx->nth - 1) / ctx->nth;
    int64_t a = per * ctx->ith;
    int64_t b = a + per;
    *lo = a < n ? a : n;
    *hi = b < n ? b : n;
}

int gt_check_f32_(const gt_tensor *t, const char *op, const char *what);
#define GT_CHECK_F32(t, op, what) do { int rc_ = gt_check_f32_((t), (op), (what)); if (rc_) return rc_; } while (0)

float gt_f16_to_f32_1(uint16_t h);
uint16_t gt_f32_to_f16_1(float f);
float gt_bf16_to_f32_1(uint16_t h);
uint16_t gt_f32_to_bf16_1(float f);

#endif
