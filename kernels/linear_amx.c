/* The AMX road (Sapphire Rapids and later Xeons): tdpbf16ps multiplies a 16 x 32 bf16 tile by a
 * 32 x 16 one into 16 x 16 fp32 accumulators, 16,384 flops per instruction (~30x the AVX512-BF16
 * road's measured peak), so a tree step's 8-32 rows cost about what one row costs: reading
 * the weight. The weight is the tile's A operand as it lies in memory (16 weight rows by 32
 * columns, the nn.Linear layout: nothing is repacked); x is the B operand, packed per step into
 * AMX's pair layout (xp: per chunk of 16 rows of x, per block of 32 columns, 16 pairs by 16 rows,
 * zeros past M and K). The accumulators hold y^T: C[n][m] += W[n][2p..2p+1] . x[m][2p..2p+1].
 *
 * Batch invariance: every output is accumulated by one tdpbf16ps per block of 32 columns in
 * increasing k, and the instruction computes each element from its own row of A and column of B
 * only (the ISA's definition), so a row of x gives the same bits alone (padded to 16 columns
 * with zeros) or among 15 others. Partial tiles (K % 32, N % 16) go through zero-padded copies,
 * so the sequence is the same there too. Linux hands out the tiles' 8 KB of state only to a
 * process that asks (the Python side asks before it picks this road), and each thread configures its tiles when it starts
 * its share and releases them after, so the kernels never rely on what other code left in
 * them (PyTorch's oneDNN uses AMX too). */
enum { AMX_BLOCKS = 3 }; /* weight blocks of 16 rows per group: accumulators in tiles 0-2, x in 4, weights in 5-7 */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

AMX_TARGET static void amx_configure(void) { /* tiles 0-7: 16 rows of 64 bytes each */
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) {
        config.rows[t] = 16;
        config.colsb[t] = 64;
    }
    _tile_loadconfig(&config);
}

/* x [M, K] bf16 into AMX's pair layout: xp[((c * KB + kb) * 16 + p) * 16 + j] holds the pair
 * x[16c + j][32 kb + 2p .. + 1] (uint32), zeros past M and K. */
static void amx_pack(const uint16_t *x, int64_t M, int64_t K, uint32_t *xp) {
    const int64_t KB = (K + 31) / 32, chunks = (M + 15) / 16;
    memset(xp, 0, sizeof(uint32_t) * chunks * KB * 256);
    for (int64_t m = 0; m < M; m++) {
        uint32_t *column = xp + (m / 16) * KB * 256 + (m % 16);
        const uint16_t *row = x + m * K;
        int64_t k = 0;
        for (; k + 2 <= K; k += 2) {
            uint32_t pair;
            memcpy(&pair, row + k, sizeof pair);
            column[(k / 32) * 256 + ((k % 32) / 2) * 16] = pair;
        }
        if (k < K) column[(k / 32) * 256 + ((k % 32) / 2) * 16] = row[k]; /* an odd K: the pair's upper half 0 */
    }
}

/* The weight rows of one block for column block kb where a tile cannot read them in place
 * (fewer than 16 rows left, or the last K % 32 columns): a zero-padded 16 x 32 copy. */
static const uint16_t *amx_padded(const uint16_t *w, int64_t rows, int64_t K, int64_t kb, uint16_t *scratch) {
    memset(scratch, 0, 16 * 32 * sizeof(uint16_t));
    const int64_t cols = K - 32 * kb < 32 ? K - 32 * kb : 32;
    for (int64_t r = 0; r < rows && r < 16; r++) memcpy(scratch + r * 32, w + r * K + 32 * kb, cols * sizeof(uint16_t));
    return scratch;
}

/* Weight block `block` at column block kb into tile `wtile`: in place when all 16 rows and 32
 * columns lie in the weight (`in_place`, rows_left), else through its zero-padded copy. */
#define AMX_LOAD(wtile, block)                                                                            \
    do {                                                                                                   \
        const uint16_t *wb = w + (int64_t)(block) * 16 * K;                                               \
        if (in_place && rows_left >= 16 * ((block) + 1))                                                  \
            _tile_loadd(wtile, wb + 32 * kb, K * 2);                                                       \
        else                                                                                               \
            _tile_loadd(wtile, amx_padded(wb, rows_left - 16 * (block), K, kb, scratch[block]), 64);      \
    } while (0)

