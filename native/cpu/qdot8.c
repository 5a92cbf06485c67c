/* qdot8.c: x @ W^T with the activations quantized to 8 bits, as llama.cpp multiplies a
 * quantized weight by a vector (generation and evaluation; never training).
 *
 * Activations: each row of x, in blocks of 32 along k, becomes a gt_act8 as llama.cpp's
 * AVX2 quantize_row_q8_0/q8_1 make them: amax = max |x|, d = amax / 127, q = x * (127 /
 * amax) rounded to nearest even (0 where amax is 0), d kept as its f16 rounding, and
 * s = f16(d * sum q) for the weight types with a minimum (Q4_1, Q5_1).
 *
 * The dot of a W row with an x row, as llama.cpp's AVX2 build computes it (its vec_dot
 * functions, and for Q4_0 the GEMV of the weights it repacks), integer products exact:
 *   Q4_1, Q5_0, Q5_1, Q8_0, and Q4_0 when W's rows are not a multiple of 8 (llama.cpp does
 *   not repack those): per block b,
 *     lane l (0..7) = sum over i in 4l .. 4l+3 of w_q[i] * x_q[i]
 *       (w_q: Q4_0 nibble - 8, Q4_1 nibble, Q5_0 5-bit value - 16, Q5_1 5-bit value, Q8_0 the
 *       byte; element i of the block),
 *     acc[l] = fma(f16(w.d) * x.d, (float)lane l, acc[l])      (acc = +0 at the start),
 *     summs = fma(f16(w.m), x.s, summs)                         (Q4_1, Q5_1),
 *   then y = ((acc0 + acc4) + (acc2 + acc6)) + ((acc1 + acc5) + (acc3 + acc7)) + summs;
 *   MXFP4 when W's rows are not a multiple of 8 (vec_dot_mxfp4_q8_0): the lanes as above (w_q
 *     the doubled E2M1 value, w.d its halved E8M0 scale, native/mxfp4.h), in two accumulators,
 *     acc for the even blocks and acc' for the odd ones of each pair (2i, 2i + 1), then
 *     y = hsum(acc + acc') in the order above, and for an odd last block
 *     y = fma(w.d * x.d, (float)(sum of its 32 products), y);
 *   Q4_0 and MXFP4 with W's rows a multiple of 8 (llama.cpp repacks them,
 *   ggml_gemv_q4_0_8x8_q8_0, ggml_gemv_mxfp4_8x8_q8_0): one chain, y = +0, then per block
 *   y = fma((float)(sum of the block's 32 products), w.d * x.d, y).
 * The plain C path and the AVX2 one (and its VNNI forms, the same integers) give the same
 * bits for any split of W's rows between threads.
 */
#include <math.h>
#include <string.h>

#include "../mxfp4.h"
#include "act8.h"

/* ---- activations -------------------------------------------------------------------- */

static void quantize_block(gt_act8 *y, const float *x) {
    float amax = 0.0f;
    for (int i = 0; i < 32; i++) {
        const float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    const float d = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
    int32_t sum = 0;
    for (int i = 0; i < 32; i++) {
        const int32_t q = (int32_t)nearbyintf(x[i] * id);   /* the default mode: nearest even */
        y->q[i] = (int8_t)q;
        sum += q;
    }
    y->d = gt_f16_to_f32_1(gt_f32_to_f16_1(d));
    y->s = gt_f16_to_f32_1(gt_f32_to_f16_1(d * (float)sum));
    y->sum = sum;
}

#if defined(__x86_64__)
/* The same block with AVX2: the max of |x| (exact in any order), x * id rounded to nearest
 * even by vroundps (nearbyintf's default mode), the integer sum, the scales as above. */
__attribute__((target("avx2,fma,f16c"))) static void quantize_block_avx2(gt_act8 *y, const float *x) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], m = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) {
        v[j] = _mm256_loadu_ps(x + 8 * j);
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[j]));
    }
    __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(m, 1), _mm256_castps256_ps128(m));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float d = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
    const __m256 idv = _mm256_set1_ps(id);
    __m256i q[4], sum = _mm256_setzero_si256();
    for (int j = 0; j < 4; j++) {
        q[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], idv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        sum = _mm256_add_epi32(sum, q[j]);
    }
    const __m256i p = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)y->q, p);
    __m128i s4 = _mm_add_epi32(_mm256_extracti128_si256(sum, 1), _mm256_castsi256_si128(sum));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    y->d = _cvtsh_ss(_cvtss_sh(d, _MM_FROUND_TO_NEAREST_INT));
    y->sum = _mm_cvtsi128_si32(s4);
    y->s = _cvtsh_ss(_cvtss_sh(d * (float)y->sum, _MM_FROUND_TO_NEAREST_INT));
}
#endif

