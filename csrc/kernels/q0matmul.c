/* The matmuls of Q8_0, Q5_0 and Q4_0 weights, with llama.cpp's arithmetic to the bit and in
 * fewer instructions (q0swap.c swaps them into the graph of a pass that draws).
 *
 * Why: on a CPU these are most of a decode pass for a small model with a large vocabulary.
 * On Gemma 3 270M (Q4_K_M) the tied output matrix, 262,144 x 640 in Q8_0, took 47 % of a pass
 * of 16 sequences, and the Q5_0 matrices (attention's q and k, the feed-forward's gate and up)
 * 21 %. ggml runs them with llamafile's sgemm (two rows and more) or its dot product (one
 * row), both 256 bits wide: a pair of sign instructions, a dot product, a conversion and a
 * fused multiply-add for each block of 32, and a scale product besides.
 *
 * Each output is computed exactly as both of those compute it: for every block, the integer
 * dot product of its 32 weights and 32 quantized activations in eight lanes of four (exact),
 * converted to float, times the product of the two blocks' scales, added to the lane's sum by
 * one fused multiply-add, block after block in order; then the eight lanes summed in ggml's
 * fixed order (hsum_float_8). Here a 512-bit register holds two weight rows' lanes, and the
 * activations go in unsigned (offset by 128, the offset's product subtracted again, exact),
 * so a block pair of one activation row costs five instructions where ggml spends about
 * fourteen. The activations are quantized by ggml's own quantize_row_q8_0, and a Q5_0 or Q4_0
 * block is unpacked to bytes as ggml unpacks it.
 *
 * Measured on this project's Xeon (one thread, Gemma's 262,144 x 640 Q8_0 matrix, random
 * weights): 64 rows 200 ms against ggml's 284, 16 rows 65 against 88, 4 rows 36 against 42,
 * one row 25 against 24 (so a matmul of one row keeps ggml's); the same outputs to the bit in
 * every case. In the tick loop on Gemma: decode 1.15x ggml's at 16 sequences, 1.06x at 4; a
 * prefill of 16 prompts 1.12x.
 *
 * Where the CPU has AVX2 but not AVX-512 VNNI, the kernel is ggml's dot product itself (the
 * same instructions for each output, so the same bits), a weight row at a time against up to
 * eight activation rows, asking for the row's bytes PREFETCH_AHEAD ahead of where it reads:
 * with a 34-byte block and a scale product each, ggml's loop reads too slowly for the
 * hardware's prefetcher to keep ahead of it. Measured on this project's AMD EPYC (Gemma's
 * 262,144 x 640 Q8_0 matrix): one activation row, 2 threads, medians of 40, 6.50 ms against
 * ggml's dot product's 8.14 (the memory's limit about 6); one thread against llamafile's
 * sgemm, 2 rows 17.7 ms against 34.4, 4 rows 30.0 against 44.8, 8 rows 57.1 against 68.7,
 * 12 rows 114 against 100. Q5_0 and Q4_0 cost their unpacking and are slower than sgemm (Q5_0,
 * 4 rows: 15.0 against 13.0); there the kernel serves only the check and tests (ls_q0_sooner
 * says which matmuls q0swap.c swaps).
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
#define CHUNK_BYTES (256 * 1024) /* weight rows a group of activation rows passes over */

#define PREFETCH_AHEAD 2048 /* bytes of a weight row asked for before they are read (AVX2) */
#define ROWS_AVX2 8 /* activation rows whose sums a pass over a weight row keeps (AVX2) */

#define TYPE_Q4_0 2 /* ggml's type numbers */
#define TYPE_Q5_0 6
#define TYPE_Q8_0 8

typedef struct {
    uint16_t d; /* the block's scale, fp16 */
    int8_t qs[QK];
} __attribute__((packed)) BlockQ8;

typedef struct {
    uint16_t d;
    uint8_t qh[4];   /* each weight's fifth bit */
    uint8_t qs[QK / 2]; /* its low four bits: weight j in byte j % 16, high nibble from 16 */
} __attribute__((packed)) BlockQ5;

typedef struct {
    uint16_t d;
    uint8_t qs[QK / 2]; /* 4-bit weights plus 8: weight j in byte j % 16, high nibble from 16 */
} __attribute__((packed)) BlockQ4;

