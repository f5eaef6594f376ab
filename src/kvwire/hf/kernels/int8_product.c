/* kvwire's int8 weight-only product for short passes (decode steps): y = scale * (x . q), all in fp32.
 *
 * x: fp32 [M, K] rows; q: int8 [N, K] codes; scale: fp32 [N]; y: fp32 [M, N].
 * Each output y[m, n] is summed in one fixed order -- eight lanes over k = 8i + lane, in sequence,
 * then the lanes as ((0+4) + (2+6)) + ((1+5) + (3+7)), then the K % 8 tail -- whatever M and
 * however the rows and columns are tiled: a row's output is the same bits alone or in any batch.
 * Compiled by kvwire.hf.int8_product with -mavx2 -mfma -ffp-contract=off (every multiply-add is
 * an explicit fused one, so the compiler cannot choose another rounding per tile).
 */
#include <immintrin.h>
#include <stdint.h>

static inline __m256 widen(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static inline float lanes_sum(__m256 a, const float *x_tail, const int8_t *q_tail, long tail) {
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    float s = _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
    for (long k = 0; k < tail; k++)
        s = __builtin_fmaf(x_tail[k], (float)q_tail[k], s);
    return s;
}

/* R rows by C output columns: each column's codes widened once, used by every row. */
#define TILE(R, C)                                                                                     \
    static void tile_##R##_##C(const float *x, long K, const int8_t *q, const float *scale, long N,    \
                               float *y, long m0, long n0) {                                           \
        __m256 acc[R][C];                                                                              \
        const float *xr[R];                                                                            \
        const int8_t *qc[C];                                                                           \
        for (int r = 0; r < R; r++) {                                                                  \
            xr[r] = x + (m0 + r) * K;                                                                  \
            for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();                               \
        }                                                                                              \
        for (int c = 0; c < C; c++) qc[c] = q + (n0 + c) * K;                                          \
        long k8 = K & ~7L;                                                                             \
        for (long k = 0; k < k8; k += 8) {                                                             \
            __m256 w[C];                                                                               \
            for (int c = 0; c < C; c++) w[c] = widen(qc[c] + k);                                       \
            for (int r = 0; r < R; r++) {                                                              \
                __m256 v = _mm256_loadu_ps(xr[r] + k);                                                 \
                for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(v, w[c], acc[r][c]);           \
            }                                                                                          \
        }                                                                                              \
        for (int r = 0; r < R; r++)                                                                    \
            for (int c = 0; c < C; c++)                                                                \
                y[(m0 + r) * N + n0 + c] =                                                             \
                    scale[n0 + c] * lanes_sum(acc[r][c], xr[r] + k8, qc[c] + k8, K - k8);              \
    }

TILE(1, 4) TILE(2, 4) TILE(3, 2) TILE(4, 2)
TILE(1, 1) TILE(2, 1) TILE(3, 1) TILE(4, 1)

#define BLOCK 16 /* output columns a thread takes at a time */

void kvwire_int8_product(const float *x, long M, long K, const int8_t *q, const float *scale, long N,
                         float *y, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long block = 0; block < (N + BLOCK - 1) / BLOCK; block++) {
        long end = (block + 1) * BLOCK < N ? (block + 1) * BLOCK : N;
        for (long m0 = 0; m0 < M; m0 += 4) {
            long rows = M - m0 < 4 ? M - m0 : 4;
            long wide = rows <= 2 ? 4 : 2, n = block * BLOCK;
            for (; n + wide <= end; n += wide) {
                switch (rows) {
                case 1: tile_1_4(x, K, q, scale, N, y, m0, n); break;
                case 2: tile_2_4(x, K, q, scale, N, y, m0, n); break;
                case 3: tile_3_2(x, K, q, scale, N, y, m0, n); break;
                default: tile_4_2(x, K, q, scale, N, y, m0, n); break;
                }
            }
            for (; n < end; n++) {
                switch (rows) {
                case 1: tile_1_1(x, K, q, scale, N, y, m0, n); break;
                case 2: tile_2_1(x, K, q, scale, N, y, m0, n); break;
                case 3: tile_3_1(x, K, q, scale, N, y, m0, n); break;
                default: tile_4_1(x, K, q, scale, N, y, m0, n); break;
                }
            }
        }
    }
}