void gt_act8_quantize_(gt_act8 *y, const float *x, int64_t K) {
#if defined(__x86_64__)
    if (gt_simd_level_() >= 1 && __builtin_cpu_supports("f16c")) {
        for (int64_t b = 0; b < K / 32; b++) quantize_block_avx2(y + b, x + 32 * b);
        return;
    }
#endif
    for (int64_t b = 0; b < K / 32; b++) quantize_block(y + b, x + 32 * b);
}

/* ---- the weight blocks ---------------------------------------------------------------- */

enum kind { K_Q4_0, K_Q4_1, K_Q5_0, K_Q5_1, K_Q8_0, K_MXFP4, N_KINDS };

static const int8_t MXFP4_VALUES[16] = GT_MXFP4_VALUES;

static int kind_of(int32_t dtype) {
    switch (dtype) {
    case GT_Q4_0: return K_Q4_0;
    case GT_Q4_1: return K_Q4_1;
    case GT_Q5_0: return K_Q5_0;
    case GT_Q5_1: return K_Q5_1;
    case GT_Q8_0: return K_Q8_0;
    case GT_MXFP4: return K_MXFP4;
    default: return -1;
    }
}

/* the kinds whose blocks have a minimum m (w = d * q + m): their dot adds m * x.s; the others'
 * weights are signed */
#define HAS_MIN(kind) ((kind) == K_Q4_1 || (kind) == K_Q5_1)

int gt_act8_supports_(int32_t dtype) {
#define ACT8_IS_(w, ID) if (dtype == ID) return 1;
    GT_ACT8_TYPES(ACT8_IS_)
#undef ACT8_IS_
    return 0;
}

/* the block's scale: its f16 d (MXFP4: the halved E8M0 scale) */
static inline float wscale(int kind, const uint8_t *b) {
    return kind == K_MXFP4 ? gt_e8m0_half(b[0]) : gt_half_at_(b);
}

/* element i of a block as an integer (Q5: the low nibble, bit i of qh above it) */
static inline int32_t wq(int kind, const uint8_t *b, int i) {
    const uint32_t qh = (uint32_t)b[kind == K_Q5_1 ? 4 : 2] | (uint32_t)b[kind == K_Q5_1 ? 5 : 3] << 8 |
                        (uint32_t)b[kind == K_Q5_1 ? 6 : 4] << 16 | (uint32_t)b[kind == K_Q5_1 ? 7 : 5] << 24;
    switch (kind) {
    case K_Q4_0: return (i < 16 ? b[2 + i] & 15 : b[2 + i - 16] >> 4) - 8;
    case K_Q4_1: return i < 16 ? b[4 + i] & 15 : b[4 + i - 16] >> 4;
    case K_Q5_0: return ((i < 16 ? b[6 + i] & 15 : b[6 + i - 16] >> 4) | (int32_t)((qh >> i) & 1) << 4) - 16;
    case K_Q5_1: return (i < 16 ? b[8 + i] & 15 : b[8 + i - 16] >> 4) | (int32_t)((qh >> i) & 1) << 4;
    case K_MXFP4: return MXFP4_VALUES[i < 16 ? b[1 + i] & 15 : b[1 + i - 16] >> 4];
    default: return (int8_t)b[2 + i];
    }
}

