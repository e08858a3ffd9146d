/* The output layer's matmul for Q8_0 weights, with llama.cpp's arithmetic to the bit and in
 * fewer instructions (graphdraw.c swaps it into the graph of a pass that draws).
 *
 * Why: on a CPU the output layer is most of a decode pass for a small model with a large
 * vocabulary: Gemma 3 270M's tied embedding, 262,144 x 640 in Q8_0, took 47 % of a pass of
 * 16 sequences. ggml runs it with llamafile's sgemm (two rows and more) or its dot product
 * (one row), both 256 bits wide: a pair of sign instructions, a dot product, a conversion and a
 * fused multiply-add for each block of 32, and a scale product besides.
 *
 * Each logit is computed exactly as both of those compute it: for every block, the integer
 * dot product of its 32 weights and 32 quantized activations in eight lanes of four (exact),
 * converted to float, times the product of the two blocks' scales, added to the lane's sum by
 * one fused multiply-add, block after block in order; then the eight lanes summed in ggml's
 * fixed order (hsum_float_8). Here a 512-bit register holds two weight rows' lanes, and the
 * activations go in unsigned (offset by 128, the offset's product subtracted again, exact),
 * so a block pair of one activation row costs five instructions where ggml spends about
 * fourteen. The activations are quantized by ggml's own quantize_row_q8_0.
 *
 * Measured on this project's Xeon (one thread, the whole 262,144 x 640 matrix, random
 * weights): 64 rows 200 ms against ggml's 284, 16 rows 65 against 88, 4 rows 36 against 42,
 * one row 25 against 24 (so a pass of one output keeps ggml's); the same logits to the bit in
 * every case. In the tick loop on Gemma: 8 % more tokens a second at 16 sequences, 4-5 % at 4.
 */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define X86 1
#endif

#define QK 32
#define ROWS_AT_ONCE 16 /* activation rows a pass over a weight row pair keeps in registers */

typedef struct {
    uint16_t d; /* the block's scale, fp16 */
    int8_t qs[QK];
} __attribute__((packed)) BlockQ8;

int ls_q8_matmul_supported(void) {
#ifdef X86
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c");
#else
    return 0;
#endif
}

#ifdef X86
#define TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,f16c,fma")))

/* ggml's hsum_float_8: the high half onto the low, then pairs, then the last two. */
TARGET static inline float lane_sum(__m256 x) {
    __m128 r = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

/* Rows [first, first + count) of the activations against weight rows r and r + 1; the
 * activations as unsigned bytes (au) with their scales (ad), nb blocks a row. */
TARGET static inline void row_pair(const BlockQ8 *r0, const BlockQ8 *r1, int64_t nb,
                                   const uint8_t *au, const float *ad, int64_t first,
                                   int count, float *out0, float *out1, int64_t ldo) {
    const __m512i offset = _mm512_set1_epi8((char)0x80);
    __m512 sum[ROWS_AT_ONCE];
#pragma GCC unroll 16
    for (int i = 0; i < ROWS_AT_ONCE; i++) sum[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i w = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)r0[b].qs)),
            _mm256_loadu_si256((const __m256i *)r1[b].qs), 1);
        __m512i w_offset = _mm512_dpbusd_epi32(_mm512_setzero_si512(), offset, w);
        __m512 dw = _mm512_insertf32x8(_mm512_set1_ps(_cvtsh_ss(r0[b].d)),
                                       _mm256_set1_ps(_cvtsh_ss(r1[b].d)), 1);
        if (count == ROWS_AT_ONCE) {
#pragma GCC unroll 16
            for (int i = 0; i < ROWS_AT_ONCE; i++) {
                int64_t at = (first + i) * nb + b;
                __m512i a = _mm512_broadcast_i64x4(_mm256_load_si256((const __m256i *)(au + at * QK)));
                __m512i dot = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), a, w),
                                               w_offset);
                __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(ad[at]));
                sum[i] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(dot), sum[i]);
            }
        } else {
            for (int i = 0; i < count; i++) {
                int64_t at = (first + i) * nb + b;
                __m512i a = _mm512_broadcast_i64x4(_mm256_load_si256((const __m256i *)(au + at * QK)));
                __m512i dot = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), a, w),
                                               w_offset);
                __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(ad[at]));
                sum[i] = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(dot), sum[i]);
            }
        }
    }
    for (int i = 0; i < count; i++) {
        out0[(first + i) * ldo] = lane_sum(_mm512_castps512_ps256(sum[i]));
        out1[(first + i) * ldo] = lane_sum(_mm512_extractf32x8_ps(sum[i], 1));
    }
}

