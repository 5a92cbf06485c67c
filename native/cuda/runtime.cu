/* runtime.cu: the CUDA library's device, memory, errors, kernel table and plan runner. */
#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.cuh"
#include "cublas.cuh"
#include "kernels.h"

extern "C" {
#include "gtc.h"
}

/* ---- errors ---------------------------------------------------------------------------------- */

static thread_local char g_error[1024];

int gtc_set_error_(int code, const char *file, int line, const char *fmt, ...) {
    char msg[896];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    const char *base = strrchr(file, '/');
    snprintf(g_error, sizeof g_error, "%s (%s:%d)", msg, base ? base + 1 : file, line);
    return code;
}

extern "C" const char *gtc_last_error(void) { return g_error; }
extern "C" void gtc_clear_error(void) { g_error[0] = 0; }

int gtc_cuda_check_(cudaError_t err, const char *what, const char *file, int line) {
    if (err == cudaSuccess) return GT_OK;
    const int code = err == cudaErrorMemoryAllocation ? GT_ERR_NOMEM : GT_ERR_UNSUPPORTED;
    return gtc_set_error_(code, file, line, "%s: CUDA error %d (%s): %s", what, (int)err, cudaGetErrorName(err),
                          cudaGetErrorString(err));
}

/* ---- the device ------------------------------------------------------------------------------ */

static cudaStream_t g_stream;
static int g_ready = 0;
static int g_device = 0;
static int32_t g_node = 0;
static unsigned long long *g_error_word = NULL;

cudaStream_t gtc_stream_(void) { return g_stream; }
int32_t gtc_node_index_(void) { return g_node; }
unsigned long long *gtc_error_word_(void) { return g_error_word; }

extern "C" int gtc_device_count(int32_t *count) {
    int n = 0;
    *count = 0;
    GTC_TRY(GTC_CUDA(cudaGetDeviceCount(&n), "cudaGetDeviceCount"));
    *count = n;
    return GT_OK;
}

extern "C" int gtc_device_info(int32_t device, char *name, int64_t size, int64_t *memory, int32_t *major,
                               int32_t *minor) {
    cudaDeviceProp p;
    GTC_TRY(GTC_CUDA(cudaGetDeviceProperties(&p, device), "cudaGetDeviceProperties"));
    if (name && size > 0) snprintf(name, (size_t)size, "%s", p.name);
    if (memory) *memory = (int64_t)p.totalGlobalMem;
    if (major) *major = p.major;
    if (minor) *minor = p.minor;
    return GT_OK;
}

extern "C" int gtc_init(int32_t device) {
    if (g_ready) return GT_OK;
    int32_t n = 0;
    GTC_TRY(gtc_device_count(&n));
    if (device < 0 || device >= n)
        return GTC_FAIL(GT_ERR_INVALID, "CUDA device %d: this machine has %d", (int)device, (int)n);
    GTC_TRY(GTC_CUDA(cudaSetDevice(device), "cudaSetDevice"));
    g_device = device;
    GTC_TRY(GTC_CUDA(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking), "cudaStreamCreate"));
    GTC_TRY(GTC_CUDA(cudaMalloc((void **)&g_error_word, GTC_ERROR_WORDS * sizeof(unsigned long long)), "cudaMalloc"));
    GTC_TRY(gtc_cublas_load_(g_stream));
    g_ready = 1;
    return GT_OK;
}

/* The library started; the device made current on this thread (cudaSetDevice is per thread). */
static int ready(const char *what) {
    if (!g_ready) return GTC_FAIL(GT_ERR_INVALID, "%s: gtc_init has not run", what);
    return GTC_CUDA(cudaSetDevice(g_device), what);
}

/* ---- memory ---------------------------------------------------------------------------------- */

extern "C" int gtc_malloc(void **out, int64_t bytes) {
    *out = NULL;
    GTC_TRY(ready("gtc_malloc"));
    if (bytes < 0) return GTC_FAIL(GT_ERR_INVALID, "gtc_malloc: %lld bytes", (long long)bytes);
    void *p = NULL;
    cudaError_t err = cudaMalloc(&p, bytes > 0 ? (size_t)bytes : 1);
    if (err != cudaSuccess) {
        size_t free_b = 0, total = 0;
        cudaGetLastError();
        cudaMemGetInfo(&free_b, &total);
        return GTC_FAIL(GT_ERR_NOMEM, "cannot allocate %.1f MiB on the GPU (%.1f MiB free of %.1f MiB): %s",
                        bytes / 1048576.0, free_b / 1048576.0, total / 1048576.0, cudaGetErrorString(err));
    }
    GTC_TRY(GTC_CUDA(cudaMemsetAsync(p, 0, bytes > 0 ? (size_t)bytes : 1, g_stream), "cudaMemset"));
    *out = p;
    return GTC_CUDA(cudaStreamSynchronize(g_stream), "cudaMalloc");
}