/* ---- plain C ---------------------------------------------------------------------------- */

static void rows_plain(float *y, int64_t ldy, const gt_act8 *x, int64_t ldx, int m, const uint8_t *w,
                       int64_t row_bytes, int kind, int chain, int block_bytes, int64_t nb, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++)
        for (int r = 0; r < m; r++) {
            const gt_act8 *xr = x + r * ldx;
            float acc[2][8] = {{0}}, summs = 0.0f, one = 0.0f, tail_d = 0.0f;
            int32_t tail = 0;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *wb = w + n * row_bytes + b * block_bytes;
                const float dd = wscale(kind, wb) * xr[b].d;
                int32_t lane[8], all = 0;
                for (int l = 0; l < 8; l++) {
                    int32_t s = 0;
                    for (int i = 4 * l; i < 4 * l + 4; i++) s += wq(kind, wb, i) * xr[b].q[i];
                    lane[l] = s;
                    all += s;
                }
                if (chain) {
                    one = fmaf((float)all, dd, one);
                    continue;
                }
                if (kind == K_MXFP4 && b == nb - 1 && nb % 2) {     /* the odd last block */
                    tail = all;
                    tail_d = dd;
                    continue;
                }
                float *a = acc[kind == K_MXFP4 ? b % 2 : 0];
                for (int l = 0; l < 8; l++) a[l] = fmaf(dd, (float)lane[l], a[l]);
                if (HAS_MIN(kind)) summs = fmaf(gt_half_at_(wb + 2), xr[b].s, summs);
            }
            if (kind == K_MXFP4 && !chain) {
                for (int l = 0; l < 8; l++) acc[0][l] += acc[1][l];
                y[r * ldy + n] = nb % 2 ? fmaf(tail_d, (float)tail, gt_hsum8_(acc[0])) : gt_hsum8_(acc[0]);
                continue;
            }
            y[r * ldy + n] = chain ? one : gt_hsum8_(acc[0]) + summs;
        }
}

/* ---- AVX2 (and VNNI) ------------------------------------------------------------------------ */

#if defined(__x86_64__)
#define T8 "avx2,fma,f16c"
#define T8_VNNI "avx2,fma,f16c,avxvnni"
#define T8_VNNI512 "avx2,fma,f16c,avx512f,avx512vl,avx512vnni"
enum { DOT_MADD, DOT_VNNI, DOT_VNNI512 };

/* The block's 32 weights as signed bytes (Q4_1, Q5_1: unsigned), element i in byte i. */
static inline __attribute__((always_inline, target(T8))) __m256i wbytes(int kind, const uint8_t *b) {
    if (kind == K_Q8_0) return _mm256_loadu_si256((const __m256i *)(b + 2));
    if (kind == K_MXFP4) {     /* each nibble looked up in the values */
        const __m128i raw = _mm_loadu_si128((const __m128i *)(b + 1)), m4 = _mm_set1_epi8(15);
        const __m128i lut = _mm_loadu_si128((const __m128i *)MXFP4_VALUES);
        return _mm256_set_m128i(_mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(raw, 4), m4)),
                                _mm_shuffle_epi8(lut, _mm_and_si128(raw, m4)));
    }
    static const int qs_at[N_KINDS] = {2, 4, 6, 8, 0, 1};
    const __m128i raw = _mm_loadu_si128((const __m128i *)(b + qs_at[kind]));
    const __m128i m4 = _mm_set1_epi8(15);
    __m256i v = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4));
    if (kind == K_Q5_0 || kind == K_Q5_1) {    /* bit i of qh as 16 in byte i */
        uint32_t qh;
        memcpy(&qh, b + (kind == K_Q5_1 ? 4 : 2), 4);
        const __m256i rep = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh),
                                                _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                                  0x0101010101010101, 0x0000000000000000));
        const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(rep, bit), bit);
        v = _mm256_or_si256(v, _mm256_and_si256(set, _mm256_set1_epi8(16)));
    }
    return kind == K_Q4_0 ? _mm256_sub_epi8(v, _mm256_set1_epi8(8))
         : kind == K_Q5_0 ? _mm256_sub_epi8(v, _mm256_set1_epi8(16)) : v;
}
#define WBYTES(kind, b) wbytes((kind), (b))

