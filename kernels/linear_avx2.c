/* The linear kernel's AVX2 road: the weight in panels of 16 output columns, x rows broadcast.
 *
 * The panel layout (treespec.kernels.cpu_kernels.pack_panels makes it once per weight): W [N, K]
 * bf16 becomes ceil(N / 16) panels of [K][16], panel p holding output columns 16p .. 16p + 15,
 * rows past N zero. At (p, k) the 16 values interleave the panel's two halves: position 2j holds
 * W[16p + j, k], position 2j + 1 holds W[16p + 8 + j, k]. One 256-bit load reads a k's 16
 * columns; a shift widens the low halves (columns 16p .. 16p + 7) to eight fp32 lanes, a mask the
 * high halves (16p + 8 .. 16p + 15): two integer operations per 16 weights, shared by every row
 * of the tile. A thread's panels lie one after another in memory, one stream the hardware
 * prefetcher follows.
 *
 * The sum: output y[m, n] is one fp32 lane that adds x[m, k] * W[n, k] for k = 0, 1, .., K - 1
 * in turn (fused multiply-adds), then the bias. No lane sums, no tail: the same chain whatever
 * the tile, the row count or the row's place among them (batch invariance). */
#define PANEL 16
#define UNROLL _Pragma("GCC unroll 8") /* R and P are constants: the accumulators stay in registers */

/* R rows of x (fp32, stride K) against P consecutive panels at wp, into y (row stride N): the
 * first `cols` of the panels' 16P columns are stored (the last panel of a matrix may be partial),
 * plus the bias where it is not NULL. R * P <= 6 keeps the 2RP accumulators, two widened weights
 * and the broadcast x in the sixteen registers. */
static inline __attribute__((always_inline)) void panel_tile(const float *x, const uint16_t *wp, const float *bias,
                                                             float *y, int64_t N, int64_t K, const int R,
                                                             const int P, int64_t cols, const char *prefetch) {
    __m256 lo[6][4], hi[6][4];
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    UNROLL
    for (int r = 0; r < R; r++)
        UNROLL
        for (int p = 0; p < P; p++) lo[r][p] = hi[r][p] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        if (prefetch && !(k & 1)) /* the next panels, a line per two k of each: as far ahead as one sweep */
            UNROLL
            for (int p = 0; p < P; p++) _mm_prefetch(prefetch + 2 * (p * K + k) * PANEL, _MM_HINT_T0);
        UNROLL
        for (int p = 0; p < P; p++) {
            const __m256i b = _mm256_loadu_si256((const __m256i *)(wp + (p * K + k) * PANEL));
            const __m256 wl = _mm256_castsi256_ps(_mm256_slli_epi32(b, 16));
            const __m256 wh = _mm256_castsi256_ps(_mm256_and_si256(b, high));
            UNROLL
            for (int r = 0; r < R; r++) {
                const __m256 xv = _mm256_broadcast_ss(x + r * K + k);
                lo[r][p] = _mm256_fmadd_ps(xv, wl, lo[r][p]);
                hi[r][p] = _mm256_fmadd_ps(xv, wh, hi[r][p]);
            }
        }
    }
    float sums[6][4][PANEL]; /* out of the registers first (constant indices), then a plain loop */
    UNROLL
    for (int r = 0; r < R; r++)
        UNROLL
        for (int p = 0; p < P; p++) {
            _mm256_storeu_ps(sums[r][p], lo[r][p]);
            _mm256_storeu_ps(sums[r][p] + 8, hi[r][p]);
        }
    UNROLL
    for (int r = 0; r < R; r++)
        for (int64_t n = 0; n < cols && n < PANEL * P; n++)
            y[r * N + n] = bias ? sums[r][n / PANEL][n % PANEL] + bias[n] : sums[r][n / PANEL][n % PANEL];
}

/* R rows against P panels, R and P known only at run time (one compiled tile per shape used). */
#define PANEL_CASE(R, P) \
    case 8 * R + P: panel_tile(x, wp, bias, y, N, K, R, P, cols, prefetch); break
static void panel_shape(const float *x, const uint16_t *wp, const float *bias, float *y, int64_t N, int64_t K,
                        int R, int P, int64_t cols, const char *prefetch) {
    switch (8 * R + P) {
        PANEL_CASE(1, 1); PANEL_CASE(1, 2); PANEL_CASE(1, 3); PANEL_CASE(1, 4); PANEL_CASE(2, 1); PANEL_CASE(2, 2);
        PANEL_CASE(3, 1); PANEL_CASE(4, 1); PANEL_CASE(5, 1); PANEL_CASE(6, 1);
        default: break; /* not reached: panel_rows asks R = 1 with P <= 4, R = 2 with P <= 2, R = 3-6 with P = 1 */
    }
}
#undef PANEL_CASE

/* M rows of x against `panels` consecutive panels at wp (their first `cols` columns kept), the
 * weights swept panel by panel so each is read from memory once for all the rows: one row takes
 * four panels at once and two rows two (eight accumulators); more split into ceil(M / 6) tiles of
 * as even a size as can be (9 rows: 4 + 5), each on one panel, so a tile keeps 8-12 chains of
 * fused multiply-adds in flight (three rows: 6). The first tile on a panel prefetches the next
 * ones. The tile shape never changes what is computed for an output. Measured on Zen 3 (30 x 1536
 * x 576 weights, 53 MB): 160-175 GFLOP/s from 9 to 32 rows, 80-85 % of the road's peak, where
 * the earlier dot-product tiles over the [N, K] layout reached 110-130. */
static void panel_rows(const float *x, const uint16_t *wp, const float *bias, float *y, int64_t M, int64_t N,
                       int64_t K, int64_t panels, int64_t cols) {
    const int chunk = M == 1 ? 4 : M == 2 ? 2 : 1;
    const int64_t tiles = (M + 5) / 6;
    for (int64_t p = 0; p < panels; p += chunk) {
        const int P = panels - p < chunk ? (int)(panels - p) : chunk;
        const int64_t n = PANEL * p;
        for (int64_t t = 0, m = 0; t < tiles; t++) {
            const int R = (int)((M - m) / (tiles - t)); /* the larger tiles last: 9 rows are 4 + 5 */
            const char *next = t == 0 ? (const char *)(wp + (n + PANEL * P) * K) : 0; /* the first tile's */
            panel_shape(x + m * K, wp + n * K, bias ? bias + n : 0, y + m * N + n, N, K, R, P, cols - n, next);
            m += R;
        }
    }
}