/* One accumulator tile (acc [16 n][16 m] fp32, y^T) into y [m][n] (row stride N): its first
 * `rows` weight rows for the first `cols` rows of x, plus the bias (fp32, or NULL). The 16 x 16
 * transpose swaps the off-diagonal b x b blocks of every 2b x 2b block for b = 8, 4, 2, 1. */
AMX_TARGET static void amx_write_back(const float *acc, int64_t rows, int64_t cols, const float *bias, float *y,
                                      int64_t N) {
    __m512 t[16];
    for (int r = 0; r < 16; r++) t[r] = _mm512_loadu_ps(acc + 16 * r);
    for (int b = 8; b >= 1; b /= 2) {
        int lo[16], hi[16];
        for (int e = 0; e < 16; e++) {
            lo[e] = e & b ? 16 + e - b : e;
            hi[e] = e & b ? 16 + e : e + b;
        }
        const __m512i ilo = _mm512_loadu_si512(lo), ihi = _mm512_loadu_si512(hi);
        for (int r = 0; r < 16; r++)
            if (!(r & b)) {
                const __m512 a = t[r], c = t[r + b];
                t[r] = _mm512_permutex2var_ps(a, ilo, c);
                t[r + b] = _mm512_permutex2var_ps(a, ihi, c);
            }
    }
    const __mmask16 keep = (__mmask16)((1u << rows) - 1);
    const __m512 add = bias ? _mm512_maskz_loadu_ps(keep, bias) : _mm512_setzero_ps();
    for (int64_t j = 0; j < cols; j++)
        _mm512_mask_storeu_ps(y + j * N, keep, bias ? _mm512_add_ps(t[j], add) : t[j]);
}

/* `blocks` (1-3) consecutive blocks of 16 weight rows (rows_left rows remain from w) against one
 * packed chunk of 16 rows of x: C tiles to acc [blocks * 16, 16] fp32, acc[n][m] = y[m][n]. */
AMX_TARGET static void amx_group(const uint16_t *w, int64_t rows_left, int64_t K, const uint32_t *xp, int blocks,
                                 float *acc, uint16_t (*scratch)[16 * 32]) {
    const int64_t KB = (K + 31) / 32;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    for (int64_t kb = 0; kb < KB; kb++) {
        const int in_place = 32 * kb + 32 <= K;
        AMX_LOAD(5, 0); /* the weight tiles' loads first: three reads from memory in flight */
        if (blocks > 1) AMX_LOAD(6, 1);
        if (blocks > 2) AMX_LOAD(7, 2);
        _tile_loadd(4, xp + kb * 256, 64);
        _tile_dpbf16ps(0, 5, 4);
        if (blocks > 1) _tile_dpbf16ps(1, 6, 4);
        if (blocks > 2) _tile_dpbf16ps(2, 7, 4);
    }
    _tile_stored(0, acc, 64);
    if (blocks > 1) _tile_stored(1, acc + 256, 64);
    if (blocks > 2) _tile_stored(2, acc + 512, 64);
}

/* Two consecutive chunks of 16 rows of x (xp0, xp1) against `blocks` (1-2) blocks of 16 weight
 * rows: each weight tile is loaded once for both chunks (accumulators 0-3: block b, chunk c at
 * tile 2c + b; x in 4-5; weights in 6-7). acc [2 chunks][2 blocks][16][16]. Each output is the
 * same one tdpbf16ps per block of 32 columns in increasing k as amx_group's. */
AMX_TARGET static void amx_group2(const uint16_t *w, int64_t rows_left, int64_t K, const uint32_t *xp0,
                                  const uint32_t *xp1, int blocks, float *acc, uint16_t (*scratch)[16 * 32]) {
    const int64_t KB = (K + 31) / 32;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kb = 0; kb < KB; kb++) {
        const int in_place = 32 * kb + 32 <= K;
        AMX_LOAD(6, 0);
        if (blocks > 1) AMX_LOAD(7, 1);
        _tile_loadd(4, xp0 + kb * 256, 64);
        _tile_loadd(5, xp1 + kb * 256, 64);
        _tile_dpbf16ps(0, 6, 4);
        _tile_dpbf16ps(2, 6, 5);
        if (blocks > 1) {
            _tile_dpbf16ps(1, 7, 4);
            _tile_dpbf16ps(3, 7, 5);
        }
    }
    _tile_stored(0, acc, 64);
    _tile_stored(2, acc + 512, 64);
    if (blocks > 1) {
        _tile_stored(1, acc + 256, 64);
        _tile_stored(3, acc + 768, 64);
    }
}