/* A last weight row without a partner: the same arithmetic, 256 bits wide. */
TARGET static void single_row(const BlockQ8 *r0, int64_t nb, const uint8_t *au, const float *ad,
                              int64_t m, float *out, int64_t ldo) {
    for (int64_t j = 0; j < m; j++) {
        __m256 sum = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            __m256i w = _mm256_loadu_si256((const __m256i *)r0[b].qs);
            __m256i a = _mm256_load_si256((const __m256i *)(au + (j * nb + b) * QK));
            __m256i dot = _mm256_sub_epi32(
                _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, w),
                _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8((char)0x80), w));
            __m256 scale = _mm256_set1_ps(_cvtsh_ss(r0[b].d) * ad[j * nb + b]);
            sum = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(dot), sum);
        }
        out[j * ldo] = lane_sum(sum);
    }
}

TARGET static void matmul_avx512(const BlockQ8 *weights, int64_t nb, int64_t first_row,
                                 int64_t end_row, const BlockQ8 *acts, int64_t m, float *out,
                                 int64_t ldo, uint8_t *au, float *ad) {
    for (int64_t i = 0; i < m * nb; i++) {
        __m256i q = _mm256_loadu_si256((const __m256i *)acts[i].qs);
        _mm256_store_si256((__m256i *)(au + i * QK), _mm256_xor_si256(q, _mm256_set1_epi8((char)0x80)));
        ad[i] = _cvtsh_ss(acts[i].d);
    }
    int64_t r = first_row;
    for (; r + 1 < end_row; r += 2) {
        const BlockQ8 *r0 = weights + r * nb;
        for (int64_t j = 0; j < m; j += ROWS_AT_ONCE) {
            int count = m - j < ROWS_AT_ONCE ? (int)(m - j) : ROWS_AT_ONCE;
            row_pair(r0, r0 + nb, nb, au, ad, j, count, out + r, out + r + 1, ldo);
        }
    }
    if (r < end_row) single_row(weights + r * nb, nb, au, ad, m, out + r, ldo);
}
#endif

/* out[j * ldo + r] for weight rows r in [first_row, end_row) (nb blocks a row) and the m
 * activation rows `acts` (Q8_0 blocks as ggml quantized them): llama.cpp's logits to the bit.
 * Returns 0 (nothing written) where this CPU lacks AVX-512 VNNI or memory runs out. */
int ls_q8_matmul(const void *weights, int64_t nb, int64_t first_row, int64_t end_row,
                 const void *acts, int64_t m, float *out, int64_t ldo) {
#ifdef X86
    if (!ls_q8_matmul_supported()) return 0;
    uint8_t *au = aligned_alloc(64, ((size_t)(m * nb * QK) + 63) / 64 * 64);
    float *ad = malloc((size_t)(m * nb) * sizeof(float));
    int done = au && ad;
    if (done)
        matmul_avx512(weights, nb, first_row, end_row, acts, m, out, ldo, au, ad);
    free(au);
    free(ad);
    return done;
#else
    (void)weights, (void)nb, (void)first_row, (void)end_row, (void)acts, (void)m, (void)out,
        (void)ldo;
    return 0;
#endif
}
