/* qdot.c: a few rows of x times a stored weight's rows, for generation (M small).
 *
 * y[r, n] = sum_k x[r, k] * W[n, k] for r < m (m <= GT_QDOT_MAX_M) and n in a
 * range of W's rows: the product x @ W^T of a matmul with a transposed stored
 * weight (f16, bf16 or a ggml block type). With M = 1 the packed GEMM would
 * pad one row of x to a 12-row tile and transpose all of W into pack buffers;
 * here each W row is read once, dequantized in registers and dotted with the
 * m rows of x, so the product runs at the speed of reading W.
 *
 * Numerics (the same on every path, so results are bit-identical across the
 * SIMD levels and for any split of the rows between threads):
 *   w = the row dequantized exactly as gt_dequantizer_ does (same operations
 *       in the same order: SIMD dequantizers use mul and add, never an FMA,
 *       where the scalar code rounds twice);
 *   16 lanes, acc[l] = +0, then for each 16-element chunk c of k in order
 *       acc[l] = fma(w[16c + l], x[16c + l], acc[l])
 *       (a last partial chunk, K % 16 != 0 for f16/bf16, is zero-padded);
 *   y = ((acc[0:8] + acc[8:16]) -> [0:4] + [4:8] -> [0:2] + [2:4] -> [0] + [1]).
 * This is a different summation order from the packed path's one chain per
 * element (so the two differ in rounding); the tests compare it with float64.
 *
 * Paths: AVX-512F and AVX2+FMA(+F16C) kernels that dequantize in registers for
 * f16, bf16, q4_0, q4_1, q8_0 and q6_k; the other types (q5_0, q5_1, q2_k..q5_k)
 * are dequantized a block at a time by the scalar dequantizer into an L1
 * buffer and dotted by the same SIMD loop; plain C (fmaf, compiled for each
 * ISA by GT_CLONES) for the scalar level. Each W row's 16-lane accumulators
 * for up to 8 (AVX-512) or 4 (AVX2) rows of x stay in registers, two W rows
 * at a time where registers allow, so that the FMA chains overlap.
 */
#include <math.h>

#include "internal.h"
#include "simd.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define LANES 16

/* How the kernels walk a row of W: in units of `unit` elements of `unit_bytes`
 * bytes (a block; 16 elements for f16/bf16, whose K needs no block multiple). */
enum kind { K_F16, K_BF16, K_Q4_0, K_Q4_1, K_Q8_0, K_Q6_K, K_GEN };

static int kind_of(int32_t dtype) {
    switch (dtype) {
    case GT_F16: return K_F16;
    case GT_BF16: return K_BF16;
    case GT_Q4_0: return K_Q4_0;
    case GT_Q4_1: return K_Q4_1;
    case GT_Q8_0: return K_Q8_0;
    case GT_Q6_K: return K_Q6_K;
    default: return K_GEN;
    }
}

static inline float reduce16(const float a[LANES]) {
    float h[8], g[4];
    for (int l = 0; l < 8; l++) h[l] = a[l] + a[l + 8];
    for (int l = 0; l < 4; l++) g[l] = h[l] + h[l + 4];
    const float f0 = g[0] + g[2], f1 = g[1] + g[3];
    return f0 + f1;
}

/* ---- plain C: dequantize a unit into buf, then the lane loop ------------------- */

/* Rows [n0, n1) of W, m rows of x; unit: elements dequantized at a time. */
GT_CLONES static void rows_plain(float *y, int64_t ldy, const float *x, int64_t ldx, int m,
                                 const uint8_t *w, int64_t row_bytes, gt_dequant_fn deq, int block,
                                 int block_bytes, int64_t K, int64_t n0, int64_t n1, float *buf) {
    /* element types go 16 at a time (block 1), block types a block at a time */
    const int unit = block == 1 ? LANES : block;
    const int64_t units = K / unit, tail = K - units * unit;
    const int64_t unit_bytes = (int64_t)block_bytes * (unit / block);
    float acc[GT_QDOT_MAX_M][LANES];
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * row_bytes;
        for (int r = 0; r < m; r++)
            for (int l = 0; l < LANES; l++) acc[r][l] = 0.0f;
        for (int64_t u = 0; u <= units; u++) {
            const int64_t k0 = u * unit;
            int len = unit;
            if (u == units) {  /* the zero-padded last chunk of an element type */
                if (!tail) break;
                len = LANES;
                for (int l = 0; l < LANES; l++) buf[l] = 0.0f;
                deq(buf, row + u * unit_bytes, tail);
            } else {
                deq(buf, row + u * unit_bytes, unit / block);
            }
            for (int r = 0; r < m; r++) {
                const float *xr = x + r * ldx + k0;
                for (int c = 0; c < len; c += LANES)
                    for (int l = 0; l < LANES; l++) {
                        const float xv = k0 + c + l < K ? xr[c + l] : 0.0f;
                        acc[r][l] = fmaf(buf[c + l], xv, acc[r][l]);
                    }
            }
        }
        for (int r = 0; r < m; r++) y[r * ldy + n] = reduce16(acc[r]);
    }
}

