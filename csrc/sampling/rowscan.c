/* Reading a row of logits once: each block's largest logit, then the tokens whose logits lie
 * in a band, read only from the blocks that reach it.
 *
 * Why: a token sampled from a 262,144-token vocabulary must read the whole row (1 MB), and
 * reading it from memory is the floor of what a draw costs (about 80 us on this project's
 * CPU). numpy reads the row again for each step of finding the tokens near the best (a
 * compare, then a nonzero over the whole row, 150 us between them); here the first pass keeps
 * every block's maximum, and the tokens a draw needs are then gathered from the blocks whose
 * maximum reaches them, which that pass has just left in the cache.
 *
 * AVX-512 or AVX2 where the CPU has them (chosen when called: one build runs on any x86-64);
 * plain C for a row's last, partial block, for what AVX2 has no version of, on a CPU with
 * neither, and where the tests limit the instruction set. rowscan.py loads it with ctypes,
 * which lets go of the GIL for each call; the tests hold every version here to numpy's
 * answers. No Python API: it is a plain shared library, not an importable module.
 */

#include <math.h>
#include <stdint.h>

#define BLOCK 256
/* The most rows ls_block_max_rows reads side by side. */
#define ROWS_AT_ONCE 4

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__)
#define X86 1
#include <immintrin.h>
#endif

/* One block (at most BLOCK tokens) in plain C: its maximum, and whether it holds a NaN. */
static float block_max_plain(const float *x, int64_t len, int *nan) {
    float most = x[0];
    for (int64_t i = 0; i < len; i++) {
        most = x[i] > most ? x[i] : most;
        *nan |= x[i] != x[i];
    }
    return most;
}

/* The tokens of row[0..len) (ids first_id on) in the band low <= x < high: their ids into ids
 * (unless NULL); returns how many. Only those ids are written: rowdraw.c gathers bands one
 * after another into one array, whose room ends with the last of them. */
static int64_t band_plain(const float *row, int64_t len, int32_t first_id, float low, float high,
                          int32_t *ids) {
    int64_t found = 0;
    for (int64_t i = 0; i < len; i++) {
        if (!((row[i] >= low) & (row[i] < high))) continue;
        if (ids) ids[found] = first_id + (int32_t)i;
        found++;
    }
    return found;
}

/* ls_exp_sum_below in plain C (for a CPU without AVX2, and a row's last few tokens): the
 * kernels' float32 differences, each exponential by libm's expf (within an ulp, inside the 2
 * ulps rowdraw.c's bounds allow) and summed in float64, so within those bounds too. */
static double exp_sum_plain(const float *row, int64_t n, float peak, float below, float *out) {
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) {
        float d = row[i] - peak;
        float e = d >= -104.0f ? expf(d) : 0.0f; /* as the kernel: 0 for -inf (and NaN) */
        if (out) out[i] = e;
        if (row[i] < below) sum += e;
    }
    return sum;
}

#ifdef X86
/* The largest of one block's BLOCK logits; nan gets a lane set where a pair of them is
 * unordered (either is a NaN). */
__attribute__((target("avx512f"))) static inline float one_block_max_avx512(const float *x,
                                                                             __mmask16 *nan) {
    /* Four blocks ahead, asked for now: without it the scan ran 10 % slower than numpy's max
     * on rows fresh from a forward pass (a prefetch past the row's end is harmless). */
    for (int line = 0; line < BLOCK; line += 16)
        _mm_prefetch((const char *)(x + 4 * BLOCK + line), _MM_HINT_T0);
    /* Four maxima side by side, so that the loads, not one chain of maxima, set the pace. */
    __m512 m0 = _mm512_loadu_ps(x), m1 = m0, m2 = m0, m3 = m0;
    for (int i = 0; i < BLOCK; i += 64) {
        __m512 v0 = _mm512_loadu_ps(x + i), v1 = _mm512_loadu_ps(x + i + 16);
        __m512 v2 = _mm512_loadu_ps(x + i + 32), v3 = _mm512_loadu_ps(x + i + 48);
        m0 = _mm512_max_ps(m0, v0);
        m1 = _mm512_max_ps(m1, v1);
        m2 = _mm512_max_ps(m2, v2);
        m3 = _mm512_max_ps(m3, v3);
        *nan |= _mm512_cmp_ps_mask(v0, v1, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v2, v3, _CMP_UNORD_Q);
    }
    return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3)));
}

/* ls_block_max_rows with AVX-512. */
__attribute__((target("avx512f"))) static void block_max_rows_avx512(const float *const *rows,
                                                                      int64_t count, int64_t n,
                                                                      float *block_max,
                                                                      int *nan) {
    int64_t n_blocks = (n + BLOCK - 1) / BLOCK, b = 0;
    __mmask16 nans[ROWS_AT_ONCE] = {0};
    for (; (b + 1) * BLOCK <= n; b++)
        for (int64_t r = 0; r < count; r++)
            block_max[r * n_blocks + b] = one_block_max_avx512(rows[r] + b * BLOCK, &nans[r]);
    for (int64_t r = 0; r < count; r++) {
        int plain_nan = 0;
        if (b * BLOCK < n)
            block_max[r * n_blocks + b] =
                block_max_plain(rows[r] + b * BLOCK, n - b * BLOCK, &plain_nan);
        nan[r] = nans[r] != 0 || plain_nan;
    }
}

