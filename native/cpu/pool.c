/* pool.c: errors, CPU feature dispatch, the persistent thread pool and the plan
 * executor. One gt_plan_compute call runs every node of a plan; each node is
 * split across threads and a barrier separates consecutive nodes. */
#define _GNU_SOURCE
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

/* ---- errors ------------------------------------------------------------ */

static _Thread_local char err_msg[1024];

int gt_set_error_(int code, const char *file, int line, const char *fmt, ...) {
    char msg[900];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    const char *base = strrchr(file, '/');
    snprintf(err_msg, sizeof err_msg, "%s (%s:%d)", msg, base ? base + 1 : file, line);
    return code;
}

const char *gt_last_error(void) { return err_msg; }
void gt_clear_error(void) { err_msg[0] = 0; }

/* ---- SIMD dispatch ------------------------------------------------------ */

static int simd_cap = 2;

int gt_cpu_features(void) {
    int f = 0;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) f |= 1;
    if ((f & 1) && __builtin_cpu_supports("avx512f")) f |= 2;
#endif
    return f;
}

int gt_simd_level_(void) {
    static int level = -1;
    if (level < 0) {
        int f = gt_cpu_features();
        level = (f & 2) ? 2 : (f & 1) ? 1 : 0;
    }
    return level < simd_cap ? level : simd_cap;
}

int gt_set_simd_level(int level) {
    if (level < 0 || level > 2) return GT_FAIL(GT_ERR_INVALID, "simd level %d not in 0..2", level);
    simd_cap = level;
    return GT_OK;
}

/* ---- thread pool ---------------------------------------------------------- */

struct gt_plan {
    gt_pool *pool;
    const gt_node *nodes;
    int64_t n_nodes;
    char *work;
    int64_t work_per_thread;
    int64_t failed_node;
    int64_t *node_ns;
};

typedef struct worker {
    gt_pool *pool;
    int ith;
} worker;

/* A pool belongs to the process that made it (owner): a fork copies the pool's memory but not
 * its threads, so in a forked child there is nothing to hand a job to, and its mutex and
 * condition variable may hold the parent's waiters (pthread_cond_destroy then waits forever: a
 * corpus worker hung so when Python's collector freed a backend the parent had made). In another
 * process gt_pool_free only frees the memory, and gt_plan_compute on more than one thread fails. */
struct gt_pool {
    pid_t owner;
    int n_threads;
    pthread_t *threads;
    worker *workers;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    atomic_int generation;      /* bumped to hand out a job (or to stop) */
    int stop;
    gt_plan *job;
    int job_nth;
    atomic_int bar_count;
    atomic_int bar_gen;
    atomic_int failed;          /* first failure wins */
    int fail_code;
    int64_t fail_node;
    char fail_msg[1024];
};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void barrier_wait(gt_pool *pool, int nth) {
    if (nth <= 1) return;
    int gen = atomic_load_explicit(&pool->bar_gen, memory_order_acquire);
    if (atomic_fetch_add_explicit(&pool->bar_count, 1, memory_order_acq_rel) == nth - 1) {
        atomic_store_explicit(&pool->bar_count, 0, memory_order_relaxed);
        atomic_fetch_add_explicit(&pool->bar_gen, 1, memory_order_release);
        return;
    }
    /* Spin briefly (nodes are short), then yield so an oversubscribed
     * machine still makes progress. */
    for (int spins = 0; atomic_load_explicit(&pool->bar_gen, memory_order_acquire) == gen; spins++) {
        if (spins < 20000) cpu_relax();
        else sched_yield();
    }
}

int gt_barrier(const gt_ctx *ctx) {
    barrier_wait((gt_pool *)ctx->pool, ctx->nth);
    return GT_OK;
}