#if defined(__x86_64__)

/* 16-element chunks per unit, a constant for every kind but K_GEN */
#define CHUNKS(kind, unit)                                                                       \
    ((kind) == K_F16 || (kind) == K_BF16 ? 1 : (kind) == K_Q6_K ? 16 : (kind) == K_GEN ? (unit) / LANES : 2)

/* ---- AVX-512F --------------------------------------------------------------------- */

#define T512 "avx512f,avx2,fma,f16c"

/* The f16 at p as f32 (F16C: exact, like gt_f16_to_f32_1). */
static inline __attribute__((always_inline, target("f16c"))) float h16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* Q6_K's chunk c (elements 16c .. 16c+15) of a block as integers q - 32, with
 * its scale index; the layout is in quant.c's dequant_q6_k. */
static inline __attribute__((always_inline, target(T512))) __m128i q6k_chunk(const uint8_t *b, int c,
                                                                             int *is) {
    const int h = c >> 3, cc = c & 7, qd = cc >> 1, l0 = (cc & 1) * 16;
    const uint8_t *ql = b + 64 * h + (qd & 1) * 32 + l0, *qh = b + 128 + 32 * h + l0;
    __m128i lo = _mm_loadu_si128((const __m128i *)ql);
    if (qd >= 2) lo = _mm_srli_epi16(lo, 4);
    lo = _mm_and_si128(lo, _mm_set1_epi8(0x0f));
    __m128i hb = _mm_loadu_si128((const __m128i *)qh);
    hb = _mm_and_si128(_mm_srli_epi16(hb, 2 * qd), _mm_set1_epi8(3));
    hb = _mm_slli_epi16(hb, 4);  /* bits 4..5 of each byte; no carry across bytes */
    *is = 8 * h + (cc & 1) + 2 * qd;
    return _mm_sub_epi8(_mm_or_si128(lo, hb), _mm_set1_epi8(32));
}

/* What a unit's chunks share: for q4_0/q4_1 the 16 values a nibble can
 * dequantize to (q - 8) * d or q * d + m, rounded as the scalar code rounds
 * them, so a chunk is one permute of this table; for q8_0 the scale. */
static inline __attribute__((always_inline, target(T512))) __m512 prep512(const int kind, const uint8_t *b) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    switch (kind) {
    case K_Q4_0: return _mm512_mul_ps(_mm512_sub_ps(iota, _mm512_set1_ps(8.0f)), _mm512_set1_ps(h16(b)));
    case K_Q4_1: return _mm512_add_ps(_mm512_mul_ps(iota, _mm512_set1_ps(h16(b))), _mm512_set1_ps(h16(b + 2)));
    case K_Q8_0: return _mm512_set1_ps(h16(b));
    default: return _mm512_setzero_ps();
    }
}

/* Chunk c (16 values) of unit u of a row, dequantized: exactly the floats
 * gt_dequantizer_ writes. buf holds the unit for K_GEN, pre what prep512 gave. */
