/* ggml's hsum_float_8, which its x86 kernels end each output with: the high half onto the
 * low, then pairs, then the last two. q0matmul.c and qkmatmul.c sum their lanes with it, as
 * the kernels they repeat do. Include after immintrin.h, inside the x86 part. */
#ifndef LOOMSERVE_LANE_SUM_H
#define LOOMSERVE_LANE_SUM_H

__attribute__((target("avx"))) static inline float lane_sum(__m256 x) {
    __m128 r = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

#endif