/* NW rows of W (from w), MM rows of x. u: the unsigned operand of the byte products (|w|, or
 * Q4_1's nibbles), v: x with w's sign (or x); lanes l = the sum of bytes 4l .. 4l+3's products,
 * by maddubs + madd (the pair sums never saturate: |w| <= 127, |x| <= 127) or by VNNI's dpbusd,
 * the same integers. */
#define BODY8(NAME, TARGET, DPB)                                                                                  \
    static inline __attribute__((always_inline, target(TARGET))) void NAME(                                     \
        float *y, int64_t ldy, const gt_act8 *x, int64_t ldx, const uint8_t *w, int64_t row_bytes, int kind,     \
        int chain, int block_bytes, int64_t nb, int NW, int MM) {                                                \
        __m256 acc[2][4], acc2[2][4];  /* acc2: MXFP4's odd blocks */                                            \
        float summs[2][4], tail_d[2][4];                                                                         \
        int32_t tail[2][4];                                                                                      \
        const int pair = kind == K_MXFP4 && !chain;  /* vec_dot_mxfp4_q8_0's block pairs and odd last block */  \
        for (int j = 0; j < NW; j++)                                                                             \
            for (int r = 0; r < MM; r++) {                                                                       \
                acc[j][r] = acc2[j][r] = _mm256_setzero_ps();                                                    \
                summs[j][r] = tail_d[j][r] = 0.0f;                                                               \
                tail[j][r] = 0;                                                                                  \
            }                                                                                                    \
        for (int64_t b = 0; b < nb; b++) {                                                                       \
            gt_prefetch_ahead_(w, row_bytes, NW, b, block_bytes, 0);                                             \
            _Pragma("GCC unroll 2") for (int j = 0; j < NW; j++) {                                               \
                const uint8_t *wb = w + j * row_bytes + b * block_bytes;                                         \
                const __m256i wv = WBYTES(kind, wb);                                                             \
                const __m256i u = HAS_MIN(kind) ? wv : _mm256_sign_epi8(wv, wv);                                 \
                const float dw = kind == K_MXFP4 ? gt_e8m0_half(wb[0]) : gt_half_at_f16c_(wb);                  \
                const float mw = HAS_MIN(kind) ? gt_half_at_f16c_(wb + 2) : 0.0f;                                \
                _Pragma("GCC unroll 4") for (int r = 0; r < MM; r++) {                                           \
                    const gt_act8 *xb = x + r * ldx + b;                                                         \
                    const __m256i xv = _mm256_loadu_si256((const __m256i *)xb->q);                               \
                    const __m256i lanes = DPB(u, HAS_MIN(kind) ? xv : _mm256_sign_epi8(xv, wv));                 \
                    if (chain) {                                                                                 \
                        summs[j][r] = fmaf((float)gt_hsum_i32_(lanes), dw * xb->d, summs[j][r]);                 \
                        continue;                                                                                \
                    }                                                                                            \
                    if (pair && b == nb - 1 && nb % 2) {                                                         \
                        tail[j][r] = gt_hsum_i32_(lanes);                                                        \
                        tail_d[j][r] = dw * xb->d;                                                               \
                        continue;                                                                                \
                    }                                                                                            \
                    const __m256 t = _mm256_cvtepi32_ps(lanes), dd = _mm256_set1_ps(dw * xb->d);                 \
                    if (pair && b % 2) acc2[j][r] = _mm256_fmadd_ps(dd, t, acc2[j][r]);                          \
                    else acc[j][r] = _mm256_fmadd_ps(dd, t, acc[j][r]);                                          \
                    if (HAS_MIN(kind)) summs[j][r] = fmaf(mw, xb->s, summs[j][r]);                               \
                }                                                                                                \
            }                                                                                                    \
        }                                                                                                        \
        for (int j = 0; j < NW; j++)                                                                             \
            for (int r = 0; r < MM; r++) {                                                                       \
                if (chain) {                                                                                     \
                    y[r * ldy + j] = summs[j][r];                                                                \
                } else if (pair) {                                                                               \
                    const float h = gt_hsum8_256_(_mm256_add_ps(acc[j][r], acc2[j][r]));                         \
                    y[r * ldy + j] = nb % 2 ? fmaf(tail_d[j][r], (float)tail[j][r], h) : h;                      \
                } else {                                                                                         \
                    y[r * ldy + j] = gt_hsum8_256_(acc[j][r]) + summs[j][r];                                     \
                }                                                                                                \
            }                                                                                                    \
    }