__attribute__((target("avx512f"))) static int block_max_avx512(const float *row, int64_t n,
                                                                 float *block_max) {
    int nan;
    block_max_rows_avx512(&row, 1, n, block_max, &nan);
    return nan;
}

__attribute__((target("avx2"))) static int block_max_avx2(const float *row, int64_t n,
                                                            float *block_max) {
    __m256 nan = _mm256_setzero_ps();
    int64_t b = 0;
    for (; (b + 1) * BLOCK <= n; b++) {
        const float *x = row + b * BLOCK;
        __m256 most = _mm256_loadu_ps(x);
        for (int i = 0; i < BLOCK; i += 8) {
            __m256 v = _mm256_loadu_ps(x + i);
            most = _mm256_max_ps(most, v);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, most);
        float m = lanes[0];
        for (int i = 1; i < 8; i++) m = lanes[i] > m ? lanes[i] : m;
        block_max[b] = m;
    }
    int plain_nan = 0;
    if (b * BLOCK < n) block_max[b] = block_max_plain(row + b * BLOCK, n - b * BLOCK, &plain_nan);
    return _mm256_movemask_ps(nan) != 0 || plain_nan;
}

/* ls_gather (ls_count where ids is NULL) with AVX-512: 16 tokens compared at a time, the ids
 * of those in the band stored side by side (a compress store). */
__attribute__((target("avx512f"))) static int64_t band_avx512(const float *row, int64_t n,
                                                                const float *block_max,
                                                                float low, float high,
                                                                int32_t *ids) {
    const __m512 lows = _mm512_set1_ps(low), highs = _mm512_set1_ps(high);
    const __m512i step = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    int64_t found = 0;
    for (int64_t lo = 0, b = 0; lo < n; lo += BLOCK, b++) {
        if (!(block_max[b] >= low)) continue;
        int64_t hi = n - lo < BLOCK ? n : lo + BLOCK, i = lo;
        for (; i + 16 <= hi; i += 16) {
            __m512 v = _mm512_loadu_ps(row + i);
            __mmask16 in = _mm512_cmp_ps_mask(v, lows, _CMP_GE_OQ) &
                           _mm512_cmp_ps_mask(v, highs, _CMP_LT_OQ);
            /* Not skipped for an empty mask: the branch mispredicts more than the store
             * costs (a band's 1,000 tokens gathered in 4.6 us, 7.3 with the branch). */
            if (ids) {
                __m512i index = _mm512_add_epi32(_mm512_set1_epi32((int32_t)i), step);
                _mm512_mask_compressstoreu_epi32(ids + found, in, index);
            }
            found += __builtin_popcount(in);
        }
        found += band_plain(row + i, hi - i, (int32_t)i, low, high, ids ? ids + found : NULL);
    }
    return found;
}

/* e^d for 16 float32 d in [-104, 0] (the caller clamps them: e^-104 is under float32's least
 * denormal, and rounds to 0), within 2 ulps (tests/worker/test_row_exp.py holds it to that):
 * Cephes' expf, e^d = 2^k e^r with k = round(d / ln 2) and r = d - k ln 2 in two parts (exact
 * with fused multiply-adds), e^r by its polynomial, here all in Horner's steps (one fewer than
 * Cephes' r + r^2 p(r) + 1, and no less exact: 1.24 ulps at worst against 1.39). */
__attribute__((target("avx512f"))) static inline __m512 exp_of_clamped_avx512(__m512 d) {
    /* d / ln 2 rounded to an integer by adding 1.5 * 2^23 and taking it away again (float32
     * keeps no fraction at that size): two plain operations where a multiply and a
     * roundscale, two micro-ops on one port, took 5 % longer. */
    const __m512 shifter = _mm512_set1_ps(12582912.0f);
    __m512 k = _mm512_sub_ps(_mm512_fmadd_ps(d, _mm512_set1_ps(1.44269504088896341f), shifter),
                             shifter);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), d);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    __m512 y = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, k);
}

/* e^d for 16 float32 differences d = x - peak <= 0: exp_of_clamped_avx512, and 0 for -inf or
 * NaN. */
__attribute__((target("avx512f"))) static inline __m512 exp_of_depth_avx512(__m512 d) {
    const __m512 deepest = _mm512_set1_ps(-104.0f);
    __mmask16 live = _mm512_cmp_ps_mask(d, deepest, _CMP_GE_OQ);
    return _mm512_maskz_mov_ps(live, exp_of_clamped_avx512(_mm512_max_ps(d, deepest)));
}

/* exp_of_clamped_avx512 for 8 floats with AVX2 and FMA: the same steps, and 2^k (k in
 * [-150, 0]) applied as two factors 2^(k/2) and 2^(k - k/2), each a normal float, so that
 * only the last product rounds, as scalef rounds once: the same bits. */