static void record_failure(gt_pool *pool, int rc, int64_t node) {
    int expected = 0;
    if (atomic_compare_exchange_strong(&pool->failed, &expected, 1)) {
        pool->fail_code = rc;
        pool->fail_node = node;
        snprintf(pool->fail_msg, sizeof pool->fail_msg, "node %lld: %.960s", (long long)node, err_msg);
    }
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Every thread runs every node of the plan (its share of each), with a barrier
 * after each node. NOTE: the plan's fields are copied first: once the last
 * barrier is passed the caller may return and free the plan while a worker is
 * still leaving this function, so nothing may read *plan after that barrier. */
static void run_plan(gt_pool *pool, gt_plan *plan, int ith, int nth) {
    const gt_node *nodes = plan->nodes;
    const int64_t n_nodes = plan->n_nodes;
    int64_t *prof = ith == 0 ? plan->node_ns : NULL;
    gt_ctx ctx;
    ctx.ith = ith;
    ctx.nth = nth;
    ctx.wdata = plan->work ? plan->work + (int64_t)ith * plan->work_per_thread : NULL;
    ctx.wsize = plan->work_per_thread;
    ctx.pool = pool;
    int64_t t_prev = prof ? now_ns() : 0;
    for (int64_t i = 0; i < n_nodes; i++) {
        const gt_node *node = &nodes[i];
        int rc = node->fn ? node->fn(node, &ctx)
                          : GT_FAIL(GT_ERR_INVALID, "node has no kernel");
        if (rc != GT_OK) record_failure(pool, rc, i);
        barrier_wait(pool, nth);
        if (prof) {
            int64_t t = now_ns();
            prof[i] += t - t_prev;
            t_prev = t;
        }
        if (atomic_load_explicit(&pool->failed, memory_order_acquire)) {
            /* Every thread saw the failure after the same barrier; one more
             * barrier so none is still to read `failed` when the caller
             * returns and the next compute resets it. */
            barrier_wait(pool, nth);
            break;
        }
    }
}

static void *worker_main(void *arg) {
    worker *w = arg;
    gt_pool *pool = w->pool;
    int seen = 0;
    for (;;) {
        int gen;
        int spins = 0;
        while ((gen = atomic_load_explicit(&pool->generation, memory_order_acquire)) == seen) {
            if (++spins < 50000) {
                cpu_relax();
                continue;
            }
            pthread_mutex_lock(&pool->mu);
            while (atomic_load_explicit(&pool->generation, memory_order_acquire) == seen)
                pthread_cond_wait(&pool->cv, &pool->mu);
            pthread_mutex_unlock(&pool->mu);
        }
        seen = gen;
        if (pool->stop) return NULL;
        if (w->ith < pool->job_nth) run_plan(pool, pool->job, w->ith, pool->job_nth);
    }
}

int gt_pool_new(gt_pool **out, int32_t n_threads) {
    if (!out) return GT_FAIL(GT_ERR_INVALID, "gt_pool_new: null output pointer");
    *out = NULL;
    if (n_threads < 1 || n_threads > 1024)
        return GT_FAIL(GT_ERR_INVALID, "gt_pool_new: n_threads %d not in 1..1024", n_threads);
    gt_pool *pool = calloc(1, sizeof *pool);
    if (!pool) return GT_FAIL(GT_ERR_NOMEM, "gt_pool_new: out of memory");
    pool->owner = getpid();
    pool->n_threads = n_threads;
    pthread_mutex_init(&pool->mu, NULL);
    pthread_cond_init(&pool->cv, NULL);
    pool->threads = calloc((size_t)n_threads, sizeof *pool->threads);
    pool->workers = calloc((size_t)n_threads, sizeof *pool->workers);
    if (!pool->threads || !pool->workers) {
        gt_pool_free(pool);
        return GT_FAIL(GT_ERR_NOMEM, "gt_pool_new: out of memory");
    }
    for (int i = 1; i < n_threads; i++) {
        pool->workers[i].pool = pool;
        pool->workers[i].ith = i;
        if (pthread_create(&pool->threads[i], NULL, worker_main, &pool->workers[i]) != 0) {
            pool->n_threads = i;  /* join the ones that started */
            gt_pool_free(pool);
            return GT_FAIL(GT_ERR_THREAD, "gt_pool_new: could not start thread %d", i);
        }
    }
    *out = pool;
    return GT_OK;
}

void gt_pool_free(gt_pool *pool) {
    if (!pool) return;
    if (pool->owner != getpid()) {    /* a forked copy: no threads to stop, sync objects untouched */
        free(pool->threads);
        free(pool->workers);
        free(pool);
        return;
    }
    if (pool->threads && pool->workers) {
        pthread_mutex_lock(&pool->mu);
        pool->stop = 1;
        atomic_fetch_add(&pool->generation, 1);
        pthread_cond_broadcast(&pool->cv);
        pthread_mutex_unlock(&pool->mu);
        for (int i = 1; i < pool->n_threads; i++) pthread_join(pool->threads[i], NULL);
    }
    pthread_mutex_destroy(&pool->mu);
    pthread_cond_destroy(&pool->cv);
    free(pool->threads);
    free(pool->workers);
    free(pool);
}

/* ---- plans ----------------------------------------------------------------- */

int gt_plan_new(gt_plan **out, gt_pool *pool, const gt_node *nodes, int64_t n_nodes,
                void *work, int64_t work_per_thread) {
    if (!out || !pool || (!nodes && n_nodes > 0) || n_nodes < 0 || work_per_thread < 0)
        return GT_FAIL(GT_ERR_INVALID, "gt_plan_new: bad arguments");
    gt_plan *plan = calloc(1, sizeof *plan);
    if (!plan) return GT_FAIL(GT_ERR_NOMEM, "gt_plan_new: out of memory");
    plan->pool = pool;
    plan->nodes = nodes;
    plan->n_nodes = n_nodes;
    plan->work = work;
    plan->work_per_thread = work ? work_per_thread : 0;
    plan->failed_node = -1;
    *out = plan;
    return GT_OK;
}

void gt_plan_free(gt_plan *plan) { free(plan); }

int gt_plan_set_profile(gt_plan *plan, int64_t *node_ns) {
    if (!plan) return GT_FAIL(GT_ERR_INVALID, "gt_plan_set_profile: null plan");
    plan->node_ns = node_ns;
    return GT_OK;
}

int64_t gt_plan_failed_node(const gt_plan *plan) { return plan ? plan->failed_node : -1; }

int gt_plan_compute(gt_plan *plan, int32_t n_threads) {
    if (!plan) return GT_FAIL(GT_ERR_INVALID, "gt_plan_compute: null plan");
    gt_pool *pool = plan->pool;
    if (n_threads < 1 || n_threads > pool->n_threads)
        return GT_FAIL(GT_ERR_INVALID, "gt_plan_compute: n_threads %d not in 1..%d (pool size)",
                       n_threads, pool->n_threads);
    if (n_threads > 1 && pool->owner != getpid())
        return GT_FAIL(GT_ERR_INVALID, "gt_plan_compute: the thread pool was made by process %d, before "
                       "a fork: this process (%d) has none of its threads; make a backend here",
                       (int)pool->owner, (int)getpid());
    atomic_store(&pool->failed, 0);
    pool->fail_node = -1;
    plan->failed_node = -1;
    atomic_store(&pool->bar_count, 0);
    if (n_threads > 1) {
        pthread_mutex_lock(&pool->mu);
        pool->job = plan;
        pool->job_nth = n_threads;
        atomic_fetch_add_explicit(&pool->generation, 1, memory_order_release);
        pthread_cond_broadcast(&pool->cv);
        pthread_mutex_unlock(&pool->mu);
    }
    run_plan(pool, plan, 0, n_threads);
    /* run_plan ends with a barrier after the last node run, so every worker
     * is past its last kernel here. */
    if (atomic_load(&pool->failed)) {
        plan->failed_node = pool->fail_node;
        snprintf(err_msg, sizeof err_msg, "%s", pool->fail_msg);
        return pool->fail_code;
    }
    return GT_OK;
}

int gt_node_compute(gt_pool *pool, const gt_node *node, int32_t n_threads, void *work,
                    int64_t work_per_thread) {
    gt_plan plan = {pool, node, 1, work, work ? work_per_thread : 0, -1, NULL};
    if (!pool || !node) return GT_FAIL(GT_ERR_INVALID, "gt_node_compute: bad arguments");
    return gt_plan_compute(&plan, n_threads);
}
