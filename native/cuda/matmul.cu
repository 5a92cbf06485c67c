/* matmul.cu: matrix products through cuBLAS (f32, exact unless gtc_set_math), products with a
 * frozen weight in its stored type (decoded to f32 in the node's work memory, then the f32
 * product: the same view, so the same layouts as the CPU's), and get_rows of stored weights.
 * Under gtc_set_math("bf16") a product's two operands are first rounded to bf16 (nearest even)
 * into the work memory, each over the span of memory its view covers, so the same offsets and
 * leading dims address them; cuBLAS multiplies them with f32 sums into the f32 dst. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.cuh"
#include "cublas.cuh"
#include "kernels.h"
#include "quant.cuh"

extern "C" {
#include "gtc.h"
}

/* ---- cuBLAS ---------------------------------------------------------------------------------- */

static gtc_cublas g_blas;

const gtc_cublas *gtc_cublas_(void) { return &g_blas; }

int gtc_cublas_load_(cudaStream_t stream) {
    const char *names[] = {getenv("GGTRAIN_CUBLAS"), "libcublas.so.13", "libcublas.so.12",
                           "/usr/local/cuda/lib64/libcublas.so.13", "/usr/local/cuda/lib64/libcublas.so.12"};
    const int n_names = (int)(sizeof names / sizeof names[0]);
    char tried[768] = "";
    void *lib = NULL;
    for (int i = 0; i < n_names && !lib; i++) {
        if (!names[i] || !names[i][0]) continue;
        lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
        if (!lib) {
            size_t used = strlen(tried);
            snprintf(tried + used, sizeof tried - used, "%s%s", used ? ", " : "", names[i]);
        }
    }
    if (!lib)
        return GTC_FAIL(GT_ERR_UNSUPPORTED, "cuBLAS cannot be loaded (tried %s): install the nvidia-cublas wheel "
                        "or the CUDA toolkit, or name the library in GGTRAIN_CUBLAS", tried);
    int (*create)(void **) = (int (*)(void **))dlsym(lib, "cublasCreate_v2");
    int (*set_stream)(void *, cudaStream_t) = (int (*)(void *, cudaStream_t))dlsym(lib, "cublasSetStream_v2");
    g_blas.gemm = (decltype(g_blas.gemm))dlsym(lib, "cublasGemmEx");
    g_blas.gemm_strided = (decltype(g_blas.gemm_strided))dlsym(lib, "cublasGemmStridedBatchedEx");
    g_blas.compute = GTC_COMPUTE_32F;
    g_blas.bf16 = 0;
    if (!create || !set_stream || !g_blas.gemm || !g_blas.gemm_strided)
        return GTC_FAIL(GT_ERR_UNSUPPORTED, "cuBLAS lacks a function ggtrain calls (cublasCreate_v2, "
                        "cublasSetStream_v2, cublasGemmEx, cublasGemmStridedBatchedEx)");
    int st = create(&g_blas.handle);
    if (st) return GTC_FAIL(GT_ERR_UNSUPPORTED, "cublasCreate failed (status %d)", st);
    st = set_stream(g_blas.handle, stream);
    if (st) return GTC_FAIL(GT_ERR_UNSUPPORTED, "cublasSetStream failed (status %d)", st);
    return GT_OK;
}

/* ---- a host stand-in for cuBLAS (tests on machines without a GPU) ----------------------------- */

static int g_host_blas = 0;   /* gemm's calls go to host_gemm: host pointers, no launch to check */

/* x as the compute type reads it: f32 as is, or rounded to nearest even at TF32's 10 fraction
 * bits (the stand-in's model of the tensor cores' input rounding). */
static float host_input(float x, int compute) {
    const int drop = compute == GTC_COMPUTE_32F_FAST_TF32 ? 13 : 0;
    if (!drop || x != x) return x;
    uint32_t u;
    memcpy(&u, &x, 4);
    u = (u + ((1u << (drop - 1)) - 1) + ((u >> drop) & 1)) & ~((1u << drop) - 1);
    memcpy(&x, &u, 4);
    return x;
}