/* Bytes a row of nb blocks of a weight type takes; 0 for a type not served here. */
int64_t ls_q0_row_bytes(int type, int64_t nb) {
    if (type == TYPE_Q4_0) return nb * (int64_t)sizeof(BlockQ4);
    if (type == TYPE_Q8_0) return nb * (int64_t)sizeof(BlockQ8);
    if (type == TYPE_Q5_0) return nb * (int64_t)sizeof(BlockQ5);
    return 0;
}

/* Whether this CPU has AVX-512 VNNI (and F16C): the two-row kernels here and in qkmatmul.c. */
int ls_avx512_vnni(void) {
#ifdef X86
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c");
#else
    return 0;
#endif
}

/* Whether it has AVX2, FMA and F16C: ggml's own dot product with prefetching. */
static int avx2(void) {
#ifdef X86
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
#else
    return 0;
#endif
}

/* Whether ls_q0_matmul runs on this CPU (and so can be checked against ggml's). */
int ls_q0_matmul_supported(void) {
    return ls_avx512_vnni() || avx2();
}

/* Whether a matmul of `type` weights by `m` activation rows is sooner here than in ggml on
 * this CPU, as measured: with AVX-512 VNNI, two rows and more (one is as fast in ggml's); with
 * AVX2 alone, Q8_0 by up to ROWS_AVX2 rows (decodes of up to 8 sequences; from 12 rows
 * llamafile's tiled sgemm is the sooner, and for Q5_0 and Q4_0 at every count). */
int ls_q0_sooner(int type, int64_t m) {
    if (ls_avx512_vnni()) return m >= 2;
    return avx2() && type == TYPE_Q8_0 && m >= 1 && m <= ROWS_AVX2;
}

#ifdef X86
#include "lane_sum.h"

#define TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))

/* The weights' blocks, unpacked as ggml unpacks them; the AVX-512 kernels inline these too. */

/* Block b of a weight row as 32 signed bytes, and its scale. */
TARGET_AVX2 static inline __m256i block_q8(const char *row, int64_t b, float *d) {
    const BlockQ8 *x = (const BlockQ8 *)row + b;
    *d = _cvtsh_ss(x->d);
    return _mm256_loadu_si256((const __m256i *)x->qs);
}

/* 16 bytes of 4-bit weights as ggml unpacks them: the low nibbles, then the high ones. */
TARGET_AVX2 static inline __m256i nibbles(const uint8_t *qs) {
    __m128i q = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_and_si256(
        _mm256_inserti128_si256(_mm256_castsi128_si256(q), _mm_srli_epi16(q, 4), 1),
        _mm256_set1_epi8(15));
}

/* A Q4_0 block as ggml unpacks it: its nibbles, each minus 8. */
TARGET_AVX2 static inline __m256i block_q4(const char *row, int64_t b, float *d) {
    const BlockQ4 *x = (const BlockQ4 *)row + b;
    *d = _cvtsh_ss(x->d);
    return _mm256_sub_epi8(nibbles(x->qs), _mm256_set1_epi8(8));
}

/* A Q5_0 block as ggml's AVX2 dot product unpacks it: each weight's fifth bit spread to a
 * byte (ggml's bytes_from_bits_32), 0xF0 or'ed into the nibble where it is clear. */
TARGET_AVX2 static inline __m256i block_q5_avx2(const char *row, int64_t b, float *d) {
    const BlockQ5 *x = (const BlockQ5 *)row + b;
    *d = _cvtsh_ss(x->d);
    uint32_t high;
    memcpy(&high, x->qh, sizeof high);
    __m256i bits = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)high),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    bits = _mm256_cmpeq_epi8(_mm256_or_si256(bits, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)),
                             _mm256_set1_epi64x(-1));
    return _mm256_or_si256(nibbles(x->qs), _mm256_andnot_si256(bits, _mm256_set1_epi8((char)0xF0)));
}

/* One weight row (nb blocks, `load` unpacking them) against activation rows [first, first +
 * count), count <= ROWS_AVX2: ggml's dot product for each, block after block into eight lanes,
 * the products as its mul_sum_i8_pairs_float makes them (the weights' signs moved onto the
 * activations, pairs summed twice into lanes of four); a block is unpacked once for all the
 * rows, and the weight row's bytes are asked for ahead. */