static inline __attribute__((always_inline, target(T512))) __m512 deq16_512(const int kind, const uint8_t *b,
                                                                            int c, const float *buf,
                                                                            __m512 pre, __m512i qx) {
    switch (kind) {
    case K_F16: return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)b));
    case K_BF16: {
        const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)b));
        return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    }
    case K_Q8_0: {
        const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2 + 16 * c)));
        return _mm512_mul_ps(_mm512_cvtepi32_ps(q), pre);
    }
    /* qx: the block's 16 bytes as dwords; the permute reads only bits 0..3 of
     * each index, so the low nibbles need no mask */
    case K_Q4_0:
    case K_Q4_1: return _mm512_permutexvar_ps(c ? _mm512_srli_epi32(qx, 4) : qx, pre);
    case K_Q6_K: {
        int is;
        const __m512i q = _mm512_cvtepi8_epi32(q6k_chunk(b, c, &is));
        const float ds = h16(b + 208) * (float)(int8_t)b[192 + is];
        return _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(ds));
    }
    default: return _mm512_load_ps(buf + 16 * c);
    }
}

static inline __attribute__((always_inline, target(T512))) float hsum512(__m512 a) {
    const __m256 lo = _mm512_castps512_ps256(a);
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
    const __m256 h = _mm256_add_ps(lo, hi);
    const __m128 g = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    const __m128 f = _mm_add_ps(g, _mm_movehl_ps(g, g));
    return _mm_cvtss_f32(_mm_add_ss(f, _mm_shuffle_ps(f, f, 1)));
}

/* NW rows of W from `row` (row_bytes apart) times MM rows of x; the walk in
 * units as in rows_plain. xt: the zero-padded last chunk of each x row. */
static inline __attribute__((always_inline, target(T512))) void
body512(float *y, int64_t ldy, const float *x, int64_t ldx, const uint8_t *row, int64_t row_bytes,
        gt_dequant_fn deq, int64_t units, int unit, int64_t unit_bytes, int block, int64_t tail,
        const float *xt, float *buf, const int kind, const int MM, const int NW) {
    __m512 acc[2][8];
#pragma GCC unroll 2
    for (int j = 0; j < NW; j++)
#pragma GCC unroll 8
        for (int r = 0; r < MM; r++) acc[j][r] = _mm512_setzero_ps();
    const int chunks = CHUNKS(kind, unit);
    for (int64_t u = 0; u < units; u++) {
        const float *xu = x + u * unit;
        gt_prefetch_ahead_(row, row_bytes, NW, u, unit_bytes, 0);
#pragma GCC unroll 2
        for (int j = 0; j < NW; j++) {
            const uint8_t *b = row + j * row_bytes + u * unit_bytes;
            if (kind == K_GEN) deq(buf, b, unit / block);
            const __m512 pre = prep512(kind, b);
            const __m512i qx = kind == K_Q4_0 || kind == K_Q4_1
                                   ? _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + (kind == K_Q4_0 ? 2 : 4))))
                                   : _mm512_setzero_si512();
            /* unrolled (chunks is a constant but for K_GEN), so a Q6_K block's
             * loads and scale conversions are shared between its chunks */
#pragma GCC unroll 16
            for (int c = 0; c < chunks; c++) {
                const __m512 v = deq16_512(kind, b, c, buf, pre, qx);
#pragma GCC unroll 8
                for (int r = 0; r < MM; r++)
                    acc[j][r] = _mm512_fmadd_ps(v, _mm512_loadu_ps(xu + r * ldx + 16 * c), acc[j][r]);
            }
        }
    }
    if (tail) {  /* element types: the last chunk, zero-padded */
#pragma GCC unroll 2
        for (int j = 0; j < NW; j++) {
            float t[LANES] = {0};
            deq(t, row + j * row_bytes + units * unit_bytes, tail);
            const __m512 v = _mm512_loadu_ps(t);
#pragma GCC unroll 8
            for (int r = 0; r < MM; r++) acc[j][r] = _mm512_fmadd_ps(v, _mm512_loadu_ps(xt + r * LANES), acc[j][r]);
        }
    }
#pragma GCC unroll 2
    for (int j = 0; j < NW; j++)
#pragma GCC unroll 8
        for (int r = 0; r < MM; r++) y[r * ldy + j] = hsum512(acc[j][r]);
}

