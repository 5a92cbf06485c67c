/* qdot8k.c: the 8-bit-activation products (qdot8.c) of the K-quant weights Q4_K, Q5_K and Q6_K,
 * with the activations in super-blocks of 256 (gt_act8k: llama.cpp's Q8_K). Integer products
 * exact; the float order, per row, as llama.cpp's AVX2 build computes it, which depends on
 * whether it repacks W (Q4_K with rows a multiple of 8, on AVX2) and on M, the rows of x:
 *   Q4_K repacked: the first M - M % 4 rows take its GEMM (ggml_gemm_q4_K_8x8_q8_K): per pair
 *     of sub-blocks c (64 elements), I_c = scale_2c * dot_2c + scale_2c+1 * dot_2c+1 and Im_c =
 *     min_2c * bsum_2c + min_2c+1 * bsum_2c+1, acc = fma((float)I_c, f16(w.d) * x.d, acc),
 *     accm = fma((float)Im_c, f16(w.dmin) * x.d, accm); the last M % 4 its GEMV, the same with
 *     I and Im over the whole super-block (8 sub-blocks); y = acc - accm.
 *   Not repacked (Q5_K; Q4_K with other row counts; Q6_K), 8 or more rows: its tiled K-quant
 *     GEMM (ggml-cpu/tiled): per super-block the exact integers I (and Im), r = (float)I *
 *     f16(w.d) (Q4_K, Q5_K: r = fma(-f16(w.dmin), (float)Im, r)), then acc = fma(r, x.d, acc)
 *     (its AVX2 kernel, which llama-cpp-python's build runs here; its AVX512-VNNI one, where
 *     built, rounds r * x.d before the sum); y = acc.
 *   Not repacked, fewer rows: its vec_dot, eight int32 lanes a super-block,
 *     Q4_K, Q5_K (ggml_vec_dot_q4_K_q8_K, _q5_K_): lane l = sum over sub-blocks s of scale_s *
 *       (sum of q * q8 at elements 32 s + 4 l .. + 3), acc[l] = fma(x.d * f16(w.d), (float)lane
 *       l, acc[l]); the mins with dmin = -(x.d * f16(w.dmin)): Q5_K one scalar, summs =
 *       fma((float)Im, dmin, summs); Q4_K four lanes, accm[t] = fma(dmin, (float)(min_2t *
 *       bsum_2t + min_2t+1 * bsum_2t+1), accm[t]); y = hsum8(acc) + summs, or + ((accm0 +
 *       accm2) + (accm1 + accm3));
 *     Q6_K (ggml_vec_dot_q6_K_q8_K): lane l = sum over j < 2, v < 4, k < 4 of scale[e / 16] *
 *       q6[e] * q8[e] at e = 128 j + 32 v + 4 l + k (q6 unsigned, 0..63) - 32 * (bsums[2l] *
 *       scale[2l] + bsums[2l+1] * scale[2l+1]), acc[l] = fma(x.d * f16(w.d), (float)lane l,
 *       acc[l]); y = hsum8(acc),
 *   hsum8 being ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)) (gt_hsum8_).
 * (bsum_s: the activations' sum over sub-block s, bsums[2s] + bsums[2s+1].) The plain C path
 * and the AVX2 one give the same bits.
 */
#include <math.h>
#include <string.h>

#include "act8.h"

/* ---- activations ------------------------------------------------------------------------ */

static void quantize_superblock(gt_act8k *y, const float *x) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < 256; j++) {
        const float a = fabsf(x[j]);
        if (a > amax) {
            amax = a;
            max = x[j];
        }
    }
    if (amax == 0.0f) {
        memset(y, 0, sizeof *y);
        return;
    }
    const float iscale = -127.0f / max;
    for (int j = 0; j < 256; j++) {
        const int v = (int)nearbyintf(iscale * x[j]);    /* nearest even, as ggml's nearest_int */
        y->q[j] = (int8_t)(v < 127 ? v : 127);
    }
    for (int g = 0; g < 16; g++) {
        int s = 0;
        for (int j = 0; j < 16; j++) s += y->q[16 * g + j];
        y->bsums[g] = (int16_t)s;
    }
    y->d = 1.0f / iscale;
}

