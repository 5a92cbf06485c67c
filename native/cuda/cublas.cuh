/* cublas.cuh: cuBLAS, loaded with dlopen when the library starts (nothing links against it):
 * the few functions the GEMMs call, declared here with cuBLAS's documented signatures. */
#ifndef GTC_CUBLAS_CUH
#define GTC_CUBLAS_CUH

#include <cuda_runtime.h>

enum { GTC_OP_N = 0, GTC_OP_T = 1 };   /* cublasOperation_t */

struct gtc_cublas {
    void *handle;
    int (*sgemm)(void *h, int ta, int tb, int m, int n, int k, const float *alpha, const float *a, int lda,
                 const float *b, int ldb, const float *beta, float *c, int ldc);
    int (*sgemm_strided)(void *h, int ta, int tb, int m, int n, int k, const float *alpha, const float *a, int lda,
                         long long sa, const float *b, int ldb, long long sb, const float *beta, float *c, int ldc,
                         long long sc, int batch);
    int (*set_math_mode)(void *h, int mode);
};

/* Loads cuBLAS (GGTRAIN_CUBLAS names the file; else libcublas.so.13, then .12, on the loader's
 * path, then in /usr/local/cuda/lib64), makes its handle on `stream`; a message names every file
 * tried when none loads. */
int gtc_cublas_load_(cudaStream_t stream);
const gtc_cublas *gtc_cublas_(void);

#endif
