/* kvwire's int8 weight-only product for short passes (decode steps): y = scale * (x . q), all in fp32.
 *
 * x: fp32 [M, K] rows; q: int8 [N, K] codes; scale: fp32 [N]; y: fp32 [M, N].
 * Each output y[m, n] is summed in one fixed order -- eight lanes over k = 8i + lane, in sequence,
 * then the lanes as ((0+4) + (2+6)) + ((1+5) + (3+7)), then the K % 8 tail -- whatever M and
 * however the rows and columns are tiled: a row's output is the same bits alone or in any batch.
 * Compiled by kvwire.hf.int8_product with -mavx2 -mfma -ffp-contract=off (every multiply-add is
 * an explicit fused one, so the compiler cannot choose another rounding per tile).
 *
 * Where the CPU has AVX-512 (F and DQ), kvwire_int8_product_avx512 computes the same bits twice as wide: a
 * 16-lane register holds two output columns' eight lanes side by side (column c's low, c + 1's high), the
 * row's eight inputs broadcast to both halves, so every lane sees the same fused multiply-adds in the same
 * order as the AVX2 code's, and each half is summed as lanes_sum sums eight lanes.
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

/* zmm: the 8 codes of column a (lanes 0-7) and of column b (lanes 8-15) at k, widened to fp32 */
__attribute__((target("avx512f,avx512dq")))
static inline __m512 widen_pair(const int8_t *a, const int8_t *b) {
    __m128i both = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)a), _mm_loadl_epi64((const __m128i *)b));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(both));
}

/* R rows by P pairs of output columns (2P columns), AVX-512: each pair's codes widened once, used by every row. */
#define PAIRS(R, P)                                                                                    \
    __attribute__((target("avx512f,avx512dq")))                                                      \
    static void pairs_##R##_##P(const float *x, long K, const int8_t *q, const float *scale, long N,  \
                                float *y, long m0, long n0) {                                        \
        __m512 acc[R][P];                                                                            \
        const float *xr[R];                                                                          \
        const int8_t *qc[2 * P];                                                                     \
        for (int r = 0; r < R; r++) {                                                                \
            xr[r] = x + (m0 + r) * K;                                                                \
            for (int p = 0; p < P; p++) acc[r][p] = _mm512_setzero_ps();                             \
        }                                                                                            \
        for (int c = 0; c < 2 * P; c++) qc[c] = q + (n0 + c) * K;                                    \
        long k8 = K & ~7L;                                                                           \
        for (long k = 0; k < k8; k += 8) {                                                           \
            __m512 w[P];                                                                             \
            for (int p = 0; p < P; p++) w[p] = widen_pair(qc[2 * p] + k, qc[2 * p + 1] + k);         \
            for (int r = 0; r < R; r++) {                                                            \
                __m512 v = _mm512_broadcast_f32x8(_mm256_loadu_ps(xr[r] + k));                       \
                for (int p = 0; p < P; p++) acc[r][p] = _mm512_fmadd_ps(v, w[p], acc[r][p]);         \
            }                                                                                        \
        }                                                                                            \
        for (int r = 0; r < R; r++)                                                                  \
            for (int p = 0; p < P; p++) {                                                            \
                long c = n0 + 2 * p;                                                                 \
                y[(m0 + r) * N + c] = scale[c] * lanes_sum(_mm512_castps512_ps256(acc[r][p]),        \
                                                           xr[r] + k8, qc[2 * p] + k8, K - k8);      \
                y[(m0 + r) * N + c + 1] = scale[c + 1] * lanes_sum(_mm512_extractf32x8_ps(acc[r][p], 1), \
                                                                   xr[r] + k8, qc[2 * p + 1] + k8, K - k8); \
            }                                                                                        \
    }

PAIRS(1, 4) PAIRS(2, 4) PAIRS(3, 3) PAIRS(4, 3)

typedef void (*tile_fn)(const float *, long, const int8_t *, const float *, long, float *, long, long);

/* One code's tiles: wide[r - 1] columns at a time for r rows, in blocks of `block` output columns a thread. */
struct tiles {
    long block;
    long wide[4];
    tile_fn tile[4];
};

static const tile_fn narrow[4] = {tile_1_1, tile_2_1, tile_3_1, tile_4_1}; /* a block's last columns, one at a time */

static void multiply(const struct tiles *t, const float *x, long M, long K, const int8_t *q, const float *scale, long N,
                     float *y, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long block = 0; block < (N + t->block - 1) / t->block; block++) {
        long end = (block + 1) * t->block < N ? (block + 1) * t->block : N;
        for (long m0 = 0; m0 < M; m0 += 4) {
            long rows = M - m0 < 4 ? M - m0 : 4, wide = t->wide[rows - 1], n = block * t->block;
            for (; n + wide <= end; n += wide) t->tile[rows - 1](x, K, q, scale, N, y, m0, n);
            for (; n < end; n++) narrow[rows - 1](x, K, q, scale, N, y, m0, n);
        }
    }
}

/* AVX2: blocks of 16 columns; AVX-512: blocks of 48, whole tiles of 8 and of 6 */
static const struct tiles avx2 = {16, {4, 4, 2, 2}, {tile_1_4, tile_2_4, tile_3_2, tile_4_2}};
static const struct tiles avx512 = {48, {8, 8, 6, 6}, {pairs_1_4, pairs_2_4, pairs_3_3, pairs_4_3}};

/* 1 where this CPU (and its OS) runs AVX-512 F and DQ, else 0 */
int kvwire_int8_has_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
}

void kvwire_int8_product_avx512(const float *x, long M, long K, const int8_t *q, const float *scale, long N,
                                float *y, int threads) {
    multiply(&avx512, x, M, K, q, scale, N, y, threads);
}

void kvwire_int8_product(const float *x, long M, long K, const int8_t *q, const float *scale, long N,
                         float *y, int threads) {
    multiply(&avx2, x, M, K, q, scale, N, y, threads);
}