__attribute__((target("avx2,fma"))) static inline __m256 exp_of_clamped_avx2(__m256 d) {
    const __m256 shifter = _mm256_set1_ps(12582912.0f);
    __m256 k = _mm256_sub_ps(_mm256_fmadd_ps(d, _mm256_set1_ps(1.44269504088896341f), shifter),
                             shifter);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), d);
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256 y = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i whole = _mm256_cvtps_epi32(k);
    __m256i half = _mm256_srai_epi32(whole, 1), rest = _mm256_sub_epi32(whole, half);
    const __m256i bias = _mm256_set1_epi32(127);
    __m256 first = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, bias), 23));
    __m256 second = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(rest, bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(y, first), second);
}

/* exp_sum_avx512 with AVX2 and FMA, 32 exponentials at a time summed in float32 as the same
 * tree (two roundings), then in float64; the row's last few tokens in plain C. */
__attribute__((target("avx2,fma"))) static double exp_sum_avx2(const float *row, int64_t n,
                                                                float peak, float below,
                                                                float *out) {
    const __m256 peaks = _mm256_set1_ps(peak), bars = _mm256_set1_ps(below);
    const __m256 deepest = _mm256_set1_ps(-104.0f);
    __m256d low = _mm256_setzero_pd(), high = _mm256_setzero_pd();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256 e[4];
        for (int j = 0; j < 4; j++) {
            __m256 x = _mm256_loadu_ps(row + i + 8 * j), d = _mm256_sub_ps(x, peaks);
            /* 0 for -inf (and NaN): e^-104 rounds to 0 all the same. */
            __m256 live = _mm256_cmp_ps(d, deepest, _CMP_GE_OQ);
            e[j] = _mm256_and_ps(live, exp_of_clamped_avx2(_mm256_max_ps(d, deepest)));
            if (out) _mm256_storeu_ps(out + i + 8 * j, e[j]);
            e[j] = _mm256_and_ps(_mm256_cmp_ps(x, bars, _CMP_LT_OQ), e[j]);
        }
        __m256 sum = _mm256_add_ps(_mm256_add_ps(e[0], e[1]), _mm256_add_ps(e[2], e[3]));
        low = _mm256_add_pd(low, _mm256_cvtps_pd(_mm256_castps256_ps128(sum)));
        high = _mm256_add_pd(high, _mm256_cvtps_pd(_mm256_extractf128_ps(sum, 1)));
    }
    double lanes[4];
    _mm256_storeu_pd(lanes, _mm256_add_pd(low, high));
    double rest = exp_sum_plain(row + i, n - i, peak, below, out ? out + i : NULL);
    return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]) + rest;
}

/* The lanes of 16 floats added to two vectors of 8 doubles. */
__attribute__((target("avx512f"))) static inline void add_as_double(__m512 v, __m512d *low,
                                                                     __m512d *high) {
    *low = _mm512_add_pd(*low, _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
    __m256 upper = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    *high = _mm512_add_pd(*high, _mm512_cvtps_pd(upper));
}

/* The mask of the lanes of 16 tokens from `at` that lie before n. */
static inline __mmask16 lanes_before(int64_t at, int64_t n) {
    int64_t left = n - at;
    return left >= 16 ? (__mmask16)0xffff : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
}

/* ls_exp_sum: 64 exponentials at a time, summed in float32 as a tree (two roundings), then in
 * float64, in vectors: no chain of scalar additions sets the pace. Only the tokens whose logit
 * is under `below` count (+inf: all); out (unless NULL) gets every token's exponential. */
__attribute__((target("avx512f"))) static double exp_sum_avx512(const float *row, int64_t n,
                                                                  float peak, float below,
                                                                  float *out) {
    const __m512 peaks = _mm512_set1_ps(peak), none = _mm512_set1_ps(-INFINITY);
    const __m512 bars = _mm512_set1_ps(below);
    __m512d low = _mm512_setzero_pd(), high = _mm512_setzero_pd();
    for (int64_t i = 0; i < n; i += 64) {
        __m512 e[4];
        for (int j = 0; j < 4; j++) {
            int64_t at = i + 16 * j;
            __mmask16 in = lanes_before(at, n);
            __m512 x = in ? _mm512_mask_loadu_ps(none, in, row + at) : none;
            e[j] = exp_of_depth_avx512(_mm512_sub_ps(x, peaks));
            if (out && in) _mm512_mask_storeu_ps(out + at, in, e[j]);
            e[j] = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, bars, _CMP_LT_OQ), e[j]);
        }
        add_as_double(_mm512_add_ps(_mm512_add_ps(e[0], e[1]), _mm512_add_ps(e[2], e[3])), &low,
                      &high);
    }
    return _mm512_reduce_add_pd(_mm512_add_pd(low, high));
}

/* ls_scan_exp_sum: ls_block_max and ls_exp_sum's total in one pass, for a top-p that will
 * need both. Each block's exponentials are taken against the largest logit so far, and the
 * sum is scaled down (in float64) whenever a block raises it: the terms and their error bounds
 * are those of exp_sum_avx512, and the row is read once, the exponentials' arithmetic hiding
 * the read (about 100 us for both on Gemma's rows, against 90 + 85 apart). Beside the sum, the
 * terms weighted by their depths (as taken, under the largest logit so far), scaled alike:
 * what the float32 differences' rounding can cost this row's sum (DEPTH_ERROR per logit). */
