/* nccl.cu: the gradient all-reduce of a data-parallel run on GPUs through NCCL, loaded with
 * dlopen (GGTRAIN_NCCL names the file; else libnccl.so.2 on the loader's path), declared here
 * with NCCL's documented signatures. The unique id travels from rank 0 over MPI (Python). */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.cuh"

extern "C" {
#include "gtc.h"
}

typedef struct { char internal[128]; } nccl_id;   /* ncclUniqueId */
enum { NCCL_FLOAT32 = 7, NCCL_SUM = 0 };            /* ncclFloat32, ncclSum */

static struct {
    int (*get_unique_id)(nccl_id *);
    int (*comm_init_rank)(void **comm, int nranks, nccl_id id, int rank);
    int (*all_reduce)(const void *send, void *recv, size_t count, int type, int op, void *comm, cudaStream_t s);
    const char *(*error_string)(int);
    void *comm;
} g_nccl;

static int nccl_fail(int st, const char *what) {
    return GTC_FAIL(GT_ERR_UNSUPPORTED, "%s: NCCL error %d (%s)", what, st,
                    g_nccl.error_string ? g_nccl.error_string(st) : "?");
}

extern "C" int gtc_nccl_load(void) {
    if (g_nccl.all_reduce) return GT_OK;
    const char *names[] = {getenv("GGTRAIN_NCCL"), "libnccl.so.2", "libnccl.so"};
    void *lib = NULL;
    for (int i = 0; i < 3 && !lib; i++)
        if (names[i] && names[i][0]) lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (!lib)
        return GTC_FAIL(GT_ERR_UNSUPPORTED, "NCCL cannot be loaded (tried GGTRAIN_NCCL, libnccl.so.2, libnccl.so): "
                        "install the nvidia-nccl wheel or name the library in GGTRAIN_NCCL");
    g_nccl.get_unique_id = (decltype(g_nccl.get_unique_id))dlsym(lib, "ncclGetUniqueId");
    g_nccl.comm_init_rank = (decltype(g_nccl.comm_init_rank))dlsym(lib, "ncclCommInitRank");
    g_nccl.error_string = (decltype(g_nccl.error_string))dlsym(lib, "ncclGetErrorString");
    g_nccl.all_reduce = (decltype(g_nccl.all_reduce))dlsym(lib, "ncclAllReduce");
    if (!g_nccl.get_unique_id || !g_nccl.comm_init_rank || !g_nccl.all_reduce) {
        g_nccl.all_reduce = NULL;
        return GTC_FAIL(GT_ERR_UNSUPPORTED, "NCCL lacks ncclGetUniqueId, ncclCommInitRank or ncclAllReduce");
    }
    return GT_OK;
}

extern "C" int gtc_nccl_unique_id(void *out) {
    GTC_TRY(gtc_nccl_load());
    nccl_id id;
    const int st = g_nccl.get_unique_id(&id);
    if (st) return nccl_fail(st, "ncclGetUniqueId");
    memcpy(out, &id, sizeof id);
    return GT_OK;
}

extern "C" int gtc_nccl_init(int32_t nranks, int32_t rank, const void *id) {
    GTC_TRY(gtc_nccl_load());
    if (g_nccl.comm) return GT_OK;
    nccl_id uid;
    memcpy(&uid, id, sizeof uid);
    const int st = g_nccl.comm_init_rank(&g_nccl.comm, nranks, uid, rank);
    if (st) return nccl_fail(st, "ncclCommInitRank");
    return GT_OK;
}

extern "C" int gtc_nccl_allreduce_f32(void *buffer, int64_t count) {
    if (!g_nccl.comm) return GTC_FAIL(GT_ERR_INVALID, "gtc_nccl_allreduce_f32: gtc_nccl_init has not run");
    const int st = g_nccl.all_reduce(buffer, buffer, (size_t)count, NCCL_FLOAT32, NCCL_SUM, g_nccl.comm, gtc_stream_());
    if (st) return nccl_fail(st, "ncclAllReduce");
    return GTC_CUDA(cudaStreamSynchronize(gtc_stream_()), "the gradient all-reduce");
}
