/* cublas.cuh: cuBLAS, loaded with dlopen when the library starts (nothing links against it):
 * the few functions the GEMMs call, declared here with cuBLAS's documented signatures. */
#ifndef GTC_CUBLAS_CUH
#define GTC_CUBLAS_CUH

#include <cuda_runtime.h>

enum { GTC_OP_N = 0, GTC_OP_T = 1 };   /* cublasOperation_t */

/* cublasComputeType_t: f32 sums, the inputs exact or rounded to TF32 on tensor cores. (Not
 * 32F_FAST_16BF: on an H100 it gave f32 operands TF32's rounding, bench/cuda_check.py showed;
 * bf16 products take bf16 operands, rounded from f32 by matmul.cu, with the 32F type.) */
enum { GTC_COMPUTE_32F = 68, GTC_COMPUTE_32F_FAST_TF32 = 77 };
enum { GTC_R_32F = 0, GTC_R_16BF = 14 };   /* cudaDataType_t: f32 (C always), bf16 (A, B of bf16 products) */
enum { GTC_GEMM_DEFAULT = -1 };        /* cublasGemmAlgo_t: cuBLAS's choice */

struct gtc_cublas {
    void *handle;
    int compute;    /* the compute type of every product (gtc_set_math) */
    int bf16;       /* products of f32 operands read them rounded to bf16 (gtc_set_math "bf16") */
    int (*gemm)(void *h, int ta, int tb, int m, int n, int k, const void *alpha, const void *a, int a_type, int lda,
                const void *b, int b_type, int ldb, const void *beta, void *c, int c_type, int ldc, int compute,
                int algo);
    int (*gemm_strided)(void *h, int ta, int tb, int m, int n, int k, const void *alpha, const void *a, int a_type,
                        int lda, long long sa, const void *b, int b_type, int ldb, long long sb, const void *beta,
                        void *c, int c_type, int ldc, long long sc, int batch, int compute, int algo);
};

/* Loads cuBLAS (GGTRAIN_CUBLAS names the file; else libcublas.so.13, then .12, on the loader's
 * path, then in /usr/local/cuda/lib64), makes its handle on `stream`; a message names every file
 * tried when none loads. */
int gtc_cublas_load_(cudaStream_t stream);
const gtc_cublas *gtc_cublas_(void);

#endif
