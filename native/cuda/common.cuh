/* common.cuh: what the CUDA kernels share (not part of the C API): errors, the stream,
 * tensor helpers on host and device, launch sizes, block reductions. */
#ifndef GTC_COMMON_CUH
#define GTC_COMMON_CUH

#include <stdint.h>
#include <cuda_runtime.h>

extern "C" {
#include "../gt_core.h"
}
#include "../elementmath.h"
#define GTC_THREADS 256

/* Records a formatted message (with file and line) for gtc_last_error and returns code. */
int gtc_set_error_(int code, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
#define GTC_FAIL(code, ...) gtc_set_error_((code), __FILE__, __LINE__, __VA_ARGS__)
#define GTC_TRY(expr) do { int rc_ = (expr); if (rc_) return rc_; } while (0)

/* The layout helpers and argument checks the CPU kernels use, with their words. */
#define GT_FAIL GTC_FAIL
#include "../checks.h"
#define GTC_MAX_DIMS GT_MAX_DIMS

/* The library's one stream, and a failed launch or CUDA call as a gt_status. */
cudaStream_t gtc_stream_(void);
int gtc_cuda_check_(cudaError_t err, const char *what, const char *file, int line);
#define GTC_CUDA(call, what) gtc_cuda_check_((call), (what), __FILE__, __LINE__)
#define GTC_LAUNCHED(what) gtc_cuda_check_(cudaGetLastError(), (what), __FILE__, __LINE__)

/* Errors only the device can see (an index out of range): the first one is kept in four
 * device words (gtc_error_word_(), passed to the kernels that can raise one): (code << 24) |
 * node index, then three numbers for its message (which element, its value, the bound), and
 * gtc_run reports it after the last node in the CPU kernels' words (dev_error_message). */
enum gtc_device_error {
    GTC_DEV_GET_ROWS = 1,         /* idx[a] (flat) is b, expected 0 <= index < V = c */
    GTC_DEV_GET_ROWS_BWD = 2,
    GTC_DEV_SET_ROWS = 3,         /* idx[a] is b, expected 0 <= index < S = c */
    GTC_DEV_TARGET = 4,           /* target of row a is b, expected < V = c */
    GTC_DEV_TARGET_BWD = 5,
    GTC_DEV_BIAS_CORRECTION = 6,
};
#define GTC_ERROR_WORDS 4
unsigned long long *gtc_error_word_(void);
int32_t gtc_node_index_(void);       /* the node gtc_run is launching (host) */
__device__ inline void gtc_raise(unsigned long long *err, int code, int32_t node, long long a, long long b,
                                 long long c) {
    const unsigned long long word = ((unsigned long long)code << 24) | (unsigned long long)(node & 0xFFFFFF);
    if (atomicCAS(err, 0ull, word) == 0ull) {
        err[1] = (unsigned long long)a;
        err[2] = (unsigned long long)b;
        err[3] = (unsigned long long)c;
    }
}
/* What a kernel that can raise takes: the words and its node. */
#define GTC_ERR_ARGS unsigned long long *err_, int32_t node_
#define GTC_ERR_PASS gtc_error_word_(), gtc_node_index_()
#define GTC_RAISE(code, a, b, c) gtc_raise(err_, (code), node_, (long long)(a), (long long)(b), (long long)(c))

/* ---- tensors (host and device) ----------------------------------------------------------- */

__host__ __device__ inline int64_t gtc_numel(const gt_tensor &t) { return gt_numel(&t); }
__host__ __device__ inline int64_t gtc_ncols(const gt_tensor &t) { return gt_ncols(&t); }
__host__ __device__ inline int64_t gtc_nrows(const gt_tensor &t) { return gt_nrows(&t); }
__host__ __device__ inline bool gtc_contiguous(const gt_tensor &t) { return gt_is_contiguous(&t); }

/* Element offset in t of flat (row-major) index i of `like`'s shape, t broadcast to it
 * (right-aligned dims; t's dims of size 1, or missing, contribute nothing). */
__host__ __device__ inline int64_t gtc_offset(const gt_tensor &t, const gt_tensor &like, int64_t i) {
    int64_t off = 0;
    int d = t.ndim - 1;
    for (int k = like.ndim - 1; k >= 0; k--, d--) {
        const int64_t n = like.shape[k];
        const int64_t idx = i % n;
        i /= n;
        if (d >= 0 && t.shape[d] != 1) off += idx * t.strides[d];
    }
    return off;
}

/* The same with 32-bit index arithmetic (64-bit division is many instructions on the GPU):
 * for like of fewer than 2^31 elements. */
__host__ __device__ inline int64_t gtc_offset32(const gt_tensor &t, const gt_tensor &like, uint32_t i) {
    int64_t off = 0;
    int d = t.ndim - 1;
    for (int k = like.ndim - 1; k >= 0; k--, d--) {
        const uint32_t n = (uint32_t)like.shape[k];
        const uint32_t idx = i % n;
        i /= n;
        if (d >= 0 && t.shape[d] != 1) off += (int64_t)idx * t.strides[d];
    }
    return off;
}

/* How a kernel reads t at flat index i of like's shape: mode 0 by i (t laid out as like);
 * 1 by i % m (t contiguous and equal to like's trailing dims, repeated over the leading ones:
 * a bias, a norm's weight); 2 through gtc_offset (any other broadcast or view). small: like
 * has fewer than 2^31 elements, so the index arithmetic is 32-bit. Made on the host
 * (gtc_reader_for), read on the device (gtc_at). */
struct gtc_reader {
    gt_tensor t;
    int64_t m;
    int mode;
    bool small;
};

/* M >= 0: the mode known at compile time (the other branches compile away); M < 0: r.mode. */
template <int M>
__device__ inline int64_t gtc_at_m(const gtc_reader &r, const gt_tensor &like, int64_t i) {
    const int mode = M >= 0 ? M : r.mode;
    if (mode == 0) return i;
    if (mode == 1) return r.small ? (int64_t)((uint32_t)i % (uint32_t)r.m) : i % r.m;
    return r.small ? gtc_offset32(r.t, like, (uint32_t)i) : gtc_offset(r.t, like, i);
}

__device__ inline int64_t gtc_at(const gtc_reader &r, const gt_tensor &like, int64_t i) {
    return gtc_at_m<-1>(r, like, i);
}

/* NOTE: kernels take tensors (gt_tensor, gtc_reader) by value as `const __grid_constant__`:
 * indexing a by-value parameter's arrays with a run-time index (shape[k] in gtc_offset) makes
 * every thread copy the whole struct to local memory first, which made a plain elementwise
 * add run at a twentieth of the memory's speed on an H100; a grid constant is read in place. */
#define GTC_PARAM const __grid_constant__

/* t is laid out as like's flat index: contiguous with like's shape (host side; kernels then
 * index it by i, without gtc_offset's division per dim). */
inline bool gtc_plain(const gt_tensor &t, const gt_tensor &like) {
    if (t.ndim != like.ndim || !gtc_contiguous(t)) return false;
    for (int i = 0; i < t.ndim; i++)
        if (t.shape[i] != like.shape[i]) return false;
    return true;
}

/* The reader of t for like's flat indices (t broadcasts to like: checked by the caller). */
inline gtc_reader gtc_reader_for(const gt_tensor &t, const gt_tensor &like) {
    gtc_reader r;
    r.t = t;
    r.m = gtc_numel(t);
    r.small = gtc_numel(like) < ((int64_t)1 << 31);
    r.mode = 2;
    if (gtc_plain(t, like)) {
        r.mode = 0;
    } else if (gtc_contiguous(t) && r.m > 0) {
        int lead = 0;                                       /* t's leading dims of 1 */
        while (lead < t.ndim && t.shape[lead] == 1) lead++;
        const int tail = t.ndim - lead;
        bool same = tail <= like.ndim;
        for (int k = 0; same && k < tail; k++) same = t.shape[lead + k] == like.shape[like.ndim - tail + k];
        if (same) r.mode = 1;
    }
    return r;
}

/* Offset of the first element of row `row` (all dims but the last), any strides. */
__host__ __device__ inline int64_t gtc_row_offset(const gt_tensor &t, int64_t row) { return gt_row_offset(&t, row); }

/* Host-side checks, as the CPU kernels make them (same words). */
int gtc_check_dtype_(const gt_tensor *t, int32_t dtype, const char *op, const char *what);
int gtc_check_n_src_(const gt_node *node, int lo, int hi, const char *op);
int gtc_check_contig_(const gt_tensor *t, const char *op, const char *what);
int gtc_check_same_shape_(const gt_tensor *a, const gt_tensor *b, const char *op, const char *wa, const char *wb);
/* t broadcasts to like's shape (right-aligned; each of t's dims 1 or equal, no more dims). */
int gtc_check_broadcast_(const gt_tensor *t, const gt_tensor *like, const char *op, const char *what);
#define GTC_F32(t, op, what) GTC_TRY(gtc_check_dtype_((t), GT_F32, (op), (what)))
#define GTC_I32(t, op, what) GTC_TRY(gtc_check_dtype_((t), GT_I32, (op), (what)))

/* Blocks of GTC_THREADS threads for n items, a grid-stride loop covering the rest. */
inline unsigned gtc_blocks(int64_t n) {
    int64_t b = (n + GTC_THREADS - 1) / GTC_THREADS;
    if (b < 1) b = 1;
    return (unsigned)(b > 65535 * 8 ? 65535 * 8 : b);
}
#define GTC_FOR(i, n) for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
                           i += (int64_t)gridDim.x * blockDim.x)

