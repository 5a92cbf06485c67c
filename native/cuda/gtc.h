/* gtc.h: the C API of ggtrain's CUDA library (layer 1), `ggtrain/native/_cuda.so`.
 *
 * Built by nvcc when it is on PATH (native/build_cuda.py) and loaded at run time by
 * core/backend_cuda.py through cffi's ABI mode, with native/gt_core.h (the tensor, node and
 * status declarations both backends share) before it as the cdef: plain declarations only,
 * no #include, no #define, no #ifdef, as ggtrain.h.
 *
 * The library links the CUDA runtime statically and loads the driver (libcuda.so.1) and
 * cuBLAS (libcublas.so.13 / .12, from the toolkit or the nvidia-cublas wheel) when
 * gtc_init runs, so it loads on a machine without either: gtc_init then fails with a
 * message naming what is missing.
 *
 * Model: the same gt_node array as the CPU's plan (native/gt_core.h), its tensors' data
 * pointing into device memory and each node's fn one of this library's launchers
 * (gtc_kernel(name)). gtc_run launches every node in order on one stream, then waits;
 * a launcher checks what it can on the host (shapes, dtypes, params) and returns a
 * gt_status like a CPU kernel; what only the device can see (an index out of range)
 * sets a device error word that gtc_run reads after the last node.
 *
 * Errors: every function returns GT_OK (0) or a negative gt_status, with a message from
 * gtc_last_error(). Nothing here aborts, exits or prints.
 */

int gtc_init(int32_t device);         /* the device to use (once per process) */
const char *gtc_last_error(void);
void gtc_clear_error(void);
int gtc_device_count(int32_t *count);
/* name (NUL-terminated, at most size bytes), total memory in bytes, compute capability */
int gtc_device_info(int32_t device, char *name, int64_t size, int64_t *memory, int32_t *major, int32_t *minor);

int gtc_malloc(void **out, int64_t bytes);   /* zero-filled device memory */
int gtc_free(void *ptr);
int gtc_copy_in(void *dst, const void *src, int64_t bytes);    /* host -> device */
int gtc_copy_out(void *dst, const void *src, int64_t bytes);   /* device -> host */
int gtc_memset(void *dst, int32_t value, int64_t bytes);
int gtc_sync(void);

/* The kernel table: gtc_kernel_count names, gtc_kernel_name(i) the i-th ("add_fwd_f32":
 * the CPU kernel's name without gt_), gtc_kernel(name) its launcher or NULL. */
int32_t gtc_kernel_count(void);
const char *gtc_kernel_name(int32_t i);
gt_kernel gtc_kernel(const char *name);
/* Node scratch and work bytes the kernel `name` needs for `node` (as the CPU's _sizes). */
int gtc_kernel_sizes(const char *name, const struct gt_node *node, int64_t *scratch, int64_t *work);

/* Runs nodes[0..n-1] in order (work: device memory of work_bytes, every node's per-thread
 * work: CUDA nodes have one "thread"); *failed = the index of a failing node, or -1. */
int gtc_run(const struct gt_node *nodes, int64_t n, void *work, int64_t work_bytes, int64_t *failed);
/* Profiling: with ns not NULL, each later gtc_run times every node with CUDA events and adds
 * its nanoseconds into ns[i] (the caller's array of n); NULL stops it. */
void gtc_set_profile(int64_t *ns);

/* The precision of every f32 matrix product from now on, by name: "f32" (exact, the default)
 * or "tf32" (the inputs rounded to TF32 on tensor cores, f32 sums: cuBLAS's 32F_FAST_TF32
 * compute type). gtc_math_name(i) is the i-th name, NULL past the last. */
int gtc_set_math(const char *name);
const char *gtc_math_name(int32_t i);

/* NCCL (nccl.cu), for the gradient all-reduce of a data-parallel run on GPUs: load it, make
 * the 128-byte unique id (rank 0), join the communicator (every rank, the id sent over MPI),
 * then sum count f32 elements of a device buffer over the ranks, in place. */
int gtc_nccl_load(void);
int gtc_nccl_unique_id(void *out);
int gtc_nccl_init(int32_t nranks, int32_t rank, const void *id);
int gtc_nccl_allreduce_f32(void *buffer, int64_t count);

/* Host copies of the device code that can run without a GPU, for the CPU-side tests:
 * dequantize n elements of a block type (the same __host__ __device__ decoder the
 * kernels use). */
int gtc_dequantize_row_host(float *dst, const void *src, int32_t dtype, int64_t n);
/* Tests only, never with a GPU in use: the f32 products' calls go to a host reference of
 * cublasSgemm (column-major, op, ld), so matmul_fwd_f32's launcher runs on host pointers and
 * its mapping of views to cuBLAS's arguments is checked against numpy. */
int gtc_test_host_blas(void);