#define ROW_AVX2(name, load, block_bytes)                                                      \
    TARGET_AVX2 static inline __attribute__((always_inline)) void name##_rows(               \
        const char *row, int64_t nb, const BlockQ8 *acts, int64_t first, const int count,     \
        float *out, int64_t ldo) {                                                           \
        const __m256i ones = _mm256_set1_epi16(1);                                           \
        __m256 sum[ROWS_AVX2];                                                               \
        _Pragma("GCC unroll 8") for (int j = 0; j < count; j++) sum[j] = _mm256_setzero_ps(); \
        for (int64_t b = 0; b < nb; b++) {                                                   \
            _mm_prefetch(row + b * (block_bytes) + PREFETCH_AHEAD, _MM_HINT_T0);             \
            float d;                                                                         \
            __m256i w = load(row, b, &d);                                                    \
            __m256i w_abs = _mm256_sign_epi8(w, w);                                          \
            _Pragma("GCC unroll 8") for (int j = 0; j < count; j++) {                        \
                const BlockQ8 *y = acts + (first + j) * nb + b;                              \
                __m256 scale = _mm256_set1_ps(d * _cvtsh_ss(y->d));                          \
                __m256i a = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)y->qs), w); \
                __m256i pairs = _mm256_maddubs_epi16(w_abs, a);                              \
                __m256 products = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));        \
                sum[j] = _mm256_fmadd_ps(scale, products, sum[j]);                           \
            }                                                                                \
        }                                                                                    \
        _Pragma("GCC unroll 8") for (int j = 0; j < count; j++) out[(first + j) * ldo] =      \
            lane_sum(sum[j]);                                                                \
    }                                                                                        \
    /* The sums stay in registers only where the count is known as the loop is compiled. */  \
    TARGET_AVX2 static void name(const char *row, int64_t nb, const BlockQ8 *acts,           \
                                 int64_t first, int count, float *out, int64_t ldo) {        \
        switch (count) {                                                                     \
        case 1: name##_rows(row, nb, acts, first, 1, out, ldo); break;                       \
        case 2: name##_rows(row, nb, acts, first, 2, out, ldo); break;                       \
        case 3: name##_rows(row, nb, acts, first, 3, out, ldo); break;                       \
        case 4: name##_rows(row, nb, acts, first, 4, out, ldo); break;                       \
        case 5: name##_rows(row, nb, acts, first, 5, out, ldo); break;                       \
        case 6: name##_rows(row, nb, acts, first, 6, out, ldo); break;                       \
        case 7: name##_rows(row, nb, acts, first, 7, out, ldo); break;                       \
        default: name##_rows(row, nb, acts, first, ROWS_AVX2, out, ldo); break;              \
        }                                                                                    \
    }

ROW_AVX2(row_q8_avx2, block_q8, (int64_t)sizeof(BlockQ8))
ROW_AVX2(row_q5_avx2, block_q5_avx2, (int64_t)sizeof(BlockQ5))
ROW_AVX2(row_q4_avx2, block_q4, (int64_t)sizeof(BlockQ4))

/* Weight rows [first_row, end_row) against the m activation rows, ROWS_AVX2 of those at a
 * time: a row's blocks are unpacked once for all of them. */
static void matmul_avx2(const char *weights, int type, int64_t nb, int64_t first_row,
                        int64_t end_row, const BlockQ8 *acts, int64_t m, float *out, int64_t ldo) {
    int64_t row_bytes = ls_q0_row_bytes(type, nb);
    for (int64_t j = 0; j < m; j += ROWS_AVX2) {
        int count = m - j < ROWS_AVX2 ? (int)(m - j) : ROWS_AVX2;
        for (int64_t r = first_row; r < end_row; r++) {
            const char *row = weights + r * row_bytes;
            if (type == TYPE_Q8_0)
                row_q8_avx2(row, nb, acts, j, count, out + r, ldo);
            else if (type == TYPE_Q5_0)
                row_q5_avx2(row, nb, acts, j, count, out + r, ldo);
            else
                row_q4_avx2(row, nb, acts, j, count, out + r, ldo);
        }
    }
}

#define TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,f16c,fma")))