extern "C" int gtc_free(void *ptr) {
    if (!ptr || !g_ready) return GT_OK;
    GTC_TRY(ready("gtc_free"));
    return GTC_CUDA(cudaFree(ptr), "cudaFree");
}

extern "C" int gtc_copy_in(void *dst, const void *src, int64_t bytes) {
    GTC_TRY(ready("gtc_copy_in"));
    if (bytes <= 0) return GT_OK;
    GTC_TRY(GTC_CUDA(cudaMemcpyAsync(dst, src, (size_t)bytes, cudaMemcpyHostToDevice, g_stream), "copy to the GPU"));
    return GTC_CUDA(cudaStreamSynchronize(g_stream), "copy to the GPU");
}

extern "C" int gtc_copy_out(void *dst, const void *src, int64_t bytes) {
    GTC_TRY(ready("gtc_copy_out"));
    if (bytes <= 0) return GT_OK;
    GTC_TRY(GTC_CUDA(cudaMemcpyAsync(dst, src, (size_t)bytes, cudaMemcpyDeviceToHost, g_stream), "copy from the GPU"));
    return GTC_CUDA(cudaStreamSynchronize(g_stream), "copy from the GPU");
}

extern "C" int gtc_memset(void *dst, int32_t value, int64_t bytes) {
    GTC_TRY(ready("gtc_memset"));
    if (bytes <= 0) return GT_OK;
    return GTC_CUDA(cudaMemsetAsync(dst, value, (size_t)bytes, g_stream), "cudaMemset");
}

extern "C" int gtc_sync(void) {
    GTC_TRY(ready("gtc_sync"));
    return GTC_CUDA(cudaStreamSynchronize(g_stream), "cudaStreamSynchronize");
}

/* ---- the kernel table ------------------------------------------------------------------------ */

struct entry {
    const char *name;
    gt_kernel fn;
    int (*sizes)(const gt_node *, int64_t *, int64_t *);
};

#define GTC_ENTRY_K(name) {#name, gtc_k_##name, NULL},
#define GTC_ENTRY_S(name) {#name, gtc_k_##name, gtc_s_##name},
static const entry g_table[] = {GTC_KERNELS(GTC_ENTRY_K, GTC_ENTRY_S)};
static const int32_t g_count = (int32_t)(sizeof g_table / sizeof g_table[0]);

static const entry *find(const char *name) {
    for (int32_t i = 0; i < g_count; i++)
        if (!strcmp(g_table[i].name, name)) return &g_table[i];
    return NULL;
}

extern "C" int32_t gtc_kernel_count(void) { return g_count; }
extern "C" const char *gtc_kernel_name(int32_t i) { return i >= 0 && i < g_count ? g_table[i].name : NULL; }
extern "C" gt_kernel gtc_kernel(const char *name) {
    const entry *e = find(name);
    return e ? e->fn : NULL;
}

extern "C" int gtc_kernel_sizes(const char *name, const gt_node *node, int64_t *scratch, int64_t *work) {
    *scratch = 0;
    *work = 0;
    const entry *e = find(name);
    if (!e) return GTC_FAIL(GT_ERR_UNSUPPORTED, "the CUDA backend has no kernel %s", name);
    return e->sizes ? e->sizes(node, scratch, work) : GT_OK;
}

/* ---- running nodes --------------------------------------------------------------------------- */

/* The device's error in the CPU kernels' words (the numbers as gtc_raise stored them). */
static int dev_error_message(int64_t node, const unsigned long long *w) {
    const int code = (int)(w[0] >> 24);
    const long long a = (long long)w[1], b = (long long)w[2], c = (long long)w[3];
    const char *op = code == GTC_DEV_GET_ROWS_BWD ? "get_rows_bwd" : code == GTC_DEV_TARGET_BWD ? "cross_entropy_bwd"
                                                                                                : NULL;
    switch (code) {
    case GTC_DEV_GET_ROWS:
    case GTC_DEV_GET_ROWS_BWD:
        return GTC_FAIL(GT_ERR_INVALID, "node %lld: %s: idx[%lld] (flat) is %lld, expected 0 <= index < V = %lld",
                        (long long)node, op ? op : "get_rows", a, b, c);
    case GTC_DEV_SET_ROWS:
        return GTC_FAIL(GT_ERR_INVALID, "node %lld: set_rows: idx[%lld] is %lld, expected 0 <= index < S = %lld",
                        (long long)node, a, b, c);
    case GTC_DEV_TARGET:
    case GTC_DEV_TARGET_BWD:
        return GTC_FAIL(GT_ERR_INVALID,
                        "node %lld: %s: target of row %lld is %lld, expected < V = %lld (or < 0 to ignore the row)",
                        (long long)node, op ? op : "cross_entropy", a, b, c);
    case GTC_DEV_BIAS_CORRECTION:
        return GTC_FAIL(GT_ERR_INVALID, "node %lld: adamw_step: bias corrections must be > 0 (step count 0?)",
                        (long long)node);
    default:
        return GTC_FAIL(GT_ERR_INVALID, "node %lld: device error %d", (long long)node, code);
    }
}

