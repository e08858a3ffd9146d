/* The matmuls of Q4_K, Q5_K and Q6_K weights, with ggml's dot products' arithmetic to the bit
 * and in fewer instructions (q0swap.c swaps them into a pass's graph where the worker keeps
 * ggml's dot product for K-quants: `--cpu-matmul dot`, batch invariance's default).
 *
 * Why: with batch invariance ggml multiplies K-quant weights one activation row and one
 * weight row at a time (ggml_vec_dot_q4_K_q8_K and its kin, 256 bits wide), for every row of
 * a pass, unpacking the weights again for each activation row. On Gemma 3 270M (Q4_K_M) its
 * Q4_K and Q6_K matrices are what is left to ggml of a pass once q0matmul.c runs the Q8_0 and
 * Q5_0 ones.
 *
 * Each output is computed as ggml's dot product computes it, per 256-weight superblock:
 * integer products in eight lanes (four weights a lane times their sub-block's scale; for
 * Q4_K beside them the mins times the activations' block sums in four lanes, for Q5_K the
 * same summed to one integer, for Q6_K the weights' offset of 32 taken off through the block
 * sums), all exact; converted to float, times the superblock's factors (y.d * x.d; -y.d *
 * x.dmin for the mins), fused-multiply-added into the lanes' sums (Q5_K's mins into one float,
 * as ggml's compiled `summs += dmin * ...` fuses them); then the lanes summed in ggml's order
 * (hsum_float_8, and Q4_K's four mins' lanes in theirs). Integers add up the same in any
 * order, so only the floats follow ggml's. Here a 512-bit register holds two weight rows'
 * lanes, a superblock of a weight row pair is unpacked (its quants and scales) once for up to
 * 16 activation rows, and each 32 weights of one activation row cost a multiply-add of bytes
 * and one of words (vpdpwssd). The activations are Q8_K blocks as ggml's quantize_row_q8_K
 * writes them. test_qkmatmul.py holds all three to the ggml that llama-cpp-python built.
 */

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define X86 1
#endif

#define QK_K 256
#define ROWS_AT_ONCE 16          /* activation rows a weight row pair's unpacking serves */
#define CHUNK_BYTES (256 * 1024) /* weight rows a group of activation rows passes over */

typedef struct {
    uint16_t d, dmin;     /* fp16: the scales' and the mins' factors */
    uint8_t scales[12];   /* eight 6-bit scales and eight 6-bit mins, packed */
    uint8_t qs[QK_K / 2]; /* 4-bit weights: sub-blocks 2j and 2j + 1 in bytes 32j.., low and high */
} __attribute__((packed)) BlockQ4K;

typedef struct {
    uint16_t d, dmin;
    uint8_t scales[12];   /* as Q4_K's */
    uint8_t qh[QK_K / 8]; /* each weight's fifth bit: sub-block k's in bit k of 32 bytes */
    uint8_t qs[QK_K / 2]; /* the low four bits, as Q4_K's */
} __attribute__((packed)) BlockQ5K;

typedef struct {
    uint8_t ql[QK_K / 2];    /* 6-bit weights: low four bits (two a byte) */
    uint8_t qh[QK_K / 4];    /* their high two bits (four a byte) */
    int8_t scales[QK_K / 16]; /* each 16 weights' scale */
    uint16_t d;              /* fp16 */
} __attribute__((packed)) BlockQ6K;

typedef struct {
    float d;
    int8_t qs[QK_K];
    int16_t bsums[QK_K / 16]; /* sums of each 16 qs */
} __attribute__((packed)) BlockQ8K;

int ls_avx512_vnni(void); /* q0matmul.c's */

/* Whether ls_qk_matmul runs on this CPU: it needs AVX-512 VNNI. */
int ls_qk_matmul_supported(void) {
    return ls_avx512_vnni();
}

#define TYPE_Q4_K 12 /* ggml's type numbers */
#define TYPE_Q5_K 13
#define TYPE_Q6_K 14

/* Bytes a row of nb superblocks of a weight type takes; 0 for a type not served here. */
int64_t ls_qk_row_bytes(int type, int64_t nb) {
    if (type == TYPE_Q4_K) return nb * (int64_t)sizeof(BlockQ4K);
    if (type == TYPE_Q5_K) return nb * (int64_t)sizeof(BlockQ5K);
    if (type == TYPE_Q6_K) return nb * (int64_t)sizeof(BlockQ6K);
    return 0;
}

