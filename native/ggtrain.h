/* ggtrain.h: the C API of ggtrain's CPU core (layer 1).
 *
 * Read by the C files (which include it once, after native/gt_core.h: the status codes,
 * dtypes, tensors, nodes and kernel signature every backend shares) and by cffi's cdef
 * (gt_core.h's text, then this one's), so it holds plain declarations only: no #include,
 * no #define, no #ifdef.
 *
 * Model: Python builds a graph and lowers it into an array of gt_node. Each node
 * names its kernel by pointer, carries tensor descriptors for its output (dst) and
 * inputs (src), and small integer/float parameters. gt_plan_compute runs every
 * node in order on a persistent thread pool: each thread calls the kernel with
 * its index (ctx->ith of ctx->nth) and the pool waits on a barrier between nodes.
 *
 * Worked example (what core/backend_cpu.py does):
 *     gt_pool *pool;  gt_pool_new(&pool, 2);
 *     gt_node nodes[1] = {{ .fn = gt_add_fwd_f32, .n_src = 2, .dst = c, .src = {a, b} }};
 *     gt_plan *plan;  gt_plan_new(&plan, pool, nodes, 1, work, work_per_thread);
 *     gt_plan_compute(plan, 2);     // c = a + b, split across 2 threads
 *
 * Tensors: shapes and strides in numpy order (outermost first), strides counted
 * in elements (not bytes). A stride of 0 broadcasts. Kernels document which
 * inputs must be contiguous; Python inserts `cont` nodes where needed.
 *
 * Errors: every function returns GT_OK (0) or a negative gt_status; a message
 * (with the C file and line) is then available from gt_last_error() on the
 * calling thread. Nothing here aborts, exits or prints.
 *
 * Determinism: every kernel gives bit-identical results for any thread count:
 * work is split so that each output element is computed by exactly one thread
 * in a fixed order, and cross-row reductions go through per-row scratch summed
 * in a fixed order.
 */

typedef struct gt_pool gt_pool;
typedef struct gt_plan gt_plan;

const char *gt_last_error(void);
int32_t gt_dtype_count(void);
const gt_dtype_traits *gt_dtype_at(int32_t i);   /* i in 0..count-1, else NULL */
void gt_clear_error(void);
int gt_cpu_features(void);   /* bit 0: AVX2+FMA, bit 1: AVX-512F (what dispatch uses) */
int gt_set_simd_level(int level);  /* cap dispatch: 0 scalar, 1 AVX2, 2 AVX-512 (tests) */

/* Persistent thread pool: n_threads - 1 workers plus the calling thread. */
int gt_pool_new(gt_pool **out, int32_t n_threads);
void gt_pool_free(gt_pool *pool);

/* A plan references `nodes` (owned by the caller, kept alive while the plan
 * lives) and per-thread scratch `work` of n_threads * work_per_thread bytes. */
int gt_plan_new(gt_plan **out, gt_pool *pool, const struct gt_node *nodes, int64_t n_nodes,
                void *work, int64_t work_per_thread);
void gt_plan_free(gt_plan *plan);
int gt_plan_compute(gt_plan *plan, int32_t n_threads);
int64_t gt_plan_failed_node(const gt_plan *plan);   /* index of the node that failed, or -1 */
/* Profiling: when node_ns is not NULL, each compute adds every node's wall time
 * (nanoseconds, measured by thread 0 from barrier to barrier) into node_ns[i]. */
int gt_plan_set_profile(gt_plan *plan, int64_t *node_ns);

/* Waits for all threads of the current node. Only for kernels with phases. */
int gt_barrier(const gt_ctx *ctx);

/* Runs a single node outside any plan (tests, direct kernels). */
int gt_node_compute(gt_pool *pool, const struct gt_node *node, int32_t n_threads,
                    void *work, int64_t work_per_thread);

/* Memory a kernel needs besides its tensors. A kernel that needs node scratch or
 * per-thread work has a companion gt_<kernel>_sizes that answers from the node's
 * dtypes, shapes, strides and params alone (data pointers are not read):
 * *scratch = bytes of node scratch (shared by its threads), *work = bytes of
 * per-thread work memory. Backends ask it when they plan memory, so the formulas
 * live next to the kernels and nowhere else. A kernel without one needs neither. */

/* ---- kernels (plan signature). Params are listed as ip[i] / fp[i]. ---------
 * Elementwise binary, numpy broadcasting through zero strides; any strides.
 * dst: contiguous f32, src0/src1: f32 views broadcast to dst's shape. */
int gt_add_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_sub_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_mul_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_div_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);

/* Elementwise unary, src any strides, dst contiguous f32, same shape.
 * scale: dst = fp[0] * src.  fill: dst = fp[0] (no src). */
int gt_scale_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_fill_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_relu_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_silu_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_tanh_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);
/* softplus: log(1 + e^x), overflow-free.  log1mexp: log(1 - e^x) for x < 0, accurate near
 * 0 (-inf at 0). (The preference losses: -log sigmoid(h) = softplus(-h), log(1 - p).) */
int gt_softplus_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_log1mexp_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_exp_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_log_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_sqrt_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_sqr_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);
/* dx = g * (x > 0); src0 = x, src1 = g (same shape), dst = dx. */
int gt_relu_bwd_f32(const struct gt_node *node, const gt_ctx *ctx);
/* dx = g * s(x) * (1 + x * (1 - s(x))); src0 = x, src1 = g. */
int gt_silu_bwd_f32(const struct gt_node *node, const gt_ctx *ctx);
/* swiglu: dst = silu(src0) * src1 (the llama FFN's gate), one shape, contiguous.
 * swiglu_bwd: src0 = g, src1 = u, src2 = dy; dst = [dg | du] (twice their size). Both
 * give the bits of silu then mul, and of those ops' backward kernels. */