#define DPB_MADD(u, v) _mm256_madd_epi16(_mm256_maddubs_epi16((u), (v)), _mm256_set1_epi16(1))
#define DPB_VNNI(u, v) _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), (u), (v))
#define DPB_VNNI512(u, v) _mm256_dpbusd_epi32(_mm256_setzero_si256(), (u), (v))
BODY8(body8_madd, T8, DPB_MADD)
BODY8(body8_vnni, T8_VNNI, DPB_VNNI)
BODY8(body8_vnni512, T8_VNNI512, DPB_VNNI512)

/* one function per (dot, kind): NW (1, 2) and MM (1..4) picked at run time, the kind's and
 * the shape's branches folded away in each body */
#define ROWS8_FN(BODY, TARGET, KIND)                                                                            \
    __attribute__((target(TARGET))) static void rows8_##BODY##_##KIND(                                          \
        float *y, int64_t ldy, const gt_act8 *x, int64_t ldx, const uint8_t *w, int64_t row_bytes, int chain,    \
        int block_bytes, int64_t nb, int mm, int nw) {                                                          \
        switch (mm * 2 + nw - 1) {                                                                              \
        case 2: BODY(y, ldy, x, ldx, w, row_bytes, KIND, chain, block_bytes, nb, 1, 1); break;                  \
        case 3: BODY(y, ldy, x, ldx, w, row_bytes, KIND, chain, block_bytes, nb, 2, 1); break;                  \
        case 4: BODY(y, ldy, x, ldx, w, row_bytes, KIND, chain, block_bytes, nb, 1, 2); break;                  \
        case 5: BODY(y, ldy, x, ldx, w, row_bytes, KIND, chain, block_bytes, nb, 2, 2); break;                  \
        case 6: BODY(y, ldy, x, ldx, w, row_bytes, KIND, chain, block_bytes, nb, 1, 3); break;                  \
        case 7: BODY(y, ldy, x, ldx, w, row_bytes, KIND, chain, block_bytes, nb, 2, 3); break;                  \
        case 8: BODY(y, ldy, x, ldx, w, row_bytes, KIND, chain, block_bytes, nb, 1, 4); break;                  \
        case 9: BODY(y, ldy, x, ldx, w, row_bytes, KIND, chain, block_bytes, nb, 2, 4); break;                  \
        default: break;                                                                                         \
        }                                                                                                       \
    }
#define ROWS8_KINDS(BODY, TARGET)                                                                       \
    ROWS8_FN(BODY, TARGET, K_Q4_0) ROWS8_FN(BODY, TARGET, K_Q4_1) ROWS8_FN(BODY, TARGET, K_Q5_0)         \
    ROWS8_FN(BODY, TARGET, K_Q5_1) ROWS8_FN(BODY, TARGET, K_Q8_0) ROWS8_FN(BODY, TARGET, K_MXFP4)
ROWS8_KINDS(body8_madd, T8)
ROWS8_KINDS(body8_vnni, T8_VNNI)
ROWS8_KINDS(body8_vnni512, T8_VNNI512)