int64_t ls_q8k_block_bytes(void) {
    return (int64_t)sizeof(BlockQ8K);
}

#ifdef X86
#define TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,f16c,fma")))

#include "lane_sum.h"

/* The mins' four lanes summed as ggml sums them: lanes 0 + 2 and 1 + 3, then those two. */
TARGET static inline float min_lane_sum(__m128 x) {
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

/* A superblock's eight scales (low eight bytes) and eight mins (high eight), unpacked from
 * their 12 bytes as ggml unpacks them. */
static inline void scales_and_mins(const uint8_t *packed, uint32_t utmp[4]) {
    const uint32_t kmask1 = 0x3f3f3f3f, kmask2 = 0x0f0f0f0f, kmask3 = 0x03030303;
    memcpy(utmp, packed, 12);
    utmp[3] = ((utmp[2] >> 4) & kmask2) | (((utmp[1] >> 6) & kmask3) << 4);
    const uint32_t uaux = utmp[1] & kmask1;
    utmp[1] = (utmp[2] & kmask2) | (((utmp[0] >> 6) & kmask3) << 4);
    utmp[2] = uaux;
    utmp[0] &= kmask1;
}

/* One superblock of a weight row pair, unpacked for every activation row to use: the
 * weights as bytes for each 32 (row 0's, then row 1's), each 16 weights' scale as words
 * spread over the lanes of their bytes, the superblock's factors. */
typedef struct {
    __m512i q[8];     /* weights 32 c to 32 c + 31 of each row */
    __m512i scale[8]; /* their scales, words */
    __m512i scales;   /* Q6_K: row 0's 16 scales as words, then row 1's */
    __m256i mins;     /* Q4_K: row 0's eight mins as words, then row 1's */
    __m512 d;         /* x.d: row 0's in lanes 0-7, row 1's in 8-15 */
    __m256 dmin;      /* Q4_K: x.dmin, row 0's in lanes 0-3, row 1's in 4-7 */
} Unpacked;

TARGET static inline __m512i pair_of(const uint8_t *a, const uint8_t *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}

/* Two rows' fp16 factors: row 0's in lanes 0-7, row 1's in 8-15. */
TARGET static inline __m512 factors(uint16_t d0, uint16_t d1) {
    return _mm512_insertf32x8(_mm512_set1_ps(_cvtsh_ss(d0)), _mm256_set1_ps(_cvtsh_ss(d1)), 1);
}

/* Word i of `words` in each of row 0's 16 lanes, word j in row 1's. */
TARGET static inline __m512i spread(__m512i words, int i, int j) {
    return _mm512_permutexvar_epi16(
        _mm512_inserti64x4(_mm512_set1_epi16((short)i), _mm256_set1_epi16((short)j), 1), words);
}

/* A Q4_K or Q5_K superblock pair's scales, mins and factors (the blocks start alike). */
TARGET static inline void unpack_scales_q4k(const BlockQ4K *x0, const BlockQ4K *x1, Unpacked *u) {
    uint32_t t0[4], t1[4];
    scales_and_mins(x0->scales, t0);
    scales_and_mins(x1->scales, t1);
    /* Each 32 weights share a scale: words 0-7 are row 0's scales, 8-15 row 1's. */
    __m512i scales = _mm512_castsi256_si512(
        _mm256_cvtepu8_epi16(_mm_set_epi32((int)t1[1], (int)t1[0], (int)t0[1], (int)t0[0])));
    for (int c = 0; c < 8; c++) u->scale[c] = spread(scales, c, 8 + c);
    u->mins = _mm256_cvtepu8_epi16(_mm_set_epi32((int)t1[3], (int)t1[2], (int)t0[3], (int)t0[2]));
    u->d = factors(x0->d, x1->d);
    u->dmin = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(_cvtsh_ss(x0->dmin))),
                                   _mm_set1_ps(_cvtsh_ss(x1->dmin)), 1);
}