int gt_swiglu_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_swiglu_bwd_f32(const struct gt_node *node, const gt_ctx *ctx);
/* swiglu_oai: gpt-oss's clamped gate (ggml_swiglu_oai): x = min(src0, fp[1]), y = src1 clamped
 * to +-fp[1], dst = x sigmoid(fp[0] x) (y + 1); fp[0] = alpha, fp[1] = limit. swiglu_oai_bwd:
 * as swiglu_bwd, dst = [dg | du], zero where a side was clamped. */
int gt_swiglu_oai_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_swiglu_oai_bwd_f32(const struct gt_node *node, const gt_ctx *ctx);
/* geglu: dst = gelu_tanh(src0) * src1 (Gemma's FFN gate; gelu's tanh approximation,
 * x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))), one shape, contiguous. geglu_bwd: as
 * swiglu_bwd, dst = [dg | du]. */
int gt_geglu_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_geglu_bwd_f32(const struct gt_node *node, const gt_ctx *ctx);
/* geglu_f16: llama.cpp's CPU geglu, its gelu a table of f16 values indexed by x rounded to f16
 * (0 for x <= -10, x for x >= 10) times src1; for inference with llama.cpp's numbers. */
int gt_geglu_f16_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);
/* swiglu_ggml: llama.cpp's CPU swiglu bit for bit (its vector exp, 16 columns of a row at a
 * time, libm's expf for the last C % 16); for inference with llama.cpp's numbers. */
int gt_swiglu_ggml_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);
/* swiglu_oai_ggml: llama.cpp's CPU swiglu_oai bit for bit: x = min(src0, fp[1]), y = src1
 * clamped to +-fp[1], x / (1 + expf(fp[0] (-x))) (y + 1) with libm's expf; for inference with
 * llama.cpp's numbers. */
int gt_swiglu_oai_ggml_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);

/* dropout: dst = src0 * keep / (1 - p), keep[i] = hash(seed, salt, i) >= p * 2^32
 * over the flat index i: src0 x f32 contiguous, src1 seed i32 of one element (the
 * host sets it each step), fp[0] = p in [0, 1), ip[0] = salt in [0, 2^32). hash:
 * MurmurHash3_x86_32 of the 12-byte key (salt, i low word, i high word) with
 * murmur's seed = seed. Kept: x * (float)(1 / (1 - p)); dropped: exactly 0. The
 * backward is dropout of g with the same seed, salt and p (elementwise.c). */
int gt_dropout_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);

/* Reductions. sum: dst scalar = sum of all of src (any strides), fixed order;
 * sumsq: the same of src's squares (a gradient's squared norm, one pass).
 * sum_rows: dst (..., 1) = sum over the last dim of src (..., N).
 * repeat: dst = src broadcast to dst's shape (src dims 1 or equal).
 * repeat_bwd: dst (shape with 1s) = src summed over the dims where dst is 1. */
int gt_sum_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_sum_fwd_f32_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_sumsq_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_sumsq_fwd_f32_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_sum_rows_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_repeat_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_repeat_bwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_repeat_bwd_f32_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);

/* Matrix product dst (..., M, N) = src0 (..., M, K) @ src1 (..., K, N).
 * Each operand's last two dims may have any strides with either the row or the
 * column stride equal to 1 (so a transposed view costs nothing). Batch dims
 * broadcast numpy-style (a size-1 batch dim of src1 is reused). dst contiguous.
 * wdata: packing buffers (gt_matmul_fwd_f32_sizes). */
int gt_matmul_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_matmul_fwd_f32_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);

/* Matrix product and get_rows with a frozen weight in its stored type, one
 * kernel per type <w> in f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q2_k, q3_k,
 * q4_k, q5_k, q6_k (the dtype table's DEQUANTIZE types but f32). W (R, C) is a
 * stored matrix: R contiguous rows of C / block blocks (C a multiple of the block).
 * matmul_fwd_f32_<w>: dst (..., M, N) f32 = src0 (..., M, K) f32 (as in
 *   gt_matmul_fwd_f32) @ src1, a view of W: W^T (shape (C, R), strides (1, C):
 *   y = x @ W^T, K = C) or W itself (shape (R, C), strides (C, 1): dx = g @ W,
 *   K = R); strides count elements as if W were unpacked. Other layouts are
 *   GT_ERR_INVALID. The packed GEMM dequantizes W a panel at a time while packing
 *   (never all of it), so dst is bit-identical to gt_matmul_fwd_f32 on the
 *   dequantized matrix in the same view. For W^T and M (batch folded) <= 32 a
 *   row-dot path reads each W row once (see qdot.c): a different, fixed
 *   summation order, the same at every SIMD level and thread count.
 *   wdata: gt_matmul_fwd_f32_<w>_sizes (pack buffers and dequantization scratch).
 * get_rows_fwd_f32_<w>: dst (N..., C) f32 = the rows of W (V, C) (whole, strides
 *   (C, 1)) at src1 idx (N...) i32, dequantized; an index outside [0, V) is
 *   GT_ERR_INVALID. */