/* Sum (or max) of one value per thread over a block of blockDim.x threads (a multiple of
 * 32, at most 1024), in a fixed order: every thread gets the result. `shared` holds 32
 * floats. Deterministic: the same bits for the same inputs and block size. */
template <typename T>
__device__ inline T gtc_warp_sum(T v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ inline float gtc_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
/* (float or double: the double one for the sums the CPU makes in double) */
template <typename T>
__device__ inline T gtc_block_sum(T v, T *shared) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = gtc_warp_sum(v);
    __syncthreads();
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    v = lane < nw ? shared[lane] : T(0);
    return gtc_warp_sum(v);
}
__device__ inline float gtc_block_max(float v, float *shared) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = gtc_warp_max(v);
    __syncthreads();
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    v = lane < nw ? shared[lane] : -INFINITY;
    return gtc_warp_max(v);
}

/* f16 and bf16 bits <-> f32, on host and device alike (no intrinsics). */
__host__ __device__ inline float gtc_f16(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, bits;
    if (exp == 0x1Fu) {
        bits = sign | 0x7F800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {                       /* subnormal: normalise */
        exp = 113u;
        while (!(man & 0x400u)) { man <<= 1; exp--; }
        bits = sign | (exp << 23) | ((man & 0x3FFu) << 13);
    }
    union { uint32_t u; float f; } v;
    v.u = bits;
    return v.f;
}
__host__ __device__ inline float gtc_bf16(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}
/* f32 to bf16, rounded to nearest even (a NaN stays a quiet NaN): copy_bf16's rounding and the
 * bf16 products' (cuda-bf16), on the device and in the host stand-in alike. */
__host__ __device__ inline uint16_t gtc_to_bf16(float f) {
    union { float f; uint32_t u; } v;
    v.f = f;
    if ((v.u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((v.u >> 16) | 0x40u);
    return (uint16_t)((v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16);
}

/* The launchers, one per kernel of the table (kernels.h lists them). */
#define GTC_LAUNCHER(name) extern "C" int gtc_k_##name(const gt_node *node, const gt_ctx *ctx)
#define GTC_SIZES(name) extern "C" int gtc_s_##name(const gt_node *node, int64_t *scratch, int64_t *work)

#endif