TARGET static inline void unpack_q4k(const void *w0, const void *w1, Unpacked *u) {
    const BlockQ4K *x0 = w0, *x1 = w1;
    const __m512i m4 = _mm512_set1_epi8(0xF);
    for (int j = 0; j < 4; j++) {
        __m512i bits = pair_of(x0->qs + 32 * j, x1->qs + 32 * j);
        u->q[2 * j] = _mm512_and_si512(bits, m4);
        u->q[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(bits, 4), m4);
    }
    unpack_scales_q4k(x0, x1, u);
}

/* As ggml's dot product unpacks a Q6_K superblock: in each half of 128 weights, the low and
 * high nibbles of two runs of 32 bytes, each with its pair of high bits. */
TARGET static inline void unpack_q6k(const void *w0, const void *w1, Unpacked *u) {
    const BlockQ6K *x0 = w0, *x1 = w1;
    const __m512i m3 = _mm512_set1_epi8(3), m15 = _mm512_set1_epi8(15);
    for (int j = 0; j < 2; j++) {
        __m512i low1 = pair_of(x0->ql + 64 * j, x1->ql + 64 * j);
        __m512i low2 = pair_of(x0->ql + 64 * j + 32, x1->ql + 64 * j + 32);
        __m512i high = pair_of(x0->qh + 32 * j, x1->qh + 32 * j);
        __m512i h0 = _mm512_slli_epi16(_mm512_and_si512(high, m3), 4);
        __m512i h1 = _mm512_slli_epi16(_mm512_and_si512(high, _mm512_set1_epi8(12)), 2);
        __m512i h2 = _mm512_and_si512(high, _mm512_set1_epi8(48));
        __m512i h3 = _mm512_srli_epi16(_mm512_and_si512(high, _mm512_set1_epi8(-64)), 2);
        u->q[4 * j] = _mm512_or_si512(_mm512_and_si512(low1, m15), h0);
        u->q[4 * j + 1] = _mm512_or_si512(_mm512_and_si512(low2, m15), h1);
        u->q[4 * j + 2] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(low1, 4), m15), h2);
        u->q[4 * j + 3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(low2, 4), m15), h3);
    }
    /* Each 16 weights have a scale: words 0-15 are row 0's, 16-31 row 1's; 32 weights' lanes
     * take their first 16's scale in lanes 0-3 and their second's in 4-7. */
    u->scales = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)x0->scales))),
        _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)x1->scales)), 1);
    for (int c = 0; c < 8; c++) {
        short first = (short)(2 * c);
        __m256i i0 = _mm256_set_m128i(_mm_set1_epi16(first + 1), _mm_set1_epi16(first));
        __m256i i1 = _mm256_set_m128i(_mm_set1_epi16(first + 17), _mm_set1_epi16(first + 16));
        u->scale[c] = _mm512_permutexvar_epi16(
            _mm512_inserti64x4(_mm512_castsi256_si512(i0), i1, 1), u->scales);
    }
    u->d = factors(x0->d, x1->d);
}

/* The eight lanes' integer sums of an activation superblock against an unpacked pair: each
 * 32 weights' bytes times the activations', in pairs of words times their scales. */
TARGET static inline __m512i products(const Unpacked *u, const BlockQ8K *y) {
    __m512i sumi = _mm512_setzero_si512();
    for (int c = 0; c < 8; c++) {
        __m512i q8 = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(y->qs + 32 * c)));
        sumi = _mm512_dpwssd_epi32(sumi, u->scale[c], _mm512_maddubs_epi16(u->q[c], q8));
    }
    return sumi;
}

TARGET static inline void step_q4k(const Unpacked *u, const BlockQ8K *y, __m512 *acc,
                                   __m256 *acc_m) {
    /* The mins: each 32 activations' sum (two block sums) times its sub-block's min. */
    __m256i bsums = _mm256_loadu_si256((const __m256i *)y->bsums);
    __m128i q8s = _mm_hadd_epi16(_mm256_castsi256_si128(bsums), _mm256_extracti128_si256(bsums, 1));
    __m256i prod = _mm256_madd_epi16(u->mins, _mm256_broadcastsi128_si256(q8s));
    __m256 dmin = _mm256_mul_ps(_mm256_set1_ps(-y->d), u->dmin);
    *acc_m = _mm256_fmadd_ps(dmin, _mm256_cvtepi32_ps(prod), *acc_m);
    __m512 d = _mm512_mul_ps(_mm512_set1_ps(y->d), u->d);
    *acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(products(u, y)), *acc);
}