void gt_act8k_quantize_(gt_act8k *y, const float *x, int64_t K) {
    for (int64_t b = 0; b < K / 256; b++) quantize_superblock(y + b, x + 256 * b);
}

/* ---- plain C ------------------------------------------------------------------------------ */

/* Q4_K (144 B: d, dmin, scales[12], qs[128]) and Q5_K (176 B: d, dmin, scales[12], qh[32],
 * qs[128]) super-blocks: element e's unsigned value (Q4_K 0..15, Q5_K 0..31); e = 64 j + 32 h + l
 * takes the low (h = 0) or high nibble of qs[32 j + l], and Q5_K bit 2 j + h of qh[l] as its 16 */
static inline int q45k_at(const uint8_t *b, int five, int e) {
    const int j = e / 64, h = e % 64 / 32, l = e % 32;
    const uint8_t q = b[(five ? 48 : 16) + 32 * j + l];
    const int v = h ? q >> 4 : q & 15;
    return five ? v | ((b[16 + l] >> (2 * j + h)) & 1) << 4 : v;
}

/* I and Im over sub-blocks s0..s1-1 */
static void q45k_ints(const uint8_t *b, int five, const gt_act8k *x, int s0, int s1, int32_t *I, int32_t *Im) {
    int32_t i_sum = 0, m_sum = 0;
    for (int s = s0; s < s1; s++) {
        int sc, mn;
        gt_k4_scale_min_(b + 4, s, &sc, &mn);
        int32_t dot = 0;
        for (int l = 0; l < 32; l++) dot += q45k_at(b, five, 32 * s + l) * x->q[32 * s + l];
        i_sum += sc * dot;
        m_sum += mn * (x->bsums[2 * s] + x->bsums[2 * s + 1]);
    }
    *I = i_sum;
    *Im = m_sum;
}

/* vec_dot's eight lanes: lane l = sum over s of scale_s * (q * q8 over elements 32 s + 4 l .. + 3);
 * mins[t] = min_2t * bsum_2t + min_2t+1 * bsum_2t+1 */
static void q45k_lanes(const uint8_t *b, int five, const gt_act8k *x, int32_t lane[8], int32_t mins[4]) {
    for (int l = 0; l < 8; l++) lane[l] = 0;
    for (int t = 0; t < 4; t++) mins[t] = 0;
    for (int s = 0; s < 8; s++) {
        int sc, mn;
        gt_k4_scale_min_(b + 4, s, &sc, &mn);
        for (int l = 0; l < 8; l++) {
            int32_t dot = 0;
            for (int k = 0; k < 4; k++) dot += q45k_at(b, five, 32 * s + 4 * l + k) * x->q[32 * s + 4 * l + k];
            lane[l] += sc * dot;
        }
        mins[s / 2] += mn * (x->bsums[2 * s] + x->bsums[2 * s + 1]);
    }
}

/* Q6_K super-block (210 B: ql[128], qh[64], scales[16], d): element e's unsigned 6-bit value */
static inline int q6k_at(const uint8_t *b, int e) {
    const int h = e / 128, r = e % 128, l = r % 32, part = r / 32;
    const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
    const int lo = part == 0 ? ql[l] & 15 : part == 1 ? ql[l + 32] & 15 : part == 2 ? ql[l] >> 4 : ql[l + 32] >> 4;
    return lo | ((qh[l] >> (2 * part)) & 3) << 4;
}

static void q6k_lanes(const uint8_t *b, const gt_act8k *x, int32_t lane[8]) {
    const int8_t *sc = (const int8_t *)(b + 192);
    for (int l = 0; l < 8; l++) {
        int32_t s = 0;
        for (int j = 0; j < 2; j++)
            for (int v = 0; v < 4; v++)
                for (int k = 0; k < 4; k++) {
                    const int e = 128 * j + 32 * v + 4 * l + k;
                    s += sc[e / 16] * q6k_at(b, e) * x->q[e];
                }
        lane[l] = s - 32 * (x->bsums[2 * l] * sc[2 * l] + x->bsums[2 * l + 1] * sc[2 * l + 1]);
    }
}

/* Which of llama.cpp's float orders (above) row `row` of an M-row product with W of N rows takes */
enum { ORDER_ONE, ORDER_PAIRS, ORDER_TILED, ORDER_VECDOT };

