/* matmul_ggml.c: x @ W^T for a weight W in f32 or f16, in llama.cpp's CPU float order: the
 * decoder's act8 mode (generation and evaluation in llama.cpp's numbers) for the weights that
 * are not quantized (qdot8.c, qdot8k.c take those), and for LoRA adapters' factors.
 *
 * llama.cpp's mul_mat of a weight W (N rows of K) by n rows of x (its ubatch's tokens) picks
 * per call, for f32 and f16 weights (ggml-cpu.c, llamafile/sgemm.cpp):
 *   n >= 2, N % 4 == 0 and K % 16 == 0: its tinyBLAS GEMM, each output gt_ggml_dot16;
 *   otherwise its vec_dot per output: gt_ggml_dot (f32 W) or gt_ggml_dot_f16 (f16 W).
 * With an f16 W, x is first rounded to f16 (the f16 vec_dot type); W's values and the
 * products of two f16 values are exact in f32. ggmlnum.h gives each dot's order. The rows
 * of x, batch dims folded in, are the product's n: a call is one ubatch. Same bits at every
 * SIMD level and thread count (threads split W's rows).
 *
 * Kernels: the plain C (block_dots, cloned per SIMD level) everywhere; with AVX-512 and F16C,
 * one row of x against 4 W rows at a time in 16 zmm lanes (row_dots64_avx512, an f16 W
 * converted as it is read, rows ahead prefetched as qdot.c's row dots do), and 4 x 4 tiles of
 * x rows by W rows for tinyBLAS's order (tile_dots16_avx512); both take the reduction trees
 * of 16 sums at once (reduce16x16_avx512), with the same pairwise adds. */
#include <string.h>

#include "ggmlnum.h"
#include "internal.h"
#include "simd.h"

#define JB 16       /* W rows a block: each is dotted with every row of x while in cache */
#define ALIGN 64

/* per thread: an f16 W's block (JB x K, or the tiled path's chunk of TILE_CHUNK_F16 rows)
 * dequantized, and 4 rows of x rounded to f16 (4 K) */
#define WCONV_ROWS (JB > 64 ? JB : 64)
static int64_t work_bytes(int32_t wtype, int64_t K) {
    return wtype == GT_F16 ? (WCONV_ROWS + 4) * (K > 0 ? K : 0) * (int64_t)sizeof(float) + ALIGN : 0;
}

/* c[i * ldc + j] (i < m, j < jn) = dot(x row i, W row j) */
GT_CLONES static void block_dots(float *c, int64_t ldc, const float *x, int64_t rs, int64_t m,
                                 const float *w, int64_t ldw, int64_t jn, int64_t K, int tiny, int f16,
                                 float *xr) {
    for (int64_t i = 0; i < m; i++) {
        const float *xi = x + i * rs;
        if (f16) {
            gt_round_f16_(xr, xi, K);
            xi = xr;
        }
        float *ci = c + i * ldc;
        for (int64_t j = 0; j < jn; j++) {
            const float *wj = w + j * ldw;
            ci[j] = tiny ? gt_ggml_dot16(xi, wj, K) : f16 ? gt_ggml_dot_f16(xi, wj, K) : gt_ggml_dot(xi, wj, K);
        }
    }
}

#if defined(__x86_64__)
#include <immintrin.h>

/* The 16 sums of a 4 x 4 tile of 16-lane accumulators, each by _mm512_reduce_add_ps's tree
 * (gt_ggml_reduce16: halves, quarters, then (t0 + t2) + (t1 + t3)), all 16 at once: the same
 * pairwise adds, with the lanes shuffled so each add serves several accumulators. out[4 q + r]
 * = the sum of acc[r][q]. */