int gt_matmul_fwd_f32_f16(const struct gt_node *node, const gt_ctx *ctx);
int gt_matmul_fwd_f32_bf16(const struct gt_node *node, const gt_ctx *ctx);
int gt_matmul_fwd_f32_q4_0(const struct gt_node *node, const gt_ctx *ctx);
int gt_matmul_fwd_f32_q4_1(const struct gt_node *node, const gt_ctx *ctx);
int gt_matmul_fwd_f32_q5_0(const struct gt_node *node, const gt_ctx *ctx);
int gt_matmul_fwd_f32_q5_1(const struct gt_node *node, const gt_ctx *ctx);
int gt_matmul_fwd_f32_q8_0(const struct gt_node *node, const gt_ctx *ctx);
int gt_matmul_fwd_f32_q2_k(const struct gt_node *node, const gt_ctx *ctx);
int gt_matmul_fwd_f32_q3_k(const struct gt_node *node, const gt_ctx *ctx);
int gt_matmul_fwd_f32_q4_k(const struct gt_node *node, const gt_ctx *ctx);
int gt_matmul_fwd_f32_q5_k(const struct gt_node *node, const gt_ctx *ctx);
int gt_matmul_fwd_f32_q6_k(const struct gt_node *node, const gt_ctx *ctx);
int gt_matmul_fwd_f32_mxfp4(const struct gt_node *node, const gt_ctx *ctx);
int gt_matmul_fwd_f32_f16_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_matmul_fwd_f32_bf16_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_matmul_fwd_f32_q4_0_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_matmul_fwd_f32_q4_1_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_matmul_fwd_f32_q5_0_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_matmul_fwd_f32_q5_1_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_matmul_fwd_f32_q8_0_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_matmul_fwd_f32_q2_k_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_matmul_fwd_f32_q3_k_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_matmul_fwd_f32_q4_k_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_matmul_fwd_f32_q5_k_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_matmul_fwd_f32_q6_k_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_matmul_fwd_f32_mxfp4_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_get_rows_fwd_f32_f16(const struct gt_node *node, const gt_ctx *ctx);
int gt_get_rows_fwd_f32_bf16(const struct gt_node *node, const gt_ctx *ctx);
int gt_get_rows_fwd_f32_q4_0(const struct gt_node *node, const gt_ctx *ctx);
int gt_get_rows_fwd_f32_q4_1(const struct gt_node *node, const gt_ctx *ctx);
int gt_get_rows_fwd_f32_q5_0(const struct gt_node *node, const gt_ctx *ctx);
int gt_get_rows_fwd_f32_q5_1(const struct gt_node *node, const gt_ctx *ctx);
int gt_get_rows_fwd_f32_q8_0(const struct gt_node *node, const gt_ctx *ctx);
int gt_get_rows_fwd_f32_q2_k(const struct gt_node *node, const gt_ctx *ctx);
int gt_get_rows_fwd_f32_q3_k(const struct gt_node *node, const gt_ctx *ctx);
int gt_get_rows_fwd_f32_q4_k(const struct gt_node *node, const gt_ctx *ctx);
int gt_get_rows_fwd_f32_q5_k(const struct gt_node *node, const gt_ctx *ctx);
int gt_get_rows_fwd_f32_q6_k(const struct gt_node *node, const gt_ctx *ctx);
int gt_get_rows_fwd_f32_mxfp4(const struct gt_node *node, const gt_ctx *ctx);

/* matmul_lora_fwd_f32[_<w>]: a frozen product plus a rank-r adapter's, in one pass over dst:
 * dst (..., M, N) = src0 @ src1 (as gt_matmul_fwd_f32[_<w>]) + src2 @ src3, src2 H (..., M, R)
 * f32 contiguous with dst's leading dims (the adapter's scaled x A^T), src3 (R, N) f32 2-D
 * with a unit stride (its B^T); K, R > 0. Each NC-wide block of dst gets the second product
 * right after the first's k panels (packed path; the row-dot and skinny paths add it after
 * theirs), so neither a temporary of dst's size nor an add pass. wdata: the matmul's. */
int gt_matmul_lora_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_matmul_lora_fwd_f32_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_matmul_lora_fwd_f32_f16(const struct gt_node *node, const gt_ctx *ctx);
int gt_matmul_lora_fwd_f32_bf16(const struct gt_node *node, const gt_ctx *ctx);
int gt_matmul_lora_fwd_f32_q4_0(const struct gt_node *node, const gt_ctx *ctx);
int gt_matmul_lora_fwd_f32_q4_1(const struct gt_node *node, const gt_ctx *ctx);
int gt_matmul_lora_fwd_f32_q5_0(const struct gt_node *node, const gt_ctx *ctx);
int gt_matmul_lora_fwd_f32_q5_1(const struct gt_node *node, const gt_ctx *ctx);
int gt_matmul_lora_fwd_f32_q8_0(const struct gt_node *node, const gt_ctx *ctx);
int gt_matmul_lora_fwd_f32_q2_k(const struct gt_node *node, const gt_ctx *ctx);
int gt_matmul_lora_fwd_f32_q3_k(const struct gt_node *node, const gt_ctx *ctx);
int gt_matmul_lora_fwd_f32_q4_k(const struct gt_node *node, const gt_ctx *ctx);
int gt_matmul_lora_fwd_f32_q5_k(const struct gt_node *node, const gt_ctx *ctx);
int gt_matmul_lora_fwd_f32_q6_k(const struct gt_node *node, const gt_ctx *ctx);
int gt_matmul_lora_fwd_f32_mxfp4(const struct gt_node *node, const gt_ctx *ctx);
int gt_matmul_lora_fwd_f32_f16_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_matmul_lora_fwd_f32_bf16_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_matmul_lora_fwd_f32_q4_0_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_matmul_lora_fwd_f32_q4_1_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_matmul_lora_fwd_f32_q5_0_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_matmul_lora_fwd_f32_q5_1_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_matmul_lora_fwd_f32_q8_0_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_matmul_lora_fwd_f32_q2_k_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_matmul_lora_fwd_f32_q3_k_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_matmul_lora_fwd_f32_q4_k_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_matmul_lora_fwd_f32_q5_k_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_matmul_lora_fwd_f32_q6_k_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_matmul_lora_fwd_f32_mxfp4_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);

/* matmul_q8_fwd_f32_<w> for w in GT_ACT8_TYPES (q4_0, q4_1, q5_0, q5_1, q8_0, q4_k, q5_k, q6_k, mxfp4): dst = src0 @ src1 as
 * matmul_fwd_f32_<w> with src1 the view W^T only, each row of src0 first quantized to 8 bits
 * in blocks of 32 (256 for the K-quants) as llama.cpp quantizes activations, the blocks
 * multiplied in integers (qdot8.c and qdot8k.c give the order; the same bits at every SIMD
 * level and thread count). For
 * generation and evaluation with llama.cpp's numerics; no gradient.
 * wdata: gt_matmul_q8_fwd_f32_<w>_sizes. */
