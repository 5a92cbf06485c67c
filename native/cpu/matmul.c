/* matmul.c: batched f32 matrix product, a packed cache-blocked GEMM in the
 * BLIS/GotoBLAS layout.
 *
 * For each batch matrix: loop over NC-wide column panels of B, KC-deep slices
 * of K and MC-tall row blocks of A; pack the B panel (KC x NC) and the A block
 * (MC x KC) into this thread's scratch as micro-panels (NR columns of B, MR rows
 * of A, k-major, zero-padded at the edges), then run an MR x NR register
 * micro-kernel over every tile. A plain B with rows less than a page apart is
 * packed only at its edges: the micro-kernel reads its full panels in place, with
 * the source's stride from one k to the next; so is a plain A with the AVX-512
 * kernels (its MR rows read as MR streams). A transposed A is always packed (see
 * B_INPLACE_RS). Edge tiles go through a small tile on the stack. Micro-kernels:
 * AVX-512F 12 x 32 (or 6 x 64 where that pads less, e.g. M <= 6), AVX2+FMA 6 x 16,
 * plain C 4 x 8 (gt_simd_level_).
 *
 * Narrow products (N <= 80 with AVX-512, N <= 32 with AVX2; the im2col convolutions'
 * x @ W^T, g @ W and g^T @ x, with N = channels) take the skinny path instead:
 * one register tile spans all N columns, so nothing is packed but a transposed
 * B's K slice; A is read in place (see "skinny path" below).
 *
 * Numerics: the micro-kernel starts the first K slice from zero and every later
 * slice from the partial result in dst, so each output element is one unbroken
 * chain acc = fma(a[i,k], b[k,j], acc) for k = 0..K-1 (multiply-then-add in the
 * scalar fallback). That chain does not depend on the tiling, on KC, on the
 * thread split or on which tile an element falls in: results are bit-identical
 * for any thread count, and the AVX2 and AVX-512 paths agree bit for bit.
 * (dst is read back only for partial sums this same call wrote, never for what
 * it held before: the kernel still just fills its output.)
 *
 * Stored weights (gt_matmul_fwd_f32_<w>: src1 a frozen f16, bf16 or ggml-block
 * weight W or its transpose): the same driver, with the B panel dequantized
 * while it is packed (pack_b_weight) into exactly the floats and places an f32
 * B would have, so the chain above, and the bits, are those of
 * gt_matmul_fwd_f32 on the dequantized matrix; no skinny path (it would read B
 * in place). Only the panel being packed is ever f32. Exception: x @ W^T with
 * at most SMALL_M rows (generation) takes the row-dot path of qdot.c, which
 * reads each W row once, in an order of its own (documented there).
 *
 * Threading: no shared scratch and no barrier. Many small matrices are split
 * by batch; otherwise each matrix is split along M or N (the longer one, at
 * multiples of MR or NR nearest to equal shares; always M on the skinny path, in
 * single rows when there are fewer tiles than threads), every thread packing its
 * own panels.
 */
#include <math.h>

#include "internal.h"
#include "rowops.h"
#include "simd.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

/* Blocking. MC is a multiple of every MR below, NC of every NR. KC is the
 * deepest K slice; a product cuts K into the fewest slices of at most KC, of
 * equal depth to a weight block (k_slice): K = 576 takes 3 x 192, not 256 +
 * 256 + 64, whose shallow last slice loads and stores every C tile for 64
 * FMAs a lane (1024 x 576 @ 576 x 1536 Q4_1 ran 8% slower than K = 768). */
#define KC 256
#define MC 144
#define NC 1024
#define MR_MAX 12
#define NR_MAX 64
#define ALIGN 64

#define A_FLOATS ((int64_t)MC * KC)
#define B_FLOATS ((int64_t)KC * NC)

static int64_t work_size(void) { return (A_FLOATS + B_FLOATS) * (int64_t)sizeof(float) + ALIGN; }

int gt_matmul_fwd_f32_sizes(const gt_node *node, int64_t *scratch, int64_t *work) {
    (void)node;
    *scratch = 0;
    *work = work_size();
    return GT_OK;
}

typedef void (*ukernel_fn)(int64_t kc, const float *a, int64_t ars, int64_t acs, const float *b, int64_t ldb,
                           float *c, int64_t ldc, int acc);
typedef void (*pack_fn)(float *dst, const float *src, int64_t rs, int64_t cs, int64_t n, int64_t kc);

typedef struct impl {
    int mr, nr;
    ukernel_fn kernel;  /* A's element (r, k) at a[r * ars + k * acs], ars or acs 1 */
    pack_fn pack_a, pack_b;
    int plain_a;        /* reads a plain A (acs = 1) in place as fast as packed */
} impl;

/* ---- packing --------------------------------------------------------------- */

/* Both operands pack to the same layout: n "lines" (rows of A, columns of B)
 * over kc values of k, in panels of w lines; in panel p, element (line i, k)
 * sits at [k*w + i - p*w], and lines past n are zeros. Two source layouts:
 *   pack_lines: line i is contiguous along k, element at src[i*ls + k]
 *               (plain A, transposed B): a transpose, done in 8x8 blocks;
 *   pack_cols:  the lines of one k are contiguous, element at src[k*ks + i]
 *               (transposed A, plain B): w-long copies. */

static inline __attribute__((always_inline)) void pack_lines_gen(float *restrict dst, const float *src,
                                                                 int64_t ls, int64_t n, int64_t kc,
                                                                 const int w) {
    for (int64_t i0 = 0; i0 < n; i0 += w, dst += (int64_t)w * kc) {
        const int lines = n - i0 < w ? (int)(n - i0) : w;
        const float *s0 = src + i0 * ls;
        int64_t k = 0;
        for (; k + 8 <= kc; k += 8) {
            float *d = dst + k * w;
            for (int i = 0; i < lines; i++) {
                const float *s = s0 + i * ls + k;
                for (int q = 0; q < 8; q++) d[q * w + i] = s[q];
            }
            for (int i = lines; i < w; i++)
                for (int q = 0; q < 8; q++) d[q * w + i] = 0.0f;
        }
        for (; k < kc; k++) {
            float *d = dst + k * w;
            for (int i = 0; i < lines; i++) d[i] = s0[i * ls + k];
            for (int i = lines; i < w; i++) d[i] = 0.0f;
        }
    }
}

static inline __attribute__((always_inline)) void pack_cols_gen(float *restrict dst, const float *src,
                                                                int64_t ks, int64_t n, int64_t kc,
                                                                const int w) {
    /* one sweep along each source row (one k), scattering w-long pieces */
    const int64_t full = n / w, rest = n - full * w, pstride = (int64_t)w * kc;
    for (int64_t k = 0; k < kc; k++) {
        const float *s = src + k * ks;
        float *d = dst + k * w;
        for (int64_t p = 0; p < full; p++, s += w, d += pstride) memcpy(d, s, (size_t)w * sizeof(float));
        if (rest) {
            for (int i = 0; i < rest; i++) d[i] = s[i];
            for (int i = (int)rest; i < w; i++) d[i] = 0.0f;
        }
    }
}

/* pack_W: lines i < n of src, element (i,k) at src[i*ls + k*ks], one of ls/ks
 * being 1 (for A: ls, ks = its row, column strides; for B: column, row). */
#define PACKER(W, LINES)                                                                       \
    static void pack_##W(float *d, const float *s, int64_t ls, int64_t ks, int64_t n,          \
                         int64_t kc) {                                                         \
        if (ls == 1) pack_cols_gen(d, s, ks, n, kc, W);                                        \
        else LINES(d, s, ls, n, kc, W);                                                        \
    }

#if defined(__x86_64__)
/* r[q][i] <- r[i][q] for an 8x8 block of floats. */
#define TRANSPOSE8(r)                                                                          \
    do {                                                                                       \
        const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]); \
        const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]); \
        const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]); \
        const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]); \
        const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE); \
        const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE); \
        const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE); \
        const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE); \
        r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);                                           \
        r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);                                           \
        r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);                                           \
        r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);                                           \
        r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);                                           \
        r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);                                           \
        r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);                                           \
        r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);                                           \
    } while (0)

/* pack_lines with 8x8 AVX transposes: 8 loads, 24 shuffles, 8 stores per 64
 * values. w is 6, 12 or a multiple of 8 (groups of 8 lines, the last 4 or 6).
 * A group of 6 is stored as 4 + 2 floats, not with vmaskmovps: that store is
 * microcoded on AMD, and took 10% of a llama step's matmul time. */