__attribute__((target("avx512f"))) static inline void reduce16x16_avx512(float *out, __m512 acc[4][4]) {
    __m512 y[8], z[4], t[2];
    for (int k = 0; k < 8; k++) {
        const __m512 a = acc[(2 * k) / 4][(2 * k) % 4], b = acc[(2 * k + 1) / 4][(2 * k + 1) % 4];
        y[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
    }
    for (int k = 0; k < 4; k++)
        z[k] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * k], y[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(y[2 * k], y[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int k = 0; k < 2; k++)
        t[k] = _mm512_add_ps(_mm512_shuffle_ps(z[2 * k], z[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(z[2 * k], z[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    _mm512_storeu_ps(out, _mm512_add_ps(_mm512_shuffle_ps(t[0], t[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                        _mm512_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 1, 3, 1))));
}

/* The 4 W rows from j0 the AVX-512 kernels read together: f32 rows ldw apart (wp) or f16 rows
 * of K (hp); rows past the n that exist repeat row j0 (their sums are dropped). */
static inline void w_rows4(const float *wp[4], const uint16_t *hp[4], const float *wf, const uint16_t *wh,
                           int64_t ldw, int64_t K, int64_t j0, int n) {
    for (int q = 0; q < 4; q++) {
        const int64_t j = j0 + (q < n ? q : 0);
        wp[q] = wh ? NULL : wf + j * ldw;
        hp[q] = wh ? wh + j * K : NULL;
    }
}

/* One row of x times W rows [0, jn) (f32 rows ldw apart, or f16 rows of K) by gt_ggml_dot or
 * gt_ggml_dot_f16: 4 W rows at a time in 4 x 4 zmm (their 64 lanes; an f16 W converted as it
 * is read, no dequantized copy), each row's lanes folded as gt_ggml_dot folds them, 16 rows'
 * trees taken together (reduce16x16_avx512), then each row's leftovers as ggmlnum.h's: the
 * bits of the plain C. */
__attribute__((target("avx512f"))) static void row_dots64_avx512(float *c, const float *x, const float *wf,
                                                                  const uint16_t *wh, int64_t ldw, int64_t jn,
                                                                  int64_t K) {
    const int64_t np = K & ~(int64_t)63;
    float sums[16];
    for (int64_t j0 = 0; j0 < jn; j0 += 16) {
        const int nr = jn - j0 < 16 ? (int)(jn - j0) : 16;
        __m512 v[4][4];     /* row j0 + 4 g + q's folded lanes at v[g][q] */
        for (int g = 0; g < 4; g++) {
            const float *wp[4];
            const uint16_t *hp[4];
            w_rows4(wp, hp, wf, wh, ldw, K, j0 + 4 * g, nr - 4 * g);
            __m512 acc[4][4];
#pragma GCC unroll 4
            for (int q = 0; q < 4; q++)
#pragma GCC unroll 4
                for (int l = 0; l < 4; l++) acc[q][l] = _mm512_setzero_ps();
            const int eb = wh ? 2 : 4;      /* bytes an element */
            const int64_t row_bytes = wh ? K * 2 : ldw * 4;
            const uint8_t *w0 = wh ? (const uint8_t *)hp[0] : (const uint8_t *)wp[0];
            for (int64_t i = 0; i < np; i += 64) {
                __m512 xv[4];
                gt_prefetch_ahead_(w0, row_bytes, 4, i / 64, 64 * eb, 1);   /* (as qdot.c's row dots do) */
#pragma GCC unroll 4
                for (int l = 0; l < 4; l++) xv[l] = _mm512_loadu_ps(x + i + 16 * l);
#pragma GCC unroll 4
                for (int q = 0; q < 4; q++)
#pragma GCC unroll 4
                    for (int l = 0; l < 4; l++)
                        acc[q][l] = _mm512_fmadd_ps(
                            xv[l],
                            wh ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(hp[q] + i + 16 * l)))
                               : _mm512_loadu_ps(wp[q] + i + 16 * l),
                            acc[q][l]);
            }
#pragma GCC unroll 4
            for (int q = 0; q < 4; q++)
                v[g][q] = _mm512_add_ps(_mm512_add_ps(acc[q][0], acc[q][2]), _mm512_add_ps(acc[q][1], acc[q][3]));
        }
        reduce16x16_avx512(sums, v);
        for (int r = 0; r < nr; r++) {
            float s = sums[4 * (r % 4) + r / 4];
            if (wh) {
                const uint16_t *w = wh + (j0 + r) * K;
                double t = (double)s;
                for (int64_t i = np; i < K; i++) t += (double)(x[i] * gt_f16_to_f32_1(w[i]));
                s = (float)t;
            } else {
                const float *w = wf + (j0 + r) * ldw;
                const int64_t n8 = np + ((K - np) & ~(int64_t)7);
                int64_t i = np;
                for (; i < n8; i++) {
                    const float p = x[i] * w[i];
                    s = s + p;
                }
                for (; i < K; i++) s = fmaf(x[i], w[i], s);
            }
            c[j0 + r] = s;
        }
    }
}

/* W rows a chunk of the tiled path: their bytes stay in L2 while every row of x passes (an f16
 * W's, converted to f32 into the thread's work, fewer) */
#define TILE_CHUNK 256
#define TILE_CHUNK_F16 64

/* Rows [0, m) of x (row stride rs) times W rows [0, jn) in tinyBLAS's order (gt_ggml_dot16),
 * K % 16 == 0: tiles of 4 x rows by 4 W rows, 16 zmm lanes each (a tile's edge rows repeat its
 * first row, their sums dropped). An f16 W is converted as it is read; xr: room for 4 rows of
 * x rounded to f16 (f16 W) or NULL. */
__attribute__((target("avx512f"))) static void tile_dots16_avx512(float *c, int64_t ldc, const float *x, int64_t rs,
                                                                   int64_t m, const float *wf, const uint16_t *wh,
                                                                   int64_t ldw, int64_t jn, int64_t K, float *xr,
                                                                   float *wconv) {
    float sums[16];
    const int64_t chunk = wh ? TILE_CHUNK_F16 : TILE_CHUNK;
    for (int64_t c0 = 0; c0 < jn; c0 += chunk) {
        const int64_t c1 = jn - c0 < chunk ? jn : c0 + chunk;
        /* an f16 chunk converted to f32 once (not in the inner loop, where the conversions would
         * share the FMA ports), then read as an f32 W of rows K apart */
        const float *wc = wf;
        int64_t lw = ldw, jb = 0;
        if (wh) {
            gt_dequantizer_(GT_F16)(wconv, (const uint8_t *)(wh + c0 * K), (c1 - c0) * K);
            wc = wconv;
            lw = K;
            jb = c0;
        }
        for (int64_t i0 = 0; i0 < m; i0 += 4) {
            const int mi = m - i0 < 4 ? (int)(m - i0) : 4;
            const float *xp[4];
            for (int r = 0; r < 4; r++) {
                const int rr = r < mi ? r : 0;
                if (xr) {
                    if (r < mi) gt_round_f16_(xr + r * K, x + (i0 + r) * rs, K);
                    xp[r] = xr + rr * K;
                } else {
                    xp[r] = x + (i0 + rr) * rs;
                }
            }
            for (int64_t j0 = c0; j0 < c1; j0 += 4) {
                const int nj = c1 - j0 < 4 ? (int)(c1 - j0) : 4;
                const float *wp[4];
                const uint16_t *hp[4];
                w_rows4(wp, hp, wc, NULL, lw, K, j0 - jb, nj);
                __m512 acc[4][4];
#pragma GCC unroll 4
                for (int r = 0; r < 4; r++)
#pragma GCC unroll 4
                    for (int q = 0; q < 4; q++) acc[r][q] = _mm512_setzero_ps();
                for (int64_t k = 0; k < K; k += 16) {
                    __m512 wv[4], xv[4];
#pragma GCC unroll 4
                    for (int q = 0; q < 4; q++) wv[q] = _mm512_loadu_ps(wp[q] + k);
#pragma GCC unroll 4
                    for (int r = 0; r < 4; r++) xv[r] = _mm512_loadu_ps(xp[r] + k);
#pragma GCC unroll 4
                    for (int r = 0; r < 4; r++)
#pragma GCC unroll 4
                        for (int q = 0; q < 4; q++) acc[r][q] = _mm512_fmadd_ps(xv[r], wv[q], acc[r][q]);
                }
                reduce16x16_avx512(sums, acc);
                for (int r = 0; r < mi; r++)
                    for (int q = 0; q < nj; q++) c[(i0 + r) * ldc + j0 + q] = sums[4 * q + r];
            }
        }
    }
}
#endif

static int product(const gt_node *node, const gt_ctx *ctx, int32_t wtype) {
    static const char *op = "matmul_ggml";
    const gt_tensor *d = &node->dst, *a = &node->src[0], *b = &node->src[1];
    GT_TRY(gt_check_n_src(node, 2, op));
    GT_CHECK_F32(d, op, "dst");
    GT_CHECK_F32(a, op, "src0");
    if (a->ndim < 2 || d->ndim != a->ndim)
        return GT_FAIL(GT_ERR_SHAPE, "%s: expected src0 (..., M, K) with at least 2 dims and dst with as many, got "
                       "%d and %d", op, a->ndim, d->ndim);
    const int64_t K = a->shape[a->ndim - 1];
    int64_t N, ldw;
    if (wtype == GT_F32) {
        GT_CHECK_F32(b, op, "src1");
        if (b->ndim != 2 || b->shape[0] != K || (K > 1 && b->strides[0] != 1) ||
            (b->shape[1] > 1 && b->strides[1] < K))
            return GT_FAIL(GT_ERR_SHAPE, "%s: expected src1 the view W^T (K=%lld, N) of a weight W (N, K) with "
                           "contiguous rows, got shape (%lld, %lld) strides (%lld, %lld)", op, (long long)K,
                           (long long)b->shape[0], (long long)(b->ndim > 1 ? b->shape[1] : 0),
                           (long long)b->strides[0], (long long)(b->ndim > 1 ? b->strides[1] : 0));
        N = b->shape[1];
        ldw = b->shape[1] > 1 ? b->strides[1] : K;
    } else {
        int trans = 0;
        GT_TRY(gt_weight_view_check(b, wtype, 1, op, 1, &trans));
        if (!trans && b->shape[0] != 1 && b->shape[1] != 1)     /* (one row or column: the same bytes) */
            return GT_FAIL(GT_ERR_INVALID, "%s: expected src1 the view W^T of a stored weight (x @ W^T)", op);
        if (b->shape[0] != K)
            return GT_FAIL(GT_ERR_SHAPE, "%s: src1 must have K = %lld rows to match src0, got %lld", op,
                           (long long)K, (long long)b->shape[0]);
        N = b->shape[1];
        ldw = K;
    }
    for (int i = 0; i < a->ndim - 1; i++)
        if (d->shape[i] != a->shape[i])
            return GT_FAIL(GT_ERR_SHAPE, "%s: dst's dim %d must be src0's %lld, got %lld", op, i,
                           (long long)a->shape[i], (long long)d->shape[i]);
    if (d->shape[d->ndim - 1] != N)
        return GT_FAIL(GT_ERR_SHAPE, "%s: dst must end in N = %lld, got %lld", op, (long long)N,
                       (long long)d->shape[d->ndim - 1]);
    if (!gt_is_contiguous(d)) return GT_FAIL(GT_ERR_INVALID, "%s: dst must be contiguous", op);
    /* the rows of x, all dims but the last folded: one stride from row to row */
    int64_t m = 1, rs = K;
    for (int i = a->ndim - 2; i >= 0; i--) {
        if (a->shape[i] == 1) continue;
        if (m == 1) rs = a->strides[i];
        else if (a->strides[i] != rs * m)
            return GT_FAIL(GT_ERR_INVALID, "%s: src0's rows must be evenly strided (its dims but the last one "
                           "row dim), got a stride of %lld at dim %d", op, (long long)a->strides[i], i);
        m *= a->shape[i];
    }
    if (K > 1 && a->strides[a->ndim - 1] != 1)
        return GT_FAIL(GT_ERR_INVALID, "%s: src0's rows must be contiguous along K", op);
    if (m == 0 || N == 0) return GT_OK;
    const int64_t need = work_bytes(wtype, K);
    if (need && (!ctx->wdata || ctx->wsize < need))
        return GT_FAIL(GT_ERR_INVALID, "%s: needs %lld bytes of per-thread scratch, got %lld", op, (long long)need,
                       (long long)(ctx->wdata ? ctx->wsize : 0));

    const int f16 = wtype == GT_F16, tiny = m >= 2 && N % 4 == 0 && K % 16 == 0;
    float *wbuf = need ? (float *)(((uintptr_t)ctx->wdata + ALIGN - 1) & ~(uintptr_t)(ALIGN - 1)) : NULL;
    float *xr = wbuf ? wbuf + WCONV_ROWS * K : NULL;
    const gt_dequant_fn deq = f16 ? gt_dequantizer_(GT_F16) : NULL;
    int64_t lo, hi;
    gt_split((N + JB - 1) / JB, ctx, &lo, &hi);
#if defined(__x86_64__)
    if (tiny && gt_simd_level_() >= 2 && __builtin_cpu_supports("f16c")) {     /* tinyBLAS tiles, vectorized */
        const int64_t j0 = lo * JB, j1 = hi * JB < N ? hi * JB : N;     /* this thread's W rows, all at once */
        if (j0 < j1)
            tile_dots16_avx512((float *)d->data + j0, N, (const float *)a->data, rs, m,
                               f16 ? NULL : (const float *)b->data + j0 * ldw, f16 ? (const uint16_t *)b->data + j0 * K : NULL,
                               ldw, j1 - j0, K, f16 ? xr : NULL, f16 ? wbuf : NULL);
        return GT_OK;
    }
    if (!tiny && gt_simd_level_() >= 2 && __builtin_cpu_supports("f16c")) {    /* vec_dot rows, vectorized */
        const int64_t j0 = lo * JB, j1 = hi * JB < N ? hi * JB : N;
        if (j0 >= j1) return GT_OK;
        for (int64_t i = 0; i < m; i++) {
            const float *xi = (const float *)a->data + i * rs;
            if (f16) {
                gt_round_f16_(xr, xi, K);
                xi = xr;
            }
            row_dots64_avx512((float *)d->data + i * N + j0, xi, f16 ? NULL : (const float *)b->data + j0 * ldw,
                              f16 ? (const uint16_t *)b->data + j0 * K : NULL, ldw, j1 - j0, K);
        }
        return GT_OK;
    }
#endif
    for (int64_t blk = lo; blk < hi; blk++) {
        const int64_t j0 = blk * JB, jn = N - j0 < JB ? N - j0 : JB;
        const float *w;
        if (f16) {
            const uint8_t *wp = (const uint8_t *)b->data + j0 * K * 2;
            for (int64_t j = 0; j < jn; j++) deq(wbuf + j * K, wp + j * K * 2, K);
            w = wbuf;
        } else {
            w = (const float *)b->data + j0 * ldw;
        }
        block_dots((float *)d->data + j0, N, (const float *)a->data, rs, m, w, f16 ? K : ldw, jn, K, tiny, f16, xr);
    }
    return GT_OK;
}

int gt_matmul_ggml_fwd_f32(const gt_node *node, const gt_ctx *ctx) { return product(node, ctx, GT_F32); }

int gt_matmul_ggml_fwd_f32_f16(const gt_node *node, const gt_ctx *ctx) { return product(node, ctx, GT_F16); }

int gt_matmul_ggml_fwd_f32_f16_sizes(const gt_node *node, int64_t *scratch, int64_t *work) {
    const gt_tensor *a = &node->src[0];
    *scratch = 0;
    *work = work_bytes(GT_F16, a->ndim >= 1 ? a->shape[a->ndim - 1] : 0);
    return GT_OK;
}

/* ---- rounding to f16 ------------------------------------------------------------------- */

#if defined(__x86_64__)
#include <immintrin.h>

__attribute__((target("avx2,f16c"))) static void round_f16_f16c(float *dst, const float *src, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i,
                         _mm256_cvtph_ps(_mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT)));
    for (; i < n; i++) dst[i] = gt_f16_to_f32_1(gt_f32_to_f16_1(src[i]));
}
#endif

void gt_round_f16_(float *dst, const float *src, int64_t n) {
#if defined(__x86_64__)
    if (__builtin_cpu_supports("f16c")) {
        round_f16_f16c(dst, src, n);
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++) dst[i] = gt_f16_to_f32_1(gt_f32_to_f16_1(src[i]));
}