int gt_matmul_q8_fwd_f32_q4_0(const struct gt_node *node, const gt_ctx *ctx);
int gt_matmul_q8_fwd_f32_q4_1(const struct gt_node *node, const gt_ctx *ctx);
int gt_matmul_q8_fwd_f32_q5_0(const struct gt_node *node, const gt_ctx *ctx);
int gt_matmul_q8_fwd_f32_q5_1(const struct gt_node *node, const gt_ctx *ctx);
int gt_matmul_q8_fwd_f32_q8_0(const struct gt_node *node, const gt_ctx *ctx);
int gt_matmul_q8_fwd_f32_q4_k(const struct gt_node *node, const gt_ctx *ctx);
int gt_matmul_q8_fwd_f32_q5_k(const struct gt_node *node, const gt_ctx *ctx);
int gt_matmul_q8_fwd_f32_q6_k(const struct gt_node *node, const gt_ctx *ctx);
int gt_matmul_q8_fwd_f32_mxfp4(const struct gt_node *node, const gt_ctx *ctx);
int gt_matmul_q8_fwd_f32_q4_0_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_matmul_q8_fwd_f32_q4_1_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_matmul_q8_fwd_f32_q5_0_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_matmul_q8_fwd_f32_q5_1_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_matmul_q8_fwd_f32_q8_0_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_matmul_q8_fwd_f32_q4_k_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_matmul_q8_fwd_f32_q5_k_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_matmul_q8_fwd_f32_q6_k_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_matmul_q8_fwd_f32_mxfp4_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);

/* matmul_ggml_fwd_f32[_f16]: dst (..., M, N) = src0 (..., M, K) @ src1, src1 the view W^T of
 * a weight W (N, K) in f32 (rows contiguous) or stored in f16, in llama.cpp's CPU float order
 * for such weights (matmul_ggml.c: its tinyBLAS GEMM's 16 lanes when M >= 2, N % 4 == 0 and
 * K % 16 == 0, else its vec_dot's 64; src0 rounded to f16 against an f16 W). The rows of src0,
 * batch dims folded, are one ubatch. Generation and evaluation in llama.cpp's numbers; no
 * gradient. wdata (f16): gt_matmul_ggml_fwd_f32_f16_sizes. */
int gt_matmul_ggml_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_matmul_ggml_fwd_f32_f16(const struct gt_node *node, const gt_ctx *ctx);
int gt_matmul_ggml_fwd_f32_f16_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);

/* linear_cross_entropy_fwd_f32[_<w>]: per-row cross-entropy of the logits s x @ W^T (soft-capped
 * to fp[1] tanh(l / fp[1]) when fp[1] > 0; s = fp[0]) against targets, and its gradient with
 * respect to x, the logits never held whole. src0 x (N, C) f32, src1 W (V, C) f32 or stored in
 * <w> (whole, as stored), src2 targets (N,) i32 (negative: ignored; >= V: GT_ERR_INVALID).
 * dst (N C + N,) f32: dx (N, C), then nll (N,); ip[0] = 1 divides both by the number of
 * counted rows; ip[1] = 0 leaves dx zeros (losses only). wdata: gt_linear_cross_entropy_fwd_f32[_<w>]_sizes. */
int gt_linear_cross_entropy_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_linear_cross_entropy_fwd_f32_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_linear_cross_entropy_fwd_f32_f16(const struct gt_node *node, const gt_ctx *ctx);
int gt_linear_cross_entropy_fwd_f32_bf16(const struct gt_node *node, const gt_ctx *ctx);
int gt_linear_cross_entropy_fwd_f32_q4_0(const struct gt_node *node, const gt_ctx *ctx);
int gt_linear_cross_entropy_fwd_f32_q4_1(const struct gt_node *node, const gt_ctx *ctx);
int gt_linear_cross_entropy_fwd_f32_q5_0(const struct gt_node *node, const gt_ctx *ctx);
int gt_linear_cross_entropy_fwd_f32_q5_1(const struct gt_node *node, const gt_ctx *ctx);
int gt_linear_cross_entropy_fwd_f32_q8_0(const struct gt_node *node, const gt_ctx *ctx);
int gt_linear_cross_entropy_fwd_f32_q2_k(const struct gt_node *node, const gt_ctx *ctx);
int gt_linear_cross_entropy_fwd_f32_q3_k(const struct gt_node *node, const gt_ctx *ctx);
int gt_linear_cross_entropy_fwd_f32_q4_k(const struct gt_node *node, const gt_ctx *ctx);
int gt_linear_cross_entropy_fwd_f32_q5_k(const struct gt_node *node, const gt_ctx *ctx);
int gt_linear_cross_entropy_fwd_f32_q6_k(const struct gt_node *node, const gt_ctx *ctx);
int gt_linear_cross_entropy_fwd_f32_mxfp4(const struct gt_node *node, const gt_ctx *ctx);
int gt_linear_cross_entropy_fwd_f32_f16_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_linear_cross_entropy_fwd_f32_bf16_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_linear_cross_entropy_fwd_f32_q4_0_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_linear_cross_entropy_fwd_f32_q4_1_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_linear_cross_entropy_fwd_f32_q5_0_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_linear_cross_entropy_fwd_f32_q5_1_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_linear_cross_entropy_fwd_f32_q8_0_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_linear_cross_entropy_fwd_f32_q2_k_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_linear_cross_entropy_fwd_f32_q3_k_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_linear_cross_entropy_fwd_f32_q4_k_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_linear_cross_entropy_fwd_f32_q5_k_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_linear_cross_entropy_fwd_f32_q6_k_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_linear_cross_entropy_fwd_f32_mxfp4_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);