__attribute__((target("avx512f"))) static int scan_exp_sum_avx512(const float *row, int64_t n,
                                                                   float *block_max,
                                                                   double *total,
                                                                   double *weighted_depth) {
    const __m512 none = _mm512_set1_ps(-INFINITY), deepest = _mm512_set1_ps(-104.0f);
    __m512d low = _mm512_setzero_pd(), high = _mm512_setzero_pd();
    __m512d depth_low = _mm512_setzero_pd(), depth_high = _mm512_setzero_pd();
    __mmask16 nan = 0;
    float running = -INFINITY; /* the largest logit so far */
    for (int64_t lo = 0, b = 0; lo < n; lo += BLOCK, b++) {
        for (int line = 0; line < BLOCK; line += 16)
            _mm_prefetch((const char *)(row + lo + 4 * BLOCK + line), _MM_HINT_T0);
        __m512 x[BLOCK / 16];
        __m512 most = none;
        for (int j = 0; j < BLOCK / 16; j++) {
            __mmask16 in = lanes_before(lo + 16 * j, n);
            x[j] = in ? _mm512_mask_loadu_ps(none, in, row + lo + 16 * j) : none;
            most = _mm512_max_ps(most, x[j]);
            nan |= _mm512_cmp_ps_mask(x[j], x[j], _CMP_UNORD_Q);
        }
        float block = block_max[b] = _mm512_reduce_max_ps(most);
        if (block > running) {
            __m512d scale = _mm512_set1_pd(exp((double)running - (double)block));
            low = _mm512_mul_pd(low, scale);
            high = _mm512_mul_pd(high, scale);
            depth_low = _mm512_mul_pd(depth_low, scale);
            depth_high = _mm512_mul_pd(depth_high, scale);
            running = block;
        }
        const __m512 peaks = _mm512_set1_ps(running);
        /* The depths' sum only bounds an error: float32 for the block's 256 terms will do. */
        __m512 depths = _mm512_setzero_ps();
        for (int j = 0; j < BLOCK / 16; j += 4) {
            __m512 sum = _mm512_setzero_ps();
            for (int k = j; k < j + 4; k++) {
                /* Clamped: e^-104 is 0 all the same, and a -inf (or NaN, which the scan
                 * reports) would make e * d a NaN. */
                __m512 d = _mm512_max_ps(_mm512_sub_ps(x[k], peaks), deepest);
                __m512 e = exp_of_clamped_avx512(d);
                sum = _mm512_add_ps(sum, e);
                depths = _mm512_fnmadd_ps(e, d, depths);
            }
            add_as_double(sum, &low, &high);
        }
        add_as_double(depths, &depth_low, &depth_high);
    }
    *total = _mm512_reduce_add_pd(_mm512_add_pd(low, high));
    *weighted_depth = _mm512_reduce_add_pd(_mm512_add_pd(depth_low, depth_high));
    return nan != 0;
}

/* 1/12!, 1/11!, ..., 1/1!, 1/0!: e^r's Taylor series to r^12 in Horner's order, for the
 * float64 exponentials below (AVX-512 and AVX2 alike). */
static const double inverse_factorials[] = {
    1.0 / 479001600, 1.0 / 39916800, 1.0 / 3628800, 1.0 / 362880, 1.0 / 40320,
    1.0 / 5040,      1.0 / 720,      1.0 / 120,     1.0 / 24,     1.0 / 6,
    1.0 / 2,         1.0,            1.0};

/* e^d for 8 float64 d <= 0, within 2 ulps down to e^-708 (tests/worker/test_rowscan.py
 * holds it to that), 0 under e^-745 and for -inf: the float32 kernel's steps in float64, ln 2 in
 * two parts and e^r by its Taylor series to r^12 (|r| <= ln 2 / 2: the first term left out is
 * under 2e-16 of it). */