/* Element i of an operand of cudaDataType `type` (f32 or bf16). */
static float host_elem(const void *p, int type, int64_t i) {
    return type == GTC_R_16BF ? gtc_bf16(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* C = alpha op(A) op(B) + beta C, column-major, A and B f32 or bf16, C f32, as cublasGemmEx
 * defines it. */
static int host_gemm(void *, int ta, int tb, int m, int n, int k, const void *alpha_, const void *A, int at,
                     int lda, const void *B, int bt, int ldb, const void *beta_, void *C_, int, int ldc, int compute,
                     int) {
    const float alpha = *(const float *)alpha_, beta = *(const float *)beta_;
    float *C = (float *)C_;
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) {
            double acc = 0.0;
            for (int l = 0; l < k; l++) {
                const float av = host_elem(A, at, ta == GTC_OP_N ? i + (int64_t)l * lda : l + (int64_t)i * lda);
                const float bv = host_elem(B, bt, tb == GTC_OP_N ? l + (int64_t)j * ldb : j + (int64_t)l * ldb);
                acc += (double)host_input(av, compute) * host_input(bv, compute);
            }
            float *c = C + i + (int64_t)j * ldc;
            *c = (float)(alpha * acc + (beta != 0.0f ? beta * *c : 0.0f));
        }
    return 0;
}

static int host_gemm_strided(void *h, int ta, int tb, int m, int n, int k, const void *alpha, const void *A,
                             int at, int lda, long long sa, const void *B, int bt, int ldb, long long sb,
                             const void *beta, void *C, int ct, int ldc, long long sc, int batch, int compute,
                             int algo) {
    const int ea = at == GTC_R_16BF ? 2 : 4, eb = bt == GTC_R_16BF ? 2 : 4;
    for (int i = 0; i < batch; i++)
        host_gemm(h, ta, tb, m, n, k, alpha, (const char *)A + i * sa * ea, at, lda, (const char *)B + i * sb * eb,
                  bt, ldb, beta, (float *)C + i * sc, ct, ldc, compute, algo);
    return 0;
}

extern "C" int gtc_test_host_blas(void) {
    g_host_blas = 1;
    g_blas.handle = &g_host_blas;
    g_blas.gemm = host_gemm;
    g_blas.gemm_strided = host_gemm_strided;
    g_blas.compute = GTC_COMPUTE_32F;
    g_blas.bf16 = 0;
    return GT_OK;
}

/* The precisions of the f32 products, by name: cuBLAS's compute type and the words --help and
 * errors use (the one table: gtc_math_name lists it for the Python side). */
static const struct {
    const char *name;
    int compute, bf16;
} g_maths[] = {{"f32", GTC_COMPUTE_32F, 0}, {"tf32", GTC_COMPUTE_32F_FAST_TF32, 0}, {"bf16", GTC_COMPUTE_32F, 1}};

extern "C" const char *gtc_math_name(int32_t i) {
    return i >= 0 && i < (int32_t)(sizeof g_maths / sizeof g_maths[0]) ? g_maths[i].name : NULL;
}

extern "C" int gtc_set_math(const char *name) {
    if (!g_blas.handle) return GTC_FAIL(GT_ERR_INVALID, "gtc_set_math: gtc_init has not run");
    char names[64] = "";
    for (const auto &m : g_maths) {
        if (name && !strcmp(name, m.name)) return (g_blas.compute = m.compute, g_blas.bf16 = m.bf16, GT_OK);
        const size_t used = strlen(names);
        snprintf(names + used, sizeof names - used, "%s%s", used ? ", " : "", m.name);
    }
    return GTC_FAIL(GT_ERR_INVALID, "matrix products in %s: expected one of %s", name ? name : "(null)", names);
}

/* ---- f32 products ---------------------------------------------------------------------------- */

/* One operand's last two dims as cuBLAS sees them (column-major): op and leading dim. */
struct operand {
    int op;
    int64_t ld;
};

static int layout(const gt_tensor *t, const char *what, operand *o) {
    const int nd = t->ndim;
    const int64_t R = t->shape[nd - 2], C = t->shape[nd - 1], sr = t->strides[nd - 2], sc = t->strides[nd - 1];
    if (sc == 1 || C == 1) {            /* rows of C contiguous floats: X^T column-major, ld sr */
        o->op = GTC_OP_N;
        o->ld = R == 1 ? (C > sr ? C : sr) : sr;   /* (one row: its stride is never used) */
        if (o->ld < C) return GTC_FAIL(GT_ERR_INVALID, "matmul: %s's rows overlap (row stride %lld < %lld "
                                       "columns): cuBLAS cannot read that view", what, (long long)sr, (long long)C);
    } else if (sr == 1 || R == 1) {     /* columns contiguous: X column-major, ld sc; X^T = op T */
        o->op = GTC_OP_T;
        o->ld = C == 1 || R == 1 ? (sc < R ? R : sc) : sc;
        if (o->ld < R) return GTC_FAIL(GT_ERR_INVALID, "matmul: %s's columns overlap (column stride %lld < %lld "
                                       "rows): cuBLAS cannot read that view", what, (long long)sc, (long long)R);
    } else {
        return GTC_FAIL(GT_ERR_INVALID, "matmul: %s needs a unit stride in one of its last two dims", what);
    }
    return GT_OK;
}

/* ---- bf16 operands (gtc_set_math "bf16") ------------------------------------------------------ */

/* Elements of memory a view covers, from its first element to its last (strides >= 0: every
 * view the plans make); -1 for a negative stride. */
static int64_t span(const gt_tensor *t) {
    if (gtc_numel(*t) == 0) return 0;
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) {
        if (t->strides[i] < 0) return -1;
        n += (t->shape[i] - 1) * t->strides[i];
    }
    return n;
}

static int64_t align256(int64_t bytes) { return (bytes + 255) / 256 * 256; }

/* Work bytes a product of a and b takes for its bf16 operands (0 unless bf16 is the math). */
static int64_t bf16_bytes(const gt_tensor *a, const gt_tensor *b) {
    if (!g_blas.bf16) return 0;
    const int64_t na = span(a), nb = span(b);
    return na < 0 || nb < 0 ? 0 : align256(na * 2) + align256(nb * 2);
}

__global__ void round_bf16_kernel(uint16_t *y, const float *x, int64_t n) { GTC_FOR(i, n) y[i] = gtc_to_bf16(x[i]); }

/* y[i] = x[i] rounded to bf16, i < n (on the host under the stand-in of cuBLAS). */
static int round_bf16(uint16_t *y, const float *x, int64_t n, const char *op) {
    if (g_host_blas) {
        for (int64_t i = 0; i < n; i++) y[i] = gtc_to_bf16(x[i]);
        return GT_OK;
    }
    round_bf16_kernel<<<gtc_blocks(n), GTC_THREADS, 0, gtc_stream_()>>>(y, x, n);
    return GTC_LAUNCHED(op);
}