/* rms_norm: dst = src / sqrt(mean(src^2, last dim) + fp[0]); src contiguous.
 * rms_norm_bwd: src0 = x, src1 = g, dst = dx (eps fp[0]); no weight (the weight
 * multiply is a separate broadcast mul). All contiguous, same shape. */
int gt_rms_norm_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_rms_norm_bwd_f32(const struct gt_node *node, const gt_ctx *ctx);

/* softmax over the last dim of src (..., T_q, T_k) after scaling by fp[0];
 * ip[0] = 1 adds a causal mask: row i of the last-but-one dim sees columns
 * j <= i + (T_k - T_q); ip[0] = 2 masks by position: src1 pos (T_q,) i32, row i
 * sees columns j <= pos[i] (decoding with a KV cache); ip[0] = 3 masks by
 * segment (packed samples): src (B, ..., T, T), src1 seg (B, T) i32 contiguous,
 * row i of batch b sees columns j <= i with seg[b, j] == seg[b, i]. Masked
 * entries are exactly 0 (a row seeing no column is all 0). softmax_bwd: src0 = y (softmax
 * output), src1 = g, dst = dx = fp[0] * y * (g - sum(g * y)). Contiguous inputs. */
int gt_softmax_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_softmax_bwd_f32(const struct gt_node *node, const gt_ctx *ctx);

/* attention: fused softmax(scale q k^T + mask) v per head, by blocks (attention.c), no
 * T_q x T_k matrix. src0 q (B, T_q, H, D), src1 k and src2 v (B, T_k, H_kv, D), H_kv
 * dividing H (query head h reads KV head h / (H / H_kv)); any strides but unit stride
 * along D. ip[0] = mask as in softmax: 0 none; 1 causal, row i sees keys j <= i +
 * (T_k - T_q); 2 by position, src3 pos (T_q,) i32, row i sees j <= pos[i]; 3 by
 * segment, src3 seg (B, T) i32 (T_q == T_k), row i sees j <= i with seg[b, j] ==
 * seg[b, i]; ip[1] = window: 0, or (with a mask) w > 0, a row sees only the w keys
 * ending at its own (i - j < w; with pos, pos[i] - j < w: llama.cpp's sliding window);
 * fp[0] = scale. dst: contiguous f32 of B*T_q*H*D + B*H*T_q elements,
 * O (B, T_q, H, D) then LSE (B, H, T_q), each row's log(sum_j exp(scale q.k_j)) over
 * the keys it sees; a row seeing none has O = 0 and LSE = -inf. ip[2] = 1: llama.cpp's CPU
 * numbers (inference; ip[3] scales q first, ip[4] as its F16 KV cache, ip[5] takes sinks (H,)
 * f32, the input after the mask's, into each softmax's denominator as its soft_max does: LSE
 * then over the keys and the sink); checks.h gt_attention_ggml_check. The CPU forward only.
 * attention_bwd: src0..2 q, k, v as above, src3 y (the forward's dst), src4 g: dO of
 * q's shape (unit stride along D), or contiguous of y's size (dO then dLSE), src5 the
 * mask input; ip, fp as above. dst: contiguous f32 [dq | dk | dv], each contiguous in
 * its input's shape. Scratch (both): mask rows, Delta, a unit counter; work: one block's
 * buffers (gt_attention_<fwd|bwd>_f32_sizes). */
int gt_attention_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_attention_fwd_f32_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_attention_bwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_attention_bwd_f32_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);

/* cross_entropy: dst scalar = mean over counted rows of -log softmax(src0)[row, src1[row]];
 * src0 logits (N, V) f32 contiguous, src1 targets (N,) i32; rows whose target
 * is negative are ignored (no loss, not counted); a target >= V is
 * GT_ERR_INVALID. ip[0] = count to divide by, or 0: the kernel counts the
 * targets >= 0. A count of 0 gives loss 0 (and zero dlogits), not NaN.
 * scratch: N floats, per-row losses summed by thread 0 in row order.
 * ip[1] = 1 (cross_entropy_rows): dst (N,) = each row's loss (0 on ignored rows), no
 * mean; and in the backward g (N,), row r's gradient scaled by g[r] (ip[0] unused).
 * cross_entropy_bwd: src0 logits, src1 targets, src2 g (one f32); dst (N, V) =
 * dlogits = g * (softmax(logits) - onehot(target)) / count, 0 on ignored rows;
 * ip[0] as in the forward; no scratch. dst may be src0 itself (in place: the
 * logits, dead after this, give their memory to their gradient). */
int gt_cross_entropy_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_cross_entropy_fwd_f32_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_cross_entropy_bwd_f32(const struct gt_node *node, const gt_ctx *ctx);

/* rope, llama.cpp modes 0 (normal: adjacent pairs) and 2 (neox: pairs n_dims/2
 * apart): src0 x (..., T, H, D) contiguous, src1 positions (T,) i32, or (..., T)
 * i32 contiguous with x's leading dims (per-row positions, e.g. (B, T) for packed
 * samples), optional src2 factors (n_dims/2,) f32 (llama 3's rope_freqs); ip[0] =
 * n_dims (rotated leading dims of D, even, 2..D; the rest pass through), ip[1] =
 * mode (0 or 2), fp[0] = freq_base (> 0), fp[1] = freq_scale (> 0, 1 for none), fp[2] =
 * attn_factor (> 0, 1 for none: the rotated pairs are scaled by it, llama.cpp's mscale).
 * theta_i = freq_scale * pos * freq_base^(-2i/n_dims) / factors[i] rotates the
 * pair i, (x0, x1) -> (x0 cos - x1 sin, x0 sin + x1 cos); theta, cos, sin computed
 * in double. fp[3] = YaRN's ext_factor (0: none), fp[4], fp[5] its correction dims (low,
 * high): pair i's freq_scale becomes freq_scale (1 - m) + m with m = fp[3] (1 - clamp((i -
 * low) / max(0.001, high - low), 0, 1)), attn_factor times 1 + 0.1 ln(1 / freq_scale)
 * (ggml's rope_yarn). rope_bwd rotates by -theta (src0 = g). */
