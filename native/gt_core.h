/* gt_core.h: what every backend of ggtrain's native core shares (layer 1): status codes,
 * the dtype table's types, tensor descriptors, plan nodes and the kernel signature, and the
 * optimizer steps' hyper vector. The CPU library's API (native/ggtrain.h) and the CUDA
 * library's (native/cuda/gtc.h) are declared after it; cffi reads it as the first part of
 * either's cdef, so it holds plain declarations only: no #include, no #define, no #ifdef.
 *
 * Tensors: shapes and strides in numpy order (outermost first), strides counted in
 * elements (not bytes). A stride of 0 broadcasts. Kernels document which inputs must be
 * contiguous; Python inserts `cont` nodes where needed. A tensor's data is host memory for
 * the CPU backend and device memory for CUDA; a node's fn is the backend's own kernel.
 *
 * Errors: every function returns GT_OK (0) or a negative gt_status, with a message from the
 * backend's last-error function. Nothing here aborts, exits or prints.
 */

typedef enum gt_status {
    GT_OK = 0,
    GT_ERR_INVALID = -1,      /* bad argument: null pointer, bad parameter */
    GT_ERR_SHAPE = -2,        /* shapes do not fit together */
    GT_ERR_DTYPE = -3,        /* dtype not supported by this kernel */
    GT_ERR_NOMEM = -4,        /* allocation failed (pool, plan) */
    GT_ERR_THREAD = -5,       /* thread creation or synchronisation failed */
    GT_ERR_UNSUPPORTED = -6   /* valid request this build cannot serve */
} gt_status;

/* dtypes. Values are ggml's type ids (a GGUF tensor's type is its gt_dtype).
 * Element types have block 1; a block type (ggml's quantizations) stores
 * `block` elements in `block_bytes` bytes, and a tensor of one is rows of whole
 * blocks along its last dim, contiguous. The table (gt_dtype_count/gt_dtype_at)
 * lists every type a GGUF file may hold; its flags say what the core can do
 * with each. Every size is numel / block * block_bytes. Only the types kernels
 * name are in this enum; the rest are in the table alone. */
typedef enum gt_dtype {
    GT_F32 = 0, GT_F16 = 1, GT_Q4_0 = 2, GT_Q4_1 = 3, GT_Q5_0 = 6, GT_Q5_1 = 7, GT_Q8_0 = 8,
    GT_Q2_K = 10, GT_Q3_K = 11, GT_Q4_K = 12, GT_Q5_K = 13, GT_Q6_K = 14,
    GT_I32 = 26, GT_BF16 = 30, GT_MXFP4 = 39
} gt_dtype;

enum gt_dtype_flag {
    GT_DTYPE_FLOAT = 1,        /* element type of real numbers (f32, f16, bf16, f64) */
    GT_DTYPE_INT = 2,          /* element type of integers */
    GT_DTYPE_BLOCK = 4,        /* block (quantized) type */
    GT_DTYPE_DEQUANTIZE = 8,   /* gt_dequantize_row converts it to f32 (kernels read it) */
    GT_DTYPE_QUANTIZE = 16     /* gt_quantize_row converts f32 to it */
};

typedef struct gt_dtype_traits {
    const char *name;          /* ggtrain's name: ggml's, lower case ("f32", "q4_0", "q6_k") */
    int32_t id;                /* gt_dtype / ggml type id */
    int32_t block;             /* elements per block (1: an element type) */
    int32_t block_bytes;       /* bytes per block */
    int32_t flags;             /* gt_dtype_flag bits */
} gt_dtype_traits;

/* GT_MAX_DIMS is 6: shape and strides arrays below have that many slots. */
typedef struct gt_tensor {
    void *data;              /* first element */
    int32_t dtype;           /* gt_dtype */
    int32_t ndim;            /* 0..6; 0 is a scalar */
    int64_t shape[6];        /* numpy order, unused slots 1 */
    int64_t strides[6];      /* in elements, unused slots 0 */
} gt_tensor;

/* What a kernel sees of the thread running it. */
typedef struct gt_ctx {
    int32_t ith;             /* this thread, 0..nth-1 */
    int32_t nth;             /* threads working on this node */
    void *wdata;             /* this thread's private scratch */
    int64_t wsize;           /* its size in bytes */
    void *pool;              /* for gt_barrier */
} gt_ctx;

struct gt_node;
typedef int (*gt_kernel)(const struct gt_node *node, const gt_ctx *ctx);

/* One step of a plan. Kernels read src[0..n_src-1] and fill dst; `scratch`
 * is node-private memory shared by all threads (size given by Python). */
typedef struct gt_node {
    gt_kernel fn;
    int32_t n_src;
    int32_t pad_;
    gt_tensor dst;
    gt_tensor src[8];        /* up to 8 inputs (delta_rule_bwd: 7) */
    int64_t ip[8];           /* integer parameters, meaning per kernel */
    float fp[8];             /* float parameters, meaning per kernel */
    void *scratch;
    int64_t scratch_size;
} gt_node;

/* Layout of the hyper vector the optimizer steps read (f32, GT_HYPER_COUNT
 * values), refilled by the host before each update. BC1/BC2 are the bias
 * corrections 1 - beta^t, computed on the host from the update count. */
enum gt_hyper {
    GT_HYPER_LR = 0, GT_HYPER_BETA1 = 1, GT_HYPER_BETA2 = 2, GT_HYPER_EPS = 3, GT_HYPER_WD = 4,
    GT_HYPER_BC1 = 5, GT_HYPER_BC2 = 6, GT_HYPER_MAX_NORM = 7, GT_HYPER_MOMENTUM = 8,
    GT_HYPER_COUNT = 9
};