/* dst (..., M, N) = a (..., M, K) @ b (..., K, N) (+ dst with beta = 1), batch dims broadcast;
 * b's data may be another pointer than b->data (a decoded weight). Under bf16 math, `half`
 * (half_bytes of work memory) takes the operands rounded to bf16. */
static int gemm(const gt_tensor *d, const gt_tensor *a, const gt_tensor *b, const float *bdata, const char *op,
                void *half, int64_t half_bytes, float beta = 0.0f) {
    if (d->ndim < 2 || a->ndim < 2 || b->ndim < 2)
        return GTC_FAIL(GT_ERR_SHAPE, "%s: operands need two dims", op);
    const int64_t M = a->shape[a->ndim - 2], K = a->shape[a->ndim - 1], N = b->shape[b->ndim - 1];
    if (b->shape[b->ndim - 2] != K || d->shape[d->ndim - 2] != M || d->shape[d->ndim - 1] != N)
        return GTC_FAIL(GT_ERR_SHAPE, "%s: (%lld, %lld) @ (%lld, %lld) into (%lld, %lld)", op, (long long)M,
                        (long long)K, (long long)b->shape[b->ndim - 2], (long long)N,
                        (long long)d->shape[d->ndim - 2], (long long)d->shape[d->ndim - 1]);
    if (!gtc_contiguous(*d)) return GTC_FAIL(GT_ERR_INVALID, "%s: dst must be contiguous", op);
    if (M > INT32_MAX || N > INT32_MAX || K > INT32_MAX)
        return GTC_FAIL(GT_ERR_UNSUPPORTED, "%s: a dim beyond 2^31", op);
    if (!g_blas.handle) return GTC_FAIL(GT_ERR_INVALID, "%s: cuBLAS is not loaded", op);
    if (a->ndim > d->ndim || b->ndim > d->ndim)
        return GTC_FAIL(GT_ERR_SHAPE, "%s: dst must have at least as many dims as the inputs", op);
    for (int i = 0; i < d->ndim - 2; i++) {     /* batch dims: each input's 1 or dst's */
        const int ia = i - (d->ndim - a->ndim), ib = i - (d->ndim - b->ndim);
        const int64_t na = ia >= 0 ? a->shape[ia] : 1, nbb = ib >= 0 ? b->shape[ib] : 1, n = d->shape[i];
        if ((na != 1 && na != n) || (nbb != 1 && nbb != n) || (n != (na != 1 ? na : nbb)))
            return GTC_FAIL(GT_ERR_SHAPE, "%s: batch dim %d does not broadcast: src0 %lld, src1 %lld, dst %lld", op,
                            i, (long long)na, (long long)nbb, (long long)n);
    }
    /* the batches: dst's leading dims, each operand broadcast to them */
    gt_tensor batch = *d;
    batch.ndim = d->ndim - 2;
    gt_tensor ab = *a, bb = *b;
    ab.ndim = a->ndim - 2;
    bb.ndim = b->ndim - 2;
    const int64_t nb = gtc_numel(batch);
    float *dd = (float *)d->data;
    const float *ad = (const float *)a->data;
    const float alpha = 1.0f;
    if (M == 0 || N == 0 || nb == 0) return GT_OK;    /* nothing to fill: the strides are moot */
    if (K == 0 && beta != 0.0f) return GT_OK;          /* nothing to add */
    if (K == 0) {                                      /* empty sums: zeros, whatever the strides */
        if (g_host_blas) return (memset(dd, 0, (size_t)(nb * M * N) * 4), GT_OK);
        return GTC_CUDA(cudaMemsetAsync(dd, 0, (size_t)(nb * M * N) * 4, gtc_stream_()), op);
    }
    operand oa = {GTC_OP_N, 0}, ob = {GTC_OP_N, 0};
    GTC_TRY(layout(a, "src0", &oa));
    GTC_TRY(layout(b, "src1", &ob));
    /* the operands as cuBLAS reads them: f32 as they are, or rounded to bf16 into `half` */
    const char *A = (const char *)ad, *B = (const char *)bdata;
    int type = GTC_R_32F, es = 4;
    if (g_blas.bf16) {
        const int64_t na = span(a), nbb = span(b);
        if (na < 0 || nbb < 0) return GTC_FAIL(GT_ERR_INVALID, "%s: bf16 products need strides >= 0", op);
        if (!half || half_bytes < bf16_bytes(a, b))
            return GTC_FAIL(GT_ERR_INVALID, "%s: needs %lld bytes of work memory for its bf16 operands, got %lld", op,
                            (long long)bf16_bytes(a, b), (long long)(half ? half_bytes : 0));
        uint16_t *ha = (uint16_t *)half, *hb = (uint16_t *)((char *)half + align256(na * 2));
        GTC_TRY(round_bf16(ha, ad, na, op));
        GTC_TRY(round_bf16(hb, bdata, nbb, op));
        A = (const char *)ha;
        B = (const char *)hb;
        type = GTC_R_16BF;
        es = 2;
    }
    /* one strided-batched call when each operand's batch offsets step evenly */
    const int64_t sa = nb > 1 ? gtc_offset(ab, batch, 1) : 0, sb = nb > 1 ? gtc_offset(bb, batch, 1) : 0;
    bool even = nb > 1;
    for (int64_t i = 2; even && i < nb; i++)
        even = gtc_offset(ab, batch, i) == i * sa && gtc_offset(bb, batch, i) == i * sb;
    int st;
    if (even && nb <= INT32_MAX) {
        st = g_blas.gemm_strided(g_blas.handle, ob.op, oa.op, (int)N, (int)M, (int)K, &alpha, B, type, (int)ob.ld, sb,
                                 A, type, (int)oa.ld, sa, &beta, dd, GTC_R_32F, (int)N, M * N, (int)nb,
                                 g_blas.compute, GTC_GEMM_DEFAULT);
        if (st) return GTC_FAIL(GT_ERR_UNSUPPORTED, "%s: cublasGemmStridedBatchedEx failed (status %d)", op, st);
        return g_host_blas ? GT_OK : GTC_LAUNCHED(op);
    }
    for (int64_t i = 0; i < nb; i++) {
        st = g_blas.gemm(g_blas.handle, ob.op, oa.op, (int)N, (int)M, (int)K, &alpha, B + gtc_offset(bb, batch, i) * es,
                         type, (int)ob.ld, A + gtc_offset(ab, batch, i) * es, type, (int)oa.ld, &beta,
                         dd + i * M * N, GTC_R_32F, (int)N, g_blas.compute, GTC_GEMM_DEFAULT);
        if (st) return GTC_FAIL(GT_ERR_UNSUPPORTED, "%s: cublasGemmEx failed (status %d)", op, st);
    }
    return g_host_blas ? GT_OK : GTC_LAUNCHED(op);
}