/* Q4_0's one chain a row (W's rows a multiple of 8), eight W rows at a time with one lane a
 * row, as llama.cpp's repacked GEMV: per block, each row's 32 products summed exactly (the
 * unsigned nibbles' dot, minus 8 times the block's sum of x), then acc = fma((float)sum,
 * d_w * d_x, acc) in every lane: the same bits as the plain chain (the integer sums are
 * exact in any order). Two rows share a vector: their low nibbles (elements 0-15) meet x's
 * first 16 bytes in each half, their high nibbles x's last 16, so the unpacking and the
 * reduction of the lanes to one sum a row take half the instructions they would a row at a
 * time; the eight rows' f16 scales go into one vector by inserts (a small array on the
 * stack, read back whole, stalled on the store). */
#define DPB2_MADD(lo, xl, hi, xh) \
    _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16((lo), (xl)), _mm256_maddubs_epi16((hi), (xh))), \
                      _mm256_set1_epi16(1))
#define DPB2_VNNI(lo, xl, hi, xh) \
    _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), (lo), (xl)), (hi), (xh))
#define DPB2_VNNI512(lo, xl, hi, xh) \
    _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), (lo), (xl)), (hi), (xh))

static inline __attribute__((always_inline)) int16_t load_i16(const uint8_t *p) {
    int16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

#define CHAIN8(NAME, TARGET, DPB2)                                                                               \
    __attribute__((target(TARGET))) static void NAME(float *y, int64_t ldy, const gt_act8 *x, int64_t ldx,       \
                                                     const uint8_t *w, int64_t row_bytes, int block_bytes,       \
                                                     int64_t nb, int MM) {                                       \
        __m256 acc[4];                                                                                           \
        for (int r = 0; r < MM; r++) acc[r] = _mm256_setzero_ps();                                               \
        const __m256i m4 = _mm256_set1_epi8(15);                                                                 \
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);                                         \
        for (int64_t b = 0; b < nb; b++) {                                                                       \
            const uint8_t *wb = w + b * block_bytes;                                                             \
            gt_prefetch_ahead_(w, row_bytes, 8, b, block_bytes, 0);                                              \
            __m256i lo[4], hi[4];                                                                                \
            _Pragma("GCC unroll 4") for (int p = 0; p < 4; p++) {                                                \
                const uint8_t *w0 = wb + 2 * p * row_bytes, *w1 = w0 + row_bytes;                                \
                const __m256i raw = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(w1 + 2)),                 \
                                                     _mm_loadu_si128((const __m128i *)(w0 + 2)));                \
                lo[p] = _mm256_and_si256(raw, m4);                                                               \
                hi[p] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);                                         \
            }                                                                                                    \
            const __m128i dh = _mm_setr_epi16(load_i16(wb), load_i16(wb + row_bytes), load_i16(wb + 2 * row_bytes), \
                                              load_i16(wb + 3 * row_bytes), load_i16(wb + 4 * row_bytes),        \
                                              load_i16(wb + 5 * row_bytes), load_i16(wb + 6 * row_bytes),        \
                                              load_i16(wb + 7 * row_bytes));                                     \
            const __m256 dw = _mm256_cvtph_ps(dh);                                                               \
            _Pragma("GCC unroll 4") for (int r = 0; r < MM; r++) {                                               \
                const gt_act8 *xb = x + r * ldx + b;                                                             \
                const __m256i xl = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)xb->q));         \
                const __m256i xh = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(xb->q + 16)));  \
                /* each vector: two rows' 4 partial sums; hadds leave rows 0 2 4 6 | 1 3 5 7 */                  \
                const __m256i h01 = _mm256_hadd_epi32(DPB2(lo[0], xl, hi[0], xh), DPB2(lo[1], xl, hi[1], xh));   \
                const __m256i h23 = _mm256_hadd_epi32(DPB2(lo[2], xl, hi[2], xh), DPB2(lo[3], xl, hi[3], xh));   \
                const __m256i h = _mm256_hadd_epi32(h01, h23);                                                   \
                const __m256i sums = _mm256_sub_epi32(_mm256_permutevar8x32_epi32(h, order),                     \
                                                      _mm256_set1_epi32(8 * xb->sum));                           \
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(dw, _mm256_set1_ps(xb->d)), acc[r]); \
            }                                                                                                    \
        }                                                                                                        \
        for (int r = 0; r < MM; r++) _mm256_storeu_ps(y + r * ldy, acc[r]);                                      \
    }
