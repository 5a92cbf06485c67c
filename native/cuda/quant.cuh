/* quant.cuh: ggml's block formats decoded to f32, one block at a time, on the device and
 * (gtc_dequantize_row_host) on the host, the same code. Layouts as ggml's block_<type>
 * structs, little-endian; every scale is f16 but MXFP4's (E8M0, native/mxfp4.h). */
#ifndef GTC_QUANT_CUH
#define GTC_QUANT_CUH

#include "common.cuh"
#include "../mxfp4.h"

__host__ __device__ inline uint16_t gtc_u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
__host__ __device__ inline uint32_t gtc_u32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* Elements a block of the type holds and its bytes; 0 for a type without a decoder. */
__host__ __device__ inline int gtc_block_elems(int32_t t) {
    switch (t) {
    case GT_F32: case GT_F16: case GT_BF16: return 1;
    case GT_Q4_0: case GT_Q4_1: case GT_Q5_0: case GT_Q5_1: case GT_Q8_0: return 32;
    case GT_Q2_K: case GT_Q3_K: case GT_Q4_K: case GT_Q5_K: case GT_Q6_K: return 256;
    case GT_MXFP4: return GT_MXFP4_BLOCK;
    default: return 0;
    }
}
__host__ __device__ inline int gtc_block_bytes(int32_t t) {
    switch (t) {
    case GT_F32: return 4;
    case GT_F16: case GT_BF16: return 2;
    case GT_Q4_0: return 18;
    case GT_Q4_1: return 20;
    case GT_Q5_0: return 22;
    case GT_Q5_1: return 24;
    case GT_Q8_0: return 34;
    case GT_Q2_K: return 84;
    case GT_Q3_K: return 110;
    case GT_Q4_K: return 144;
    case GT_Q5_K: return 176;
    case GT_Q6_K: return 210;
    case GT_MXFP4: return GT_MXFP4_BLOCK_BYTES;
    default: return 0;
    }
}