/* The same Q5_0 block in fewer instructions: the fifth bits as a byte mask. */
TARGET static inline __m256i block_q5(const char *row, int64_t b, float *d) {
    const BlockQ5 *x = (const BlockQ5 *)row + b;
    *d = _cvtsh_ss(x->d);
    uint32_t high;
    memcpy(&high, x->qh, sizeof high);
    return _mm256_or_si256(nibbles(x->qs),
                           _mm256_maskz_mov_epi8(~high, _mm256_set1_epi8((char)0xF0)));
}

/* Rows [first, first + count) of the activations against weight rows r0 and r1 (nb blocks
 * each, `load` unpacking them); the activations as unsigned bytes (au) with their scales (ad). */
#define ROW_PAIR(name, load)                                                                   \
    TARGET static void name(const char *r0, const char *r1, int64_t nb, const uint8_t *au,    \
                            const float *ad, int64_t first, int count, float *out0,          \
                            float *out1, int64_t ldo) {                                      \
        const __m512i offset = _mm512_set1_epi8((char)0x80);                                  \
        __m512 sum[ROWS_AT_ONCE];                                                             \
        _Pragma("GCC unroll 16") for (int i = 0; i < ROWS_AT_ONCE; i++) sum[i] =             \
            _mm512_setzero_ps();                                                              \
        for (int64_t b = 0; b < nb; b++) {                                                    \
            float d0, d1;                                                                     \
            __m256i w0 = load(r0, b, &d0), w1 = load(r1, b, &d1);                             \
            __m512i w = _mm512_inserti64x4(_mm512_castsi256_si512(w0), w1, 1);                \
            __m512i w_offset = _mm512_dpbusd_epi32(_mm512_setzero_si512(), offset, w);        \
            __m512 dw = _mm512_insertf32x8(_mm512_set1_ps(d0), _mm256_set1_ps(d1), 1);        \
            if (count == ROWS_AT_ONCE) {                                                      \
                _Pragma("GCC unroll 16") for (int i = 0; i < ROWS_AT_ONCE; i++)               \
                    sum[i] = block_step(w, w_offset, dw, au, ad, (first + i) * nb + b, sum[i]); \
            } else {                                                                          \
                for (int i = 0; i < count; i++)                                               \
                    sum[i] = block_step(w, w_offset, dw, au, ad, (first + i) * nb + b, sum[i]); \
            }                                                                                 \
        }                                                                                     \
        for (int i = 0; i < count; i++) {                                                     \
            out0[(first + i) * ldo] = lane_sum(_mm512_castps512_ps256(sum[i]));              \
            out1[(first + i) * ldo] = lane_sum(_mm512_extractf32x8_ps(sum[i], 1));           \
        }                                                                                     \
    }

/* One activation block (at `at`) against a pair of weight blocks, into their lanes' sums. */
TARGET static inline __m512 block_step(__m512i w, __m512i w_offset, __m512 dw, const uint8_t *au,
                                       const float *ad, int64_t at, __m512 sum) {
    __m512i a = _mm512_broadcast_i64x4(_mm256_load_si256((const __m256i *)(au + at * QK)));
    __m512i dot = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), a, w), w_offset);
    __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(ad[at]));
    return _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(dot), sum);
}

ROW_PAIR(row_pair_q8, block_q8)
ROW_PAIR(row_pair_q5, block_q5)
ROW_PAIR(row_pair_q4, block_q4)

/* A last weight row without a partner: the same arithmetic, 256 bits wide. */
TARGET static void single_row(const char *r0, int type, int64_t nb, const uint8_t *au,
                              const float *ad, int64_t m, float *out, int64_t ldo) {
    for (int64_t j = 0; j < m; j++) {
        __m256 sum = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            float dw;
            __m256i w = type == TYPE_Q8_0   ? block_q8(r0, b, &dw)
                        : type == TYPE_Q5_0 ? block_q5(r0, b, &dw)
                                            : block_q4(r0, b, &dw);
            __m256i a = _mm256_load_si256((const __m256i *)(au + (j * nb + b) * QK));
            __m256i dot = _mm256_sub_epi32(
                _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, w),
                _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8((char)0x80), w));
            __m256 scale = _mm256_set1_ps(dw * ad[j * nb + b]);
            sum = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(dot), sum);
        }
        out[j * ldo] = lane_sum(sum);
    }
}