/* A Q5_K superblock as ggml's dot product unpacks it: Q4_K's nibbles, each with its fifth
 * bit (sub-block k's is bit k of the 32 high-bit bytes); scales and mins as Q4_K's. */
TARGET static inline void unpack_q5k(const void *w0, const void *w1, Unpacked *u) {
    const BlockQ5K *x0 = w0, *x1 = w1;
    unpack_scales_q4k(w0, w1, u);
    const __m512i m4 = _mm512_set1_epi8(0xF), one = _mm512_set1_epi8(1);
    __m512i high = pair_of(x0->qh, x1->qh);
    for (int j = 0; j < 4; j++) {
        __m512i bits = pair_of(x0->qs + 32 * j, x1->qs + 32 * j);
        __m512i h0 = _mm512_and_si512(_mm512_srli_epi16(high, 2 * j), one);
        __m512i h1 = _mm512_and_si512(_mm512_srli_epi16(high, 2 * j + 1), one);
        h0 = _mm512_slli_epi16(h0, 4);
        h1 = _mm512_slli_epi16(h1, 4);
        u->q[2 * j] = _mm512_or_si512(_mm512_and_si512(bits, m4), h0);
        u->q[2 * j + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(bits, 4), m4), h1);
    }
}

/* As Q4_K's, but ggml sums a row's four mins' products as one integer a superblock, times
 * -y.d * x.dmin, into one float: lane 0 of acc_m for row 0, lane 4 for row 1. */
TARGET static inline void step_q5k(const Unpacked *u, const BlockQ8K *y, __m512 *acc,
                                   __m256 *acc_m) {
    __m256i bsums = _mm256_loadu_si256((const __m256i *)y->bsums);
    __m128i q8s = _mm_hadd_epi16(_mm256_castsi256_si128(bsums), _mm256_extracti128_si256(bsums, 1));
    __m256i prod = _mm256_madd_epi16(u->mins, _mm256_broadcastsi128_si256(q8s));
    prod = _mm256_hadd_epi32(prod, prod);
    prod = _mm256_hadd_epi32(prod, prod);
    __m256 dmin = _mm256_mul_ps(_mm256_set1_ps(-y->d), u->dmin);
    *acc_m = _mm256_fmadd_ps(dmin, _mm256_cvtepi32_ps(prod), *acc_m);
    __m512 d = _mm512_mul_ps(_mm512_set1_ps(y->d), u->d);
    *acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(products(u, y)), *acc);
}

TARGET static inline void step_q6k(const Unpacked *u, const BlockQ8K *y, __m512 *acc,
                                   __m256 *acc_m) {
    (void)acc_m;
    /* The weights' offset of 32: 32 times each 16 activations' sum times its scale, taken
     * off two such terms a lane. */
    __m256i bsums = _mm256_loadu_si256((const __m256i *)y->bsums);
    __m512i offset = _mm512_slli_epi32(
        _mm512_madd_epi16(_mm512_broadcast_i64x4(bsums), u->scales), 5);
    __m512 d = _mm512_mul_ps(_mm512_set1_ps(y->d), u->d);
    *acc = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(products(u, y), offset)), *acc);
}

/* How ggml ends an output: the eight lanes' sum, plus the mins' four lanes summed in
 * their order (Q4_K), or their one float (Q5_K), or nothing more (Q6_K). */
enum { NO_MINS, MIN_LANES, MIN_SUM };

TARGET static inline float finish(__m256 acc, __m128 acc_m, int mins) {
    if (mins == MIN_LANES) return lane_sum(acc) + min_lane_sum(acc_m);
    if (mins == MIN_SUM) return lane_sum(acc) + _mm_cvtss_f32(acc_m);
    return lane_sum(acc);
}

/* Activation rows [first, first + count) against weight rows w0 and w1 (nb superblocks of
 * `block` bytes each); out1 NULL where w1 only stands in for a missing partner. */
