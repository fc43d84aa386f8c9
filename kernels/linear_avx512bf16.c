/* The AVX512-BF16 road (Cooper Lake, Sapphire Rapids and later Xeons, Zen 4 and later): x stays
 * bf16 and vdpbf16ps multiplies 32 bf16 pairs per instruction into 16 fp32 lanes, with no
 * widening. Its own fixed sequence per output: lane j accumulates the pairs k = 32i + 2j, 2j + 1
 * in increasing i (the instruction's order within a pair), the K % 32 tail as one masked step
 * with zeros past K, then the 16 lanes folded in one fixed tree (sums4: four outputs at once). A given CPU gives each row the
 * same bits alone or among others, as on the AVX2 road; the two roads differ from each other in
 * the last bits, so a process keeps one (treespec_set_isa, called once at load). */

/* The 16-lane sums of four accumulators a, b, c, d at once, into out[0..3]. Each sum is one fixed
 * tree whatever the other three hold (zeros for a tile's missing columns): within each 128-bit
 * quarter (l0 + l2) + (l1 + l3), then the quarters (q0 + q2) + (q1 + q3). */
BF16_TARGET static inline void sums4(__m512 a, __m512 b, __m512 c, __m512 d, float *out) {
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b)); /* a02 b02 a13 b13 */
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    const __m512 lo = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd)));
    const __m512 hi = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd)));
    const __m512 quarters = _mm512_add_ps(lo, hi); /* per quarter: a b c d */
    const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(quarters),
                                      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(quarters), 1)));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1)));
}

BF16_TARGET static inline __attribute__((always_inline)) void tile_bf16(const uint16_t *x, const uint16_t *w,
                                                                        const float *bias, float *y, int64_t N,
                                                                        int64_t K, const int R, const int C,
                                                                        const char *prefetch) {
    __m512 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps();
    const int64_t K32 = K & ~(int64_t)31;
    for (int64_t k = 0; k < K32; k += 32) {
        if (prefetch) /* four lines of the next weight rows per 32 columns (see block_rows) */
            for (int line = 0; line < 4; line++) _mm_prefetch(prefetch + k * 8 + line * 64, _MM_HINT_T0);
        __m512i wv[4];
        for (int c = 0; c < C; c++) wv[c] = _mm512_loadu_si512((const void *)(w + c * K + k));
        for (int r = 0; r < R; r++) {
            const __m512i xv = _mm512_loadu_si512((const void *)(x + r * K + k));
            for (int c = 0; c < C; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)xv, (__m512bh)wv[c]);
        }
    }
    if (K32 < K) {
        const __mmask32 tail = (__mmask32)((1ull << (K - K32)) - 1);
        __m512i wv[4];
        for (int c = 0; c < C; c++) wv[c] = _mm512_maskz_loadu_epi16(tail, w + c * K + K32);
        for (int r = 0; r < R; r++) {
            const __m512i xv = _mm512_maskz_loadu_epi16(tail, x + r * K + K32);
            for (int c = 0; c < C; c++) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)xv, (__m512bh)wv[c]);
        }
    }
    for (int r = 0; r < R; r++) {
        for (int c = C; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
        float dots[4];
        sums4(acc[r][0], acc[r][1], acc[r][2], acc[r][3], dots);
        for (int c = 0; c < C; c++) y[r * N + c] = bias ? dots[c] + bias[c] : dots[c];
    }
}

BF16_TARGET static inline __attribute__((always_inline)) void columns_bf16(const uint16_t *x, const uint16_t *w,
                                                                           const float *bias, float *y, int64_t N,
                                                                           int64_t K, const int R, int C,
                                                                           const char *prefetch) {
    switch (C) {
        case 4: tile_bf16(x, w, bias, y, N, K, R, 4, prefetch); break;
        case 3: tile_bf16(x, w, bias, y, N, K, R, 3, prefetch); break;
        case 2: tile_bf16(x, w, bias, y, N, K, R, 2, prefetch); break;
        default: tile_bf16(x, w, bias, y, N, K, R, 1, prefetch); break;
    }
}

/* block_rows on the AVX512-BF16 road: 32 registers hold 4 x 4 accumulators, so every tile takes
 * all C weight rows at once. */
BF16_TARGET static void block_rows_bf16(const uint16_t *x, const uint16_t *w, const float *bias, float *y,
                                        int64_t m0, int64_t m1, int64_t N, int64_t K, int C) {
    const char *next = (const char *)(w + C * K);
    int64_t m = m0;
    for (; m + 4 <= m1; m += 4) columns_bf16(x + m * K, w, bias, y + m * N, N, K, 4, C, m == m0 ? next : 0);
    for (; m + 2 <= m1; m += 2) columns_bf16(x + m * K, w, bias, y + m * N, N, K, 2, C, m == m0 ? next : 0);
    for (; m < m1; m++) columns_bf16(x + m * K, w, bias, y + m * N, N, K, 1, C, m == m0 ? next : 0);
}