TARGET static void matmul_avx512(const char *weights, int type, int64_t nb, int64_t first_row,
                                 int64_t end_row, const BlockQ8 *acts, int64_t m, float *out,
                                 int64_t ldo, uint8_t *au, float *ad) {
    for (int64_t i = 0; i < m * nb; i++) {
        __m256i q = _mm256_loadu_si256((const __m256i *)acts[i].qs);
        _mm256_store_si256((__m256i *)(au + i * QK), _mm256_xor_si256(q, _mm256_set1_epi8((char)0x80)));
        ad[i] = _cvtsh_ss(acts[i].d);
    }
    /* Weight rows in chunks that stay in the core's L2 while every group of activation rows
     * passes over them (a prefill's hundreds of rows would otherwise stream through L2 once
     * for each pair of weight rows); a decode's one group reads each chunk once. */
    int64_t row_bytes = ls_q0_row_bytes(type, nb);
    int64_t chunk = (CHUNK_BYTES / row_bytes) & ~(int64_t)1, paired_end = end_row;
    if (chunk < 2) chunk = 2;
    if ((end_row - first_row) % 2) paired_end--;
    for (int64_t start = first_row; start < paired_end; start += chunk) {
        int64_t stop = start + chunk < paired_end ? start + chunk : paired_end;
        for (int64_t j = 0; j < m; j += ROWS_AT_ONCE) {
            int count = m - j < ROWS_AT_ONCE ? (int)(m - j) : ROWS_AT_ONCE;
            for (int64_t r = start; r < stop; r += 2) {
                const char *r0 = weights + r * row_bytes;
                const char *r1 = r0 + row_bytes;
                if (type == TYPE_Q8_0)
                    row_pair_q8(r0, r1, nb, au, ad, j, count, out + r, out + r + 1, ldo);
                else if (type == TYPE_Q5_0)
                    row_pair_q5(r0, r1, nb, au, ad, j, count, out + r, out + r + 1, ldo);
                else
                    row_pair_q4(r0, r1, nb, au, ad, j, count, out + r, out + r + 1, ldo);
            }
        }
    }
    if (paired_end < end_row)
        single_row(weights + paired_end * row_bytes, type, nb, au, ad, m, out + paired_end, ldo);
}
#endif

/* This thread's buffer `slot` (0 to 2), of at least `bytes`, 64-byte aligned; NULL where
 * memory runs out. It grows and is kept: llama.cpp's threads run a matmul after another. */
void *ls_q0_thread_buffer(int slot, size_t bytes) {
    static _Thread_local void *buffers[3];
    static _Thread_local size_t sizes[3];
    if (bytes > sizes[slot]) {
        free(buffers[slot]);
        sizes[slot] = (bytes + 63) / 64 * 64;
        buffers[slot] = aligned_alloc(64, sizes[slot]);
        if (!buffers[slot]) sizes[slot] = 0;
    }
    return buffers[slot];
}

/* out[j * ldo + r] for weight rows r in [first_row, end_row) of a Q8_0, Q5_0 or Q4_0 matrix
 * (`type`, ggml's number; nb blocks a row) and the m activation rows `acts` (Q8_0 blocks as ggml
 * quantized them): ggml's outputs to the bit. Returns 0 (nothing written) for another type,
 * where this CPU lacks AVX2, or where memory runs out. */
int ls_q0_matmul(const void *weights, int type, int64_t nb, int64_t first_row, int64_t end_row,
                 const void *acts, int64_t m, float *out, int64_t ldo) {
#ifdef X86
    if (!ls_q0_matmul_supported() || !ls_q0_row_bytes(type, nb)) return 0;
    if (!ls_avx512_vnni()) {
        matmul_avx2(weights, type, nb, first_row, end_row, acts, m, out, ldo);
        return 1;
    }
    uint8_t *au = ls_q0_thread_buffer(1, (size_t)(m * nb * QK));
    float *ad = ls_q0_thread_buffer(2, (size_t)(m * nb) * sizeof(float));
    if (!au || !ad) return 0;
    matmul_avx512(weights, type, nb, first_row, end_row, acts, m, out, ldo, au, ad);
    return 1;
#else
    (void)weights, (void)type, (void)nb, (void)first_row, (void)end_row, (void)acts, (void)m, (void)out,
        (void)ldo;
    return 0;
#endif
}