#define B512_ARGS y, ldy, x, ldx, row, row_bytes, deq, units, unit, unit_bytes, block, tail, xt, buf
#define B512_FN(KIND)                                                                           \
    __attribute__((target(T512))) static void rows512_##KIND(                                    \
        float *y, int64_t ldy, const float *x, int64_t ldx, const uint8_t *row, int64_t row_bytes, \
        gt_dequant_fn deq, int64_t units, int unit, int64_t unit_bytes, int block, int64_t tail,  \
        const float *xt, float *buf, int mm, int nw) {                                          \
        switch (mm * 2 + nw - 1) {                                                               \
        case 2: body512(B512_ARGS, KIND, 1, 1); break;                                           \
        case 3: body512(B512_ARGS, KIND, 1, 2); break;                                           \
        case 4: body512(B512_ARGS, KIND, 2, 1); break;                                           \
        case 5: body512(B512_ARGS, KIND, 2, 2); break;                                           \
        case 6: body512(B512_ARGS, KIND, 3, 1); break;                                           \
        case 7: body512(B512_ARGS, KIND, 3, 2); break;                                           \
        case 8: body512(B512_ARGS, KIND, 4, 1); break;                                           \
        case 9: body512(B512_ARGS, KIND, 4, 2); break;                                           \
        case 10: body512(B512_ARGS, KIND, 5, 1); break;                                          \
        case 12: body512(B512_ARGS, KIND, 6, 1); break;                                          \
        case 14: body512(B512_ARGS, KIND, 7, 1); break;                                          \
        case 16: body512(B512_ARGS, KIND, 8, 1); break;                                          \
        default: break;                                                                          \
        }                                                                                        \
    }

B512_FN(K_F16)
B512_FN(K_BF16)
B512_FN(K_Q4_0)
B512_FN(K_Q4_1)
B512_FN(K_Q8_0)
B512_FN(K_Q6_K)
B512_FN(K_GEN)

/* ---- AVX2+FMA: 16 lanes as two ymm ----------------------------------------------- */

#define T256 "avx2,fma,f16c"

typedef struct v16 {
    __m256 lo, hi;
} v16;

static inline __attribute__((always_inline, target(T256))) v16 cvt16(__m128i q8, int is_signed) {
    v16 v;
    const __m256i a = is_signed ? _mm256_cvtepi8_epi32(q8) : _mm256_cvtepu8_epi32(q8);
    const __m256i b = is_signed ? _mm256_cvtepi8_epi32(_mm_srli_si128(q8, 8))
                                : _mm256_cvtepu8_epi32(_mm_srli_si128(q8, 8));
    v.lo = _mm256_cvtepi32_ps(a);
    v.hi = _mm256_cvtepi32_ps(b);
    return v;
}

static inline __attribute__((always_inline, target(T256))) __m128i nibbles256(const uint8_t *p, int hi) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    return _mm_and_si128(hi ? _mm_srli_epi16(b, 4) : b, _mm_set1_epi8(0x0f));
}

static inline __attribute__((always_inline, target(T256))) __m128i q6k_chunk256(const uint8_t *b, int c,
                                                                                int *is) {
    const int h = c >> 3, cc = c & 7, qd = cc >> 1, l0 = (cc & 1) * 16;
    const uint8_t *ql = b + 64 * h + (qd & 1) * 32 + l0, *qh = b + 128 + 32 * h + l0;
    __m128i lo = _mm_loadu_si128((const __m128i *)ql);
    if (qd >= 2) lo = _mm_srli_epi16(lo, 4);
    lo = _mm_and_si128(lo, _mm_set1_epi8(0x0f));
    __m128i hb = _mm_loadu_si128((const __m128i *)qh);
    hb = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(hb, 2 * qd), _mm_set1_epi8(3)), 4);
    *is = 8 * h + (cc & 1) + 2 * qd;
    return _mm_sub_epi8(_mm_or_si128(lo, hb), _mm_set1_epi8(32));
}

static inline __attribute__((always_inline, target(T256))) v16 scale16(v16 v, float s) {
    const __m256 d = _mm256_set1_ps(s);
    v.lo = _mm256_mul_ps(v.lo, d);
    v.hi = _mm256_mul_ps(v.hi, d);
    return v;
}