/* The 6-bit scale and min j of a Q4_K / Q5_K block's 12 scale bytes. */
__host__ __device__ inline void gtc_scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* y[0..block) = block b of type t decoded. */
__host__ __device__ inline void gtc_decode_block(int32_t t, const uint8_t *b, float *y) {
    switch (t) {
    case GT_F32: {
        union { uint32_t u; float f; } v;
        v.u = gtc_u32(b);
        y[0] = v.f;
        return;
    }
    case GT_F16: y[0] = gtc_f16(gtc_u16(b)); return;
    case GT_BF16: y[0] = gtc_bf16(gtc_u16(b)); return;
    case GT_Q4_0: {
        const float d = gtc_f16(gtc_u16(b));
        const uint8_t *qs = b + 2;
        for (int j = 0; j < 16; j++) {
            y[j] = (float)((qs[j] & 0xF) - 8) * d;
            y[j + 16] = (float)((qs[j] >> 4) - 8) * d;
        }
        return;
    }
    case GT_Q4_1: {
        const float d = gtc_f16(gtc_u16(b)), m = gtc_f16(gtc_u16(b + 2));
        const uint8_t *qs = b + 4;
        for (int j = 0; j < 16; j++) {
            y[j] = (float)(qs[j] & 0xF) * d + m;
            y[j + 16] = (float)(qs[j] >> 4) * d + m;
        }
        return;
    }
    case GT_Q5_0: {
        const float d = gtc_f16(gtc_u16(b));
        const uint32_t qh = gtc_u32(b + 2);
        const uint8_t *qs = b + 6;
        for (int j = 0; j < 16; j++) {
            const int h0 = ((qh >> j) << 4) & 0x10, h1 = (qh >> (j + 12)) & 0x10;
            y[j] = (float)(((qs[j] & 0xF) | h0) - 16) * d;
            y[j + 16] = (float)(((qs[j] >> 4) | h1) - 16) * d;
        }
        return;
    }
    case GT_Q5_1: {
        const float d = gtc_f16(gtc_u16(b)), m = gtc_f16(gtc_u16(b + 2));
        const uint32_t qh = gtc_u32(b + 4);
        const uint8_t *qs = b + 8;
        for (int j = 0; j < 16; j++) {
            const int h0 = ((qh >> j) << 4) & 0x10, h1 = (qh >> (j + 12)) & 0x10;
            y[j] = (float)((qs[j] & 0xF) | h0) * d + m;
            y[j + 16] = (float)((qs[j] >> 4) | h1) * d + m;
        }
        return;
    }
    case GT_Q8_0: {
        const float d = gtc_f16(gtc_u16(b));
        for (int j = 0; j < 32; j++) y[j] = (float)(int8_t)b[2 + j] * d;
        return;
    }
    case GT_Q2_K: {   /* scales[16], qs[64], d, dmin */
        const uint8_t *sc = b, *q = b + 16;
        const float d = gtc_f16(gtc_u16(b + 80)), dmin = gtc_f16(gtc_u16(b + 82));
        int is = 0;
        for (int n = 0; n < 256; n += 128) {
            int shift = 0;
            for (int j = 0; j < 4; j++) {
                uint8_t s = sc[is++];
                float dl = d * (s & 0xF), ml = dmin * (s >> 4);
                for (int l = 0; l < 16; l++) *y++ = dl * (float)((q[l] >> shift) & 3) - ml;
                s = sc[is++];
                dl = d * (s & 0xF);
                ml = dmin * (s >> 4);
                for (int l = 0; l < 16; l++) *y++ = dl * (float)((q[l + 16] >> shift) & 3) - ml;
                shift += 2;
            }
            q += 32;
        }
        return;
    }
    case GT_Q3_K: {   /* hmask[32], qs[64], scales[12], d */
        const uint8_t *hm = b, *q = b + 32, *raw = b + 96;
        const float d = gtc_f16(gtc_u16(b + 108));
        const uint32_t k1 = 0x03030303u, k2 = 0x0f0f0f0fu;
        uint32_t aux[4] = {gtc_u32(raw), gtc_u32(raw + 4), gtc_u32(raw + 8), 0};
        const uint32_t tmp = aux[2];
        aux[2] = ((aux[0] >> 4) & k2) | (((tmp >> 4) & k1) << 4);
        aux[3] = ((aux[1] >> 4) & k2) | (((tmp >> 6) & k1) << 4);
        aux[0] = (aux[0] & k2) | (((tmp >> 0) & k1) << 4);
        aux[1] = (aux[1] & k2) | (((tmp >> 2) & k1) << 4);
        int8_t scales[16];
        for (int i = 0; i < 16; i++) scales[i] = (int8_t)((aux[i / 4] >> (8 * (i % 4))) & 0xFF);
        int is = 0;
        uint8_t m = 1;
        for (int n = 0; n < 256; n += 128) {
            int shift = 0;
            for (int j = 0; j < 4; j++) {
                float dl = d * (float)(scales[is++] - 32);
                for (int l = 0; l < 16; l++)
                    *y++ = dl * (float)((int8_t)((q[l] >> shift) & 3) - ((hm[l] & m) ? 0 : 4));
                dl = d * (float)(scales[is++] - 32);
                for (int l = 0; l < 16; l++)
                    *y++ = dl * (float)((int8_t)((q[l + 16] >> shift) & 3) - ((hm[l + 16] & m) ? 0 : 4));
                shift += 2;
                m <<= 1;
            }
            q += 32;
        }
        return;
    }
    case GT_Q4_K: {   /* d, dmin, scales[12], qs[128] */
        const float d = gtc_f16(gtc_u16(b)), dmin = gtc_f16(gtc_u16(b + 2));
        const uint8_t *sc = b + 4, *q = b + 16;
        int is = 0;
        for (int j = 0; j < 256; j += 64) {
            uint8_t s, mm;
            gtc_scale_min_k4(is, sc, &s, &mm);
            const float d1 = d * s, m1 = dmin * mm;
            gtc_scale_min_k4(is + 1, sc, &s, &mm);
            const float d2 = d * s, m2 = dmin * mm;
            for (int l = 0; l < 32; l++) *y++ = d1 * (float)(q[l] & 0xF) - m1;
            for (int l = 0; l < 32; l++) *y++ = d2 * (float)(q[l] >> 4) - m2;
            q += 32;
            is += 2;
        }
        return;
    }
    case GT_Q5_K: {   /* d, dmin, scales[12], qh[32], qs[128] */
        const float d = gtc_f16(gtc_u16(b)), dmin = gtc_f16(gtc_u16(b + 2));
        const uint8_t *sc = b + 4, *qh = b + 16, *ql = b + 48;
        int is = 0;
        uint8_t u1 = 1, u2 = 2;
        for (int j = 0; j < 256; j += 64) {
            uint8_t s, mm;
            gtc_scale_min_k4(is, sc, &s, &mm);
            const float d1 = d * s, m1 = dmin * mm;
            gtc_scale_min_k4(is + 1, sc, &s, &mm);
            const float d2 = d * s, m2 = dmin * mm;
            for (int l = 0; l < 32; l++) *y++ = d1 * (float)((ql[l] & 0xF) + ((qh[l] & u1) ? 16 : 0)) - m1;
            for (int l = 0; l < 32; l++) *y++ = d2 * (float)((ql[l] >> 4) + ((qh[l] & u2) ? 16 : 0)) - m2;
            ql += 32;
            is += 2;
            u1 <<= 2;
            u2 <<= 2;
        }
        return;
    }
    case GT_Q6_K: {   /* ql[128], qh[64], scales[16] (int8), d */
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = gtc_f16(gtc_u16(b + 208));
        for (int n = 0; n < 256; n += 128) {
            for (int l = 0; l < 32; l++) {
                const int is = l / 16;
                const int8_t q1 = (int8_t)((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                const int8_t q2 = (int8_t)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                const int8_t q3 = (int8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                const int8_t q4 = (int8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                y[l] = d * (float)sc[is + 0] * (float)q1;
                y[l + 32] = d * (float)sc[is + 2] * (float)q2;
                y[l + 64] = d * (float)sc[is + 4] * (float)q3;
                y[l + 96] = d * (float)sc[is + 6] * (float)q4;
            }
            y += 128;
            ql += 64;
            qh += 32;
            sc += 8;
        }
        return;
    }
    case GT_MXFP4: {  /* e (E8M0), qs[16] */
        const float d = gt_e8m0_half(b[0]);
        for (int j = 0; j < GT_MXFP4_BLOCK / 2; j++) {
            y[j] = (float)gt_mxfp4_value(b[1 + j] & 0xF) * d;
            y[j + GT_MXFP4_BLOCK / 2] = (float)gt_mxfp4_value(b[1 + j] >> 4) * d;
        }
        return;
    }
    default: return;
    }
}

#endif