__attribute__((target("avx512f"))) static inline __m512d exp_of_depth_pd_avx512(__m512d d) {
    __mmask8 live = _mm512_cmp_pd_mask(d, _mm512_set1_pd(-745.2), _CMP_GE_OQ);
    __m512d k = _mm512_roundscale_pd(_mm512_mul_pd(d, _mm512_set1_pd(0x1.71547652b82fep0)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512d r = _mm512_fnmadd_pd(k, _mm512_set1_pd(0x1.62e42fefa39efp-1), d);
    r = _mm512_fnmadd_pd(k, _mm512_set1_pd(0x1.abc9e3b39803fp-56), r);
    __m512d p = _mm512_set1_pd(inverse_factorials[0]);
    for (int i = 1; i < 13; i++) p = _mm512_fmadd_pd(p, r, _mm512_set1_pd(inverse_factorials[i]));
    return _mm512_maskz_mov_pd(live, _mm512_scalef_pd(p, k));
}

/* 8 float64 terms summed in order onto `carry` (its lanes all the sum so far): lane i gets
 * carry + terms[0..i], in three steps of shifted adds rather than a chain of eight. */
__attribute__((target("avx512f"))) static inline __m512d running_sum_pd(__m512d terms,
                                                                       __m512d carry) {
    const __m512i by1 = _mm512_set_epi64(6, 5, 4, 3, 2, 1, 0, 0);
    const __m512i by2 = _mm512_set_epi64(5, 4, 3, 2, 1, 0, 0, 0);
    const __m512i by4 = _mm512_set_epi64(3, 2, 1, 0, 0, 0, 0, 0);
    terms = _mm512_add_pd(terms, _mm512_maskz_permutexvar_pd(0xfe, by1, terms));
    terms = _mm512_add_pd(terms, _mm512_maskz_permutexvar_pd(0xfc, by2, terms));
    terms = _mm512_add_pd(terms, _mm512_maskz_permutexvar_pd(0xf0, by4, terms));
    return _mm512_add_pd(terms, carry);
}

/* ls_cumulative_weights: 16 tokens at a time, their logits gathered by id, each half's
 * exponentials in float64 and summed onto the running total. */
__attribute__((target("avx512f"))) static double cumulative_avx512(const float *row,
                                                                     const int32_t *ids,
                                                                     int64_t n, float peak,
                                                                     double temperature,
                                                                     double start,
                                                                     double *weights) {
    const __m512d peaks = _mm512_set1_pd((double)peak), temperatures = _mm512_set1_pd(temperature);
    const __m512i last = _mm512_set1_epi64(7);
    __m512d carry = _mm512_set1_pd(start);
    for (int64_t i = 0; i < n; i += 16) {
        __mmask16 in = lanes_before(i, n);
        __m512i at = _mm512_maskz_loadu_epi32(in, ids + i);
        __m512 x = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), in, at, row, 4);
        __m512d halves[2] = {
            _mm512_cvtps_pd(_mm512_castps512_ps256(x)),
            _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)))};
        for (int half = 0; half < 2; half++) {
            __mmask8 lanes = (__mmask8)(in >> (8 * half));
            __m512d depth = _mm512_div_pd(_mm512_sub_pd(halves[half], peaks), temperatures);
            __m512d terms = _mm512_maskz_mov_pd(lanes, exp_of_depth_pd_avx512(depth));
            __m512d sums = running_sum_pd(terms, carry);
            _mm512_mask_storeu_pd(weights + i + 8 * half, lanes, sums);
            carry = _mm512_permutexvar_pd(last, sums);
        }
    }
    /* Not the carry: past the last token its lanes add the zeros in another order. */
    return n ? weights[n - 1] : start;
}

/* exp_of_depth_pd_avx512 for 4 doubles with AVX2 and FMA: the same steps, and 2^k applied as
 * two factors 2^(k/2) and 2^(k - k/2), each a normal double, so that only the last product
 * rounds, as scalef rounds once. */
__attribute__((target("avx2,fma"))) static inline __m256d exp_of_depth_pd_avx2(__m256d d) {
    __m256d live = _mm256_cmp_pd(d, _mm256_set1_pd(-745.2), _CMP_GE_OQ);
    d = _mm256_and_pd(live, d); /* -inf and NaN out of the arithmetic: their lanes end 0 */
    __m256d k = _mm256_round_pd(_mm256_mul_pd(d, _mm256_set1_pd(0x1.71547652b82fep0)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256d r = _mm256_fnmadd_pd(k, _mm256_set1_pd(0x1.62e42fefa39efp-1), d);
    r = _mm256_fnmadd_pd(k, _mm256_set1_pd(0x1.abc9e3b39803fp-56), r);
    __m256d p = _mm256_set1_pd(inverse_factorials[0]);
    for (int i = 1; i < 13; i++) p = _mm256_fmadd_pd(p, r, _mm256_set1_pd(inverse_factorials[i]));
    /* k's halves as int64s (|k| < 2^31): a whole double added to 1.5 * 2^52 has the bits of
     * 1.5 * 2^52 plus itself. */
    const __m256d shifter = _mm256_set1_pd(0x1.8p52);
    __m256d k_half = _mm256_round_pd(_mm256_mul_pd(k, _mm256_set1_pd(0.5)),
                                     _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    __m256i half = _mm256_sub_epi64(_mm256_castpd_si256(_mm256_add_pd(k_half, shifter)),
                                    _mm256_castpd_si256(shifter));
    __m256i rest = _mm256_sub_epi64(
        _mm256_castpd_si256(_mm256_add_pd(_mm256_sub_pd(k, k_half), shifter)),
        _mm256_castpd_si256(shifter));
    const __m256i bias = _mm256_set1_epi64x(1023);
    __m256d first = _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_add_epi64(half, bias), 52));
    __m256d second = _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_add_epi64(rest, bias), 52));
    return _mm256_and_pd(live, _mm256_mul_pd(_mm256_mul_pd(p, first), second));
}

/* running_sum_pd for 4 float64 terms: lane i gets carry + terms[0..i], the terms added as
 * the AVX-512 version adds them in its first four lanes. */
__attribute__((target("avx2"))) static inline __m256d running_sum_pd_avx2(__m256d terms,
                                                                         __m256d carry) {
    const __m256d zero = _mm256_setzero_pd();
    terms = _mm256_add_pd(
        terms, _mm256_blend_pd(_mm256_permute4x64_pd(terms, _MM_SHUFFLE(2, 1, 0, 0)), zero, 0x1));
    terms = _mm256_add_pd(
        terms, _mm256_blend_pd(_mm256_permute4x64_pd(terms, _MM_SHUFFLE(1, 0, 0, 0)), zero, 0x3));
    return _mm256_add_pd(terms, carry);
}