/* Work memory: the bf16 operands of the product, and of matmul_lora's second product. */
GTC_SIZES(matmul_fwd_f32) {
    *scratch = 0;
    *work = 0;
    if (node->n_src >= 2) *work = bf16_bytes(&node->src[0], &node->src[1]);
    if (node->n_src >= 4) {
        const int64_t second = bf16_bytes(&node->src[2], &node->src[3]);
        *work = second > *work ? second : *work;
    }
    return GT_OK;
}

/* matmul_lora's second product, dst += src2 (..., M, R) @ src3 (R, N) (ggtrain.h). */
static int lora_product(const gt_node *node, const char *op, void *half, int64_t half_bytes) {
    const gt_tensor *d = &node->dst, *h = &node->src[2], *bt = &node->src[3];
    GTC_F32(h, op, "src2 (h)");
    GTC_F32(bt, op, "src3 (B^T)");
    bool same = h->ndim == d->ndim && bt->ndim == 2 && bt->shape[1] == d->shape[d->ndim - 1] &&
                h->shape[h->ndim - 1] == bt->shape[0] && bt->shape[0] > 0;
    for (int i = 0; same && i < d->ndim - 1; i++) same = h->shape[i] == d->shape[i];
    if (!same)
        return GTC_FAIL(GT_ERR_SHAPE, "%s: expected h (..., M, R) with dst's leading dims and B^T (R, N), got h of "
                        "%d dims and B^T of %d", op, h->ndim, bt->ndim);
    GTC_TRY(gtc_check_contig_(h, op, "src2 (h)"));
    return gemm(d, h, bt, (const float *)bt->data, op, half, half_bytes, 1.0f);
}

static int f32_matmul(const gt_node *node, const gt_ctx *ctx, const char *op, bool lora) {
    GTC_TRY(gtc_check_n_src_(node, lora ? 4 : 2, lora ? 4 : 2, op));
    GTC_F32(&node->dst, op, "dst");
    GTC_F32(&node->src[0], op, "src0");
    GTC_F32(&node->src[1], op, "src1");
    GTC_TRY(gemm(&node->dst, &node->src[0], &node->src[1], (const float *)node->src[1].data, op, ctx->wdata,
                 ctx->wsize));
    return lora ? lora_product(node, op, ctx->wdata, ctx->wsize) : GT_OK;
}

GTC_LAUNCHER(matmul_fwd_f32) { return f32_matmul(node, ctx, "matmul", false); }

/* matmul_lora: the product, then the adapter's added by a second cuBLAS product (beta = 1). */
GTC_SIZES(matmul_lora_fwd_f32) { return gtc_s_matmul_fwd_f32(node, scratch, work); }
GTC_LAUNCHER(matmul_lora_fwd_f32) { return f32_matmul(node, ctx, "matmul_lora", true); }

/* ---- stored weights -------------------------------------------------------------------------- */

/* W (R, C) of a stored view of type `type` (checks.h's words): W^T (shape (C, R), strides
 * (1, C)) or W (shape (R, C), strides (C, 1)). */
static int weight_dims(const gt_tensor *w, int32_t type, int64_t *R, int64_t *C, const char *op, int data) {
    int trans = 0;
    GTC_TRY(gt_weight_view_check(w, type, gtc_block_elems(type), op, data, &trans));
    *R = w->shape[trans ? 1 : 0];
    *C = w->shape[trans ? 0 : 1];
    return GT_OK;
}

__global__ void decode_blocks(float *y, const uint8_t *w, int32_t type, int64_t n_blocks, int be, int bb) {
    GTC_FOR(i, n_blocks) gtc_decode_block(type, w + i * bb, y + i * be);
}

static int decode(float *y, const gt_tensor *w, int64_t R, int64_t C) {
    const int be = gtc_block_elems(w->dtype), bb = gtc_block_bytes(w->dtype);
    const int64_t n = R * C / be;
    decode_blocks<<<gtc_blocks(n), GTC_THREADS, 0, gtc_stream_()>>>(y, (const uint8_t *)w->data, w->dtype, n, be, bb);
    return GTC_LAUNCHED("decoding a stored weight");
}