static inline __attribute__((always_inline, target(T256))) v16 deq16_256(const int kind, const uint8_t *b,
                                                                         int c, const float *buf) {
    v16 v;
    switch (kind) {
    case K_F16:
        v.lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b));
        v.hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 16)));
        return v;
    case K_BF16:
        v.lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)b)), 16));
        v.hi = _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(b + 16))), 16));
        return v;
    case K_Q8_0:
        return scale16(cvt16(_mm_loadu_si128((const __m128i *)(b + 2 + 16 * c)), 1), h16(b));
    case K_Q4_0:
        /* q - 8 in bytes (signed), then to float */
        return scale16(cvt16(_mm_sub_epi8(nibbles256(b + 2, c), _mm_set1_epi8(8)), 1),
                       h16(b));
    case K_Q4_1: {
        v = scale16(cvt16(nibbles256(b + 4, c), 0), h16(b));
        const __m256 m = _mm256_set1_ps(h16(b + 2));
        v.lo = _mm256_add_ps(v.lo, m);
        v.hi = _mm256_add_ps(v.hi, m);
        return v;
    }
    case K_Q6_K: {
        int is;
        const __m128i q = q6k_chunk256(b, c, &is);
        return scale16(cvt16(q, 1), h16(b + 208) * (float)(int8_t)b[192 + is]);
    }
    default:
        v.lo = _mm256_load_ps(buf + 16 * c);
        v.hi = _mm256_load_ps(buf + 16 * c + 8);
        return v;
    }
}

static inline __attribute__((always_inline, target(T256))) float hsum256(__m256 lo, __m256 hi) {
    const __m256 h = _mm256_add_ps(lo, hi);
    const __m128 g = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    const __m128 f = _mm_add_ps(g, _mm_movehl_ps(g, g));
    return _mm_cvtss_f32(_mm_add_ss(f, _mm_shuffle_ps(f, f, 1)));
}

static inline __attribute__((always_inline, target(T256))) void
body256(float *y, int64_t ldy, const float *x, int64_t ldx, const uint8_t *row, int64_t row_bytes,
        gt_dequant_fn deq, int64_t units, int unit, int64_t unit_bytes, int block, int64_t tail,
        const float *xt, float *buf, const int kind, const int MM, const int NW) {
    __m256 lo[2][4], hi[2][4];
#pragma GCC unroll 2
    for (int j = 0; j < NW; j++)
#pragma GCC unroll 4
        for (int r = 0; r < MM; r++) lo[j][r] = hi[j][r] = _mm256_setzero_ps();
    const int chunks = CHUNKS(kind, unit);
    for (int64_t u = 0; u < units; u++) {
        const float *xu = x + u * unit;
        gt_prefetch_ahead_(row, row_bytes, NW, u, unit_bytes, 0);
#pragma GCC unroll 2
        for (int j = 0; j < NW; j++) {
            const uint8_t *b = row + j * row_bytes + u * unit_bytes;
            if (kind == K_GEN) deq(buf, b, unit / block);
            /* unrolled (chunks is a constant but for K_GEN), so a Q6_K block's
             * loads and scale conversions are shared between its chunks */
#pragma GCC unroll 16
            for (int c = 0; c < chunks; c++) {
                const v16 v = deq16_256(kind, b, c, buf);
#pragma GCC unroll 4
                for (int r = 0; r < MM; r++) {
                    const float *xc = xu + r * ldx + 16 * c;
                    lo[j][r] = _mm256_fmadd_ps(v.lo, _mm256_loadu_ps(xc), lo[j][r]);
                    hi[j][r] = _mm256_fmadd_ps(v.hi, _mm256_loadu_ps(xc + 8), hi[j][r]);
                }
            }
        }
    }
    if (tail) {
#pragma GCC unroll 2
        for (int j = 0; j < NW; j++) {
            float t[LANES] = {0};
            deq(t, row + j * row_bytes + units * unit_bytes, tail);
            const __m256 vl = _mm256_loadu_ps(t), vh = _mm256_loadu_ps(t + 8);
#pragma GCC unroll 4
            for (int r = 0; r < MM; r++) {
                lo[j][r] = _mm256_fmadd_ps(vl, _mm256_loadu_ps(xt + r * LANES), lo[j][r]);
                hi[j][r] = _mm256_fmadd_ps(vh, _mm256_loadu_ps(xt + r * LANES + 8), hi[j][r]);
            }
        }
    }
#pragma GCC unroll 2
    for (int j = 0; j < NW; j++)
#pragma GCC unroll 4
        for (int r = 0; r < MM; r++) y[r * ldy + j] = hsum256(lo[j][r], hi[j][r]);
}