/* ls_cumulative_weights with AVX2: 8 tokens at a time, gathered by id, each half's
 * exponentials in float64 and summed onto the running total; the last few in plain C. */
__attribute__((target("avx2,fma"))) static double cumulative_avx2(const float *row,
                                                                  const int32_t *ids, int64_t n,
                                                                  float peak, double temperature,
                                                                  double start, double *weights) {
    const __m256d peaks = _mm256_set1_pd((double)peak), temperatures = _mm256_set1_pd(temperature);
    const __m256i steps = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256d carry = _mm256_set1_pd(start);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        /* 8 ids that follow each other (most of a flat row's head) are loaded, not
         * gathered: AMD's gathers cost more than the exponentials. */
        __m256i at = _mm256_loadu_si256((const __m256i *)(ids + i));
        __m256i run = _mm256_add_epi32(_mm256_set1_epi32(ids[i]), steps);
        __m256 x = _mm256_movemask_epi8(_mm256_cmpeq_epi32(at, run)) == -1
                       ? _mm256_loadu_ps(row + ids[i])
                       : _mm256_i32gather_ps(row, at, 4);
        __m256d halves[2] = {_mm256_cvtps_pd(_mm256_castps256_ps128(x)),
                             _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1))};
        for (int half = 0; half < 2; half++) {
            __m256d depth = _mm256_div_pd(_mm256_sub_pd(halves[half], peaks), temperatures);
            __m256d sums = running_sum_pd_avx2(exp_of_depth_pd_avx2(depth), carry);
            _mm256_storeu_pd(weights + i + 4 * half, sums);
            carry = _mm256_permute4x64_pd(sums, _MM_SHUFFLE(3, 3, 3, 3));
        }
    }
    double sum = i ? weights[i - 1] : start;
    for (; i < n; i++)
        weights[i] = sum += exp(((double)row[ids[i]] - (double)peak) / temperature);
    return sum;
}

/* ls_sum_below: each term converted to float64 before it is added, as numpy's sum does. */
__attribute__((target("avx512f"))) static double sum_below_avx512(const float *values,
                                                                    const float *row, int64_t n,
                                                                    float below) {
    const __m512 bar = _mm512_set1_ps(below);
    __m512d low = _mm512_setzero_pd(), high = _mm512_setzero_pd();
    for (int64_t at = 0; at < n; at += 16) {
        __mmask16 in = lanes_before(at, n);
        __mmask16 under = _mm512_mask_cmp_ps_mask(in, _mm512_maskz_loadu_ps(in, row + at), bar,
                                                  _CMP_LT_OQ);
        add_as_double(_mm512_maskz_loadu_ps(under, values + at), &low, &high);
    }
    return _mm512_reduce_add_pd(_mm512_add_pd(low, high));
}
#endif

/* The widest instructions to use: 2 AVX-512, 1 AVX2, 0 plain C (ls_limit_isa lowers it, so
 * that the tests check every version this CPU can run). */
static int isa_limit = 2;

void ls_limit_isa(int level) {
    isa_limit = level;
}

#ifdef X86
static int cpu_has(int level) {
    if (level > isa_limit) return 0;
    __builtin_cpu_init();
    return level == 2 ? __builtin_cpu_supports("avx512f") : __builtin_cpu_supports("avx2");
}
#endif