static int weight_sizes(const gt_node *node, int32_t type, int64_t *scratch, int64_t *work) {
    int64_t R = 0, C = 0;
    *scratch = 0;
    *work = 0;
    if (node->n_src < 2 || node->src[1].dtype != type) return GT_OK;
    GTC_TRY(weight_dims(&node->src[1], type, &R, &C, "matmul", 0));
    int64_t half = bf16_bytes(&node->src[0], &node->src[1]);
    if (node->n_src >= 4) {
        const int64_t second = bf16_bytes(&node->src[2], &node->src[3]);
        half = second > half ? second : half;
    }
    *work = (half ? align256(R * C * (int64_t)sizeof(float)) : R * C * (int64_t)sizeof(float)) + half;
    return GT_OK;
}

static int weight_matmul(const gt_node *node, const gt_ctx *ctx, int32_t type, const char *op, bool lora = false) {
    GTC_TRY(gtc_check_n_src_(node, lora ? 4 : 2, lora ? 4 : 2, op));
    GTC_F32(&node->dst, op, "dst");
    GTC_F32(&node->src[0], op, "src0");
    int64_t R = 0, C = 0;
    GTC_TRY(weight_dims(&node->src[1], type, &R, &C, op, 1));
    if (!ctx->wdata || ctx->wsize < R * C * (int64_t)sizeof(float))
        return GTC_FAIL(GT_ERR_INVALID, "%s: needs %lld bytes of scratch (the decoded weight), got %lld", op,
                        (long long)(R * C * 4), (long long)ctx->wsize);
    float *y = (float *)ctx->wdata;
    const int64_t at = align256(R * C * (int64_t)sizeof(float));   /* the bf16 operands, past the weight */
    void *half = ctx->wsize > at ? (char *)ctx->wdata + at : NULL;
    const int64_t half_bytes = ctx->wsize > at ? ctx->wsize - at : 0;
    GTC_TRY(decode(y, &node->src[1], R, C));
    GTC_TRY(gemm(&node->dst, &node->src[0], &node->src[1], y, op, half, half_bytes));
    return lora ? lora_product(node, op, half, half_bytes) : GT_OK;
}

__global__ void get_rows_blocks(float *d, const uint8_t *w, const int32_t *idx, int64_t n, int64_t V, int64_t C,
                                int64_t row_bytes, int32_t type, int be, int bb, GTC_ERR_ARGS) {
    const int64_t per = C / be;
    GTC_FOR(i, n * per) {
        const int64_t r = i / per, k = i % per;
        const int32_t v = idx[r];
        if (v < 0 || v >= V) {
            GTC_RAISE(GTC_DEV_GET_ROWS, r, v, V);
            continue;
        }
        gtc_decode_block(type, w + v * row_bytes + k * bb, d + r * C + k * be);
    }
}

static int weight_get_rows(const gt_node *node, int32_t type, const char *op) {
    GTC_TRY(gtc_check_n_src_(node, 2, 2, op));
    const gt_tensor *d = &node->dst, *w = &node->src[0], *ix = &node->src[1];
    GTC_F32(d, op, "dst");
    GTC_I32(ix, op, "idx");
    if (w->dtype != type)
        return GTC_FAIL(GT_ERR_DTYPE, "%s: expected a table of dtype %s, got %s", op, gt_type_name(type),
                        gt_type_name(w->dtype));
    if (w->ndim != 2 || w->strides[1] != 1 || w->strides[0] != w->shape[1])
        return GTC_FAIL(GT_ERR_INVALID, "%s: the table must be a whole stored matrix", op);
    GTC_TRY(gtc_check_contig_(ix, op, "idx"));
    GTC_TRY(gtc_check_contig_(d, op, "dst"));
    const int64_t V = w->shape[0], C = w->shape[1], n = gtc_numel(*ix);
    const int be = gtc_block_elems(type), bb = gtc_block_bytes(type);
    if (C % be) return GTC_FAIL(GT_ERR_INVALID, "%s: rows of %lld are not whole blocks", op, (long long)C);
    if (gtc_numel(*d) != n * C) return GTC_FAIL(GT_ERR_SHAPE, "%s: dst must hold %lld rows of %lld", op,
                                                (long long)n, (long long)C);
    get_rows_blocks<<<gtc_blocks(n * (C / be)), GTC_THREADS, 0, gtc_stream_()>>>(
        (float *)d->data, (const uint8_t *)w->data, (const int32_t *)ix->data, n, V, C, C / be * bb, type, be, bb,
        GTC_ERR_PASS);
    return GTC_LAUNCHED(op);
}