#define B256_FN(KIND)                                                                           \
    __attribute__((target(T256))) static void rows256_##KIND(                                    \
        float *y, int64_t ldy, const float *x, int64_t ldx, const uint8_t *row, int64_t row_bytes, \
        gt_dequant_fn deq, int64_t units, int unit, int64_t unit_bytes, int block, int64_t tail,  \
        const float *xt, float *buf, int mm, int nw) {                                          \
        switch (mm * 2 + nw - 1) {                                                               \
        case 2: body256(B512_ARGS, KIND, 1, 1); break;                                           \
        case 3: body256(B512_ARGS, KIND, 1, 2); break;                                           \
        case 4: body256(B512_ARGS, KIND, 2, 1); break;                                           \
        case 5: body256(B512_ARGS, KIND, 2, 2); break;                                           \
        case 6: body256(B512_ARGS, KIND, 3, 1); break;                                           \
        case 8: body256(B512_ARGS, KIND, 4, 1); break;                                           \
        default: break;                                                                          \
        }                                                                                        \
    }

B256_FN(K_F16)
B256_FN(K_BF16)
B256_FN(K_Q4_0)
B256_FN(K_Q4_1)
B256_FN(K_Q8_0)
B256_FN(K_Q6_K)
B256_FN(K_GEN)

typedef void (*rows_fn)(float *y, int64_t ldy, const float *x, int64_t ldx, const uint8_t *row,
                        int64_t row_bytes, gt_dequant_fn deq, int64_t units, int unit, int64_t unit_bytes,
                        int block, int64_t tail, const float *xt, float *buf, int mm, int nw);

static const rows_fn ROWS512[] = {rows512_K_F16, rows512_K_BF16, rows512_K_Q4_0, rows512_K_Q4_1,
                                  rows512_K_Q8_0, rows512_K_Q6_K, rows512_K_GEN};
static const rows_fn ROWS256[] = {rows256_K_F16, rows256_K_BF16, rows256_K_Q4_0, rows256_K_Q4_1,
                                  rows256_K_Q8_0, rows256_K_Q6_K, rows256_K_GEN};

#endif /* __x86_64__ */

void gt_qdot_rows_(float *y, int64_t ldy, const float *x, int64_t ldx, int m, const uint8_t *w,
                   int64_t row_bytes, int32_t dtype, int64_t K, int64_t n0, int64_t n1, float *scratch) {
    const gt_dtype_traits *t = gt_dtype_find_(dtype);
    const gt_dequant_fn deq = gt_dequantizer_(dtype);
    const int block = t->block;
    float *buf = (float *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);  /* QK_K floats */
#if defined(__x86_64__)
    const int level = gt_simd_level_();
    if (level >= 1 && __builtin_cpu_supports("f16c")) {
        const int kind = kind_of(dtype);
        const rows_fn fn = level >= 2 ? ROWS512[kind] : ROWS256[kind];
        const int gmax = level >= 2 ? 8 : 4;          /* x rows per pass */
        const int unit = block == 1 ? LANES : block;
        const int64_t units = K / unit, tail = K - units * unit;
        const int64_t unit_bytes = (int64_t)t->block_bytes * (unit / block);
        float *xt = buf + 256;                        /* the group's zero-padded tails */
        for (int r0 = 0; r0 < m; r0 += gmax) {
            const int g = m - r0 < gmax ? m - r0 : gmax;
            /* two W rows at a time while their accumulators fit in registers */
            const int nw = level >= 2 ? (g <= 4 ? 2 : 1) : (g <= 2 ? 2 : 1);
            const float *xg = x + r0 * ldx;
            for (int r = 0; r < g && tail; r++)
                for (int l = 0; l < LANES; l++) xt[r * LANES + l] = l < tail ? xg[r * ldx + units * unit + l] : 0.0f;
            int64_t n = n0;
            for (; n + nw <= n1; n += nw)
                fn(y + r0 * ldy + n, ldy, xg, ldx, w + n * row_bytes, row_bytes, deq, units, unit, unit_bytes,
                   block, tail, xt, buf, g, nw);
            for (; n < n1; n++)
                fn(y + r0 * ldy + n, ldy, xg, ldx, w + n * row_bytes, row_bytes, deq, units, unit, unit_bytes,
                   block, tail, xt, buf, g, 1);
        }
        return;
    }
#endif
    rows_plain(y, ldy, x, ldx, m, w, row_bytes, deq, block, t->block_bytes, K, n0, n1, buf);
}