static inline __attribute__((always_inline, target("avx2"))) void
pack_lines_avx2(float *restrict dst, const float *src, int64_t ls, int64_t n, int64_t kc, const int w) {
    for (int64_t i0 = 0; i0 < n; i0 += w, dst += (int64_t)w * kc) {
        const int lines = n - i0 < w ? (int)(n - i0) : w;
        const float *s0 = src + i0 * ls;
        int64_t k = 0;
        for (; k + 8 <= kc; k += 8) {
            for (int g = 0; g < w; g += 8) {
                const int gl = w - g < 8 ? w - g : 8;
                __m256 r[8];
#pragma GCC unroll 8
                for (int i = 0; i < 8; i++)
                    r[i] = i < gl && g + i < lines ? _mm256_loadu_ps(s0 + (g + i) * ls + k)
                                                   : _mm256_setzero_ps();
                TRANSPOSE8(r);
                float *d = dst + k * w + g;
#pragma GCC unroll 8
                for (int q = 0; q < 8; q++) {
                    if (gl == 8) {
                        _mm256_storeu_ps(d + q * w, r[q]);
                    } else {
                        _mm_storeu_ps(d + q * w, _mm256_castps256_ps128(r[q]));
                        if (gl == 6) _mm_storel_pi((__m64 *)(d + q * w + 4), _mm256_extractf128_ps(r[q], 1));
                    }
                }
            }
        }
        for (; k < kc; k++) {
            float *d = dst + k * w;
            for (int i = 0; i < lines; i++) d[i] = s0[i * ls + k];
            for (int i = lines; i < w; i++) d[i] = 0.0f;
        }
    }
}
#define PACKER_AVX2(W)                                                                        \
    __attribute__((target("avx2"))) static void pack_lines_avx2_##W(                          \
        float *d, const float *s, int64_t ls, int64_t n, int64_t kc, int w) {                 \
        (void)w;                                                                               \
        pack_lines_avx2(d, s, ls, n, kc, W);                                                   \
    }                                                                                          \
    PACKER(W, pack_lines_avx2_##W)
#endif

/* ---- scalar micro-kernel (4 x 8), plain C ------------------------------------ */

PACKER(4, pack_lines_gen)
PACKER(8, pack_lines_gen)

/* c[4 x 8] (row stride ldc) = (acc ? c : 0) + a-panel x b-panel over kc, one
 * multiply-then-add per k in order. */
static void ukernel_scalar(int64_t kc, const float *restrict a, int64_t ars, int64_t acs, const float *restrict b,
                           int64_t ldb, float *restrict c, int64_t ldc, int acc) {
    float t[4][8];
    for (int r = 0; r < 4; r++)
        for (int j = 0; j < 8; j++) t[r][j] = acc ? c[r * ldc + j] : 0.0f;
    for (int64_t k = 0; k < kc; k++, a += acs, b += ldb)
        for (int r = 0; r < 4; r++)
            for (int j = 0; j < 8; j++) t[r][j] = t[r][j] + a[r * ars] * b[j];
    for (int r = 0; r < 4; r++)
        for (int j = 0; j < 8; j++) c[r * ldc + j] = t[r][j];
}

static const impl impl_scalar = {4, 8, ukernel_scalar, pack_4, pack_8, 0};

#if defined(__x86_64__)

/* ---- AVX2+FMA micro-kernel (6 x 16): 12 ymm accumulators ------------------- */

PACKER_AVX2(6)
PACKER_AVX2(16)

#define AVX2_ROW(r)                                                       \
    {                                                                     \
        const __m256 t = _mm256_broadcast_ss(a + (r) * ars);              \
        c##r##0 = _mm256_fmadd_ps(t, b0, c##r##0);                        \
        c##r##1 = _mm256_fmadd_ps(t, b1, c##r##1);                        \
    }
#define AVX2_LOAD(r)                                                      \
    c##r##0 = _mm256_loadu_ps(c + (r) * ldc);                             \
    c##r##1 = _mm256_loadu_ps(c + (r) * ldc + 8);
#define AVX2_STORE(r)                                                     \
    _mm256_storeu_ps(c + (r) * ldc, c##r##0);                             \
    _mm256_storeu_ps(c + (r) * ldc + 8, c##r##1);

/* c[6 x 16] = (acc ? c : 0) + a-panel x b-panel, one FMA chain per element. */
__attribute__((target("avx2,fma"))) static void ukernel_avx2(int64_t kc, const float *restrict a,
                                                             int64_t ars, int64_t acs,
                                                             const float *restrict b, int64_t ldb,
                                                             float *restrict c, int64_t ldc,
                                                             int acc) {
    __m256 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
    if (acc) {
        AVX2_LOAD(0) AVX2_LOAD(1) AVX2_LOAD(2) AVX2_LOAD(3) AVX2_LOAD(4) AVX2_LOAD(5)
    } else {
        c00 = c01 = c10 = c11 = c20 = c21 = _mm256_setzero_ps();
        c30 = c31 = c40 = c41 = c50 = c51 = _mm256_setzero_ps();
    }
    for (int64_t k = 0; k < kc; k++, a += acs, b += ldb) {
        _mm_prefetch((const char *)(b + ldb * 8), _MM_HINT_T0);
        const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
        AVX2_ROW(0) AVX2_ROW(1) AVX2_ROW(2) AVX2_ROW(3) AVX2_ROW(4) AVX2_ROW(5)
    }
    AVX2_STORE(0) AVX2_STORE(1) AVX2_STORE(2) AVX2_STORE(3) AVX2_STORE(4) AVX2_STORE(5)
}

static const impl impl_avx2 = {6, 16, ukernel_avx2, pack_6, pack_16, 0};

/* ---- AVX-512F micro-kernels: 6 x 64 and 12 x 32, 24 zmm accumulators each ---- */

PACKER_AVX2(64)

#define Z_ROW(r)                                                          \
    {                                                                     \
        const __m512 t = _mm512_set1_ps(A_ROW(r));                        \
        c##r##0 = _mm512_fmadd_ps(t, b0, c##r##0);                        \
        c##r##1 = _mm512_fmadd_ps(t, b1, c##r##1);                        \
        c##r##2 = _mm512_fmadd_ps(t, b2, c##r##2);                        \
        c##r##3 = _mm512_fmadd_ps(t, b3, c##r##3);                        \
    }
#define Z_LOAD(r)                                                         \
    c##r##0 = _mm512_loadu_ps(c + (r) * ldc);                             \
    c##r##1 = _mm512_loadu_ps(c + (r) * ldc + 16);                        \
    c##r##2 = _mm512_loadu_ps(c + (r) * ldc + 32);                        \
    c##r##3 = _mm512_loadu_ps(c + (r) * ldc + 48);
#define Z_STORE(r)                                                        \
    _mm512_storeu_ps(c + (r) * ldc, c##r##0);                             \
    _mm512_storeu_ps(c + (r) * ldc + 16, c##r##1);                        \
    _mm512_storeu_ps(c + (r) * ldc + 32, c##r##2);                        \
    _mm512_storeu_ps(c + (r) * ldc + 48, c##r##3);
#define Z_ZERO(r) c##r##0 = c##r##1 = c##r##2 = c##r##3 = _mm512_setzero_ps();

/* Row r of the A tile at k: q[r / 4][o[r % 4]], the pointers q stepping by acs per k
 * (3 pointers and 3 offsets in registers, rather than MR offsets). */
#define A_ROW(r) q[(r) / 4][o[(r) % 4]]
#define A_SETUP(MR)                                                        \
    const float *q[3] = {a, (MR) > 4 ? a + 4 * ars : a, (MR) > 8 ? a + 8 * ars : a}; \
    const int64_t o[4] = {0, ars, 2 * ars, 3 * ars};
#define A_STEP q[0] += acs, q[1] += acs, q[2] += acs

/* Each AVX-512 kernel in two builds: A packed (ars = 1: the MR values of one k
 * adjacent, at constant offsets) or plain, read in place (acs = 1, rows ars apart). */
#define Z_BUILDS(NAME, BODY)                                                               \
    __attribute__((target("avx512f"))) static void NAME(int64_t kc, const float *restrict a,  \
                                                        int64_t ars, int64_t acs,             \
                                                        const float *restrict b, int64_t ldb, \
                                                        float *restrict c, int64_t ldc, int acc) { \
        if (ars == 1) BODY(kc, a, 1, acs, b, ldb, c, ldc, acc);                                \
        else BODY(kc, a, ars, 1, b, ldb, c, ldc, acc);                                         \
    }

/* c[6 x 64] = (acc ? c : 0) + a-panel x b-panel, one FMA chain per element. */
static inline __attribute__((always_inline, target("avx512f"))) void
z6x64_body(int64_t kc, const float *restrict a, int64_t ars, int64_t acs, const float *restrict b, int64_t ldb,
           float *restrict c, int64_t ldc, int acc) {
    A_SETUP(6)
    __m512 c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23;
    __m512 c30, c31, c32, c33, c40, c41, c42, c43, c50, c51, c52, c53;
    if (acc) {
        Z_LOAD(0) Z_LOAD(1) Z_LOAD(2) Z_LOAD(3) Z_LOAD(4) Z_LOAD(5)
    } else {
        Z_ZERO(0) Z_ZERO(1) Z_ZERO(2) Z_ZERO(3) Z_ZERO(4) Z_ZERO(5)
    }
    for (int64_t k = 0; k < kc; k++, A_STEP, b += ldb) {
        const __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + 16);
        const __m512 b2 = _mm512_loadu_ps(b + 32), b3 = _mm512_loadu_ps(b + 48);
        Z_ROW(0) Z_ROW(1) Z_ROW(2) Z_ROW(3) Z_ROW(4) Z_ROW(5)
    }
    Z_STORE(0) Z_STORE(1) Z_STORE(2) Z_STORE(3) Z_STORE(4) Z_STORE(5)
}
Z_BUILDS(ukernel_avx512_6x64, z6x64_body)

static const impl impl_avx512_6x64 = {6, 64, ukernel_avx512_6x64, pack_6, pack_64, 1};

/* ---- AVX-512F micro-kernel (12 x 32): 24 zmm accumulators ------------------- */

PACKER_AVX2(12)
PACKER_AVX2(32)

#define Y_ROW(r)                                                          \
    {                                                                     \
        const __m512 t = _mm512_set1_ps(A_ROW(r));                        \
        c##r##0 = _mm512_fmadd_ps(t, b0, c##r##0);                        \
        c##r##1 = _mm512_fmadd_ps(t, b1, c##r##1);                        \
    }
#define Y_LOAD(r)                                                         \
    c##r##0 = _mm512_loadu_ps(c + (r) * ldc);                             \
    c##r##1 = _mm512_loadu_ps(c + (r) * ldc + 16);
#define Y_STORE(r)                                                        \
    _mm512_storeu_ps(c + (r) * ldc, c##r##0);                             \
    _mm512_storeu_ps(c + (r) * ldc + 16, c##r##1);
#define Y_ZERO(r) c##r##0 = c##r##1 = _mm512_setzero_ps();

/* c[12 x 32] = (acc ? c : 0) + a-panel x b-panel, one FMA chain per element. */
static inline __attribute__((always_inline, target("avx512f"))) void
z12x32_body(int64_t kc, const float *restrict a, int64_t ars, int64_t acs, const float *restrict b, int64_t ldb,
            float *restrict c, int64_t ldc, int acc) {
    A_SETUP(12)
    __m512 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
    __m512 c60, c61, c70, c71, c80, c81, c90, c91;
    __m512 c100, c101, c110, c111;
    if (acc) {
        Y_LOAD(0) Y_LOAD(1) Y_LOAD(2) Y_LOAD(3) Y_LOAD(4) Y_LOAD(5)
        Y_LOAD(6) Y_LOAD(7) Y_LOAD(8) Y_LOAD(9) Y_LOAD(10) Y_LOAD(11)
    } else {
        Y_ZERO(0) Y_ZERO(1) Y_ZERO(2) Y_ZERO(3) Y_ZERO(4) Y_ZERO(5)
        Y_ZERO(6) Y_ZERO(7) Y_ZERO(8) Y_ZERO(9) Y_ZERO(10) Y_ZERO(11)
    }
    for (int64_t k = 0; k < kc; k++, A_STEP, b += ldb) {
        const __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + 16);
        Y_ROW(0) Y_ROW(1) Y_ROW(2) Y_ROW(3) Y_ROW(4) Y_ROW(5)
        Y_ROW(6) Y_ROW(7) Y_ROW(8) Y_ROW(9) Y_ROW(10) Y_ROW(11)
    }
    Y_STORE(0) Y_STORE(1) Y_STORE(2) Y_STORE(3) Y_STORE(4) Y_STORE(5)
    Y_STORE(6) Y_STORE(7) Y_STORE(8) Y_STORE(9) Y_STORE(10) Y_STORE(11)
}
Z_BUILDS(ukernel_avx512_12x32, z12x32_body)

static const impl impl_avx512_12x32 = {12, 32, ukernel_avx512_12x32, pack_12, pack_32, 1};

/* Padded area of an m x n product in mr x nr tiles. */
static int64_t padded(int64_t m, int64_t n, int mr, int nr) {
    return (m + mr - 1) / mr * mr * ((n + nr - 1) / nr * nr);
}

#endif /* __x86_64__ */

/* The micro-kernel for this CPU (capped by gt_set_simd_level) and shape. The
 * two AVX-512 kernels give identical results (same FMA chain per element), so
 * the choice, made from the shape alone, only affects speed: the one wasting
 * less work on zero padding, 12 x 32 on a tie (measured a little faster). */
static const impl *pick_impl(int64_t m, int64_t n) {
#if defined(__x86_64__)
    const int level = gt_simd_level_();
    if (level >= 2) {
        return padded(m, n, 6, 64) < padded(m, n, 12, 32) ? &impl_avx512_6x64 : &impl_avx512_12x32;
    }
    if (level >= 1) return &impl_avx2;
#endif
    (void)m;
    (void)n;
    return &impl_scalar;
}

/* ---- skinny path: N <= 80, A read in place ---------------------------------------- */

/* For a narrow product (N up to 5 vectors) the whole row of C fits in one
 * register tile, so A needs no packing: the micro-kernel broadcasts A[i, k]
 * straight from the source (any strides) and multiplies it by the row k of B,
 * read in place when B's rows are contiguous (cs == 1) or else from a copy of
 * the current K slice. The last vector of a row is masked (no padding, no edge
 * tiles along N); rows at the edge run a kernel instantiated for that many rows.
 * Tiles (rows x vectors, 12 to 25 accumulators): AVX-512 12x1, 12x2, 8x3, 6x4,
 * 5x5 zmm; AVX2 12x1, 6x2, 4x3, 3x4 ymm (N <= 8 takes the ymm 12x1 at either
 * level: a zmm would be half empty). K is cut in SK_KC slices, the first
 * starting from zero and the others from dst, as in the packed path: the same
 * FMA chain per element, so the two paths, and the AVX2 and AVX-512 kernels,
 * agree bit for bit.
 * Why: for the CNN's shapes (N = 8 or 16 channels, K = 9 or 16, or K = 392000
 * for a 9 x 8 weight gradient) the packed path spent more time packing, and
 * multiplying zero padding of its 32- or 64-wide tiles, than on the product. */
#define SK_KC 256          /* K slice: B slice of <= 256 x 80 floats stays in L2 */
#define SK_MR_CAP 12
#define SK_NV_CAP 5

/* c[mm x n] (row stride ldc) = (acc ? c : 0) + A[mm x kc] @ B[kc x n], with
 * A[r, k] = a[r*ars + k*acs], row k of B at b + k*ldb, n = (nv - 1) * vw + nlast. */
typedef void (*sk_fn)(int mm, int64_t kc, const float *a, int64_t ars, int64_t acs, const float *b,
                      int64_t ldb, float *c, int64_t ldc, int acc, int nlast);

typedef struct skimpl {
    int vw, nv, mr;  /* vector width, vectors per row, rows per tile */
    sk_fn fn;
} skimpl;

#if defined(__x86_64__)

/* A with ars == 1 (a transposed view: the MR values of one k together, rows of
 * A^T far apart) defeats the hardware prefetcher when rows of A^T are long,
 * each k touching a new line: fetch the tile's part of row k + SK_PF ahead. */
#define SK_PF 256
#define SK_PREFETCH(a, acs, MR)                                                              \
    do {                                                                                     \
        _mm_prefetch((const char *)((a) + SK_PF * (acs)), _MM_HINT_T0);                      \
        _mm_prefetch((const char *)((a) + SK_PF * (acs) + (MR) - 1), _MM_HINT_T0);           \
    } while (0)

/* A with acs == 1 (plain, rows >= 128 bytes): MR row streams, each advancing
 * by a float per k; fetch the next tile's rows meanwhile, line by line (line
 * k / MR of row k % MR: with MR <= 16 that covers rows of kc floats). */
#define SK_PREFETCH_NEXT(pn, pr, ars, MR)                                                    \
    do {                                                                                     \
        _mm_prefetch((const char *)((pn) + (pr) * (ars)), _MM_HINT_T0);                      \
        if (++(pr) == (MR)) {                                                                \
            (pr) = 0;                                                                        \
            (pn) += 16;                                                                      \
        }                                                                                    \
    } while (0)

/* One MR x NV-vector tile; MR and NV are constants after inlining, so the
 * accumulator arrays live in registers. */
static inline __attribute__((always_inline, target("avx512f"))) void
sk512_body(int64_t kc, const float *a, int64_t ars, int64_t acs, const float *b, int64_t ldb,
           float *c, int64_t ldc, int acc, __mmask16 lm, const int MR, const int NV, const int FULL) {
    __m512 t[SK_MR_CAP][SK_NV_CAP];
#pragma GCC unroll 16
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 8
        for (int v = 0; v < NV; v++)
            t[r][v] = !acc ? _mm512_setzero_ps()
                      : v + 1 < NV || FULL ? _mm512_loadu_ps(c + r * ldc + v * 16)
                                           : _mm512_maskz_loadu_ps(lm, c + r * ldc + v * 16);
    /* prefetching pays for long K only (the CNN's weight gradients), not for the short
     * block products of fused kernels */
    const int pf = ars == 1 && acs >= 32 && kc >= 128, pfrows = acs == 1 && ars >= 32 && kc >= 128;
    const float *pn = a + MR * ars;  /* the next tile's rows */
    int pr = 0;
    /* row r of A at q[r / 4] + (r % 4) * ars: 3 pointers and 3 offsets in registers
     * rather than MR offsets (which spilled for MR = 12) */
    const float *q[3] = {a, a + 4 * ars, a + 8 * ars};
    const int64_t off[4] = {0, ars, 2 * ars, 3 * ars};
    for (int64_t k = 0; k < kc; k++, q[0] += acs, q[1] += acs, q[2] += acs, b += ldb) {
        if (pf) SK_PREFETCH(q[0], acs, MR);
        if (pfrows) SK_PREFETCH_NEXT(pn, pr, ars, MR);
        __m512 bv[SK_NV_CAP];
#pragma GCC unroll 8
        for (int v = 0; v < NV; v++)
            bv[v] = v + 1 < NV || FULL ? _mm512_loadu_ps(b + v * 16) : _mm512_maskz_loadu_ps(lm, b + v * 16);
#pragma GCC unroll 16
        for (int r = 0; r < MR; r++) {
            const __m512 s = _mm512_set1_ps(q[r / 4][off[r % 4]]);
#pragma GCC unroll 8
            for (int v = 0; v < NV; v++) t[r][v] = _mm512_fmadd_ps(s, bv[v], t[r][v]);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 8
        for (int v = 0; v < NV; v++) {
            if (v + 1 < NV || FULL) _mm512_storeu_ps(c + r * ldc + v * 16, t[r][v]);
            else _mm512_mask_storeu_ps(c + r * ldc + v * 16, lm, t[r][v]);
        }
}

/* Same with ymm vectors (16 registers: MR * NV <= 12). The tail vector uses
 * vmaskmov only when it is partial (the masked store is slow on AMD). */
static inline __attribute__((always_inline, target("avx2,fma"))) void
sk256_body(int64_t kc, const float *a, int64_t ars, int64_t acs, const float *b, int64_t ldb,
           float *c, int64_t ldc, int acc, int nlast, const int MR, const int NV) {
    const __m256i lm = _mm256_cmpgt_epi32(_mm256_set1_epi32(nlast), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const int full = nlast == 8, pf = ars == 1 && acs >= 32, pfrows = acs == 1 && ars >= 32;
    const float *pn = a + MR * ars;
    int pr = 0;
    __m256 t[SK_MR_CAP][SK_NV_CAP];
#pragma GCC unroll 16
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 8
        for (int v = 0; v < NV; v++)
            t[r][v] = !acc ? _mm256_setzero_ps()
                      : v + 1 < NV || full ? _mm256_loadu_ps(c + r * ldc + v * 8)
                                           : _mm256_maskload_ps(c + r * ldc + v * 8, lm);
    if (full) {
        for (int64_t k = 0; k < kc; k++, a += acs, b += ldb) {
            if (pf) SK_PREFETCH(a, acs, MR);
            if (pfrows) SK_PREFETCH_NEXT(pn, pr, ars, MR);
            __m256 bv[SK_NV_CAP];
#pragma GCC unroll 8
            for (int v = 0; v < NV; v++) bv[v] = _mm256_loadu_ps(b + v * 8);
#pragma GCC unroll 16
            for (int r = 0; r < MR; r++) {
                const __m256 s = _mm256_broadcast_ss(a + r * ars);
#pragma GCC unroll 8
                for (int v = 0; v < NV; v++) t[r][v] = _mm256_fmadd_ps(s, bv[v], t[r][v]);
            }
        }
    } else {
        for (int64_t k = 0; k < kc; k++, a += acs, b += ldb) {
            if (pf) SK_PREFETCH(a, acs, MR);
            if (pfrows) SK_PREFETCH_NEXT(pn, pr, ars, MR);
            __m256 bv[SK_NV_CAP];
#pragma GCC unroll 8
            for (int v = 0; v < NV; v++)
                bv[v] = v + 1 < NV ? _mm256_loadu_ps(b + v * 8) : _mm256_maskload_ps(b + v * 8, lm);
#pragma GCC unroll 16
            for (int r = 0; r < MR; r++) {
                const __m256 s = _mm256_broadcast_ss(a + r * ars);
#pragma GCC unroll 8
                for (int v = 0; v < NV; v++) t[r][v] = _mm256_fmadd_ps(s, bv[v], t[r][v]);
            }
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 8
        for (int v = 0; v < NV; v++) {
            if (v + 1 < NV || full) _mm256_storeu_ps(c + r * ldc + v * 8, t[r][v]);
            else _mm256_maskstore_ps(c + r * ldc + v * 8, lm, t[r][v]);
        }
}

/* sk<bits>_<NV>: the kernel for any mm in 1..MR, each row count instantiated. */
#define SK_ROWS(R, CALL)                                                                      \
    case R:                                                                                  \
        if (R <= MR) CALL(R);                                                                 \
        break;
#define SK_SWITCH(CALL)                                                                       \
    switch (mm) {                                                                            \
        SK_ROWS(1, CALL) SK_ROWS(2, CALL) SK_ROWS(3, CALL) SK_ROWS(4, CALL)                   \
        SK_ROWS(5, CALL) SK_ROWS(6, CALL) SK_ROWS(7, CALL) SK_ROWS(8, CALL)                   \
        SK_ROWS(9, CALL) SK_ROWS(10, CALL) SK_ROWS(11, CALL) SK_ROWS(12, CALL)                \
        default: break;                                                                      \
    }
#define SK_FN(BITS, TARGET, NV, MR_)                                                    \
    __attribute__((target(TARGET))) static void sk##BITS##_##NV(                              \
        int mm, int64_t kc, const float *a, int64_t ars, int64_t acs, const float *b,         \
        int64_t ldb, float *c, int64_t ldc, int acc, int nlast) {                             \
        enum { MR = MR_ };                                                                    \
        (void)nlast;                                                                          \
        SK_SWITCH(SK_CALL_##BITS##_##NV)                                                      \
    }
/* AVX-512 tiles come in four builds: the last vector full (nlast = 16: no masked loads
 * and stores, whose mask register GCC reloaded from the stack every k) or not, and A's
 * rows adjacent (ars = 1, a transposed A: the MR broadcasts at constant offsets) or
 * not (MR row offsets in registers, which spilled for MR = 12). */
#define SK_CALL_512(R, NV)                                                                    \
    do {                                                                                     \
        const __mmask16 lm_ = (__mmask16)((1u << nlast) - 1u);                                \
        if (nlast == 16 && ars == 1) sk512_body(kc, a, 1, acs, b, ldb, c, ldc, acc, lm_, R, NV, 1); \
        else if (nlast == 16) sk512_body(kc, a, ars, acs, b, ldb, c, ldc, acc, lm_, R, NV, 1);  \
        else if (ars == 1) sk512_body(kc, a, 1, acs, b, ldb, c, ldc, acc, lm_, R, NV, 0);      \
        else sk512_body(kc, a, ars, acs, b, ldb, c, ldc, acc, lm_, R, NV, 0);                 \
    } while (0)
#define SK_CALL_256(R, NV) sk256_body(kc, a, ars, acs, b, ldb, c, ldc, acc, nlast, R, NV)
#define SK_CALL_512_1(R) SK_CALL_512(R, 1)
#define SK_CALL_512_2(R) SK_CALL_512(R, 2)
#define SK_CALL_512_3(R) SK_CALL_512(R, 3)
#define SK_CALL_512_4(R) SK_CALL_512(R, 4)
#define SK_CALL_512_5(R) SK_CALL_512(R, 5)
#define SK_CALL_256_1(R) SK_CALL_256(R, 1)
#define SK_CALL_256_2(R) SK_CALL_256(R, 2)
#define SK_CALL_256_3(R) SK_CALL_256(R, 3)
#define SK_CALL_256_4(R) SK_CALL_256(R, 4)

SK_FN(512, "avx512f", 1, 12)
SK_FN(512, "avx512f", 2, 12)
SK_FN(512, "avx512f", 3, 8)
SK_FN(512, "avx512f", 4, 6)
SK_FN(512, "avx512f", 5, 5)
SK_FN(256, "avx2,fma", 1, 12)
SK_FN(256, "avx2,fma", 2, 6)
SK_FN(256, "avx2,fma", 3, 4)
SK_FN(256, "avx2,fma", 4, 3)

static const skimpl sk_avx512[SK_NV_CAP] = {
    {16, 1, 12, sk512_1}, {16, 2, 12, sk512_2}, {16, 3, 8, sk512_3}, {16, 4, 6, sk512_4}, {16, 5, 5, sk512_5}};
static const skimpl sk_avx2[4] = {{8, 1, 12, sk256_1}, {8, 2, 6, sk256_2}, {8, 3, 4, sk256_3}, {8, 4, 3, sk256_4}};

#endif /* __x86_64__ */

/* The skinny kernel for n columns at this SIMD level, or NULL (packed path).
 * N <= 8 takes the ymm kernel at either level (a zmm would be half empty). */
static const skimpl *pick_skinny(int64_t n) {
#if defined(__x86_64__)
    const int level = gt_simd_level_();
    if (level >= 1 && n <= 8) return &sk_avx2[0];
    if (level >= 2 && n <= 16 * SK_NV_CAP) return &sk_avx512[(n + 15) / 16 - 1];
    if (level == 1 && n <= 32) return &sk_avx2[(n + 7) / 8 - 1];
#endif
    (void)n;
    return NULL;
}

/* ---- blocked driver ------------------------------------------------------------ */

typedef struct operand {
    const float *p;
    int64_t rs, cs;  /* strides of the last two dims, one of them 1 */
} operand;

/* ---- B from a stored weight (f16, bf16, ggml blocks): dequantized while packing ---- */

/* A frozen weight W (R, C) of a block type (or f16/bf16: blocks of 1), stored
 * as R contiguous rows of C / block blocks, used as B = W^T (trans: K = C,
 * N = R) or B = W (K = R, N = C). tmp: this thread's dequantization scratch,
 * WTMP_FLOATS floats. */
typedef struct wsource {
    const uint8_t *p;
    int64_t row_bytes;       /* bytes of one row of W */
    int block, block_bytes;
    int trans;
    gt_dequant_fn deq;
    float *tmp;
} wsource;

/* The largest block is 256 (K-quants); KC and NC are multiples of it. */
#define QBLOCK_MAX 256
#define WTMP_FLOATS ((int64_t)NR_MAX * KC > NC + 2 * QBLOCK_MAX ? (int64_t)NR_MAX * KC : NC + 2 * QBLOCK_MAX)

/* Pack the KC x NC panel B[pc:pc+kc, jc:jc+nc] of a stored weight in the
 * layout im->pack_b gives an f32 B (so the micro-kernels see the same floats
 * in the same places as for gt_matmul_fwd_f32 on the dequantized matrix).
 * B = W^T: B's lines (columns) are rows of W, contiguous along k, and the
 *   slice [pc, pc + kc) of a row is whole blocks (k_slice cuts K at multiples
 *   of the block, and K is one): dequantize the panel's nr rows into tmp
 *   (nr x kc, row-major), then pack them as an f32 W^T would be.
 * B = W: each k is a row of W and the panel its columns [jc, jc + nc), which
 *   need not start or end on a block (thread splits are in units of nr):
 *   dequantize the blocks enclosing them into tmp and scatter the part needed
 *   into nr-wide panels, as pack_cols does. */
static void pack_b_weight(const impl *im, const wsource *W, float *restrict bp, int64_t pc, int64_t kc,
                          int64_t jc, int64_t nc) {
    const int w = im->nr, qb = W->block;
    if (W->trans) {
        const uint8_t *col = W->p + pc / qb * W->block_bytes;
        for (int64_t j0 = 0; j0 < nc; j0 += w) {
            const int lines = nc - j0 < w ? (int)(nc - j0) : w;
            for (int i = 0; i < lines; i++) W->deq(W->tmp + i * kc, col + (jc + j0 + i) * W->row_bytes, kc / qb);
            im->pack_b(bp + j0 * kc, W->tmp, kc, 1, lines, kc);
        }
        return;
    }
    const int64_t b0 = jc / qb, b1 = (jc + nc + qb - 1) / qb, skip = jc - b0 * qb;
    const int64_t full = nc / w, rest = nc - full * w, pstride = (int64_t)w * kc;
    for (int64_t k = 0; k < kc; k++) {
        W->deq(W->tmp, W->p + (pc + k) * W->row_bytes + b0 * W->block_bytes, b1 - b0);
        const float *s = W->tmp + skip;
        float *d = bp + k * w;
        for (int64_t p = 0; p < full; p++, s += w, d += pstride) memcpy(d, s, (size_t)w * sizeof(float));
        if (rest) {
            for (int i = 0; i < rest; i++) d[i] = s[i];
            for (int i = (int)rest; i < w; i++) d[i] = 0.0f;
        }
    }
}

/* This thread's rows (or columns) [lo, hi) of `total`, cut at multiples of `unit`
 * (tiles) nearest to equal shares of elements: gt_split over whole units gave the
 * first thread one unit more, e.g. 13 of 25 32-wide panels (416 of 784 columns). */
static void split_even(int64_t total, int64_t unit, const gt_ctx *ctx, int64_t *lo, int64_t *hi) {
    int64_t b0 = (total * ctx->ith / ctx->nth + unit / 2) / unit * unit;
    int64_t b1 = (total * (ctx->ith + 1) / ctx->nth + unit / 2) / unit * unit;
    if (ctx->ith == 0) b0 = 0;
    if (ctx->ith == ctx->nth - 1) b1 = total;
    *lo = b0 < total ? b0 : total;
    *hi = b1 < total ? b1 : total;
}

/* Whether rows rs floats apart crowd into few cache sets: a multiple of 16 KiB apart, they
 * fall in at most 8 of the 128 KiB-periodic set groups of a 16-way 2 MiB L2, so an A block
 * read in place (MC rows) evicts itself; it is packed instead. Measured on x @ W with a
 * long K (the output projection's input gradient, K = the vocabulary): dy rows 128 KiB
 * apart ran at 140-150 GFLOP/s in place, 200-210 packed. (A transposed A and a plain B so
 * far apart are packed anyway: see B_INPLACE_RS.) */
static int set_aliased(int64_t rs) { return rs * (int64_t)sizeof(float) % 16384 == 0; }

/* Row stride (floats) from which a plain B is packed rather than read in place: a page
 * (4 KiB) or more apart, each k of an in-place panel is on a page of its own, and its
 * rows stream from L2 slower than the packed panel's. Measured, one thread, alternating
 * in one process (AVX-512, 12 x 32): g @ W with N = 1376, 1536 and 2048 (dx of a llama
 * FFN, of SmolLM2's, a 2048-wide layer) ran 4-13% faster packed, N = 512 and 576 the
 * same either way. Packing a transposed A always (rather than reading its tiles in
 * place) made every weight gradient g^T @ x of llama config b's and SmolLM2's shapes
 * 12-20% faster (1376 x 1024 x 512: 119 -> 144 GFLOP/s on one thread, 226 -> 257 on
 * two), and llama config b's update 5-9% faster. */
#define PAGE_BYTES 4096
#define B_INPLACE_RS (PAGE_BYTES / (int64_t)sizeof(float))

/* A second, f32 product a gemm adds to its own (matmul_lora: a rank-r adapter's H @ B^T on
 * the frozen product): A2 (rows as A's) @ B2 (K2, the same columns), K2 > 0. */
typedef struct extra_product {
    operand A2, B2;
    int64_t K2;
} extra_product;

/* C[m0:m1, n0:n1] (row stride ldc) = (acc0 ? C : 0) + A[m0:m1, :K] @ B[:K, n0:n1], plus
 * X->A2 @ X->B2 over the same block when X is not NULL (each NC-wide block of C gets it
 * right after its own k panels, while that block is still in cache). m0 is a multiple of
 * mr and n0 of nr (thread splits), K > 0. B is the f32 operand B, or, when W is not NULL,
 * the stored weight W describes (B.p unused). */
static int64_t k_slice(int64_t K, int unit) {
    const int64_t n = (K + KC - 1) / KC, even = (K + n - 1) / n;
    return (even + unit - 1) / unit * unit;     /* <= KC: KC is a multiple of every unit */
}

static void gemm(const impl *im, int64_t m0, int64_t m1, int64_t n0, int64_t n1, int64_t K,
                 operand A, operand B, const wsource *W, float *C, int64_t ldc, float *ap, float *bp, int acc0,
                 const extra_product *X) {
    const int mr = im->mr, nr = im->nr;
    /* A plain f32 B whose rows are less than a page (B_INPLACE_RS floats) apart is not
     * packed: the micro-kernel reads its full nr-wide panels where they lie, row k at B.rs
     * floats from row k - 1; only a last, narrower panel is packed, zero-padded. (When
     * threads split M each packs all of B, which cost up to 30% of small products.) */
    const int inplace = !W && B.cs == 1 && B.rs < B_INPLACE_RS;
    /* A plain A's full MR-row tiles are read in place too by the AVX-512 kernels (MR row
     * streams), unless set-aliased; only an edge tile is packed (the pack was 2-3% of a
     * llama step). A transposed A (x^T of a weight gradient: the MR values of one k
     * together, k steps a row of x apart) is always packed: read in place, each k is a
     * new line a row away, which the prefetcher does not follow from L2 as it streams
     * the packed panel (see B_INPLACE_RS for the figures). */
    const int ainplace = A.cs == 1 && im->plain_a && !set_aliased(A.rs);
    _Alignas(ALIGN) float tile[MR_MAX * NR_MAX];
    const int64_t kstep = k_slice(K, W ? W->block : 16);
    for (int64_t jc = n0; jc < n1; jc += NC) {
        const int64_t nc = n1 - jc < NC ? n1 - jc : NC;
        for (int64_t pc = 0; pc < K; pc += kstep) {
            const int64_t kc = K - pc < kstep ? K - pc : kstep;
            const int acc = acc0 || pc > 0;
            if (W) pack_b_weight(im, W, bp, pc, kc, jc, nc);
            else if (!inplace) im->pack_b(bp, B.p + pc * B.rs + jc * B.cs, B.cs, B.rs, nc, kc);
            else if (nc % nr) im->pack_b(bp, B.p + pc * B.rs + jc + nc / nr * nr, 1, B.rs, nc % nr, kc);
            for (int64_t ic = m0; ic < m1; ic += MC) {
                const int64_t mc = m1 - ic < MC ? m1 - ic : MC;
                const int64_t mfull = ainplace ? mc / mr * mr : 0;
                if (!ainplace) im->pack_a(ap, A.p + ic * A.rs + pc * A.cs, A.rs, A.cs, mc, kc);
                else if (mc > mfull)
                    im->pack_a(ap, A.p + (ic + mfull) * A.rs + pc * A.cs, A.rs, A.cs, mc - mfull, kc);
                for (int64_t jr = 0; jr < nc; jr += nr) {
                    const int nn = nc - jr < nr ? (int)(nc - jr) : nr;
                    const int own = inplace && nn == nr;   /* else packed (the tail panel at bp) */
                    const float *bq = own ? B.p + pc * B.rs + jc + jr : inplace ? bp : bp + jr * kc;
                    const int64_t ldb = own ? B.rs : nr;
                    for (int64_t ir = 0; ir < mc; ir += mr) {
                        const int mm = mc - ir < mr ? (int)(mc - ir) : mr;
                        const int owna = ainplace && mm == mr;
                        const float *aq = owna ? A.p + (ic + ir) * A.rs + pc * A.cs : ainplace ? ap : ap + ir * kc;
                        const int64_t ars = owna ? A.rs : 1, acs = owna ? A.cs : mr;
                        float *cq = C + (ic + ir) * ldc + jc + jr;
                        if (mm == mr && nn == nr) {
                            im->kernel(kc, aq, ars, acs, bq, ldb, cq, ldc, acc);
                            continue;
                        }
                        if (acc)
                            for (int r = 0; r < mm; r++)
                                for (int j = 0; j < nn; j++) tile[r * nr + j] = cq[r * ldc + j];
                        im->kernel(kc, aq, ars, acs, bq, ldb, tile, nr, acc);
                        for (int r = 0; r < mm; r++)
                            for (int j = 0; j < nn; j++) cq[r * ldc + j] = tile[r * nr + j];
                    }
                }
            }
        }
        if (X) gemm(im, m0, m1, jc, jc + nc, X->K2, X->A2, X->B2, NULL, C, ldc, ap, bp, 1, NULL);
    }
}

/* C[m0:m1, :N] (row stride ldc) = A[m0:m1, :K] @ B[:K, :N] through a skinny
 * kernel (N <= s->nv * s->vw), K > 0. bp: room for SK_KC x s->nv * s->vw floats. */
static void gemm_skinny(const skimpl *s, int64_t m0, int64_t m1, int64_t N, int64_t K, operand A,
                        operand B, float *C, int64_t ldc, float *bp) {
    const int nlast = (int)(N - (int64_t)(s->nv - 1) * s->vw);
    const int64_t ldp = (int64_t)s->nv * s->vw;
    for (int64_t pc = 0; pc < K; pc += SK_KC) {
        const int64_t kc = K - pc < SK_KC ? K - pc : SK_KC;
        const float *b = B.p + pc * B.rs;
        int64_t ldb = B.rs;
        if (B.cs != 1) {  /* columns contiguous along k: copy the slice row-major */
            for (int64_t j = 0; j < N; j++) {
                const float *src = b + j * B.cs;
                for (int64_t k = 0; k < kc; k++) bp[k * ldp + j] = src[k];
            }
            b = bp;
            ldb = ldp;
        }
        for (int64_t i = m0; i < m1; i += s->mr) {
            const int mm = m1 - i < s->mr ? (int)(m1 - i) : s->mr;
            s->fn(mm, kc, A.p + i * A.rs + pc * A.cs, A.rs, A.cs, b, ldb, C + i * ldc, ldc, pc > 0, nlast);
        }
    }
}

/* ---- small products for fused kernels ------------------------------------------------ */

/* See internal.h. Columns go in chunks a skinny kernel spans (N <= 80 in one, else 64
 * at a time with AVX-512; 32 with AVX2), rows in that kernel's tiles, the last tile
 * through its row-count instantiation; so nothing is packed or padded. */
void gt_gemm_small_(float *c, int64_t ldc, const float *a, int64_t ars, int64_t acs, const float *b,
                    int64_t ldb, int64_t M, int64_t N, int64_t K, int acc) {
    if (M <= 0 || N <= 0) return;
    if (K <= 0) {
        if (!acc)
            for (int64_t i = 0; i < M; i++) memset(c + i * ldc, 0, (size_t)N * sizeof(float));
        return;
    }
#if defined(__x86_64__)
    const int level = gt_simd_level_();
    if (level >= 1) {
        const int64_t cap = level >= 2 ? (N <= 16 * SK_NV_CAP ? N : 64) : 32;
        for (int64_t n0 = 0; n0 < N; n0 += cap) {
            const int64_t n = N - n0 < cap ? N - n0 : cap;
            const skimpl *s = pick_skinny(n);
            const int nlast = (int)(n - (int64_t)(s->nv - 1) * s->vw);
            for (int64_t i = 0; i < M; i += s->mr) {
                const int mm = M - i < s->mr ? (int)(M - i) : s->mr;
                s->fn(mm, K, a + i * ars, ars, acs, b + n0, ldb, c + i * ldc + n0, ldc, acc, nlast);
            }
        }
        return;
    }
#endif
    for (int64_t i = 0; i < M; i++) {
        float *ci = c + i * ldc;
        for (int64_t j = 0; j < N; j++) {
            float t = acc ? ci[j] : 0.0f;
            for (int64_t k = 0; k < K; k++) t = t + a[i * ars + k * acs] * b[k * ldb + j];
            ci[j] = t;
        }
    }
}

/* ---- blocks of rows for other kernels (moe.c's grouped expert products) -------------- */

int64_t gt_gemm_work_bytes_(int32_t btype) {
    return (A_FLOATS + B_FLOATS + (btype == GT_F32 ? 0 : WTMP_FLOATS)) * (int64_t)sizeof(float) + ALIGN;
}

/* See internal.h: gemm() over C[0:M, n0:n1], the packed kernels only (the skinny path would
 * take all N columns at once; its chain, hence its bits, is the same). */
void gt_gemm_(float *c, int64_t ldc, const float *a, int64_t ars, int64_t acs, const void *b, int32_t btype,
              int64_t brs, int64_t bcs, int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1, int acc,
              void *work) {
    if (M <= 0 || n1 <= n0) return;
    if (K <= 0) {
        if (!acc)
            for (int64_t i = 0; i < M; i++) memset(c + i * ldc + n0, 0, (size_t)(n1 - n0) * sizeof(float));
        return;
    }
    float *ap = (float *)(((uintptr_t)work + ALIGN - 1) & ~(uintptr_t)(ALIGN - 1));
    float *bp = ap + A_FLOATS;
    operand A = {a, ars, acs}, B = {(const float *)b, brs, bcs};
    wsource ws, *W = NULL;
    if (btype != GT_F32) {
        const gt_dtype_traits *t = gt_dtype_find_(btype);
        ws.p = (const uint8_t *)b;
        ws.trans = brs == 1;
        ws.block = t->block;
        ws.block_bytes = t->block_bytes;
        ws.row_bytes = (ws.trans ? K : N) / t->block * t->block_bytes;
        ws.deq = gt_dequantizer_(btype);
        ws.tmp = bp + B_FLOATS;
        W = &ws;
    }
    gemm(pick_impl(M, n1 - n0), 0, M, n0, n1, K, A, B, W, c, ldc, ap, bp, acc, NULL);
}

/* ---- the kernel ------------------------------------------------------------------ */

/* Strides of t's last two dims, with the stride of a size-1 dim replaced by 1
 * (it is never stepped), so a (M, 1) or (1, K) view of anything qualifies. */
static operand last2(const gt_tensor *t) {
    operand o;
    o.p = t->data;
    o.rs = t->shape[t->ndim - 2] == 1 ? 1 : t->strides[t->ndim - 2];
    o.cs = t->shape[t->ndim - 1] == 1 ? 1 : t->strides[t->ndim - 1];
    return o;
}

/* ---- stored weights ---------------------------------------------------------------- */

/* Rows of x up to which x @ W^T with a stored W takes the row-dot path
 * (gt_qdot_rows_) instead of the packed GEMM; threads split W's rows in units
 * of SMALL_N_UNIT. Measured (AVX-512, one thread; Q4_1 1536x576, Q8_0 576x576
 * and 49152x576; M = 1 .. 48): the row-dot path ran at 70-76 GFLOP/s from
 * M = 8 on, the packed one at 33-70 up to M = 48 (it dequantizes and
 * transposes all of W for those few rows), and 7x slower at M = 1. */
#define SMALL_M GT_QDOT_MAX_M
#define SMALL_N_UNIT 16

/* Work bytes per thread with a stored weight: the pack buffers plus the
 * dequantization scratch (packed path), or a contiguous copy of up to SMALL_M
 * rows of x plus the row-dot scratch (row-dot path), whichever is larger. */
static int64_t weight_work_size(int64_t K) {
    const int64_t packed = A_FLOATS + B_FLOATS + WTMP_FLOATS;
    const int64_t rows = SMALL_M * (K > 0 ? K : 0) + ALIGN / 4 + GT_QDOT_SCRATCH_FLOATS;
    return (packed > rows ? packed : rows) * (int64_t)sizeof(float) + ALIGN;
}

static int matmul_weight_sizes(const gt_node *node, int64_t *scratch, int64_t *work, int32_t wtype) {
    (void)wtype;
    const gt_tensor *a = &node->src[0];
    *scratch = 0;
    *work = weight_work_size(a->ndim >= 1 ? a->shape[a->ndim - 1] : 0);
    return GT_OK;
}

/* src1 = a stored weight W (R, C) of type wtype, whole, as the view W^T
 * (shape (C, R), strides (1, C)) or W (shape (R, C), strides (C, 1)); fills ws. */
static int check_weight(const gt_tensor *b, int32_t wtype, wsource *ws) {
    const gt_dtype_traits *t = gt_dtype_find_(wtype);
    int trans = 0;
    GT_TRY(gt_weight_view_check(b, wtype, t->block, "matmul", 1, &trans));
    const int64_t K = b->shape[0], N = b->shape[1];
    const int qb = t->block;
    ws->p = b->data;
    ws->trans = trans;
    ws->block = qb;
    ws->block_bytes = t->block_bytes;
    ws->row_bytes = (trans ? K : N) / qb * t->block_bytes;
    ws->deq = gt_dequantizer_(wtype);
    ws->tmp = NULL;
    return GT_OK;
}

/* C[:M, n0:n1] (row stride ldc) = x (M, K; strides of A) @ W^T[:, n0:n1] by row
 * dots, M <= SMALL_M. x rows not contiguous along k are copied into scratch. */
static void small_m(float *C, int64_t ldc, const float *x, operand A, int64_t M, int64_t K, int32_t dtype,
                    const wsource *W, int64_t n0, int64_t n1, float *scratch) {
    int64_t ldx = A.rs;
    if (A.cs != 1) {
        for (int64_t r = 0; r < M; r++)
            for (int64_t k = 0; k < K; k++) scratch[r * K + k] = x[r * A.rs + k * A.cs];
        x = scratch;
        ldx = K;
        scratch += M * K;
    }
    gt_qdot_rows_(C, ldc, x, ldx, (int)M, W->p, W->row_bytes, dtype, K, n0, n1, scratch);
}

/* Matrix product, f32: dst (..., M, N) = src0 (..., M, K) @ src1 (..., K, N).
 * dst contiguous; src0 and src1 any strides as long as, in each, the last or
 * the last-but-one dim has stride 1 (transposed views need no copy). Batch dims
 * (up to 4) broadcast numpy-style: a size-1 or missing batch dim of either input
 * is reused. K = 0 gives zeros. Exact per-element FMA chain over k in order
 * (see the top of the file), so results do not depend on the thread count.
 * wdata: gt_matmul_fwd_f32_sizes' work bytes per thread. */
/* Work bytes per thread of matmul_q8: a row of x gathered when strided, and SMALL_M rows of
 * it quantized. */
static int64_t act8_work_size(int64_t K) {
    const int64_t blocks = SMALL_M * (K / 32 + 1) * (int64_t)sizeof(gt_act8),
                  super = SMALL_M * (K / 256 + 1) * (int64_t)sizeof(gt_act8k);
    return (K > 0 ? K : 0) * (int64_t)sizeof(float) + (blocks > super ? blocks : super) + ALIGN;
}

/* C[:Mx, n0:n1] (row stride ldc) = x (Mx, K; strides of A) quantized to 8 bits @ W^T[:, n0:n1]
 * (qdot8.c), SMALL_M rows of x at a time. */
static void act8_rows(float *C, int64_t ldc, const float *x, operand A, int64_t Mx, int64_t K, int64_t N,
                      int32_t dtype, const wsource *W, int64_t n0, int64_t n1, void *work) {
    float *row = (float *)(((uintptr_t)work + ALIGN - 1) & ~(uintptr_t)(ALIGN - 1));
    const int super = gt_dtype_find_(dtype)->block == 256;     /* K-quants: Q8_K super-blocks */
    gt_act8 *q = (gt_act8 *)(row + K);
    gt_act8k *qk = (gt_act8k *)(row + K);
    const int64_t nb = K / (super ? 256 : 32);
    for (int64_t m0 = 0; m0 < Mx; m0 += SMALL_M) {
        const int64_t g = Mx - m0 < SMALL_M ? Mx - m0 : SMALL_M;
        for (int64_t r = 0; r < g; r++) {
            const float *xr = x + (m0 + r) * A.rs;
            if (A.cs != 1) {
                for (int64_t k = 0; k < K; k++) row[k] = xr[k * A.cs];
                xr = row;
            }
            if (super) gt_act8k_quantize_(qk + r * nb, xr, K);
            else gt_act8_quantize_(q + r * nb, xr, K);
        }
        if (super)      /* (the row's place in the product picks llama.cpp's kernel, hence its order) */
            gt_qdot8k_rows_(C + m0 * ldc, ldc, qk, nb, (int)g, Mx, m0, W->p, W->row_bytes, dtype, K, N, n0, n1);
        else gt_qdot8_rows_(C + m0 * ldc, ldc, q, nb, (int)g, W->p, W->row_bytes, dtype, K, N, n0, n1);
    }
}

static int matmul(const gt_node *node, const gt_ctx *ctx, int32_t wtype, int act8, int lora) {
    const gt_tensor *d = &node->dst, *a = &node->src[0], *b = &node->src[1];
    if (node->n_src != (lora ? 4 : 2))
        return GT_FAIL(GT_ERR_INVALID, "%s: expected %d inputs, got %d", lora ? "matmul_lora" : "matmul", lora ? 4 : 2,
                       node->n_src);
    GT_CHECK_F32(d, "matmul", "dst");
    GT_CHECK_F32(a, "matmul", "src0");
    wsource ws, *W = NULL;
    if (wtype == GT_F32) GT_CHECK_F32(b, "matmul", "src1");
    else GT_TRY(check_weight(b, wtype, &ws));
    if (a->ndim < 2 || b->ndim < 2 || d->ndim < 2)
        return GT_FAIL(GT_ERR_SHAPE, "matmul: expected inputs and output with at least 2 dims, got "
                       "src0 %d, src1 %d, dst %d", a->ndim, b->ndim, d->ndim);
    const int64_t M = a->shape[a->ndim - 2], K = a->shape[a->ndim - 1];
    const int64_t N = b->shape[b->ndim - 1];
    if (b->shape[b->ndim - 2] != K)
        return GT_FAIL(GT_ERR_SHAPE, "matmul: src1 must have K = %lld rows to match src0 (M=%lld, K=%lld), "
                       "got %lld", (long long)K, (long long)M, (long long)K,
                       (long long)b->shape[b->ndim - 2]);
    if (d->shape[d->ndim - 2] != M || d->shape[d->ndim - 1] != N)
        return GT_FAIL(GT_ERR_SHAPE, "matmul: dst must end in (M=%lld, N=%lld), got (%lld, %lld)",
                       (long long)M, (long long)N, (long long)d->shape[d->ndim - 2],
                       (long long)d->shape[d->ndim - 1]);
    const int nb = d->ndim - 2;
    if (a->ndim > d->ndim || b->ndim > d->ndim)
        return GT_FAIL(GT_ERR_SHAPE, "matmul: dst must have at least as many dims as the inputs, "
                       "got dst %d, src0 %d, src1 %d", d->ndim, a->ndim, b->ndim);
    /* batch strides of a and b aligned to dst's batch dims, 0 where broadcast */
    int64_t sa[4] = {0, 0, 0, 0}, sb[4] = {0, 0, 0, 0};
    int64_t nbatch = 1;
    for (int i = 0; i < nb; i++) {
        const int ia = i - (d->ndim - a->ndim), ib = i - (d->ndim - b->ndim);
        const int64_t n = d->shape[i];
        const int64_t na = ia >= 0 ? a->shape[ia] : 1, nbb = ib >= 0 ? b->shape[ib] : 1;
        if (na != 1 && nbb != 1 && na != nbb)
            return GT_FAIL(GT_ERR_SHAPE, "matmul: batch dim %d does not broadcast: src0 has %lld, "
                           "src1 has %lld (expected equal or 1)", i, (long long)na, (long long)nbb);
        const int64_t want = na != 1 ? na : nbb;
        if (n != want)
            return GT_FAIL(GT_ERR_SHAPE, "matmul: batch dim %d of dst must be %lld (src0 %lld, "
                           "src1 %lld), got %lld", i, (long long)want, (long long)na,
                           (long long)nbb, (long long)n);
        sa[i] = na != 1 ? a->strides[ia] : 0;
        sb[i] = nbb != 1 ? b->strides[ib] : 0;
        nbatch *= n;
    }
    /* matmul_lora's second product: src2 H (..., M, R) contiguous, batch dims as dst's, and
     * src3 B2 (R, N) 2-D (the adapter's B^T), one unit stride; added to every row block */
    extra_product X = {{NULL, 0, 0}, {NULL, 0, 0}, 0};
    if (lora) {
        const gt_tensor *h = &node->src[2], *b2 = &node->src[3];
        GT_CHECK_F32(h, "matmul_lora", "src2 (h)");
        GT_CHECK_F32(b2, "matmul_lora", "src3 (B^T)");
        int same = h->ndim == d->ndim && b2->ndim == 2 && b2->shape[1] == N && h->shape[h->ndim - 1] == b2->shape[0];
        for (int i = 0; same && i < d->ndim - 1; i++) same = h->shape[i] == d->shape[i];
        if (!same)
            return GT_FAIL(GT_ERR_SHAPE, "matmul_lora: expected h (..., M, R) with dst's leading dims and B^T (R, N), "
                           "got h of %d dims and B^T of %d", h->ndim, b2->ndim);
        if (!gt_is_contiguous(h)) return GT_FAIL(GT_ERR_INVALID, "matmul_lora: h (src2) must be contiguous");
        if (K == 0 || b2->shape[0] == 0)
            return GT_FAIL(GT_ERR_SHAPE, "matmul_lora: both products need k > 0 (K = %lld, R = %lld)", (long long)K,
                           (long long)b2->shape[0]);
        X.K2 = b2->shape[0];
        X.A2 = (operand){h->data, X.K2, 1};
        X.B2 = last2(b2);
        if (X.B2.rs != 1 && X.B2.cs != 1)
            return GT_FAIL(GT_ERR_INVALID, "matmul_lora: src3 must have row or column stride 1, got strides "
                           "(%lld, %lld)", (long long)X.B2.rs, (long long)X.B2.cs);
    }
    float *C = d->data;
    if (M == 0 || N == 0 || nbatch == 0) return GT_OK;  /* nothing to fill, strides moot */
    if (!gt_is_contiguous(d)) return GT_FAIL(GT_ERR_INVALID, "matmul: dst must be contiguous");
    if (K == 0) {  /* empty sums; the inputs' strides are moot */
        int64_t lo, hi;
        gt_split(nbatch * M * N, ctx, &lo, &hi);
        for (int64_t i = lo; i < hi; i++) C[i] = 0.0f;
        return GT_OK;
    }
    operand A = last2(a), B = last2(b);
    if (A.rs != 1 && A.cs != 1)
        return GT_FAIL(GT_ERR_INVALID, "matmul: src0 must have row or column stride 1, got strides "
                       "(%lld, %lld)", (long long)A.rs, (long long)A.cs);
    if (B.rs != 1 && B.cs != 1)
        return GT_FAIL(GT_ERR_INVALID, "matmul: src1 must have row or column stride 1, got strides "
                       "(%lld, %lld)", (long long)B.rs, (long long)B.cs);
    const int64_t need = act8 ? act8_work_size(K) : wtype == GT_F32 ? work_size() : weight_work_size(K);
    if (!ctx->wdata || ctx->wsize < need)
        return GT_FAIL(GT_ERR_INVALID, "matmul: needs %lld bytes of per-thread scratch, got %lld",
                       (long long)need, (long long)(ctx->wdata ? ctx->wsize : 0));
    float *ap = (float *)(((uintptr_t)ctx->wdata + ALIGN - 1) & ~(uintptr_t)(ALIGN - 1));
    float *bp = ap + A_FLOATS;
    if (wtype != GT_F32) {
        W = &ws;
        ws.tmp = bp + B_FLOATS;
    }

    /* Fold the batch into M when B is the same for every batch and A's batch
     * rows continue its row stride (e.g. (B, T, C) @ (C, N)). */
    int64_t Mx = M;
    {
        int fold = nbatch > 1 && M > 1 && A.cs == 1;
        int64_t expect = M * A.rs;
        for (int i = nb - 1; i >= 0 && fold; i--) {
            if (sb[i] != 0 || (d->shape[i] != 1 && sa[i] != expect)) fold = 0;
            expect *= d->shape[i];
        }
        if (fold) {
            Mx = M * nbatch;
            nbatch = 1;
        }
    }

    /* row dots with W^T, threads splitting N: any rows with the activations in 8 bits, or a few
     * rows times a transposed stored weight */
    if (act8 && (!W || !W->trans || !gt_act8_supports_(wtype)))
#define ACT8_NAME_(w, ID) " " #w
        return GT_FAIL(GT_ERR_INVALID, "matmul_q8: expected x @ W^T with W stored in one of"
                       GT_ACT8_TYPES(ACT8_NAME_));
#undef ACT8_NAME_
    if (act8 || (W && W->trans && Mx <= SMALL_M)) {
        int64_t lo, hi;
        gt_split((N + SMALL_N_UNIT - 1) / SMALL_N_UNIT, ctx, &lo, &hi);
        lo *= SMALL_N_UNIT;
        hi = hi * SMALL_N_UNIT < N ? hi * SMALL_N_UNIT : N;
        if (lo >= hi) return GT_OK;
        for (int64_t t = 0; t < nbatch; t++) {
            const float *x = A.p;
            int64_t rem = t;
            for (int i = nb - 1; i >= 0; i--) {
                x += rem % d->shape[i] * sa[i];
                rem /= d->shape[i];
            }
            if (act8) act8_rows(C + t * Mx * N, N, x, A, Mx, K, N, wtype, W, lo, hi, ctx->wdata);
            else small_m(C + t * Mx * N, N, x, A, Mx, K, b->dtype, W, lo, hi, ap);
            if (lora) {     /* (batch t's rows of H: H is laid out as dst) */
                operand H = X.A2;
                H.p += t * Mx * X.K2;
                gemm(pick_impl(Mx, hi - lo), 0, Mx, lo, hi, X.K2, H, X.B2, NULL, C + t * Mx * N, N, ap, bp, 1, NULL);
            }
        }
        return GT_OK;
    }

    /* the skinny kernels when N is narrow enough (f32 only), else the packed ones */
    const skimpl *sk = W ? NULL : pick_skinny(N);
    const impl *im = sk ? NULL : pick_impl(Mx, N);
    const int64_t mn = Mx * N;
    /* This thread's share: whole matrices when there are enough of them, else
     * a block of every matrix along M (always, for the skinny kernels) or along
     * the longer of M and N, in whole micro-tiles (single rows when the skinny
     * tiles are fewer than the threads). */
    int64_t t0 = 0, t1 = nbatch, m0 = 0, m1 = Mx, n0 = 0, n1 = N;
    if (nbatch > 1 && (nbatch % ctx->nth == 0 || nbatch >= 4 * ctx->nth)) {
        gt_split(nbatch, ctx, &t0, &t1);
    } else if (sk || Mx >= N) {
        int64_t unit = sk ? sk->mr : im->mr;
        if (sk && (Mx + unit - 1) / unit < ctx->nth) unit = 1;
        split_even(Mx, unit, ctx, &m0, &m1);
    } else {
        split_even(N, im->nr, ctx, &n0, &n1);
    }
    if (m0 >= m1 || n0 >= n1) return GT_OK;
    for (int64_t t = t0; t < t1; t++) {
        operand At = A, Bt = B;
        int64_t rem = t;
        for (int i = nb - 1; i >= 0; i--) {
            const int64_t idx = rem % d->shape[i];
            rem /= d->shape[i];
            At.p += idx * sa[i];
            Bt.p += idx * sb[i];
        }
        extra_product Xt = X;
        Xt.A2.p += t * mn / N * X.K2;
        if (sk) {
            gemm_skinny(sk, m0, m1, N, K, At, Bt, C + t * mn, N, bp);
            if (lora) gemm(pick_impl(Mx, N), m0, m1, 0, N, X.K2, Xt.A2, X.B2, NULL, C + t * mn, N, ap, bp, 1, NULL);
        } else {
            gemm(im, m0, m1, n0, n1, K, At, Bt, W, C + t * mn, N, ap, bp, 0, lora ? &Xt : NULL);
        }
    }
    return GT_OK;
}

int gt_matmul_fwd_f32(const gt_node *node, const gt_ctx *ctx) { return matmul(node, ctx, GT_F32, 0, 0); }

/* gt_matmul_lora_fwd_f32[_<w>]: the same product plus a rank-r adapter's (src2 @ src3), in
 * one pass over dst (ggtrain.h). */
int gt_matmul_lora_fwd_f32(const gt_node *node, const gt_ctx *ctx) { return matmul(node, ctx, GT_F32, 0, 1); }
int gt_matmul_lora_fwd_f32_sizes(const gt_node *node, int64_t *scratch, int64_t *work) {
    return gt_matmul_fwd_f32_sizes(node, scratch, work);
}

/* gt_matmul_fwd_f32_<w> for every stored weight type: the same kernel, with a
 * weight type to check src1 against and dequantize it from. */
#define MATMUL_WEIGHT(w, ID)                                                                   \
    int gt_matmul_fwd_f32_##w(const gt_node *node, const gt_ctx *ctx) {                        \
        return matmul(node, ctx, ID, 0, 0);                                                    \
    }                                                                                          \
    int gt_matmul_fwd_f32_##w##_sizes(const gt_node *node, int64_t *scratch, int64_t *work) {  \
        return matmul_weight_sizes(node, scratch, work, ID);                                   \
    }                                                                                          \
    int gt_matmul_lora_fwd_f32_##w(const gt_node *node, const gt_ctx *ctx) {                   \
        return matmul(node, ctx, ID, 0, 1);                                                    \
    }                                                                                          \
    int gt_matmul_lora_fwd_f32_##w##_sizes(const gt_node *node, int64_t *scratch, int64_t *work) { \
        return matmul_weight_sizes(node, scratch, work, ID);                                   \
    }
GT_WEIGHT_TYPES(MATMUL_WEIGHT)

/* gt_matmul_q8_fwd_f32_<w>: the product with x quantized to 8 bits (qdot8.c). */
#define MATMUL_ACT8(w, ID)                                                                     \
    int gt_matmul_q8_fwd_f32_##w(const gt_node *node, const gt_ctx *ctx) {                     \
        return matmul(node, ctx, ID, 1, 0);                                                    \
    }                                                                                          \
    int gt_matmul_q8_fwd_f32_##w##_sizes(const gt_node *node, int64_t *scratch, int64_t *work) { \
        const gt_tensor *a = &node->src[0];                                                    \
        *scratch = 0;                                                                          \
        *work = act8_work_size(a->ndim >= 1 ? a->shape[a->ndim - 1] : 0);                      \
        return GT_OK;                                                                          \
    }
GT_ACT8_TYPES(MATMUL_ACT8)

/* ---- linear_cross_entropy: the loss over a frozen output matrix, logits never held ---- */

/* Rows of x a thread takes through W at once, and W rows (vocabulary entries) a block:
 * a block's logits (XENT_ROWS x XENT_VB), its dequantized panel and the rows' gradient
 * accumulators (XENT_ROWS x C) stay in L2 together for C up to ~1000. */
#define XENT_ROWS 256
#define XENT_VB 256

static int64_t xent_work_floats(int64_t C) {
    return A_FLOATS + B_FLOATS + (int64_t)XENT_VB * C + (int64_t)XENT_ROWS * XENT_VB + 7 * XENT_ROWS + C +
           3 * ALIGN / 4;
}

/* One row's block of logits l (n) taken into the running softmax of its row: l <- the
 * transformed logits' exp(l - m_new) times their derivative, *m (running max) <- m_new,
 * *sum <- *sum * alpha + sum of exp(l - m_new), *alpha = exp(m_old - m_new) (0 on the first
 * block), and where the target is in the block (t >= 0: its index here) its logit and
 * derivative into *ly, *dy. s multiplies the product (1 / logit_scale); cap > 0 soft-caps
 * it: l = cap * tanh(s x / cap), whose derivative is s (1 - (l / cap)^2). */
GT_CLONES static void xent_block_row(float *l, int64_t n, float s, float cap, int64_t t, float *m, double *sum,
                                     float *alpha, float *ly, float *dy) {
    if (s != 1.0f || cap > 0.0f) {
        if (cap > 0.0f)
            for (int64_t j = 0; j < n; j++) l[j] = cap * tanhf(s * l[j] / cap);
        else mul_row(l, s, n);
    }
    const float mb = scaled_max_row(l, 1.0f, n), m0 = *m;
    const float mn = mb > m0 ? mb : m0;
    if (t >= 0) {
        *ly = l[t];
        *dy = cap > 0.0f ? s * (1.0f - (l[t] / cap) * (l[t] / cap)) : s;
    }
    float e;
    if (cap > 0.0f) {
        e = 0.0f;
        for (int64_t j = 0; j < n; j++) {
            const float q = gt_expf_(l[j] - mn), u = l[j] / cap;
            e += q;
            l[j] = q * s * (1.0f - u * u);
        }
    } else {
        e = exp_row_inplace(l, mn, n);
        if (s != 1.0f) mul_row(l, s, n);
    }
    *alpha = m0 == -INFINITY ? 0.0f : gt_expf_(m0 - mn);
    *sum = *sum * (double)*alpha + (double)e;
    *m = mn;
}

/* linear_cross_entropy: each row's cross-entropy over the logits of x against a frozen
 * output matrix, and its gradient with respect to x, without the logits ever existing
 * whole (the loss of a LoRA fine-tune, whose output matrix is not trained).
 *   src0 x (N, C) f32 contiguous; src1 W (V, C) f32 or a stored weight (whole, not
 *   transposed); src2 targets (N,) i32 contiguous, < V (negative: the row is ignored).
 *   logits l[r] = s x[r] W^T (fp[0] = s, 1 / logit_scale), soft-capped to
 *   cap tanh(l / cap) when fp[1] = cap > 0.
 *   dst (N C + N,) f32: first dx (N, C), row r = d nll[r] / d x[r], then nll (N,), each
 *   row's -log softmax(l[r])[target] (0 and a zero row where ignored); with ip[0] = 1 both
 *   divided by the number of counted rows (the mean's gradient and terms; none counted: 0).
 *   ip[1] = 0: the losses only (dx zeros, the second GEMM skipped: evaluation).
 * Threads split the rows; each takes its rows XENT_ROWS at a time through W in blocks of
 * XENT_VB rows, as in FlashAttention: the block's logits by the packed GEMM (a stored W's
 * block dequantized into the thread's work first), the running max and sum of exps per row rescaled as the max grows,
 * and sum_j p_j W[j] accumulated in dst's dx rows by a second GEMM of the block's exps with
 * the same W rows (accumulator rows multiplied by exp(old max - new max) first). At the
 * end dx[r] = acc[r] / sum[r] - dl[t] W[t], nll[r] = max + log(sum) - l[t]. Each row's
 * numbers depend on the block size, not on the thread count (the GEMM's order per element
 * does not depend on the rows a thread takes). */
static int linear_xent(const gt_node *node, const gt_ctx *ctx, int32_t wtype) {
    const char *op = "linear_cross_entropy";
    const gt_tensor *d = &node->dst, *x = &node->src[0], *w = &node->src[1], *tg = &node->src[2];
    GT_TRY(gt_check_n_src(node, 3, op));
    GT_CHECK_F32(x, op, "x (src0)");
    GT_CHECK_F32(d, op, "dst");
    GT_TRY(gt_check_i32(tg, op, "targets (src2)"));
    if (x->ndim != 2 || w->ndim != 2 || tg->ndim != 1 || tg->shape[0] != x->shape[0] ||
        w->shape[1] != x->shape[1] || x->shape[1] < 1)
        return GT_FAIL(GT_ERR_SHAPE, "%s: expected x (N, C), W (V, C) and targets (N,), got x of %d dims, "
                       "W of %d, targets of %d", op, x->ndim, w->ndim, tg->ndim);
    const int64_t N = x->shape[0], C = x->shape[1], V = w->shape[0];
    if (d->ndim != 1 || d->shape[0] != N * C + N)
        return GT_FAIL(GT_ERR_SHAPE, "%s: expected dst (N C + N,) = (%lld,)", op, (long long)(N * C + N));
    GT_TRY(gt_check_contig(x, op, "x (src0)"));
    GT_TRY(gt_check_contig(tg, op, "targets (src2)"));
    GT_TRY(gt_check_contig(d, op, "dst"));
    wsource ws = {0};
    const float *wf = NULL;
    if (wtype == GT_F32) {
        GT_CHECK_F32(w, op, "W (src1)");
        GT_TRY(gt_check_contig(w, op, "W (src1)"));
        wf = w->data;
    } else {
        int trans = 0;
        GT_TRY(gt_weight_view_check(w, wtype, gt_dtype_find_(wtype)->block, op, 1, &trans));
        if (trans) return GT_FAIL(GT_ERR_INVALID, "%s: expected W (V, C) as stored, got its transpose", op);
        const gt_dtype_traits *t = gt_dtype_find_(wtype);
        ws.p = w->data;
        ws.block = t->block;
        ws.block_bytes = t->block_bytes;
        ws.row_bytes = C / t->block * t->block_bytes;
        ws.deq = gt_dequantizer_(wtype);
    }
    const int32_t *td = tg->data;
    int64_t count = 0, used = 0;   /* used: rows up to the last counted one */
    for (int64_t r = 0; r < N; r++) {
        if (td[r] >= V)
            return GT_FAIL(GT_ERR_INVALID, "%s: target of row %lld is %d, expected < V = %lld (or < 0 to ignore "
                           "the row)", op, (long long)r, (int)td[r], (long long)V);
        count += td[r] >= 0;
        if (td[r] >= 0) used = r + 1;
    }
    const int64_t need = xent_work_floats(C) * (int64_t)sizeof(float);
    if (!ctx->wdata || ctx->wsize < need)
        return GT_FAIL(GT_ERR_INVALID, "%s: needs %lld bytes of per-thread scratch, got %lld", op, (long long)need,
                       (long long)(ctx->wdata ? ctx->wsize : 0));
    const float s = node->fp[0], cap = node->fp[1];
    const int grad = node->ip[1] != 0;
    const float scale = node->ip[0] ? (count ? 1.0f / (float)count : 0.0f) : 1.0f;
    float *dx = d->data, *nll = dx + N * C;
    float *ap = (float *)(((uintptr_t)ctx->wdata + ALIGN - 1) & ~(uintptr_t)(ALIGN - 1));
    float *bp = ap + A_FLOATS, *wb = bp + B_FLOATS, *L = wb + (int64_t)XENT_VB * C;
    float *m = L + (int64_t)XENT_ROWS * XENT_VB, *alpha = m + XENT_ROWS, *ly = alpha + XENT_ROWS,
          *dy = ly + XENT_ROWS;
    double *sum = (double *)(((uintptr_t)(dy + XENT_ROWS) + 7) & ~(uintptr_t)7);
    float *erow = (float *)(sum + XENT_ROWS);
    int64_t lo, hi;
    /* the rows after the last counted one (a plan's padding of loss rows) are zeros; the
     * threads split the others, so padding does not leave one thread the work */
    gt_split(N - used, ctx, &lo, &hi);
    for (int64_t r = used + lo; r < used + hi; r++) {
        memset(dx + r * C, 0, (size_t)C * sizeof(float));
        nll[r] = 0.0f;
    }
    split_even(used, 12, ctx, &lo, &hi);
    const float *xd = x->data;
    for (int64_t g0 = lo; g0 < hi; g0 += XENT_ROWS) {
        int64_t g = hi - g0 < XENT_ROWS ? hi - g0 : XENT_ROWS;
        for (int64_t r = g0; r < g0 + g; r++) {   /* ignored rows: zeros */
            if (td[r] >= 0) continue;
            memset(dx + r * C, 0, (size_t)C * sizeof(float));
            nll[r] = 0.0f;
        }
        while (g > 0 && td[g0 + g - 1] < 0) g--;   /* padding at the end is not multiplied */
        if (g == 0) continue;
        for (int64_t i = 0; i < g; i++) {
            m[i] = -INFINITY;
            sum[i] = 0.0;
            ly[i] = dy[i] = 0.0f;
        }
        const impl *im1 = pick_impl(g, XENT_VB), *im2 = pick_impl(g, C);
        const operand A = {xd + g0 * C, C, 1}, P = {L, XENT_VB, 1};
        float *acc = dx + g0 * C;
        for (int64_t v0 = 0; v0 < V; v0 += XENT_VB) {
            const int64_t nv = V - v0 < XENT_VB ? V - v0 : XENT_VB;
            /* a stored block is dequantized once, for both products: the first packs it
             * transposed, the second reads its rows in place */
            const float *blk = wf ? wf + v0 * C : wb;
            if (!wf)
                for (int64_t j = 0; j < nv; j++) ws.deq(wb + j * C, ws.p + (v0 + j) * ws.row_bytes, C / ws.block);
            const operand B1 = {blk, 1, C}, B2 = {blk, C, 1};
            gemm(im1, 0, g, 0, nv, C, A, B1, NULL, L, XENT_VB, ap, bp, 0, NULL);
            for (int64_t i = 0; i < g; i++) {
                float *li = L + i * XENT_VB;
                const int64_t t = td[g0 + i];
                if (t < 0) {
                    memset(li, 0, (size_t)nv * sizeof(float));
                    alpha[i] = 1.0f;
                    continue;
                }
                xent_block_row(li, nv, s, cap, t >= v0 && t < v0 + nv ? t - v0 : -1, m + i, sum + i, alpha + i,
                               ly + i, dy + i);
                if (grad && v0 > 0 && alpha[i] != 1.0f) mul_row(acc + i * C, alpha[i], C);
            }
            if (grad) gemm(im2, 0, g, 0, C, nv, P, B2, NULL, acc, C, ap, bp, v0 > 0, NULL);
        }
        for (int64_t i = 0; i < g; i++) {
            const int64_t r = g0 + i, t = td[r];
            float *dr = dx + r * C;
            if (t < 0 || !grad) memset(dr, 0, (size_t)C * sizeof(float));
            if (t < 0) {
                nll[r] = 0.0f;
                continue;
            }
            nll[r] = (float)(((double)m[i] + log(sum[i]) - (double)ly[i]) * (double)scale);
            if (!grad) continue;
            const float *et = wf ? wf + t * C : erow;
            if (!wf) ws.deq(erow, ws.p + t * ws.row_bytes, C / ws.block);
            const float inv = (float)(1.0 / sum[i]), c = dy[i];
            for (int64_t k = 0; k < C; k++) dr[k] = (dr[k] * inv - c * et[k]) * scale;
        }
    }
    return GT_OK;
}

static int linear_xent_sizes(const gt_node *node, int64_t *scratch, int64_t *work) {
    const gt_tensor *x = &node->src[0];
    *scratch = 0;
    *work = xent_work_floats(x->ndim == 2 ? x->shape[1] : 0) * (int64_t)sizeof(float);
    return GT_OK;
}

int gt_linear_cross_entropy_fwd_f32(const gt_node *node, const gt_ctx *ctx) { return linear_xent(node, ctx, GT_F32); }
int gt_linear_cross_entropy_fwd_f32_sizes(const gt_node *node, int64_t *scratch, int64_t *work) {
    return linear_xent_sizes(node, scratch, work);
}

/* gt_linear_cross_entropy_fwd_f32_<w>: the same with W stored in each weight type. */
#define LINEAR_XENT_WEIGHT(w, ID)                                                                      \
    int gt_linear_cross_entropy_fwd_f32_##w(const gt_node *node, const gt_ctx *ctx) {                  \
        return linear_xent(node, ctx, ID);                                                             \
    }                                                                                                  \
    int gt_linear_cross_entropy_fwd_f32_##w##_sizes(const gt_node *node, int64_t *scratch, int64_t *work) { \
        return linear_xent_sizes(node, scratch, work);                                                 \
    }
GT_WEIGHT_TYPES(LINEAR_XENT_WEIGHT)