static int64_t *g_profile = NULL;
extern "C" void gtc_set_profile(int64_t *ns) { g_profile = ns; }

/* Each node between two events (a profiled run; the events cost a little). */
static int run_profiled(const gt_node *nodes, int64_t n, gt_ctx *ctx, int64_t *failed) {
    cudaEvent_t ev[2];
    GTC_TRY(GTC_CUDA(cudaEventCreate(&ev[0]), "profiling"));
    GTC_TRY(GTC_CUDA(cudaEventCreate(&ev[1]), "profiling"));
    int rc = GT_OK;
    for (int64_t i = 0; i < n && !rc; i++) {
        g_node = (int32_t)i;
        cudaEventRecord(ev[0], g_stream);
        rc = nodes[i].fn(&nodes[i], ctx);
        cudaEventRecord(ev[1], g_stream);
        cudaEventSynchronize(ev[1]);
        float ms = 0.0f;
        cudaEventElapsedTime(&ms, ev[0], ev[1]);
        g_profile[i] += (int64_t)(ms * 1e6f);
        if (rc) *failed = i;
    }
    cudaEventDestroy(ev[0]);
    cudaEventDestroy(ev[1]);
    return rc;
}

extern "C" int gtc_run(const gt_node *nodes, int64_t n, void *work, int64_t work_bytes, int64_t *failed) {
    *failed = -1;
    GTC_TRY(ready("gtc_run"));
    GTC_TRY(GTC_CUDA(cudaMemsetAsync(g_error_word, 0, sizeof(unsigned long long), g_stream), "gtc_run"));
    gt_ctx ctx;
    memset(&ctx, 0, sizeof ctx);
    ctx.ith = 0;
    ctx.nth = 1;
    ctx.wdata = work;
    ctx.wsize = work_bytes;
    if (g_profile) {
        const int rc = run_profiled(nodes, n, &ctx, failed);
        if (rc) {
            cudaStreamSynchronize(g_stream);
            return rc;
        }
    }
    for (int64_t i = 0; i < n && !g_profile; i++) {
        g_node = (int32_t)i;
        int rc = nodes[i].fn(&nodes[i], &ctx);
        if (rc) {
            *failed = i;
            cudaStreamSynchronize(g_stream);
            return rc;
        }
    }
    unsigned long long words[GTC_ERROR_WORDS] = {0, 0, 0, 0};
    GTC_TRY(GTC_CUDA(cudaMemcpyAsync(words, g_error_word, sizeof words, cudaMemcpyDeviceToHost, g_stream), "gtc_run"));
    GTC_TRY(GTC_CUDA(cudaStreamSynchronize(g_stream), "running the plan"));
    if (words[0]) {
        *failed = (int64_t)(words[0] & 0xFFFFFF);
        return dev_error_message(*failed, words);
    }
    return GT_OK;
}

/* ---- host-side checks ------------------------------------------------------------------------ */

int gtc_check_dtype_(const gt_tensor *t, int32_t dtype, const char *op, const char *what) {
    if (dtype == GT_I32) return gt_check_i32(t, op, what);
    if (dtype == GT_F32) return gt_check_f32_(t, op, what);
    if (t->dtype != dtype)
        return GTC_FAIL(GT_ERR_DTYPE, "%s: expected %s of dtype %s, got %s", op, what, gt_type_name(dtype),
                        gt_type_name(t->dtype));
    return GT_OK;
}

/* lo..hi inputs: fewer is the CPU kernels' error; more means a plan made for another kernel. */
int gtc_check_n_src_(const gt_node *node, int lo, int hi, const char *op) {
    GTC_TRY(gt_check_n_src(node, lo, op));
    if (node->n_src > hi)
        return GTC_FAIL(GT_ERR_INVALID, "%s: expected at most %d inputs, got %d", op, hi, (int)node->n_src);
    return GT_OK;
}

int gtc_check_contig_(const gt_tensor *t, const char *op, const char *what) { return gt_check_contig(t, op, what); }

int gtc_check_same_shape_(const gt_tensor *a, const gt_tensor *b, const char *op, const char *wa, const char *wb) {
    return gt_check_same_shape(a, b, op, wa, wb);
}

int gtc_check_broadcast_(const gt_tensor *t, const gt_tensor *like, const char *op, const char *what) {
    bool ok = t->ndim <= like->ndim;
    for (int i = 0; ok && i < t->ndim; i++) {
        const int64_t n = t->shape[t->ndim - 1 - i], m = like->shape[like->ndim - 1 - i];
        ok = n == 1 || n == m;
    }
    if (!ok) return GTC_FAIL(GT_ERR_SHAPE, "%s: %s does not broadcast to the output's shape", op, what);
    return GT_OK;
}