static int row_order(int32_t dtype, int64_t N, int64_t M, int64_t row) {
    if (dtype == GT_Q4_K && N % 8 == 0) return row < M - M % 4 ? ORDER_PAIRS : ORDER_ONE;   /* repacked */
    if (M >= 8) return ORDER_TILED;
    return dtype == GT_Q6_K ? ORDER_ONE : ORDER_VECDOT;
}

/* vec_dot's mins term: Q5_K's scalar summs, Q4_K's four lanes' ((m0 + m2) + (m1 + m3)) */
static inline float mins_term(int five, float summs, const float accm[4]) {
    return five ? summs : (accm[0] + accm[2]) + (accm[1] + accm[3]);
}

static void rows_plain(float *y, int64_t ldy, const gt_act8k *x, int64_t ldx, int m, int64_t M, int64_t m0,
                       const uint8_t *w, int64_t row_bytes, int32_t dtype, int64_t N, int64_t nb, int64_t n0,
                       int64_t n1) {
    const int64_t bb = gt_dtype_find_(dtype)->block_bytes;
    const int five = dtype == GT_Q5_K;
    for (int64_t n = n0; n < n1; n++)
        for (int r = 0; r < m; r++) {
            const gt_act8k *xr = x + r * ldx;
            const int order = row_order(dtype, N, M, m0 + r);
            float acc[8] = {0}, accm[4] = {0}, a = 0.0f, am = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *wb = w + n * row_bytes + b * bb;
                if (order == ORDER_TILED) {
                    int32_t I = 0, Im = 0;
                    float rr;
                    if (dtype != GT_Q6_K) {
                        q45k_ints(wb, five, xr + b, 0, 8, &I, &Im);
                        rr = fmaf(-gt_half_at_(wb + 2), (float)Im, (float)I * gt_half_at_(wb));
                    } else {
                        int32_t lane[8];
                        q6k_lanes(wb, xr + b, lane);
                        for (int l = 0; l < 8; l++) I += lane[l];
                        rr = (float)I * gt_half_at_(wb + 208);
                    }
                    a = fmaf(rr, xr[b].d, a);
                } else if (order == ORDER_VECDOT) {
                    int32_t lane[8], mins[4];
                    q45k_lanes(wb, five, xr + b, lane, mins);
                    const float d = xr[b].d * gt_half_at_(wb), dmin = -(xr[b].d * gt_half_at_(wb + 2));
                    for (int l = 0; l < 8; l++) acc[l] = fmaf(d, (float)lane[l], acc[l]);
                    if (five) am = fmaf((float)(mins[0] + mins[1] + mins[2] + mins[3]), dmin, am);
                    else
                        for (int t = 0; t < 4; t++) accm[t] = fmaf(dmin, (float)mins[t], accm[t]);
                } else if (dtype == GT_Q4_K) {
                    const int step = order == ORDER_PAIRS ? 2 : 8;   /* GEMM: a pair of sub-blocks; GEMV: all 8 */
                    for (int s0 = 0; s0 < 8; s0 += step) {
                        int32_t I, Im;
                        q45k_ints(wb, 0, xr + b, s0, s0 + step, &I, &Im);
                        a = fmaf((float)I, gt_half_at_(wb) * xr[b].d, a);
                        am = fmaf((float)Im, gt_half_at_(wb + 2) * xr[b].d, am);
                    }
                } else {
                    int32_t lane[8];
                    q6k_lanes(wb, xr + b, lane);
                    const float d = xr[b].d * gt_half_at_(wb + 208);
                    for (int l = 0; l < 8; l++) acc[l] = fmaf(d, (float)lane[l], acc[l]);
                }
            }
            y[r * ldy + n] = order == ORDER_TILED                     ? a
                             : order == ORDER_VECDOT                  ? gt_hsum8_(acc) + mins_term(five, am, accm)
                             : dtype == GT_Q4_K                       ? a - am
                                                                      : gt_hsum8_(acc);
        }
}

/* ---- AVX2 --------------------------------------------------------------------------------- */

#if defined(__x86_64__)
#define TK "avx2,fma,f16c"