/* Whether the AVX2 exponentials can run: AVX2 with FMA (every AVX2 CPU made has both). */
static int has_avx2_fma(void) {
#ifdef X86
    return cpu_has(1) && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

/* The level the functions below run at (within ls_limit_isa's). */
int ls_isa(void) {
#ifdef X86
    if (cpu_has(2)) return 2;
    if (cpu_has(1)) return 1;
#endif
    return 0;
}

/* block_max[b]: the largest logit of tokens [b * BLOCK, (b + 1) * BLOCK), the last block
 * possibly shorter. Returns 1 if the row holds a NaN (the maxima then mean nothing), else 0. */
int ls_block_max(const float *row, int64_t n, float *block_max) {
#ifdef X86
    if (cpu_has(2)) return block_max_avx512(row, n, block_max);
    if (cpu_has(1)) return block_max_avx2(row, n, block_max);
#endif
    int nan = 0;
    for (int64_t lo = 0, b = 0; lo < n; lo += BLOCK, b++)
        block_max[b] = block_max_plain(row + lo, n - lo < BLOCK ? n - lo : BLOCK, &nan);
    return nan;
}

/* ls_block_max of `count` rows (at most ROWS_AT_ONCE; row r's maxima at block_max + r *
 * n_blocks, whether it holds a NaN in nan[r]). With AVX-512 the rows are read side by side, a
 * block of each in turn: a core keeps more reads from memory in flight over several streams
 * than over one (64 argmaxes of rows fresh from a forward pass, two threads: 3.1 ms a row at a
 * time, 2.7 four side by side). */
void ls_block_max_rows(const float *const *rows, int64_t count, int64_t n, float *block_max,
                       int *nan) {
    int64_t n_blocks = (n + BLOCK - 1) / BLOCK;
#ifdef X86
    if (cpu_has(2)) {
        block_max_rows_avx512(rows, count, n, block_max, nan);
        return;
    }
#endif
    for (int64_t r = 0; r < count; r++) nan[r] = ls_block_max(rows[r], n, block_max + r * n_blocks);
}

/* The index of the row's first largest logit, or of its first NaN if it holds one (nan):
 * numpy's argmax, from the blocks' maxima and one block read again. */
static int64_t argmax_from(const float *row, int64_t n, const float *block_max, int nan) {
    if (nan) {
        for (int64_t i = 0; i < n; i++)
            if (row[i] != row[i]) return i;
    }
    int64_t n_blocks = (n + BLOCK - 1) / BLOCK, best = 0;
    for (int64_t b = 1; b < n_blocks; b++)
        if (block_max[b] > block_max[best]) best = b;
    const float peak = block_max[best];
    for (int64_t i = best * BLOCK; i < n; i++)
        if (row[i] == peak) return i;
    return best * BLOCK; /* unreachable: the block's maximum is one of its logits */
}

/* argmax_from, for graphdraw.c, whose threads read the blocks' maxima a slice each. */
int64_t ls_argmax_from(const float *row, int64_t n, const float *block_max, int nan) {
    return argmax_from(row, n, block_max, nan);
}

/* numpy's argmax of a row, with room for its blocks' maxima in block_max. numpy's own took
 * 111-115 us a row of Gemma's fresh from a forward pass, this 90. */
int64_t ls_argmax(const float *row, int64_t n, float *block_max) {
    return argmax_from(row, n, block_max, ls_block_max(row, n, block_max));
}

/* How many floats of block maxima ls_argmax_rows needs for rows of n logits. */
int64_t ls_argmax_scratch_floats(int64_t n) {
    return ROWS_AT_ONCE * ((n + BLOCK - 1) / BLOCK);
}

/* out[r] = ls_argmax of each of `count` rows (at most ROWS_AT_ONCE) of n logits, one after
 * another, their maxima read side by side (ls_block_max_rows). */
void ls_argmax_rows(const float *rows, int64_t count, int64_t n, float *block_max,
                    int64_t *out) {
    int64_t n_blocks = (n + BLOCK - 1) / BLOCK;
    const float *each[ROWS_AT_ONCE] = {0};
    int nan[ROWS_AT_ONCE];
    for (int64_t r = 0; r < count; r++) each[r] = rows + r * n;
    ls_block_max_rows(each, count, n, block_max, nan);
    for (int64_t r = 0; r < count; r++)
        out[r] = argmax_from(each[r], n, block_max + r * n_blocks, nan[r]);
}

/* The row's one-pass scan and sum (ls_scan_exp_sum) runs in parts of SCAN_PART_BLOCKS blocks,
 * each summed against its own largest logit, and the parts are folded together in order
 * (ls_scan_fold): the same sums, to the bit, whether one thread takes every part in turn (the
 * host's draw) or llama.cpp's threads take a share each (graphdraw.c's). 64 blocks: 64 KB of
 * logits, 16 parts of Gemma's rows, enough to share among a CPU's threads evenly. */
#define SCAN_PART_BLOCKS 64

/* How many parts ls_scan_exp_sum_part cuts a row of n logits into. */
int64_t ls_scan_parts(int64_t n) {
    int64_t n_blocks = (n + BLOCK - 1) / BLOCK;
    return (n_blocks + SCAN_PART_BLOCKS - 1) / SCAN_PART_BLOCKS;
}

/* Part `part`'s scan: its blocks' maxima into block_max (the whole row's array), and into
 * sums[0..3) its sum of e^(x - its peak), that sum's weighted depth (ls_scan_exp_sum's) and its
 * peak. Returns 1 if the part holds a NaN, else 0; -1 (nothing done) without AVX-512. */
int ls_scan_exp_sum_part(const float *row, int64_t n, float *block_max, int64_t part,
                         double *sums) {
#ifdef X86
    if (cpu_has(2)) {
        int64_t first = part * SCAN_PART_BLOCKS, lo = first * BLOCK;
        int64_t hi = lo + SCAN_PART_BLOCKS * BLOCK < n ? lo + SCAN_PART_BLOCKS * BLOCK : n;
        int nan = scan_exp_sum_avx512(row + lo, hi - lo, block_max + first, &sums[0], &sums[1]);
        float peak = -INFINITY;
        for (int64_t b = first; b < first + (hi - lo + BLOCK - 1) / BLOCK; b++)
            peak = block_max[b] > peak ? block_max[b] : peak;
        sums[2] = peak;
        return nan;
    }
#endif
    (void)row, (void)n, (void)block_max, (void)part, (void)sums;
    return -1;
}

/* A part's sums, or the fold of parts so far: as ls_scan_exp_sum_part writes them. */
typedef struct {
    double total, weighted_depth, peak;
} ScanSums;

/* One more part folded into the sums so far: both scaled down (in float64) when the part's
 * peak is higher, as the scan itself scales its sum when a block's is; the part counted at
 * its share of the peak (none for a part all -inf, whole for one that sets the peak). */
static void fold_part(ScanSums *into, const ScanSums *part) {
    if (part->peak > into->peak) {
        double scale = exp(into->peak - part->peak);
        into->total *= scale;
        into->weighted_depth *= scale;
        into->peak = part->peak;
    }
    double share = part->peak == into->peak ? 1.0 : exp(part->peak - into->peak);
    into->total += part->total * share;
    into->weighted_depth += part->weighted_depth * share;
}

/* The parts' sums (ls_scan_exp_sum_part's, `count` of them in row order, three doubles each)
 * folded into the row's total and weighted depth, against the row's peak. */
void ls_scan_fold(const double *sums, int64_t count, double *total, double *weighted_depth) {
    ScanSums row = {0.0, 0.0, -INFINITY};
    for (int64_t p = 0; p < count; p++)
        fold_part(&row, &(ScanSums){sums[3 * p], sums[3 * p + 1], sums[3 * p + 2]});
    *total = row.total;
    *weighted_depth = row.weighted_depth;
}

/* ls_block_max, and into total the sum of e^(x - peak) over the row (peak: its largest logit)
 * as ls_exp_sum gives it, in one pass; into weighted_depth the sum of each term times the
 * depth (x - the peak it was taken against, no more than x - peak) its float32 difference was
 * rounded at. -1 (and nothing done) where the CPU lacks AVX-512. Part by part, each folded in
 * as it is scanned: ls_scan_fold's arithmetic. */
int ls_scan_exp_sum(const float *row, int64_t n, float *block_max, double *total,
                    double *weighted_depth) {
    ScanSums sums = {0.0, 0.0, -INFINITY};
    int nan = 0;
    for (int64_t p = 0, count = ls_scan_parts(n); p < count; p++) {
        double part[3];
        int part_nan = ls_scan_exp_sum_part(row, n, block_max, p, part);
        if (part_nan < 0) return -1;
        nan |= part_nan;
        fold_part(&sums, &(ScanSums){part[0], part[1], part[2]});
    }
    *total = sums.total;
    *weighted_depth = sums.weighted_depth;
    return nan;
}

/* The tokens whose logit x has low <= x < high, in order, into ids; returns how many. Only
 * the blocks whose maximum (block_max, from ls_block_max) reaches low are read. */
int64_t ls_gather(const float *row, int64_t n, const float *block_max, float low, float high,
                  int32_t *ids) {
#ifdef X86
    if (cpu_has(2)) return band_avx512(row, n, block_max, low, high, ids);
#endif
    int64_t found = 0;
    for (int64_t lo = 0, b = 0; lo < n; lo += BLOCK, b++) {
        if (!(block_max[b] >= low)) continue;
        int64_t len = n - lo < BLOCK ? n - lo : BLOCK;
        found += band_plain(row + lo, len, (int32_t)lo, low, high, ids ? ids + found : NULL);
    }
    return found;
}

/* How many tokens ls_gather would find, without writing them. */
int64_t ls_count(const float *row, int64_t n, const float *block_max, float low, float high) {
    return ls_gather(row, n, block_max, low, high, NULL);
}

/* out[i] = e^(row[i] - peak) in float32 (peak: the row's largest logit), and their sum in
 * float64. */
double ls_exp_sum(const float *row, int64_t n, float peak, float *out) {
#ifdef X86
    if (cpu_has(2)) return exp_sum_avx512(row, n, peak, INFINITY, out);
    if (has_avx2_fma()) return exp_sum_avx2(row, n, peak, INFINITY, out);
#endif
    return exp_sum_plain(row, n, peak, INFINITY, out);
}

/* The same sum over the tokens whose logit is under `below`, and none stored. */
double ls_exp_sum_below(const float *row, int64_t n, float peak, float below) {
#ifdef X86
    if (cpu_has(2)) return exp_sum_avx512(row, n, peak, below, NULL);
    if (has_avx2_fma()) return exp_sum_avx2(row, n, peak, below, NULL);
#endif
    return exp_sum_plain(row, n, peak, below, NULL);
}

/* The sum, in float64, of values[i] over the tokens whose logit row[i] is under `below`. */
double ls_sum_below(const float *values, const float *row, int64_t n, float below) {
#ifdef X86
    if (cpu_has(2)) return sum_below_avx512(values, row, n, below);
#endif
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++)
        if (row[i] < below) sum += values[i];
    return sum;
}

/* weights[i] = start + the sum of e^((row[ids[j]] - peak) / temperature) over j <= i, in
 * float64 (peak: no less than any of those logits); returns the last (start if n is 0). The
 * weights a draw's candidates are picked by; numpy's cumsum of np.exp to within a few parts in
 * 10^16 (the terms are added in another order). */
double ls_cumulative_weights(const float *row, const int32_t *ids, int64_t n, float peak,
                             double temperature, double start, double *weights) {
#ifdef X86
    if (cpu_has(2)) return cumulative_avx512(row, ids, n, peak, temperature, start, weights);
#endif
    if (has_avx2_fma()) return cumulative_avx2(row, ids, n, peak, temperature, start, weights);
    double sum = start;
    for (int64_t i = 0; i < n; i++)
        weights[i] = sum += exp(((double)row[ids[i]] - (double)peak) / temperature);
    return sum;
}