CHAIN8(chain8_madd, T8, DPB2_MADD)
CHAIN8(chain8_vnni, T8_VNNI, DPB2_VNNI)
CHAIN8(chain8_vnni512, T8_VNNI512, DPB2_VNNI512)
typedef void (*chain8_fn)(float *y, int64_t ldy, const gt_act8 *x, int64_t ldx, const uint8_t *w, int64_t row_bytes,
                          int block_bytes, int64_t nb, int MM);
static const chain8_fn CHAIN8S[3] = {chain8_madd, chain8_vnni, chain8_vnni512};

typedef void (*rows8_fn)(float *y, int64_t ldy, const gt_act8 *x, int64_t ldx, const uint8_t *w, int64_t row_bytes,
                         int chain, int block_bytes, int64_t nb, int mm, int nw);
#define ROWS8_ROW(BODY) \
    {rows8_##BODY##_K_Q4_0, rows8_##BODY##_K_Q4_1, rows8_##BODY##_K_Q5_0, rows8_##BODY##_K_Q5_1, rows8_##BODY##_K_Q8_0, \
     rows8_##BODY##_K_MXFP4}
static const rows8_fn ROWS8[3][N_KINDS] = {ROWS8_ROW(body8_madd), ROWS8_ROW(body8_vnni), ROWS8_ROW(body8_vnni512)};

/* the CPU's byte dot: AVX-VNNI, else AVX512-VNNI (with VL), else maddubs + madd */
static int dot_level(void) {
    static int level = -1;
    if (level < 0)
        level = __builtin_cpu_supports("avxvnni") ? DOT_VNNI
              : __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") ? DOT_VNNI512
              : DOT_MADD;
    return level;
}
#endif /* __x86_64__ */

void gt_qdot8_rows_(float *y, int64_t ldy, const gt_act8 *x, int64_t ldx, int m, const uint8_t *w,
                    int64_t row_bytes, int32_t dtype, int64_t K, int64_t N, int64_t n0, int64_t n1) {
    const int kind = kind_of(dtype);
    const int chain = (kind == K_Q4_0 || kind == K_MXFP4) && N % 8 == 0;
    const int block_bytes = gt_dtype_find_(dtype)->block_bytes;
    const int64_t nb = K / 32;
#if defined(__x86_64__)
    if (gt_simd_level_() >= 1 && __builtin_cpu_supports("f16c")) {
        const int dot = gt_simd_level_() >= 2 ? dot_level() : DOT_MADD;
        const rows8_fn fn = ROWS8[dot][kind];
        for (int r0 = 0; r0 < m; r0 += 4) {
            const int g = m - r0 < 4 ? m - r0 : 4;
            int64_t n = n0;
            if (chain && kind == K_Q4_0)     /* (MXFP4's chain: the same bits, a row at a time below) */
                for (; n + 8 <= n1; n += 8)
                    CHAIN8S[dot](y + r0 * ldy + n, ldy, x + r0 * ldx, ldx, w + n * row_bytes, row_bytes, block_bytes,
                                 nb, g);
            for (; n + 2 <= n1; n += 2)
                fn(y + r0 * ldy + n, ldy, x + r0 * ldx, ldx, w + n * row_bytes, row_bytes, chain, block_bytes, nb, g, 2);
            for (; n < n1; n++)
                fn(y + r0 * ldy + n, ldy, x + r0 * ldx, ldx, w + n * row_bytes, row_bytes, chain, block_bytes, nb, g, 1);
        }
        return;
    }
#endif
    rows_plain(y, ldy, x, ldx, m, w, row_bytes, kind, chain, block_bytes, nb, n0, n1);
}