int gt_rope_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_rope_bwd_f32(const struct gt_node *node, const gt_ctx *ctx);

/* get_rows: dst (N..., C) = src0 (V, C)[src1 (N...) i32]; src0 rows of stride 1
 * (any row stride), src1 contiguous. An index outside [0, V) is GT_ERR_INVALID.
 * get_rows_bwd: src0 g (N..., C), src1 idx, both contiguous; dst (V, C) =
 * scatter-add of g (rows no index points to are 0). Deterministic. */
int gt_get_rows_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_get_rows_bwd_f32(const struct gt_node *node, const gt_ctx *ctx);

/* im2col over NHWC: src (N, H, W, C) contiguous -> dst (N, OH, OW, C*KH*KW),
 * column index c*KH*KW + kh*KW + kw; ip = {KH, KW, stride, pad}; zero padding;
 * OH = (H + 2 pad - KH) / stride + 1 (floor), OW alike.
 * im2col_bwd: src g (N, OH, OW, C*KH*KW) -> dst dx (N, H, W, C) (dst's shape
 * gives H, W, C); writes every element of dx. */
int gt_im2col_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_im2col_bwd_f32(const struct gt_node *node, const gt_ctx *ctx);

/* conv2d: direct convolution over NHWC with bias, relu and max-pool fused.
 * src0 x (N, H, W, C), src1 kernel (CO, C, KH, KW), src2 bias (CO,) (optional),
 * all contiguous; ip = {KH, KW, stride, pad, relu (0/1), pool (1: none)}; zero
 * padding, OH = (H + 2 pad - KH) / stride + 1 (floor), OW alike. v = relu?(conv
 * + bias), bit for bit what im2col, matmul, add and relu give. dst: v (N, OH,
 * OW, CO) when pool == 1; else (2, N, OH/pool, OW/pool, CO): [0] the max of v
 * over each pool x pool window (stride pool, floor), [1] the window index
 * i*pool + j of its first maximum as f32, or -1 where relu made it 0.
 * conv2d_weight_bwd: src0 x, src1 conv2d's dst, src2 g (N, OH/pool, OW/pool, CO)
 * (gradient of the values); dst (C*KH*KW + 1, CO): row ci*KH*KW + kh*KW + kw
 * holds d kernel[:, ci, kh, kw], the last row d bias. Node scratch: partial sums
 * per fixed block of images (gt_conv2d_weight_bwd_f32_sizes).
 * conv2d_input_bwd: src0 kernel, src1 conv2d's dst, src2 g; dst dx (N, H, W, C).
 * wdata: padded images and packed weights (the _sizes functions). */
int gt_conv2d_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_conv2d_fwd_f32_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_conv2d_weight_bwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_conv2d_weight_bwd_f32_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_conv2d_input_bwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_conv2d_input_bwd_f32_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);

/* causal_conv1d: the causal depthwise convolution over time of LFM2's short-convolution
 * layers (llama.cpp's ssm_conv over its conv state): src0 x (B, T, C), src1 w (C, L) ->
 * dst y (B, T, C), y[b, t, c] = sum over k < L of w[c, k] x[b, t - L + 1 + k, c], rows
 * before 0 zero; optional src2 seg (B, T) i32: terms from another segment are zero too
 * (packed samples). Summed from 0 in k order; ip[0] = 1: each tap a fused multiply-add
 * (llama.cpp's CPU numbers).
 * causal_conv1d_input_bwd: src0 w, src1 g (B, T, C) [, src2 seg] -> dst dx (B, T, C).
 * causal_conv1d_weight_bwd: src0 x, src1 g [, src2 seg] -> dst dw (C, L).
 * All contiguous. */
int gt_causal_conv1d_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_causal_conv1d_input_bwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_causal_conv1d_weight_bwd_f32(const struct gt_node *node, const gt_ctx *ctx);

/* Mixture-of-experts routing (native/cpu/moe.c; checks.h's gt_moe_route_check):
 * moe_topk_fwd_i32: src0 logits (..., E) f32 [, src1 a selection bias (E,) f32] -> dst
 *   (..., k) i32, k = ip[0]: each row's k largest, largest first (of equal ones the lower
 *   index first), by the logits (ip[1] = 0: softmax gating) or by sigmoid(logits) plus the
 *   bias (ip[1] = 1: sigmoid gating).
 * moe_weights_fwd_f32: src0 logits, src1 ids (..., k) i32 -> dst (..., k): softmax(logits)
 *   (ip[2] = 0) or sigmoid(logits) (ip[2] = 1) at ids, or softmax(logits at ids) (ip[2] = 2,
 *   llama.cpp's SOFTMAX_WEIGHT: softmax's renormalised over the chosen), divided by their sum
 *   (clamped below at 2^-14) where ip[0] = 1; ip[1] = 1: llama.cpp's CPU numbers
 *   (ggml_soft_max's exp and sums, over the E or with ip[2] = 2 the k chosen; ggml_sigmoid's).
 *   wdata: E floats.
 * moe_weights_bwd_f32: src0 logits, src1 ids, src2 g (..., k) -> dst dlogits (..., E); ip[0]
 *   norm, ip[1] sigmoid gating.
 * An id outside [0, E) is GT_ERR_INVALID. All contiguous. */
int gt_moe_topk_fwd_i32(const struct gt_node *node, const gt_ctx *ctx);
int gt_moe_weights_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_moe_weights_fwd_f32_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_moe_weights_bwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_moe_weights_bwd_f32_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);