/* Q4_K and Q5_K: the integer sums by maddubs (pairs of q * q8, at most 2 * 31 * 127) and madd
 * with the sub-block's scale, one int32 vector (llama.cpp's vec_dot lanes) a super-block */
__attribute__((target(TK))) static void rows_q45k(float *y, int64_t ldy, const gt_act8k *x, int64_t ldx, int m,
                                                  int64_t M, int64_t m0, const uint8_t *w, int64_t row_bytes,
                                                  int64_t N, int64_t nb, int64_t n0, int64_t n1, int five) {
    const __m256i m4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
    const int64_t bb = five ? 176 : 144;
    for (int64_t n = n0; n < n1; n++)
        for (int r = 0; r < m; r++) {
            const gt_act8k *xr = x + r * ldx;
            float a = 0.0f, am = 0.0f, accm[4] = {0};
            __m256 acc8 = _mm256_setzero_ps();
            const int order = row_order(five ? GT_Q5_K : GT_Q4_K, N, M, m0 + r);
            const int per_pair = order == ORDER_PAIRS;  /* GEMM order: fma each pair of sub-blocks */
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *wb = w + n * row_bytes + b * bb;
                for (int o = 0; o < bb; o += 64)
                    _mm_prefetch((const char *)(wb + GT_QDOT_PREFETCH_ROWS * row_bytes + o), _MM_HINT_T0);
                const float dx = gt_half_at_f16c_(wb) * xr[b].d, mx = gt_half_at_f16c_(wb + 2) * xr[b].d;
                const __m256i qh = five ? _mm256_loadu_si256((const __m256i *)(wb + 16)) : _mm256_setzero_si256();
                __m256i iacc = _mm256_setzero_si256();
                int32_t Im = 0, mins[4];
                for (int c = 0; c < 4; c++) {
                    int sc0, mn0, sc1, mn1;
                    gt_k4_scale_min_(wb + 4, 2 * c, &sc0, &mn0);
                    gt_k4_scale_min_(wb + 4, 2 * c + 1, &sc1, &mn1);
                    const __m256i q = _mm256_loadu_si256((const __m256i *)(wb + (five ? 48 : 16) + 32 * c));
                    __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                    if (five) {     /* the 16s: bits 2c and 2c + 1 of qh's bytes */
                        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), one), 4));
                        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), one), 4));
                    }
                    const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xr[b].q + 64 * c));
                    const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xr[b].q + 64 * c + 32));
                    iacc = _mm256_add_epi32(iacc, _mm256_madd_epi16(_mm256_maddubs_epi16(lo, x0),
                                                                    _mm256_set1_epi16((short)sc0)));
                    iacc = _mm256_add_epi32(iacc, _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x1),
                                                                    _mm256_set1_epi16((short)sc1)));
                    mins[c] = mn0 * (xr[b].bsums[4 * c] + xr[b].bsums[4 * c + 1]) +
                              mn1 * (xr[b].bsums[4 * c + 2] + xr[b].bsums[4 * c + 3]);
                    Im += mins[c];
                    if (per_pair) {
                        a = fmaf((float)gt_hsum_i32_(iacc), dx, a);
                        am = fmaf((float)Im, mx, am);
                        iacc = _mm256_setzero_si256();
                        Im = 0;
                    }
                }
                if (order == ORDER_TILED) {
                    const float rr = fmaf(-gt_half_at_f16c_(wb + 2), (float)Im,
                                          (float)gt_hsum_i32_(iacc) * gt_half_at_f16c_(wb));
                    a = fmaf(rr, xr[b].d, a);
                } else if (order == ORDER_VECDOT) {
                    const float d = xr[b].d * gt_half_at_f16c_(wb), dmin = -(xr[b].d * gt_half_at_f16c_(wb + 2));
                    acc8 = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(iacc), acc8);
                    if (five) am = fmaf((float)Im, dmin, am);
                    else
                        for (int t = 0; t < 4; t++) accm[t] = fmaf(dmin, (float)mins[t], accm[t]);
                } else if (!per_pair) {
                    a = fmaf((float)gt_hsum_i32_(iacc), dx, a);
                    am = fmaf((float)Im, mx, am);
                }
            }
            y[r * ldy + n] = order == ORDER_TILED    ? a
                             : order == ORDER_VECDOT ? gt_hsum8_256_(acc8) + mins_term(five, am, accm)
                                                     : a - am;
        }
}

