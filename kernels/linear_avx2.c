/* The linear kernel's AVX2 road: x packed in pairs, register tiles sized per row count. */

/* The AVX2 road reads x packed in pairs (pack_pairs): per block of 16 columns, the 8 even
 * columns then the 8 odd ones, the K % 16 tail as it is. A weight block of 16 bf16 (one 256-bit
 * load) widens to its even columns with a shift and to its odd ones with a mask, one integer
 * operation per 8 products (the shift-and-zero-extend of 8 columns took two, on the ports the
 * FMAs share). */
#define PAIR_BLOCK 16

/* R rows of packed x (stride K) against C rows of W (stride K) into y (row stride N), plus the
 * bias. Lane j of an output's accumulator adds x[16i + 2j] w[16i + 2j], then x[16i + 2j + 1]
 * w[16i + 2j + 1], in increasing i (fused multiply-adds); the lanes are summed in lanes_sum's
 * order and the K % 16 tail is added last, one fused multiply-add per column. `prefetch`: the
 * next C weight rows, spread over this tile's blocks. */
static inline __attribute__((always_inline)) void tile(const float *x, const uint16_t *w, const float *bias,
                                                       float *y, int64_t N, int64_t K, const int R, const int C,
                                                       const char *prefetch) {
    __m256 acc[6][6];
    const __m256i odd = _mm256_set1_epi32((int)0xffff0000u);
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    const int64_t K16 = K & ~(int64_t)(PAIR_BLOCK - 1);
    for (int64_t k = 0; k < K16; k += PAIR_BLOCK) {
        if (prefetch) /* C * 32 bytes of the next rows per block */
            for (int line = 0; line < (C + 1) / 2; line++) _mm_prefetch(prefetch + 2 * C * k + 64 * line, _MM_HINT_T0);
        __m256 wv[6];
        for (int c = 0; c < C; c++)
            wv[c] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256((const __m256i *)(w + c * K + k)), 16));
        for (int r = 0; r < R; r++) {
            const __m256 xv = _mm256_loadu_ps(x + r * K + k);
            for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
        }
        for (int c = 0; c < C; c++)
            wv[c] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256((const __m256i *)(w + c * K + k)), odd));
        for (int r = 0; r < R; r++) {
            const __m256 xv = _mm256_loadu_ps(x + r * K + k + 8);
            for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            float dot = add_tail(x + r * K, w + c * K, K16, K, lanes_sum(acc[r][c]));
            y[r * N + c] = bias ? dot + bias[c] : dot;
        }
}

/* The weight rows a tile of R x rows takes at once: as many as 16 registers hold beside R * C
 * accumulators, the x row and the mask (1: 6, 2: 4, 3: 3). A GROUP of weight rows is a multiple
 * of each, so every tile of a group sweeps it in whole steps. */
#define GROUP 12
static inline int tile_columns(int R) { return R == 1 ? 6 : R == 2 ? 4 : 3; }

/* R x rows against C <= tile_columns(R) weight rows (C known only at run time: one tile per C). */
#define TILE_CASE(R, C) \
    case C: tile(x, w, bias, y, N, K, R, C, prefetch); break
static inline __attribute__((always_inline)) void rows_tile(const float *x, const uint16_t *w, const float *bias,
                                                            float *y, int64_t N, int64_t K, const int R, int C,
                                                            const char *prefetch) {
    switch (R) {
        case 1: switch (C) { TILE_CASE(1, 6); TILE_CASE(1, 5); TILE_CASE(1, 4); TILE_CASE(1, 3); TILE_CASE(1, 2); default: tile(x, w, bias, y, N, K, 1, 1, prefetch); } break;
        case 2: switch (C) { TILE_CASE(2, 4); TILE_CASE(2, 3); TILE_CASE(2, 2); default: tile(x, w, bias, y, N, K, 2, 1, prefetch); } break;
        default: switch (C) { TILE_CASE(3, 3); TILE_CASE(3, 2); default: tile(x, w, bias, y, N, K, 3, 1, prefetch); } break;
    }
}
#undef TILE_CASE

/* Rows m0..m1 of packed x against G <= GROUP consecutive rows of W. Up to three rows are one
 * tile. More take the group four weight rows at a time, every tile of two rows (and a last one of
 * one) on each chunk while it is in L1, so the pass that streams the weight from memory does all
 * the rows' products. Measured on Zen 3 (one 8,192 x 576 matrix in L3): 71-74 % of the road's
 * peak from 4 to 64 rows, where tiles of six rows by two weight rows (fewer widenings per
 * product, but sixteen registers with a spill) ran at 50-62 % from 9 rows up, and tiles holding
 * three x rows in registers by four weight rows slower still. The tile shape never changes what
 * is computed for an output, only how many are computed together (tests/test_cpu_kernels.py: the
 * same bits at every row count). */
static void block_rows(const float *x, const uint16_t *w, const float *bias, float *y, int64_t m0, int64_t m1,
                       int64_t N, int64_t K, int G) {
    /* While the first tile streams a chunk, it prefetches the same chunk of the next group (a
     * step of a few rows is bound by reading the weight from memory; more lines in flight read
     * it faster). */
    const char *next = (const char *)(w + G * K);
    if (m1 - m0 <= 3) {
        const int R = (int)(m1 - m0), C = tile_columns(R);
        for (int c = 0; c < G; c += C)
            rows_tile(x + m0 * K, w + c * K, bias ? bias + c : 0, y + m0 * N + c, N, K, R, G - c < C ? G - c : C,
                      next + 2 * c * K);
        return;
    }
    for (int c = 0; c < G; c += 4)
        for (int64_t m = m0; m < m1; m += 2)
            rows_tile(x + m * K, w + c * K, bias ? bias + c : 0, y + m * N + c, N, K, m + 1 < m1 ? 2 : 1,
                      G - c < 4 ? G - c : 4, m == m0 ? next + 2 * c * K : 0);
}

/* x rows m0..m1 (fp32, stride K) packed in pairs for the AVX2 tiles, into xp [m1 - m0, K]: per
 * block of 16 columns the 8 even ones then the 8 odd ones, the K % 16 tail as it is. */
static void pack_pairs(const float *x, int64_t m0, int64_t m1, int64_t K, float *xp) {
    const int64_t K16 = K & ~(int64_t)(PAIR_BLOCK - 1);
    for (int64_t m = m0; m < m1; m++) {
        const float *row = x + m * K;
        float *out = xp + (m - m0) * K;
        for (int64_t k = 0; k < K16; k += PAIR_BLOCK) {
            const __m256 a = _mm256_loadu_ps(row + k), b = _mm256_loadu_ps(row + k + 8);
            const __m256 even = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)); /* a0 a2 b0 b2 | a4 a6 b4 b6 */
            const __m256 odd = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1));
            _mm256_storeu_ps(out + k, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(even), 0xd8)));
            _mm256_storeu_ps(out + k + 8, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(odd), 0xd8)));
        }
        memcpy(out + K16, row + K16, sizeof(float) * (K - K16));
    }
}