/* The grouped expert product, ggml's mul_mat_id (native/cpu/moe.c; checks.h's
 * gt_moe_matmul_check): moe_matmul_fwd_f32[_<w>]: src0 x (N, X, K) f32 (X = 1 or k), src1 the
 * expert weights w (E, M, K) f32 or stored in <w> (whole, contiguous), src2 ids (N, k) i32 ->
 * dst (N, k, M), y[n, s] = w[ids[n, s]] @ x[n, X == 1 ? 0 : s], each expert's product over
 * only the tokens routed to it: each expert's rows gathered into one block through the
 * matmul's GEMM (gt_gemm_; a stored w with few rows through its row-dot kernel,
 * gt_qdot_rows_). ip[0] = 1: llama.cpp's numbers (f32 and f16 w only: per-row dots).
 * moe_matmul_input_bwd_f32[_<w>]: src0 w, src1 ids, src2 g (N, k, M) -> dst dx (N, X, K).
 * moe_matmul_weight_bwd_f32: src0 x, src1 ids, src2 g -> dst dw (E, M, K) (f32 experts).
 * wdata: the _sizes functions. */
int gt_moe_matmul_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_moe_matmul_input_bwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_moe_matmul_weight_bwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_moe_matmul_fwd_f32_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_moe_matmul_input_bwd_f32_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_moe_matmul_weight_bwd_f32_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_moe_matmul_fwd_f32_f16(const struct gt_node *node, const gt_ctx *ctx);
int gt_moe_matmul_fwd_f32_bf16(const struct gt_node *node, const gt_ctx *ctx);
int gt_moe_matmul_fwd_f32_q4_0(const struct gt_node *node, const gt_ctx *ctx);
int gt_moe_matmul_fwd_f32_q4_1(const struct gt_node *node, const gt_ctx *ctx);
int gt_moe_matmul_fwd_f32_q5_0(const struct gt_node *node, const gt_ctx *ctx);
int gt_moe_matmul_fwd_f32_q5_1(const struct gt_node *node, const gt_ctx *ctx);
int gt_moe_matmul_fwd_f32_q8_0(const struct gt_node *node, const gt_ctx *ctx);
int gt_moe_matmul_fwd_f32_q2_k(const struct gt_node *node, const gt_ctx *ctx);
int gt_moe_matmul_fwd_f32_q3_k(const struct gt_node *node, const gt_ctx *ctx);
int gt_moe_matmul_fwd_f32_q4_k(const struct gt_node *node, const gt_ctx *ctx);
int gt_moe_matmul_fwd_f32_q5_k(const struct gt_node *node, const gt_ctx *ctx);
int gt_moe_matmul_fwd_f32_q6_k(const struct gt_node *node, const gt_ctx *ctx);
int gt_moe_matmul_fwd_f32_mxfp4(const struct gt_node *node, const gt_ctx *ctx);
int gt_moe_matmul_input_bwd_f32_f16(const struct gt_node *node, const gt_ctx *ctx);
int gt_moe_matmul_input_bwd_f32_bf16(const struct gt_node *node, const gt_ctx *ctx);
int gt_moe_matmul_input_bwd_f32_q4_0(const struct gt_node *node, const gt_ctx *ctx);
int gt_moe_matmul_input_bwd_f32_q4_1(const struct gt_node *node, const gt_ctx *ctx);
int gt_moe_matmul_input_bwd_f32_q5_0(const struct gt_node *node, const gt_ctx *ctx);
int gt_moe_matmul_input_bwd_f32_q5_1(const struct gt_node *node, const gt_ctx *ctx);
int gt_moe_matmul_input_bwd_f32_q8_0(const struct gt_node *node, const gt_ctx *ctx);
int gt_moe_matmul_input_bwd_f32_q2_k(const struct gt_node *node, const gt_ctx *ctx);
int gt_moe_matmul_input_bwd_f32_q3_k(const struct gt_node *node, const gt_ctx *ctx);
int gt_moe_matmul_input_bwd_f32_q4_k(const struct gt_node *node, const gt_ctx *ctx);
int gt_moe_matmul_input_bwd_f32_q5_k(const struct gt_node *node, const gt_ctx *ctx);
int gt_moe_matmul_input_bwd_f32_q6_k(const struct gt_node *node, const gt_ctx *ctx);
int gt_moe_matmul_input_bwd_f32_mxfp4(const struct gt_node *node, const gt_ctx *ctx);
int gt_moe_matmul_fwd_f32_f16_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_moe_matmul_fwd_f32_bf16_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_moe_matmul_fwd_f32_q4_0_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_moe_matmul_fwd_f32_q4_1_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_moe_matmul_fwd_f32_q5_0_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_moe_matmul_fwd_f32_q5_1_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_moe_matmul_fwd_f32_q8_0_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_moe_matmul_fwd_f32_q2_k_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_moe_matmul_fwd_f32_q3_k_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_moe_matmul_fwd_f32_q4_k_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_moe_matmul_fwd_f32_q5_k_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_moe_matmul_fwd_f32_q6_k_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_moe_matmul_fwd_f32_mxfp4_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_moe_matmul_input_bwd_f32_f16_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_moe_matmul_input_bwd_f32_bf16_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_moe_matmul_input_bwd_f32_q4_0_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_moe_matmul_input_bwd_f32_q4_1_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_moe_matmul_input_bwd_f32_q5_0_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_moe_matmul_input_bwd_f32_q5_1_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_moe_matmul_input_bwd_f32_q8_0_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_moe_matmul_input_bwd_f32_q2_k_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_moe_matmul_input_bwd_f32_q3_k_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_moe_matmul_input_bwd_f32_q4_k_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_moe_matmul_input_bwd_f32_q5_k_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_moe_matmul_input_bwd_f32_q6_k_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_moe_matmul_input_bwd_f32_mxfp4_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);