#define GTC_WEIGHT_KERNELS(name, type)                                                                   \
    GTC_SIZES(matmul_fwd_f32_##name) { return weight_sizes(node, type, scratch, work); }                 \
    GTC_LAUNCHER(matmul_fwd_f32_##name) { return weight_matmul(node, ctx, type, "matmul_" #name); }     \
    GTC_SIZES(matmul_lora_fwd_f32_##name) { return weight_sizes(node, type, scratch, work); }            \
    GTC_LAUNCHER(matmul_lora_fwd_f32_##name) {                                                           \
        return weight_matmul(node, ctx, type, "matmul_lora_" #name, true);                               \
    }                                                                                                    \
    GTC_LAUNCHER(get_rows_fwd_f32_##name) {                                                              \
        (void)ctx;                                                                                       \
        return weight_get_rows(node, type, "get_rows_" #name);                                           \
    }
GT_WEIGHT_TYPES(GTC_WEIGHT_KERNELS)

/* ---- the host's copy of the decoder ---------------------------------------------------------- */

extern "C" int gtc_dequantize_row_host(float *dst, const void *src, int32_t dtype, int64_t n) {
    const int be = gtc_block_elems(dtype), bb = gtc_block_bytes(dtype);
    if (!be) return GTC_FAIL(GT_ERR_UNSUPPORTED, "dequantize: type %d has no decoder", (int)dtype);
    if (n % be) return GTC_FAIL(GT_ERR_INVALID, "dequantize: %lld elements are not whole blocks", (long long)n);
    const uint8_t *b = (const uint8_t *)src;
    for (int64_t i = 0; i < n / be; i++) gtc_decode_block(dtype, b + i * bb, dst + i * be);
    return GT_OK;
}

/* ---- linear_cross_entropy: the loss over a frozen output matrix, logits never held ------------ */

/* ggtrain.h's linear_cross_entropy, as the CPU kernel computes it (FlashAttention's running
 * softmax over the vocabulary), with the GPU's sizes: W is taken in blocks of vb vocabulary
 * rows (as many as keep a block's logits of all N rows within XENT_LOGITS floats); per block
 * a stored W's rows are decoded into the work memory, cuBLAS makes the logits L = x W_b^T
 * (N, vb), one thread block per row takes them into its running max and sum of exps (the
 * row's gradient accumulator, dst's dx row, multiplied by exp(old max - new max) when the max
 * grows) and leaves in L the exps times the logits' derivative, and cuBLAS adds L W_b into
 * the accumulators. At the end dx = acc / sum - dl_t W_t, nll = max + log(sum) - l_t, both
 * divided by the counted rows under ip[0]. Each row's bits depend on vb (so on N), not on
 * the other rows' values. */
#define XENT_LOGITS ((int64_t)1 << 24)
#define XENT_THREADS 256

struct xent_layout {
    int64_t vb;                     /* vocabulary rows a block */
    int64_t sum, m, ly, dy, count;  /* byte offsets in the work memory */
    int64_t logits, wblock, total;
};

static xent_layout xent_plan(int64_t N, int64_t C, int64_t V, bool stored) {
    xent_layout p;
    int64_t vb = N > 0 ? XENT_LOGITS / N / 256 * 256 : V;
    vb = vb < 256 ? 256 : vb;
    p.vb = vb > V ? V : vb;
    const int64_t nf = (N + 63) / 64 * 64 * (int64_t)sizeof(float);   /* one float a row, 256-byte aligned */
    p.sum = 0;                                           /* doubles */
    p.m = p.sum + 2 * nf;
    p.ly = p.m + nf;
    p.dy = p.ly + nf;
    p.count = p.dy + nf;
    p.logits = p.count + 256;
    p.wblock = p.logits + (N * p.vb * (int64_t)sizeof(float) + 255) / 256 * 256;
    p.total = p.wblock + (stored ? p.vb * C * (int64_t)sizeof(float) : 0);
    return p;
}

/* Running state, and the counted rows (targets in [0, V); one at or past V is raised). */
__global__ void xent_start(double *sum, float *m, float *ly, float *dy, float *count, const int32_t *t, int64_t N,
                           int64_t V, GTC_ERR_ARGS) {
    __shared__ double sh[32];
    double c = 0.0;
    for (int64_t r = threadIdx.x; r < N; r += blockDim.x) {
        sum[r] = 0.0;
        m[r] = -INFINITY;
        ly[r] = dy[r] = 0.0f;
        if (t[r] >= V) GTC_RAISE(GTC_DEV_TARGET, r, t[r], V);
        c += t[r] >= 0 && t[r] < V ? 1.0 : 0.0;
    }
    c = gtc_block_sum(c, sh);
    if (threadIdx.x == 0) *count = (float)c;
}

/* Row r's block of logits l (nv, from vocabulary row v0) into its running softmax (the CPU's
 * xent_block_row): l <- s l, or cap tanh(s l / cap); then l <- exp(l - m_new) times the
 * derivative of the transformed logit; the target's logit and derivative kept; the
 * accumulator row (C) rescaled when the max grew and an earlier block added to it. */
__global__ void xent_block(float *L, int64_t nv, int64_t v0, const int32_t *t, int64_t V, double *sum, float *m,
                           float *ly, float *dy, float *acc, int64_t C, float s, float cap, int grad) {
    __shared__ float shf[32];
    __shared__ double shd[32];
    const int64_t r = blockIdx.x;
    const int32_t tr = t[r];
    float *l = L + r * nv;
    if (tr < 0 || tr >= V) {        /* ignored: nothing added to its accumulator */
        for (int64_t j = threadIdx.x; j < nv; j += blockDim.x) l[j] = 0.0f;
        return;
    }
    float mb = -INFINITY;
    for (int64_t j = threadIdx.x; j < nv; j += blockDim.x) {
        float z = l[j];
        z = cap > 0.0f ? cap * tanhf(s * z / cap) : (s != 1.0f ? z * s : z);
        l[j] = z;
        mb = fmaxf(mb, z);
    }
    mb = gtc_block_max(mb, shf);     /* (its barriers make every l[j] visible) */
    const float m0 = m[r], mn = mb > m0 ? mb : m0;
    if (threadIdx.x == 0 && tr >= v0 && tr < v0 + nv) {
        const float lt = l[tr - v0];
        ly[r] = lt;
        dy[r] = cap > 0.0f ? s * (1.0f - (lt / cap) * (lt / cap)) : s;
    }
    __syncthreads();
    float e = 0.0f;
    for (int64_t j = threadIdx.x; j < nv; j += blockDim.x) {
        const float q = gt_expf_(l[j] - mn);
        e += q;
        if (cap > 0.0f) {
            const float u = l[j] / cap;
            l[j] = q * s * (1.0f - u * u);
        } else {
            l[j] = s != 1.0f ? q * s : q;
        }
    }
    const double es = gtc_block_sum((double)e, shd);
    const float alpha = m0 == -INFINITY ? 0.0f : gt_expf_(m0 - mn);
    if (grad && v0 > 0 && alpha != 1.0f)
        for (int64_t k = threadIdx.x; k < C; k += blockDim.x) acc[r * C + k] *= alpha;
    if (threadIdx.x == 0) {
        sum[r] = sum[r] * (double)alpha + es;
        m[r] = mn;
    }
}

/* dx[r] = (acc[r] / sum - dl_t W[t]) * k, nll[r] = (m + log(sum) - l_t) * k, k = 1 or 1 /
 * count; zeros for an ignored row (and dx zeros without grad). W: f32 rows, or stored rows
 * of `type` (row_bytes each) decoded a block at a time. */
__global__ void xent_finish(float *dx, float *nll, const int32_t *t, int64_t V, const double *sum, const float *m,
                            const float *ly, const float *dy, const float *count, const uint8_t *w, int32_t type,
                            int64_t row_bytes, int64_t C, int mean, int grad) {
    const int64_t r = blockIdx.x;
    const int32_t tr = t[r];
    float *dr = dx + r * C;
    if (tr < 0 || tr >= V || !grad)
        for (int64_t k = threadIdx.x; k < C; k += blockDim.x) dr[k] = 0.0f;
    if (tr < 0 || tr >= V) {
        if (threadIdx.x == 0) nll[r] = 0.0f;
        return;
    }
    const float scale = mean ? (*count > 0.0f ? 1.0f / *count : 0.0f) : 1.0f;
    if (threadIdx.x == 0) nll[r] = (float)(((double)m[r] + log(sum[r]) - (double)ly[r]) * (double)scale);
    if (!grad) return;
    const float inv = (float)(1.0 / sum[r]), c = dy[r];
    const uint8_t *wt = w + tr * row_bytes;
    const int be = gtc_block_elems(type), bb = gtc_block_bytes(type);
    float y[256];
    for (int64_t kb = threadIdx.x; kb < C / be; kb += blockDim.x) {
        gtc_decode_block(type, wt + kb * bb, y);
        for (int i = 0; i < be; i++) {
            const int64_t k = kb * be + i;
            dr[k] = (dr[k] * inv - c * y[i]) * scale;
        }
    }
}

static int xent_check(const gt_node *node, int32_t wtype, const char *op, int64_t *row_bytes) {
    const gt_tensor *d = &node->dst, *x = &node->src[0], *w = &node->src[1], *tg = &node->src[2];
    GTC_TRY(gtc_check_n_src_(node, 3, 3, op));
    GTC_F32(x, op, "x (src0)");
    GTC_F32(d, op, "dst");
    GTC_I32(tg, op, "targets (src2)");
    if (x->ndim != 2 || w->ndim != 2 || tg->ndim != 1 || tg->shape[0] != x->shape[0] ||
        w->shape[1] != x->shape[1] || x->shape[1] < 1)
        return GTC_FAIL(GT_ERR_SHAPE, "%s: expected x (N, C), W (V, C) and targets (N,), got x of %d dims, "
                        "W of %d, targets of %d", op, x->ndim, w->ndim, tg->ndim);
    const int64_t N = x->shape[0], C = x->shape[1];
    if (d->ndim != 1 || d->shape[0] != N * C + N)
        return GTC_FAIL(GT_ERR_SHAPE, "%s: expected dst (N C + N,) = (%lld,)", op, (long long)(N * C + N));
    GTC_TRY(gtc_check_contig_(x, op, "x (src0)"));
    GTC_TRY(gtc_check_contig_(tg, op, "targets (src2)"));
    GTC_TRY(gtc_check_contig_(d, op, "dst"));
    if (wtype == GT_F32) {
        GTC_F32(w, op, "W (src1)");
        GTC_TRY(gtc_check_contig_(w, op, "W (src1)"));
        *row_bytes = C * (int64_t)sizeof(float);
    } else {
        int trans = 0;
        GTC_TRY(gt_weight_view_check(w, wtype, gtc_block_elems(wtype), op, 1, &trans));
        if (trans) return GTC_FAIL(GT_ERR_INVALID, "%s: expected W (V, C) as stored, got its transpose", op);
        *row_bytes = C / gtc_block_elems(wtype) * gtc_block_bytes(wtype);
    }
    if (N > INT32_MAX || C > INT32_MAX || w->shape[0] > INT32_MAX)
        return GTC_FAIL(GT_ERR_UNSUPPORTED, "%s: a dim beyond 2^31", op);
    return GT_OK;
}

static int linear_xent(const gt_node *node, const gt_ctx *ctx, int32_t wtype) {
    const char *op = "linear_cross_entropy";
    int64_t row_bytes = 0;
    GTC_TRY(xent_check(node, wtype, op, &row_bytes));
    const gt_tensor *x = &node->src[0], *w = &node->src[1], *tg = &node->src[2];
    const int64_t N = x->shape[0], C = x->shape[1], V = w->shape[0];
    if (N == 0) return GT_OK;
    if (!g_blas.handle || g_host_blas) return GTC_FAIL(GT_ERR_INVALID, "%s: cuBLAS is not loaded", op);
    const bool stored = wtype != GT_F32;
    const xent_layout p = xent_plan(N, C, V, stored);
    if (!ctx->wdata || ctx->wsize < p.total)
        return GTC_FAIL(GT_ERR_INVALID, "%s: needs %lld bytes of work memory, got %lld", op, (long long)p.total,
                        (long long)(ctx->wdata ? ctx->wsize : 0));
    char *work = (char *)ctx->wdata;
    double *sum = (double *)(work + p.sum);
    float *m = (float *)(work + p.m), *ly = (float *)(work + p.ly), *dy = (float *)(work + p.dy),
          *count = (float *)(work + p.count), *L = (float *)(work + p.logits), *wb = (float *)(work + p.wblock);
    float *dx = (float *)node->dst.data, *nll = dx + N * C;
    const float *xd = (const float *)x->data;
    const int32_t *td = (const int32_t *)tg->data;
    const uint8_t *wd = (const uint8_t *)w->data;
    const float s = node->fp[0], cap = node->fp[1];
    const int grad = node->ip[1] != 0;
    cudaStream_t st = gtc_stream_();
    xent_start<<<1, 1024, 0, st>>>(sum, m, ly, dy, count, td, N, V, GTC_ERR_PASS);
    GTC_TRY(GTC_LAUNCHED(op));
    const float one = 1.0f, zero = 0.0f;
    for (int64_t v0 = 0; v0 < V; v0 += p.vb) {
        const int64_t nv = V - v0 < p.vb ? V - v0 : p.vb;
        const float *blk = (const float *)(wd + v0 * row_bytes);
        if (stored) {
            const int be = gtc_block_elems(wtype), bb = gtc_block_bytes(wtype);
            const int64_t nb = nv * C / be;
            decode_blocks<<<gtc_blocks(nb), GTC_THREADS, 0, st>>>(wb, wd + v0 * row_bytes, wtype, nb, be, bb);
            GTC_TRY(GTC_LAUNCHED(op));
            blk = wb;
        }
        /* L (N, nv) row-major = (W_b x^T) column-major */
        int rc = g_blas.gemm(g_blas.handle, GTC_OP_T, GTC_OP_N, (int)nv, (int)N, (int)C, &one, blk, GTC_R_32F, (int)C,
                             xd, GTC_R_32F, (int)C, &zero, L, GTC_R_32F, (int)nv, g_blas.compute, GTC_GEMM_DEFAULT);
        if (rc) return GTC_FAIL(GT_ERR_UNSUPPORTED, "%s: cublasGemmEx failed (status %d)", op, rc);
        xent_block<<<(unsigned)N, XENT_THREADS, 0, st>>>(L, nv, v0, td, V, sum, m, ly, dy, dx, C, s, cap, grad);
        GTC_TRY(GTC_LAUNCHED(op));
        if (grad) {   /* acc (N, C) += L W_b: (W_b^T L^T) column-major */
            const float beta = v0 > 0 ? 1.0f : 0.0f;
            rc = g_blas.gemm(g_blas.handle, GTC_OP_N, GTC_OP_N, (int)C, (int)N, (int)nv, &one, blk, GTC_R_32F, (int)C,
                             L, GTC_R_32F, (int)nv, &beta, dx, GTC_R_32F, (int)C, g_blas.compute, GTC_GEMM_DEFAULT);
            if (rc) return GTC_FAIL(GT_ERR_UNSUPPORTED, "%s: cublasGemmEx failed (status %d)", op, rc);
        }
    }
    xent_finish<<<(unsigned)N, XENT_THREADS, 0, st>>>(dx, nll, td, V, sum, m, ly, dy, count, wd, wtype, row_bytes, C,
                                                       node->ip[0] != 0, grad);
    return GTC_LAUNCHED(op);
}

static int linear_xent_sizes(const gt_node *node, int32_t wtype, int64_t *scratch, int64_t *work) {
    const gt_tensor *x = &node->src[0], *w = &node->src[1];
    *scratch = 0;
    *work = 0;
    if (node->n_src < 2 || x->ndim != 2 || w->ndim != 2) return GT_OK;   /* (the launcher says what is wrong) */
    *work = xent_plan(x->shape[0], x->shape[1], w->shape[0], wtype != GT_F32).total;
    return GT_OK;
}

GTC_SIZES(linear_cross_entropy_fwd_f32) { return linear_xent_sizes(node, GT_F32, scratch, work); }
GTC_LAUNCHER(linear_cross_entropy_fwd_f32) { return linear_xent(node, ctx, GT_F32); }

#define GTC_XENT_KERNELS(name, type)                                                                     \
    GTC_SIZES(linear_cross_entropy_fwd_f32_##name) { return linear_xent_sizes(node, type, scratch, work); } \
    GTC_LAUNCHER(linear_cross_entropy_fwd_f32_##name) { return linear_xent(node, ctx, type); }
GT_WEIGHT_TYPES(GTC_XENT_KERNELS)