#define ROW_PAIR(name, unpack, step, mins)                                                  \
    TARGET static void name(const char *w0, const char *w1, int64_t nb, int64_t block,        \
                            const BlockQ8K *acts, int64_t first, int count, float *out0,       \
                            float *out1, int64_t ldo) {                                        \
        __m512 acc[ROWS_AT_ONCE];                                                              \
        __m256 acc_m[ROWS_AT_ONCE];                                                            \
        for (int i = 0; i < count; i++) {                                                      \
            acc[i] = _mm512_setzero_ps();                                                      \
            acc_m[i] = _mm256_setzero_ps();                                                    \
        }                                                                                      \
        Unpacked u;                                                                            \
        for (int64_t b = 0; b < nb; b++) {                                                     \
            unpack(w0 + b * block, w1 + b * block, &u);                                        \
            for (int i = 0; i < count; i++)                                                    \
                step(&u, acts + (first + i) * nb + b, &acc[i], &acc_m[i]);                     \
        }                                                                                      \
        for (int i = 0; i < count; i++) {                                                      \
            out0[(first + i) * ldo] = finish(_mm512_castps512_ps256(acc[i]),                   \
                                             _mm256_castps256_ps128(acc_m[i]), mins);          \
            if (out1)                                                                          \
                out1[(first + i) * ldo] = finish(_mm512_extractf32x8_ps(acc[i], 1),            \
                                                 _mm256_extractf128_ps(acc_m[i], 1), mins);    \
        }                                                                                      \
    }

ROW_PAIR(row_pair_q4k, unpack_q4k, step_q4k, MIN_LANES)
ROW_PAIR(row_pair_q5k, unpack_q5k, step_q5k, MIN_SUM)
ROW_PAIR(row_pair_q6k, unpack_q6k, step_q6k, NO_MINS)

TARGET static void matmul_avx512(const char *weights, int type, int64_t nb, int64_t first_row,
                                 int64_t end_row, const BlockQ8K *acts, int64_t m, float *out,
                                 int64_t ldo) {
    /* Weight rows in chunks that stay in L2 while every group of activation rows passes over
     * them, as in q0matmul.c. */
    int64_t row_bytes = ls_qk_row_bytes(type, nb), block = row_bytes / nb;
    int64_t chunk = (CHUNK_BYTES / row_bytes) & ~(int64_t)1;
    if (chunk < 2) chunk = 2;
    for (int64_t start = first_row; start < end_row; start += chunk) {
        int64_t stop = start + chunk < end_row ? start + chunk : end_row;
        for (int64_t j = 0; j < m; j += ROWS_AT_ONCE) {
            int count = m - j < ROWS_AT_ONCE ? (int)(m - j) : ROWS_AT_ONCE;
            for (int64_t r = start; r < stop; r += 2) {
                const char *w0 = weights + r * row_bytes;
                int paired = r + 1 < stop;
                const char *w1 = paired ? w0 + row_bytes : w0;
                float *out1 = paired ? out + r + 1 : NULL;
                if (type == TYPE_Q4_K)
                    row_pair_q4k(w0, w1, nb, block, acts, j, count, out + r, out1, ldo);
                else if (type == TYPE_Q5_K)
                    row_pair_q5k(w0, w1, nb, block, acts, j, count, out + r, out1, ldo);
                else
                    row_pair_q6k(w0, w1, nb, block, acts, j, count, out + r, out1, ldo);
            }
        }
    }
}
#endif

/* out[j * ldo + r] for weight rows r in [first_row, end_row) of a Q4_K, Q5_K or Q6_K matrix
 * (`type`, ggml's number; nb superblocks a row) and the m activation rows `acts` (Q8_K blocks
 * as ggml quantized them): ggml's ggml_vec_dot_q4_K_q8_K, _q5_K_ or _q6_K_ to the bit.
 * Returns 0 (nothing written) for another type or where this CPU lacks AVX-512 VNNI. */
int ls_qk_matmul(const void *weights, int type, int64_t nb, int64_t first_row, int64_t end_row,
                 const void *acts, int64_t m, float *out, int64_t ldo) {
#ifdef X86
    if (!ls_qk_matmul_supported() || !ls_qk_row_bytes(type, nb)) return 0;
    matmul_avx512(weights, type, nb, first_row, end_row, acts, m, out, ldo);
    return 1;
#else
    (void)weights, (void)type, (void)nb, (void)first_row, (void)end_row, (void)acts, (void)m,
        (void)out, (void)ldo;
    return 0;
#endif
}