/* linear_share on the AMX road: thread `me` takes a contiguous range of the matrices' blocks of
 * 16 weight rows (matrix i owns blocks first_block[i] .. first_block[i+1]-1), groups of up to
 * AMX_BLOCKS at a time, each against every chunk of 16 rows of x. xp is this thread's buffer for the
 * packed x ((M+15)/16 * (K+31)/32 * 256 pairs). */
AMX_TARGET static void amx_share(int64_t me, int64_t threads, const uint16_t *xb, int64_t M, int64_t K, int count,
                                 const uint16_t *const *w, const float *const *bias, float *const *y,
                                 const int64_t *N, const int64_t *first_block, uint32_t *xp) {
    const int64_t blocks = first_block[count], KB = (K + 31) / 32, chunks = (M + 15) / 16;
    const int64_t b0 = blocks * me / threads, b1 = blocks * (me + 1) / threads;
    if (b0 >= b1) return;
    float acc[4 * 256]; /* amx_group's AMX_BLOCKS tiles or amx_group2's four */
    uint16_t scratch[AMX_BLOCKS][16 * 32];
    amx_pack(xb, M, K, xp);
    amx_configure();
    int i = 0;
    for (int64_t b = b0; b < b1;) {
        while (b >= first_block[i + 1]) i++;
        const int64_t end = b1 < first_block[i + 1] ? b1 : first_block[i + 1];
        const int group = end - b < AMX_BLOCKS ? (int)(end - b) : AMX_BLOCKS;
        const int64_t n = 16 * (b - first_block[i]), rows_left = N[i] - n;
        const uint16_t *wg = w[i] + n * K;
        if (chunks >= 2) { /* pairs of chunks share each weight tile load: groups of two blocks */
            const int pair = group < 2 ? group : 2;
            for (int64_t c = 0; c < chunks; c += 2) {
                const int both = c + 1 < chunks;
                if (both)
                    amx_group2(wg, rows_left, K, xp + c * KB * 256, xp + (c + 1) * KB * 256, pair, acc, scratch);
                else
                    amx_group(wg, rows_left, K, xp + c * KB * 256, pair, acc, scratch);
                for (int half = 0; half <= both; half++) {
                    const int64_t cc = c + half, cols = M - 16 * cc < 16 ? M - 16 * cc : 16;
                    for (int blk = 0; blk < pair && 16 * blk < rows_left; blk++) {
                        const int64_t rows = rows_left - 16 * blk < 16 ? rows_left - 16 * blk : 16, at = n + 16 * blk;
                        amx_write_back(acc + 512 * half + 256 * blk, rows, cols, bias[i] ? bias[i] + at : 0,
                                       y[i] + 16 * cc * N[i] + at, N[i]);
                    }
                }
            }
            b += pair;
            continue;
        }
        for (int64_t c = 0; c < chunks; c++) {
            amx_group(wg, rows_left, K, xp + c * KB * 256, group, acc, scratch);
            const int64_t cols = M - 16 * c < 16 ? M - 16 * c : 16;
            for (int blk = 0; blk < group && 16 * blk < rows_left; blk++) {
                const int64_t rows = rows_left - 16 * blk < 16 ? rows_left - 16 * blk : 16, at = n + 16 * blk;
                amx_write_back(acc + 256 * blk, rows, cols, bias[i] ? bias[i] + at : 0, y[i] + 16 * c * N[i] + at, N[i]);
            }
        }
        b += group;
    }
    _tile_release();
}

static void block_offsets(int count, const int64_t *N, int64_t *first_block) {
    first_block[0] = 0;
    for (int i = 0; i < count; i++) first_block[i + 1] = first_block[i] + (N[i] + 15) / 16;
}

/* The packed x a thread needs on the AMX road for M rows of K columns (in pairs). */
static int64_t amx_pack_size(int64_t M, int64_t K) { return (M + 15) / 16 * ((K + 31) / 32) * 256; }