/* delta_rule: the gated delta rule over time (Qwen3.5's gated DeltaNet layers, llama.cpp's
 * gated_delta_net): src0 q, src1 k (B, T, Hk, Dk), src2 v (B, T, Hv, Dv), src3 g, src4 beta
 * (B, T, Hv) [, seg (B, T) i32 when ip[0]] [, s0 (B, Hv, Dv, Dk) when ip[1]] -> dst o (B, T, Hv,
 * Dv) [with the last state after o: (B, T*Hv*Dv + Hv*Dv*Dk)]. Per V head h (K head h % Hk),
 * S (Dk, Dv) from 0 (or s0; back to 0 where seg changes): S = e^g S; S += k (beta (v - S^T
 * k))^T; o = S^T q / sqrt(Dk) (deltarule.h). delta_rule_bwd: src0..4 as the forward's, src5 go
 * [, seg] -> dst (B, T, 2 Hk Dk + Hv Dv + 2 Hv): dq | dk | dv | dg | dbeta. ip[2] = 1 (both,
 * not with s0): the chunked form (cpu/deltachunk.c; the CUDA kernels run row by row either
 * way). All contiguous; work: the _sizes functions. */
int gt_delta_rule_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_delta_rule_fwd_f32_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);
int gt_delta_rule_bwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_delta_rule_bwd_f32_sizes(const struct gt_node *node, int64_t *scratch, int64_t *work);

/* max_pool2d over NHWC, window and stride ip[0], no padding (floor):
 * src (N, H, W, C) -> dst (N, H/k, W/k, C). max_pool2d_bwd: src0 x, src1 g ->
 * dst dx; the gradient goes to the first maximum of each window (row-major
 * order), every other element of dx is 0. All contiguous. */
int gt_max_pool2d_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_max_pool2d_bwd_f32(const struct gt_node *node, const gt_ctx *ctx);

/* Copy with conversion to the dst dtype (named by the suffix); src any dtype
 * among f32/f16/bf16 and any strides, dst contiguous. f32 -> f16/bf16 rounds to
 * nearest even. Also serves `cont` (same dtype). */
int gt_copy_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_copy_fwd_f16(const struct gt_node *node, const gt_ctx *ctx);
int gt_copy_fwd_bf16(const struct gt_node *node, const gt_ctx *ctx);
/* set_rows, in place: dst (S, C) aliases src0 (persistent target, f32);
 * row src2[t] (idx (T,) i32) becomes src1[t] (values (T, C) f32) for t in
 * order; the other rows keep their values. Indices outside [0, S) fail. */
int gt_set_rows_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);
/* view_bwd: dst = zeros of the base shape, with src (g of a view) copied into
 * the view's place: ip[0] = element offset, view strides = dst strides given in
 * ip[1..6] over src's shape. */
int gt_view_bwd_f32(const struct gt_node *node, const gt_ctx *ctx);

/* The hyper vector (enum gt_hyper) is declared in gt_core.h. */

/* Optimizer steps, in place: dst aliases src0 (the parameter), and the state
 * tensors are updated too (the one exception to "kernels fill only dst").
 * src0 param, src1 grad, src2 hyper (f32 vector laid out as enum gt_hyper),
 * src3 grad norm (f32 scalar; clipping when hyper[max_norm] > 0), then state:
 * adamw_step: src4 m, src5 v.  sgd_step: src4 momentum buffer (unused when
 * hyper[momentum] == 0). fp[0] = weight-decay multiplier of this tensor (0/1).
 * All the same shape, contiguous f32. */
int gt_adamw_step_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);
int gt_sgd_step_fwd_f32(const struct gt_node *node, const gt_ctx *ctx);

/* Direct (non-plan) helpers: element conversions, contiguous, n elements. */
int gt_f32_to_f16(uint16_t *dst, const float *src, int64_t n);
int gt_f16_to_f32(float *dst, const uint16_t *src, int64_t n);
int gt_f32_to_bf16(uint16_t *dst, const float *src, int64_t n);
int gt_bf16_to_f32(float *dst, const uint16_t *src, int64_t n);

/* ggml block formats (quant.c). dequantize_row: dst (n f32) = src (n elements
 * of `dtype`, any type flagged GT_DTYPE_DEQUANTIZE); n a multiple of its block.
 * Bit-identical to gguf.quants. quantize_row: dst (n elements of `dtype`, any
 * type flagged GT_DTYPE_QUANTIZE) = src (n f32), rounded as ggml's reference
 * quantizers do. GT_ERR_UNSUPPORTED for other types. */
int gt_dequantize_row(float *dst, const void *src, int32_t dtype, int64_t n);
int gt_quantize_row(void *dst, const float *src, int32_t dtype, int64_t n);
/* quantize_rows_imatrix (quant_imatrix.c): dst (n_rows rows of n_cols elements of `dtype`) =
 * src (n_rows x n_cols f32), each row's scale searches weighting column j by imatrix[j]
 * (n_cols f32, llama.cpp's importance matrix values), as llama.cpp's quantizer does with one:
 * Q2_K..Q6_K, Q4_0, Q4_1, Q5_0, Q5_1; the other types as quantize_row (ggml does not weight
 * them). GT_ERR_SHAPE when n_cols is not a whole number of blocks. */
int gt_quantize_rows_imatrix(void *dst, const float *src, const float *imatrix, int32_t dtype, int64_t n_rows,
                             int64_t n_cols);

/* scan_strings (strings.c): walks n length-prefixed strings (u64 little-endian
 * length, then the bytes) in data[0..size). Fills bounds[2i], bounds[2i+1]
 * with the [start, stop) byte range of string i (bounds may be NULL: check
 * only) and *end with the byte after the last one. Fails (GT_ERR_INVALID,
 * *end = index of the bad string) on a length past the end or a string that
 * is not valid UTF-8 (overlongs, surrogates, > U+10FFFF rejected as Python does). */
int gt_scan_strings(int64_t *bounds, const uint8_t *data, int64_t size, int64_t n, int64_t *end);