/* Q6_K: each 32-byte vector of q6 values (two sub-blocks of 16) by maddubs (at most 2 * 63 * 127)
 * and madd with its two scales; the 32-times-bsums term by madd of the bsums and the scales */
__attribute__((target(TK))) static void rows_q6k(float *y, int64_t ldy, const gt_act8k *x, int64_t ldx, int m,
                                                 int64_t M, const uint8_t *w, int64_t row_bytes, int64_t nb,
                                                 int64_t n0, int64_t n1) {
    const __m256i m15 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3);
    const int tiled = M >= 8;
    for (int64_t n = n0; n < n1; n++)
        for (int r = 0; r < m; r++) {
            const gt_act8k *xr = x + r * ldx;
            __m256 acc = _mm256_setzero_ps();
            float a = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *wb = w + n * row_bytes + b * 210;
                for (int o = 0; o < 256; o += 64)
                    _mm_prefetch((const char *)(wb + GT_QDOT_PREFETCH_ROWS * row_bytes + o), _MM_HINT_T0);
                const int8_t *sc = (const int8_t *)(wb + 192);
                __m256i sumi = _mm256_setzero_si256();
                for (int j = 0; j < 2; j++) {
                    const __m256i l0 = _mm256_loadu_si256((const __m256i *)(wb + 64 * j));
                    const __m256i l1 = _mm256_loadu_si256((const __m256i *)(wb + 64 * j + 32));
                    const __m256i h = _mm256_loadu_si256((const __m256i *)(wb + 128 + 32 * j));
                    __m256i q[4];
                    q[0] = _mm256_or_si256(_mm256_and_si256(l0, m15), _mm256_slli_epi16(_mm256_and_si256(h, m3), 4));
                    q[1] = _mm256_or_si256(_mm256_and_si256(l1, m15),
                                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), m3), 4));
                    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m15),
                                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), m3), 4));
                    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m15),
                                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), m3), 4));
                    for (int v = 0; v < 4; v++) {
                        const int s = 8 * j + 2 * v;      /* the sub-blocks of bytes 0..15 and 16..31 */
                        const __m256i scales = _mm256_set_m128i(_mm_set1_epi16(sc[s + 1]), _mm_set1_epi16(sc[s]));
                        const __m256i xv = _mm256_loadu_si256((const __m256i *)(xr[b].q + 128 * j + 32 * v));
                        sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_maddubs_epi16(q[v], xv), scales));
                    }
                }
                const __m256i bs = _mm256_loadu_si256((const __m256i *)xr[b].bsums);
                const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
                sumi = _mm256_sub_epi32(sumi, _mm256_slli_epi32(_mm256_madd_epi16(bs, sc16), 5));
                if (tiled) {
                    a = fmaf((float)gt_hsum_i32_(sumi) * gt_half_at_f16c_(wb + 208), xr[b].d, a);
                    continue;
                }
                const float d = xr[b].d * gt_half_at_f16c_(wb + 208);
                acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
            }
            y[r * ldy + n] = tiled ? a : gt_hsum8_256_(acc);
        }
}
#endif /* __x86_64__ */

void gt_qdot8k_rows_(float *y, int64_t ldy, const gt_act8k *x, int64_t ldx, int m, int64_t M, int64_t m0,
                     const uint8_t *w, int64_t row_bytes, int32_t dtype, int64_t K, int64_t N, int64_t n0, int64_t n1) {
    const int64_t nb = K / 256;
#if defined(__x86_64__)
    if (gt_simd_level_() >= 1 && __builtin_cpu_supports("f16c")) {
        if (dtype == GT_Q6_K) rows_q6k(y, ldy, x, ldx, m, M, w, row_bytes, nb, n0, n1);
        else rows_q45k(y, ldy, x, ldx, m, M, m0, w, row_bytes, N, nb, n0, n1, dtype == GT_Q5_K);
        return;
    }
#endif
    rows_plain(y, ldy, x, ldx, m, M, m0, w, row_bytes, dtype, N, nb, n0, n1);
}
