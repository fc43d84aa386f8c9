/* treespec's CPU kernels for x86-64: the linear layer y = x W^T + b with bf16 weights, the tree
 * attention over treespec's KV cache, and a whole Llama-style decoder stack in one call.
 *
 * Linear: W is [N, K] bf16 (the nn.Linear layout), x [M, K] and y [M, N] bf16 or fp32. The
 * weight stays bf16 in memory (half the bytes of an fp32 copy: a one-row step is bound by
 * reading it). Two roads, one per process (treespec_set_isa): AVX2 + FMA widens the weight to
 * fp32 in registers (a shift: exact) and accumulates with FMAs; AVX512-BF16 keeps x in bf16 and
 * multiplies pairs with vdpbf16ps (see that road below).
 *
 * Batch invariance: every output y[m, n] is computed by the same sequence of operations whatever
 * M is and wherever row m falls. On the AVX2 road x is packed in pairs (per block of 16 columns
 * the even ones, then the odd ones) and lane j of eight fp32 lanes accumulates x[m, 16i + 2j] *
 * W[n, 16i + 2j], then x[m, 16i + 2j + 1] * W[n, 16i + 2j + 1], with fused multiply-adds in
 * increasing i; the lanes are summed in one fixed order, and the K % 16 tail is added last, one
 * fused multiply-add per k. A row scored alone (an autoregressive step) and the same row scored
 * among a tree's rows give the same bits. Built with -ffp-contract=off, so the compiler adds no
 * fusions of its own. The plain reference of this contract is
 * treespec.kernels.cpu_kernels.linear_reference (the same sums in float64).
 *
 * Work split: threads take contiguous ranges of groups of 12 weight rows (OpenMP, the process's
 * own runtime: PyTorch's libgomp is already loaded and serves this library too); within a range,
 * rows of x go by blocks of 64 (a block stays in L2 while the weight streams past it), and
 * register tiles sized to the road do the arithmetic (AVX2: six x rows by two weight rows, down
 * to one x row by six; see block_rows).
 *
 * Failure: an entry point that cannot allocate its work buffers returns TREESPEC_NO_MEMORY before
 * computing anything (the Python side raises MemoryError); nothing here aborts the process.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ROW_BLOCK 64

/* What an entry point returns when it could not allocate its work buffers (0: done). It returns
 * before computing anything, and the Python side raises MemoryError. */
#define TREESPEC_NO_MEMORY 1

static inline __m256 widen_bf16(const uint16_t *p) {
    __m128i half = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

static inline float lanes_sum(__m256 v) { /* one fixed order: (0+4, 1+5, 2+6, 3+7), then pairs */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float add_tail(const float *x, const uint16_t *w, int64_t k0, int64_t K, float acc) {
    for (int64_t k = k0; k < K; k++) {
        uint32_t bits = (uint32_t)w[k] << 16;
        float wk;
        memcpy(&wk, &bits, sizeof wk);
        acc = __builtin_fmaf(x[k], wk, acc);
    }
    return acc;
}

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
 * accumulators, the x row and the mask (1: 6, 2: 4, 3: 3, 4-6: 2). A GROUP of weight rows is a
 * multiple of each, so every tile of a group sweeps it in whole steps. */
#define GROUP 12
static inline int tile_columns(int R) { return R == 1 ? 6 : R == 2 ? 4 : R == 3 ? 3 : 2; }

/* R x rows against C <= tile_columns(R) weight rows (C known only at run time: one tile per C). */
#define TILE_CASE(R, C) \
    case C: tile(x, w, bias, y, N, K, R, C, prefetch); break
static inline __attribute__((always_inline)) void rows_tile(const float *x, const uint16_t *w, const float *bias,
                                                            float *y, int64_t N, int64_t K, const int R, int C,
                                                            const char *prefetch) {
    switch (R) {
        case 1: switch (C) { TILE_CASE(1, 6); TILE_CASE(1, 5); TILE_CASE(1, 4); TILE_CASE(1, 3); TILE_CASE(1, 2); default: tile(x, w, bias, y, N, K, 1, 1, prefetch); } break;
        case 2: switch (C) { TILE_CASE(2, 4); TILE_CASE(2, 3); TILE_CASE(2, 2); default: tile(x, w, bias, y, N, K, 2, 1, prefetch); } break;
        case 3: switch (C) { TILE_CASE(3, 3); TILE_CASE(3, 2); default: tile(x, w, bias, y, N, K, 3, 1, prefetch); } break;
        case 4: if (C == 2) tile(x, w, bias, y, N, K, 4, 2, prefetch); else tile(x, w, bias, y, N, K, 4, 1, prefetch); break;
        case 5: if (C == 2) tile(x, w, bias, y, N, K, 5, 2, prefetch); else tile(x, w, bias, y, N, K, 5, 1, prefetch); break;
        default: if (C == 2) tile(x, w, bias, y, N, K, 6, 2, prefetch); else tile(x, w, bias, y, N, K, 6, 1, prefetch); break;
    }
}
#undef TILE_CASE

/* Rows m0..m1 of packed x against G <= GROUP consecutive rows of W. A block of 4-8 rows takes
 * the group four weight rows at a time, every tile of two rows (and a last one of one) on each
 * chunk while it is in L1, so the pass that streams the weight from memory does all the rows'
 * products (measured on Zen 3: faster than one tile of four or five by two weight rows, both
 * when the weight streams from memory and when it sits in cache). Other blocks go by tiles of
 * six (the most products per widened weight) and the last 1-5 rows as one tile, a remainder of
 * one after sixes as 2 + 5 (a one-row tile widens every weight for one product); up to three rows
 * are one tile. The tile shape never changes what is computed for an output, only how many are
 * computed together (tests/test_cpu_kernels.py: the same bits at every row count). */
static void block_rows(const float *x, const uint16_t *w, const float *bias, float *y, int64_t m0, int64_t m1,
                       int64_t N, int64_t K, int G) {
    /* While the first tile streams a chunk, it prefetches the same chunk of the next group (a
     * step of a few rows is bound by reading the weight from memory; more lines in flight read
     * it faster). */
    const char *next = (const char *)(w + G * K);
    if (m1 - m0 >= 4 && m1 - m0 <= 8) {
        for (int c = 0; c < G; c += 4)
            for (int64_t m = m0; m < m1; m += 2)
                rows_tile(x + m * K, w + c * K, bias ? bias + c : 0, y + m * N + c, N, K, m + 1 < m1 ? 2 : 1,
                          G - c < 4 ? G - c : 4, m == m0 ? next + 2 * c * K : 0);
        return;
    }
    for (int64_t m = m0; m < m1;) {
        const int64_t left = m1 - m;
        const int R = left >= 6 && left != 7 ? 6 : left == 7 || left == 4 ? 2 : (int)left;
        const int C = tile_columns(R);
        for (int c = 0; c < G; c += C)
            rows_tile(x + m * K, w + c * K, bias ? bias + c : 0, y + m * N + c, N, K, R, G - c < C ? G - c : C,
                      m == m0 ? next + 2 * c * K : 0);
        m += R;
    }
}

/* The AVX512-BF16 road (Cooper Lake, Sapphire Rapids and later Xeons, Zen 4 and later): x stays
 * bf16 and vdpbf16ps multiplies 32 bf16 pairs per instruction into 16 fp32 lanes, with no
 * widening. Its own fixed sequence per output: lane j accumulates the pairs k = 32i + 2j, 2j + 1
 * in increasing i (the instruction's order within a pair), the K % 32 tail as one masked step
 * with zeros past K, then the 16 lanes folded in one fixed tree (sums4: four outputs at once). A given CPU gives each row the
 * same bits alone or among others, as on the AVX2 road; the two roads differ from each other in
 * the last bits, so a process keeps one (treespec_set_isa, called once at load). */
enum { ISA_AVX2 = 0, ISA_AVX512_BF16 = 2, ISA_AMX = 3 };
static int g_isa = ISA_AVX2;

#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))

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
#define AMX_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))
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

/* The road this process takes: ISA_AVX2, ISA_AVX512_BF16 or ISA_AMX (the caller has checked the
 * CPU, and for AMX that the OS permits it). */
void treespec_set_isa(int isa) { g_isa = isa; }
int treespec_get_isa(void) { return g_isa; }

static inline float widen_one(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t round_bf16(float f) { /* round to nearest even, as PyTorch rounds */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* a quiet NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

/* round_bf16 on eight lanes: each lane's bf16 bits in the low half of its 32 (the same
 * round-to-nearest-even and quiet NaN as the scalar). */
static inline __m256i round_bf16x8(__m256 f) {
    const __m256i bits = _mm256_castps_si256(f);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    return _mm256_blendv_epi8(rounded, _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40)), nan);
}

/* widen_one(round_bf16(v)) on eight lanes. */
static inline __m256 widen_rounded8(__m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(round_bf16x8(v), 16)); }

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

/* Whether a linear over x (xb: its bf16 copy, or NULL) runs the AVX2 tiles on this road. */
static inline int avx2_tiles(const uint16_t *xb) { return g_isa == ISA_AVX2 || !xb; }

/* The scratch one thread of linear_share needs for M rows of K columns, in 4-byte words: AMX's
 * pairs, or the AVX2 tiles' packed rows of one block. */
static int64_t share_scratch(const uint16_t *xb, int64_t M, int64_t K) {
    if (avx2_tiles(xb)) return (M < ROW_BLOCK ? M : ROW_BLOCK) * K;
    return g_isa == ISA_AMX ? amx_pack_size(M, K) : 0;
}

/* One thread's share of y_i = x W_i^T + bias_i for `count` matrices read from the same x (fp32
 * [M, K]): thread `me` of `threads` takes a contiguous range of the matrices' groups of GROUP
 * weight rows (matrix i owns groups first_group[i] .. first_group[i+1]-1) and computes them for
 * every row of x, by blocks of ROW_BLOCK rows. y_i are fp32 [M, N_i]; biases fp32 (each may be
 * NULL). scratch: share_scratch(xb, M, K) words of this thread's own. */
static void linear_share(int64_t me, int64_t threads, const float *x, const uint16_t *xb, int64_t M, int64_t K,
                         int count, const uint16_t *const *w, const float *const *bias, float *const *y,
                         const int64_t *N, const int64_t *first_group, void *scratch) {
    if (g_isa == ISA_AMX && xb) {
        int64_t first_block[count + 1];
        block_offsets(count, N, first_block);
        amx_share(me, threads, xb, M, K, count, w, bias, y, N, first_block, scratch);
        return;
    }
    const int tiles = avx2_tiles(xb);
    const int64_t groups = first_group[count];
    const int64_t g0 = groups * me / threads, g1 = groups * (me + 1) / threads;
    for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK) {
        const int64_t m1 = m0 + ROW_BLOCK < M ? m0 + ROW_BLOCK : M;
        if (tiles) {
            if (g0 == g1) break; /* nothing to compute: no rows to pack */
            pack_pairs(x, m0, m1, K, scratch);
        }
        int i = 0;
        for (int64_t g = g0; g < g1; g++) {
            while (g >= first_group[i + 1]) i++;
            const int64_t n = GROUP * (g - first_group[i]);
            const int G = N[i] - n < GROUP ? (int)(N[i] - n) : GROUP;
            const float *b = bias[i] ? bias[i] + n : 0;
            if (tiles)
                block_rows(scratch, w[i] + n * K, b, y[i] + m0 * N[i] + n, 0, m1 - m0, N[i], K, G);
            else /* AVX512-BF16: tiles of up to four weight rows */
                for (int c = 0; c < G; c += 4)
                    block_rows_bf16(xb, w[i] + (n + c) * K, b ? b + c : 0, y[i] + n + c, m0, m1, N[i], K,
                                    G - c < 4 ? G - c : 4);
        }
    }
}

static void group_offsets(int count, const int64_t *N, int64_t *first_group) {
    first_group[0] = 0;
    for (int i = 0; i < count; i++) first_group[i + 1] = first_group[i] + (N[i] + GROUP - 1) / GROUP;
}

/* For each of `count` matrices i: y_i[M, N_i] = x[M, K] W_i[N_i, K]^T + bias_i[N_i], in one
 * parallel pass (q/k/v or gate/up of a layer read the same x: one call instead of three). x and
 * the y_i are bf16 when x_bf16 / y_bf16, else fp32; the W_i and the biases (each may be NULL) are
 * bf16. Every output is computed exactly as a call for its matrix alone would compute it. */
int treespec_linear_bf16_many(const void *x_in, int x_bf16, int count, const uint16_t *const *w,
                              const uint16_t *const *bias_in, void *const *y_out, int y_bf16, int64_t M,
                              const int64_t *N, int64_t K) {
    const uint16_t *xb = x_bf16 ? x_in : 0; /* the bf16 roads read it as it is */
    const int widen = x_bf16 && g_isa == ISA_AVX2;
    float *x = widen ? malloc(sizeof(float) * M * K) : (float *)x_in;
    float *y[count], *bias[count];
    const int team = omp_get_max_threads();
    const int64_t pack = share_scratch(xb, M, K);
    uint32_t *xp = pack ? malloc(sizeof(uint32_t) * pack * team) : 0;
    int failed = (widen && !x) || (pack && !xp);
    for (int i = 0; i < count; i++) {
        y[i] = !y_bf16 ? (float *)y_out[i] : failed ? 0 : malloc(sizeof(float) * M * N[i]);
        bias[i] = bias_in[i] && !failed ? malloc(sizeof(float) * N[i]) : 0;
        failed |= (y_bf16 && !y[i]) || (bias_in[i] && !bias[i]);
    }
    if (failed) { /* nothing computed, nothing left allocated */
        if (widen) free(x);
        free(xp);
        for (int i = 0; i < count; i++) {
            if (y_bf16) free(y[i]);
            free(bias[i]);
        }
        return TREESPEC_NO_MEMORY;
    }
    if (widen)
        for (int64_t i = 0; i < M * K; i++) x[i] = widen_one(xb[i]);
    int64_t first_group[count + 1];
    group_offsets(count, N, first_group);
    for (int i = 0; i < count; i++)
        if (bias[i])
            for (int64_t n = 0; n < N[i]; n++) bias[i][n] = widen_one(bias_in[i][n]);
#pragma omp parallel num_threads(team)
    {
        const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
        linear_share(me, threads, x, xb, M, K, count, w, (const float *const *)bias, y, N, first_group,
                     xp ? xp + me * pack : 0);
        if (y_bf16) {
#pragma omp barrier
            for (int i = 0; i < count; i++) {
                uint16_t *out = y_out[i];
                const int64_t size = M * N[i];
                const int64_t e0 = size * me / threads, e1 = size * (me + 1) / threads;
                int64_t e = e0;
                for (; e + 8 <= e1; e += 8) { /* round_bf16 on eight lanes: the same bits */
                    const __m256i r = round_bf16x8(_mm256_loadu_ps(y[i] + e));
                    _mm_storeu_si128((__m128i *)(out + e),
                                     _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08)));
                }
                for (; e < e1; e++) out[e] = round_bf16(y[i][e]);
            }
        }
    }
    if (widen) free(x);
    free(xp);
    for (int i = 0; i < count; i++) {
        if (y_bf16) free(y[i]);
        free(bias[i]);
    }
    return 0;
}

/* One matrix: y[M, N] = x[M, K] W[N, K]^T + bias[N] (see treespec_linear_bf16_many). */
int treespec_linear_bf16(const void *x_in, int x_bf16, const uint16_t *w, const uint16_t *bias_in, void *y_out,
                         int y_bf16, int64_t M, int64_t N, int64_t K) {
    return treespec_linear_bf16_many(x_in, x_bf16, 1, &w, &bias_in, &y_out, y_bf16, M, &N, K);
}

/* Tree attention for bf16 queries and K/V cache, batch-invariant.
 *
 * q and out are [T, Hq, D]; the caches are [S, Hkv, L, D] (treespec's KVCache layout). Query row t
 * belongs to cache row row_slot[t], sees every committed key 0 .. row_prefix[t] - 1 and, of its
 * request's new keys (cache positions row_prefix[t] + j), those whose bit j is set in its mask
 * words mask[t, 0 .. W-1], or j <= row_index[t] when mask is NULL (a causal chain). Head h reads
 * KV head h / (Hq / Hkv).
 *
 * Every (row, head) output is computed alone, visiting its visible keys in increasing cache
 * position: scores as fixed-order dot products (as in the linear kernel), the maximum, then
 * exp(score - max) summed and the values accumulated in that order, divided once at the end. No
 * other row's presence changes a bit of it, and a tree node sees its ancestors in the order an
 * autoregressive step sees the same tokens. */
#include <math.h>

/* exp on eight fp32 lanes: Cody-Waite reduction x = n ln2 + r, a degree-5 polynomial for e^r
 * (Cephes' coefficients, ~1 ulp) and 2^n from the exponent bits, inputs clamped to
 * [-87.3, 88.3]. Every lane runs the same sequence, so a value's exponential does not depend on
 * its neighbours or its position: the attention's weights and SiLU stay batch-invariant, at a
 * fraction of a scalar expf's cost. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

/* exp8 over n <= 8 values (the tail of a run goes through the same lanes, zero-padded). */
static inline void exp_run(const float *in, float *out, int64_t n) {
    if (n == 8) {
        _mm256_storeu_ps(out, exp8(_mm256_loadu_ps(in)));
        return;
    }
    float a[8] = {0}, b[8];
    memcpy(a, in, sizeof(float) * n);
    _mm256_storeu_ps(b, exp8(_mm256_loadu_ps(a)));
    memcpy(out, b, sizeof(float) * n);
}

static inline int key_visible(const int32_t *mask_row, int64_t j, int64_t row_index) {
    if (!mask_row) return j <= row_index;
    return (int)(((uint32_t)mask_row[j >> 5] >> (j & 31)) & 1u);
}

static inline float dot1(const float *q, const uint16_t *k, int64_t D) {
    const int64_t D8 = D & ~(int64_t)7;
    __m256 a = _mm256_setzero_ps();
    for (int64_t d = 0; d < D8; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), widen_bf16(k + d), a);
    return add_tail(q, k, D8, D, lanes_sum(a));
}

/* Per-thread scratch of the attention: for up to HEADS_TOGETHER query heads, scores for up to
 * L + 4 keys, one query and one accumulator row each; the visible keys' positions. */
enum { HEADS_TOGETHER = 4, AMX_COLUMNS = 16 }; /* AMX_COLUMNS: (row, head) queries per tile product */
typedef struct {
    float *scores, *qf, *acc;
    int64_t *keys;
    float *tile_scores;  /* AMX road: [L + 16 keys][16 columns] fp32, the tile products' S^T */
    uint32_t *q_pairs;   /* AMX road: 16 queries in AMX's pair layout, per block of 32 dims */
    uint16_t *key_tail;  /* AMX road: the last keys of a cache row, zero-padded to 16 */
} attention_scratch;

static void scratch_pool_free(attention_scratch *pool, int count) {
    for (int i = 0; i < count; i++) {
        free(pool[i].scores);
        free(pool[i].qf);
        free(pool[i].acc);
        free(pool[i].keys);
        free(pool[i].tile_scores);
        free(pool[i].q_pairs);
        free(pool[i].key_tail);
    }
    free(pool);
}

/* Scratch for each of `count` threads, allocated before the parallel region that uses it so
 * that a failed allocation is reported before any work: NULL then (nothing is left allocated). */
static attention_scratch *scratch_pool(int64_t L, int64_t D, int count) {
    attention_scratch *pool = calloc((size_t)count, sizeof *pool);
    if (!pool) return 0;
    const int amx = g_isa == ISA_AMX;
    for (int i = 0; i < count; i++) {
        pool[i] = (attention_scratch){malloc(sizeof(float) * AMX_COLUMNS * (L + 4)),
                                      malloc(sizeof(float) * HEADS_TOGETHER * D),
                                      malloc(sizeof(float) * HEADS_TOGETHER * D), malloc(sizeof(int64_t) * (L + 4)),
                                      amx ? malloc(sizeof(float) * 16 * (L + 16)) : 0,
                                      amx ? malloc(sizeof(uint32_t) * 256 * ((D + 31) / 32)) : 0,
                                      amx ? malloc(sizeof(uint16_t) * 16 * D) : 0};
        if (!pool[i].scores || !pool[i].qf || !pool[i].acc || !pool[i].keys ||
            (amx && (!pool[i].tile_scores || !pool[i].q_pairs || !pool[i].key_tail))) {
            scratch_pool_free(pool, count);
            return 0;
        }
    }
    return pool;
}

/* The scores of G query heads (qf [G, D] fp32) against keys k0 and k1, into scores[h * stride +
 * i] and [.. + i + 1]: each key is widened once for all G heads, and each score is dot1's fixed
 * sequence (eight lanes in increasing d, the lanes in one order, the tail last). */
static inline __attribute__((always_inline)) void head_dots2(const float *qf, const int G, const uint16_t *k0,
                                                             const uint16_t *k1, int64_t D, float *scores,
                                                             int64_t stride, int64_t i) {
    const int64_t D8 = D & ~(int64_t)7;
    __m256 a0[HEADS_TOGETHER], a1[HEADS_TOGETHER];
    for (int h = 0; h < G; h++) a0[h] = a1[h] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D8; d += 8) {
        const __m256 kv0 = widen_bf16(k0 + d), kv1 = widen_bf16(k1 + d);
        for (int h = 0; h < G; h++) {
            const __m256 qv = _mm256_loadu_ps(qf + h * D + d);
            a0[h] = _mm256_fmadd_ps(qv, kv0, a0[h]);
            a1[h] = _mm256_fmadd_ps(qv, kv1, a1[h]);
        }
    }
    for (int h = 0; h < G; h++) {
        scores[h * stride + i] = add_tail(qf + h * D, k0, D8, D, lanes_sum(a0[h]));
        scores[h * stride + i + 1] = add_tail(qf + h * D, k1, D8, D, lanes_sum(a1[h]));
    }
}

/* acc[h, d] = sum_i e[h, i] v_i[d] for G heads, one FMA per key in key order for every (h, d):
 * each value row is widened once for all G heads; 16 columns at a time keep 2 G accumulators in
 * registers across all keys. */
static inline __attribute__((always_inline)) void head_values(const float *e, int64_t stride, const int G,
                                                              const uint16_t *vbase, const int64_t *keys, int64_t n,
                                                              int64_t D, float *acc) {
    const int64_t D8 = D & ~(int64_t)7;
    int64_t d = 0;
    for (; d + 16 <= D8; d += 16) {
        __m256 a0[HEADS_TOGETHER], a1[HEADS_TOGETHER];
        for (int h = 0; h < G; h++) a0[h] = a1[h] = _mm256_setzero_ps();
        for (int64_t i = 0; i < n; i++) {
            const uint16_t *v = vbase + keys[i] * D + d;
            const __m256 v0 = widen_bf16(v), v1 = widen_bf16(v + 8);
            for (int h = 0; h < G; h++) {
                const __m256 ev = _mm256_set1_ps(e[h * stride + i]);
                a0[h] = _mm256_fmadd_ps(ev, v0, a0[h]);
                a1[h] = _mm256_fmadd_ps(ev, v1, a1[h]);
            }
        }
        for (int h = 0; h < G; h++) {
            _mm256_storeu_ps(acc + h * D + d, a0[h]);
            _mm256_storeu_ps(acc + h * D + d + 8, a1[h]);
        }
    }
    for (; d < D8; d += 8) {
        __m256 a0[HEADS_TOGETHER];
        for (int h = 0; h < G; h++) a0[h] = _mm256_setzero_ps();
        for (int64_t i = 0; i < n; i++) {
            const __m256 v0 = widen_bf16(vbase + keys[i] * D + d);
            for (int h = 0; h < G; h++) a0[h] = _mm256_fmadd_ps(_mm256_set1_ps(e[h * stride + i]), v0, a0[h]);
        }
        for (int h = 0; h < G; h++) _mm256_storeu_ps(acc + h * D + d, a0[h]);
    }
    for (int h = 0; h < G; h++)
        for (int64_t j = D8; j < D; j++) acc[h * D + j] = 0.0f;
    for (int64_t i = 0; i < n && D8 < D; i++) {
        const uint16_t *v = vbase + keys[i] * D;
        for (int h = 0; h < G; h++)
            for (int64_t j = D8; j < D; j++) acc[h * D + j] = __builtin_fmaf(e[h * stride + i], widen_one(v[j]), acc[h * D + j]);
    }
}

/* G query heads h0 .. h0 + G - 1 of row t over the n visible keys: scores, softmax, values. */
static inline __attribute__((always_inline)) void attend_heads(int64_t t, int64_t h0, const int G, const uint16_t *q,
                                                               const uint16_t *kbase, const uint16_t *vbase,
                                                               uint16_t *out, const int64_t *keys, int64_t n,
                                                               int64_t Hq, int64_t L, int64_t D, float sm_scale,
                                                               attention_scratch s) {
    const int64_t stride = L + 4;
    float *scores = s.scores, *qf = s.qf, *acc = s.acc;
    for (int h = 0; h < G; h++)
        for (int64_t d = 0; d < D; d++) qf[h * D + d] = widen_one(q[(t * Hq + h0 + h) * D + d]);
    int64_t i = 0;
    for (; i + 2 <= n; i += 2) head_dots2(qf, G, kbase + keys[i] * D, kbase + keys[i + 1] * D, D, scores, stride, i);
    for (; i < n; i++)
        for (int h = 0; h < G; h++) scores[h * stride + i] = dot1(qf + h * D, kbase + keys[i] * D, D);
    float total[HEADS_TOGETHER];
    for (int h = 0; h < G; h++) {
        float *row = scores + h * stride, best = -INFINITY;
        for (i = 0; i < n; i++) {
            row[i] *= sm_scale;
            if (row[i] > best) best = row[i];
        }
        for (i = 0; i < n; i++) row[i] -= best;
        for (i = 0; i < n; i += 8) exp_run(row + i, row + i, n - i < 8 ? n - i : 8);
        total[h] = 0.0f;
        for (i = 0; i < n; i++) total[h] += row[i];
    }
    head_values(scores, stride, G, vbase, keys, n, D, acc);
    for (int h = 0; h < G; h++)
        for (int64_t d = 0; d < D; d++) out[(t * Hq + h0 + h) * D + d] = round_bf16(acc[h * D + d] / total[h]);
}

/* Row t's attention for KV head kvh and its group of query heads (q and out [T, Hq, D]; the
 * caches one layer's [S, Hkv, L, D]), HEADS_TOGETHER query heads at a time so that every key
 * and value row is loaded and widened once for them all. Each (row, head) output is the same
 * sequence of operations however many heads share the loads. */
static void attend_item(int64_t t, int64_t kvh, const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache,
                        uint16_t *out, const int64_t *row_slot, const int64_t *row_prefix, const int64_t *row_index,
                        const int64_t *row_new, const int32_t *mask, int64_t W, int64_t Hq, int64_t Hkv, int64_t L,
                        int64_t D, float sm_scale, attention_scratch s) {
    const int64_t group = Hq / Hkv;
    const uint16_t *kbase = k_cache + (row_slot[t] * Hkv + kvh) * L * D;
    const uint16_t *vbase = v_cache + (row_slot[t] * Hkv + kvh) * L * D;
    const int32_t *mask_row = mask ? mask + t * W : 0;
    int64_t *keys = s.keys, n = 0;
    for (int64_t p = 0; p < row_prefix[t]; p++) keys[n++] = p;
    for (int64_t j = 0; j < row_new[t]; j++)
        if (key_visible(mask_row, j, row_index[t])) keys[n++] = row_prefix[t] + j;
    for (int64_t h0 = kvh * group; h0 < (kvh + 1) * group; h0 += HEADS_TOGETHER) {
        const int64_t left = (kvh + 1) * group - h0;
        switch (left < HEADS_TOGETHER ? left : HEADS_TOGETHER) {
            case 4: attend_heads(t, h0, 4, q, kbase, vbase, out, keys, n, Hq, L, D, sm_scale, s); break;
            case 3: attend_heads(t, h0, 3, q, kbase, vbase, out, keys, n, Hq, L, D, sm_scale, s); break;
            case 2: attend_heads(t, h0, 2, q, kbase, vbase, out, keys, n, Hq, L, D, sm_scale, s); break;
            default: attend_heads(t, h0, 1, q, kbase, vbase, out, keys, n, Hq, L, D, sm_scale, s); break;
        }
    }
}

/* One column's softmax on the AMX road, over its n visible scores in key order (in place: the
 * unnormalised weights exp(s * scale - max)); returns their sum. Sixteen lanes in key order, the
 * lanes summed in one fixed order: the sequence depends only on the visible scores, so a node's
 * weights are the same in a tree and in its autoregressive step. */
AMX_TARGET static float amx_softmax_row(float *row, int64_t n, float sm_scale) {
    const __m512 scale = _mm512_set1_ps(sm_scale);
    __m512 best = _mm512_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(row + i), scale);
        _mm512_storeu_ps(row + i, v);
        best = _mm512_max_ps(best, v);
    }
    if (i < n) {
        const __mmask16 part = (__mmask16)((1u << (n - i)) - 1);
        const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(part, row + i), scale);
        _mm512_mask_storeu_ps(row + i, part, v);
        best = _mm512_mask_max_ps(best, part, best, v);
    }
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best));
    __m256 sum = _mm256_setzero_ps();
    for (i = 0; i < n; i += 8) {
        const int64_t m = n - i < 8 ? n - i : 8;
        const __mmask8 part = (__mmask8)((1u << m) - 1);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_maskz_loadu_ps(part, row + i), _mm512_castps512_ps256(top)));
        _mm256_mask_storeu_ps(row + i, part, e);
        sum = _mm256_add_ps(sum, _mm256_maskz_mov_ps(part, e));
    }
    return lanes_sum(sum);
}

/* The values for columns j0 .. j0 + g - 1 of amx_attend_columns (g a constant: the accumulators,
 * 4 x 16 fp32 per column, stay in registers): one FMA per visible key in key order per column,
 * each value row widened once for the g columns; the outputs divided by their totals and rounded. */
enum { PV_COLUMNS = 6 };
AMX_TARGET static inline __attribute__((always_inline)) void amx_values(
    const int g, int64_t j0, int64_t t0, int64_t c0, int64_t kvh, const uint16_t *vbase, uint16_t *out, int64_t prefix,
    int64_t fresh, const int64_t *row_index, const int32_t *mask, int64_t W, int64_t Hq, int64_t G, int64_t D,
    int64_t stride, const float *total, attention_scratch s) {
    const float *e[PV_COLUMNS];
    const int32_t *mask_row[PV_COLUMNS];
    int64_t index[PV_COLUMNS];
    for (int j = 0; j < g; j++) {
        const int64_t t = t0 + (c0 + j0 + j) / G;
        e[j] = s.scores + (j0 + j) * stride;
        mask_row[j] = mask ? mask + t * W : 0;
        index[j] = row_index[t];
    }
    for (int64_t d0 = 0; d0 < D; d0 += 64) {
        __m512 acc[PV_COLUMNS][4];
        for (int j = 0; j < g; j++)
            for (int z = 0; z < 4; z++) acc[j][z] = _mm512_setzero_ps();
        for (int64_t p = 0; p < prefix; p++) { /* committed keys: every column sees them */
            const uint16_t *v = vbase + p * D + d0;
            __m512 vv[4];
            for (int z = 0; z < 4; z++)
                vv[z] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v + 16 * z))), 16));
            for (int j = 0; j < g; j++) {
                const __m512 w = _mm512_set1_ps(e[j][p]);
                for (int z = 0; z < 4; z++) acc[j][z] = _mm512_fmadd_ps(w, vv[z], acc[j][z]);
            }
        }
        int64_t at[PV_COLUMNS];
        for (int j = 0; j < g; j++) at[j] = prefix;
        for (int64_t k = 0; k < fresh; k++) { /* new keys: the columns whose row sees them */
            const uint16_t *v = vbase + (prefix + k) * D + d0;
            __m512 vv[4];
            for (int z = 0; z < 4; z++)
                vv[z] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v + 16 * z))), 16));
            for (int j = 0; j < g; j++) {
                if (!key_visible(mask_row[j], k, index[j])) continue;
                const __m512 w = _mm512_set1_ps(e[j][at[j]++]);
                for (int z = 0; z < 4; z++) acc[j][z] = _mm512_fmadd_ps(w, vv[z], acc[j][z]);
            }
        }
        for (int j = 0; j < g; j++) {
            const int64_t c = c0 + j0 + j, t = t0 + c / G;
            uint16_t *o = out + (t * Hq + kvh * G + c % G) * D + d0;
            const __m512 sum = _mm512_set1_ps(total[j0 + j]);
            float values[64];
            for (int z = 0; z < 4; z++) _mm512_storeu_ps(values + 16 * z, _mm512_div_ps(acc[j][z], sum));
            for (int x = 0; x < 64; x++) o[x] = round_bf16(values[x]);
        }
    }
}

/* Attention on the AMX road, for up to AMX_COLUMNS (row, query head) columns that share a cache
 * row and KV head: the rows t0 .. of one request (same slot, committed length and new tokens),
 * their query heads of group kvh, columns c0 .. c0 + nc - 1 (column c is row t0 + c / G, head
 * kvh * G + c % G). The scores of every column against every key come from tile products: the
 * cached keys are the A operand as they lie in the cache (16 keys by 32 dims), the queries the B
 * operand in AMX's pair layout, so a key is read once for all the columns and the products cost
 * next to nothing. Then, per column, its visible keys' scores in key order go through the same
 * softmax sequence as attend_heads', and the values are summed with one FMA per visible key in
 * key order (the committed keys, then the visible new ones), each value row widened once for the
 * columns it serves. Every column's output is the same sequence whatever columns share the tile
 * (the tile product computes each element from its own key row and query column), so a node
 * scored in a tree has the bits of the one-token step over its path. Needs D % 64 == 0. */
AMX_TARGET static void amx_attend_columns(int64_t t0, int64_t c0, int64_t nc, int64_t kvh, const uint16_t *q,
                                          const uint16_t *kbase, const uint16_t *vbase, uint16_t *out,
                                          int64_t prefix, int64_t fresh, const int64_t *row_index, const int32_t *mask,
                                          int64_t W, int64_t Hq, int64_t G, int64_t L, int64_t D, float sm_scale,
                                          attention_scratch s) {
    const int64_t DB = D / 32, N = prefix + fresh, stride = L + 4;
    uint32_t *qp = s.q_pairs;
    memset(qp, 0, sizeof(uint32_t) * 256 * DB);
    for (int64_t j = 0; j < nc; j++) {
        const int64_t c = c0 + j, t = t0 + c / G;
        const uint16_t *qrow = q + (t * Hq + kvh * G + c % G) * D;
        for (int64_t d = 0; d < D; d += 2) {
            uint32_t pair;
            memcpy(&pair, qrow + d, sizeof pair);
            qp[(d / 32) * 256 + ((d % 32) / 2) * 16 + j] = pair;
        }
    }
    amx_configure();
    float *st = s.tile_scores;
    for (int64_t k0 = 0; k0 < N; k0 += 16) {
        const uint16_t *keys = kbase + k0 * D;
        int64_t key_stride = D * 2;
        if (k0 + 16 > L) { /* the tile would read past the cache row: a zero-padded copy */
            memset(s.key_tail, 0, sizeof(uint16_t) * 16 * D);
            memcpy(s.key_tail, keys, sizeof(uint16_t) * (N - k0) * D);
            keys = s.key_tail;
        }
        _tile_zero(0);
        for (int64_t db = 0; db < DB; db++) {
            _tile_loadd(5, keys + 32 * db, key_stride);
            _tile_loadd(4, qp + db * 256, 64);
            _tile_dpbf16ps(0, 5, 4);
        }
        _tile_stored(0, st + k0 * 16, 64);
    }
    _tile_release();
    float total[AMX_COLUMNS];
    for (int64_t j = 0; j < nc; j++) { /* column j's visible scores, in key order, then its softmax */
        const int64_t t = t0 + (c0 + j) / G;
        const int32_t *mask_row = mask ? mask + t * W : 0;
        float *row = s.scores + j * stride;
        int64_t n = 0;
        for (int64_t p = 0; p < prefix; p++) row[n++] = st[p * 16 + j];
        for (int64_t k = 0; k < fresh; k++)
            if (key_visible(mask_row, k, row_index[t])) row[n++] = st[(prefix + k) * 16 + j];
        total[j] = amx_softmax_row(row, n, sm_scale);
    }
    for (int64_t j0 = 0; j0 < nc; j0 += PV_COLUMNS) {
        const int64_t g = nc - j0 < PV_COLUMNS ? nc - j0 : PV_COLUMNS;
        switch (g) {
            case 6: amx_values(6, j0, t0, c0, kvh, vbase, out, prefix, fresh, row_index, mask, W, Hq, G, D, stride, total, s); break;
            case 5: amx_values(5, j0, t0, c0, kvh, vbase, out, prefix, fresh, row_index, mask, W, Hq, G, D, stride, total, s); break;
            case 4: amx_values(4, j0, t0, c0, kvh, vbase, out, prefix, fresh, row_index, mask, W, Hq, G, D, stride, total, s); break;
            case 3: amx_values(3, j0, t0, c0, kvh, vbase, out, prefix, fresh, row_index, mask, W, Hq, G, D, stride, total, s); break;
            case 2: amx_values(2, j0, t0, c0, kvh, vbase, out, prefix, fresh, row_index, mask, W, Hq, G, D, stride, total, s); break;
            default: amx_values(1, j0, t0, c0, kvh, vbase, out, prefix, fresh, row_index, mask, W, Hq, G, D, stride, total, s); break;
        }
    }
}

/* Whether the AMX attention serves these shapes: the road is on and a tile product covers the
 * head dimension in whole 64-dim steps. */
static int amx_attention(int64_t D) { return g_isa == ISA_AMX && D % 64 == 0; }

/* The AMX attention's work items for T rows: per run of rows of one request (same cache row,
 * committed length and count of new tokens), its columns (row, query head of one KV head) in
 * chunks of AMX_COLUMNS. item_row[i] is the run's first row, item_col[i] its first column in the
 * run, item_cols[i] how many; the items are the same for every KV head. Returns the count. */
static int64_t amx_items(int64_t T, int64_t G, const int64_t *row_slot, const int64_t *row_prefix,
                         const int64_t *row_new, int64_t *item_row, int64_t *item_col, int64_t *item_cols) {
    int64_t items = 0;
    for (int64_t t0 = 0; t0 < T;) {
        int64_t t1 = t0 + 1;
        while (t1 < T && row_slot[t1] == row_slot[t0] && row_prefix[t1] == row_prefix[t0] && row_new[t1] == row_new[t0])
            t1++;
        const int64_t columns = (t1 - t0) * G;
        for (int64_t c = 0; c < columns; c += AMX_COLUMNS) {
            item_row[items] = t0;
            item_col[items] = c;
            item_cols[items++] = columns - c < AMX_COLUMNS ? columns - c : AMX_COLUMNS;
        }
        t0 = t1;
    }
    return items;
}

/* Thread me's share of the AMX attention's items (amx_items' three arrays, `cap` apart), every
 * item for every KV head: the caches are one layer's [S, Hkv, L, D]. */
static void attend_items(int64_t me, int64_t team, int64_t count, const int64_t *items, int64_t cap, const uint16_t *q,
                         const uint16_t *k_cache, const uint16_t *v_cache, uint16_t *out, const int64_t *row_slot,
                         const int64_t *row_prefix, const int64_t *row_index, const int64_t *row_new,
                         const int32_t *mask, int64_t W, int64_t Hq, int64_t Hkv, int64_t L, int64_t D, float sm_scale,
                         attention_scratch s) {
    for (int64_t item = count * Hkv * me / team; item < count * Hkv * (me + 1) / team; item++) {
        const int64_t i = item / Hkv, kvh = item % Hkv, t0 = items[i], at = (row_slot[t0] * Hkv + kvh) * L * D;
        amx_attend_columns(t0, items[cap + i], items[2 * cap + i], kvh, q, k_cache + at, v_cache + at, out,
                           row_prefix[t0], row_new[t0], row_index, mask, W, Hq, Hq / Hkv, L, D, sm_scale, s);
    }
}

int treespec_tree_attention_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, uint16_t *out,
                                 const int64_t *row_slot, const int64_t *row_prefix, const int64_t *row_index,
                                 const int64_t *row_new, const int32_t *mask, int64_t W, int64_t T, int64_t Hq,
                                 int64_t Hkv, int64_t L, int64_t D, float sm_scale) {
    const int threads = omp_get_max_threads();
    attention_scratch *pool = scratch_pool(L, D, threads);
    if (!pool) return TREESPEC_NO_MEMORY;
    const int64_t G = Hq / Hkv, cap = T * G / AMX_COLUMNS + T + 1;
    int64_t *items = amx_attention(D) ? malloc(sizeof(int64_t) * 3 * cap) : 0;
    if (amx_attention(D) && !items) {
        scratch_pool_free(pool, threads);
        return TREESPEC_NO_MEMORY;
    }
    const int64_t count = items ? amx_items(T, G, row_slot, row_prefix, row_new, items, items + cap, items + 2 * cap) : 0;
#pragma omp parallel num_threads(threads)
    {
        const int me = omp_get_thread_num(), team = omp_get_num_threads();
        const attention_scratch s = pool[me];
        if (items)
            attend_items(me, team, count, items, cap, q, k_cache, v_cache, out, row_slot, row_prefix, row_index, row_new,
                         mask, W, Hq, Hkv, L, D, sm_scale, s);
        else
            for (int64_t item = (T * Hkv) * me / team; item < (T * Hkv) * (me + 1) / team; item++)
                attend_item(item / Hkv, item % Hkv, q, k_cache, v_cache, out, row_slot, row_prefix, row_index,
                            row_new, mask, W, Hq, Hkv, L, D, sm_scale, s); /* one row, one KV head, its query heads */
    }
    free(items);
    scratch_pool_free(pool, threads);
    return 0;
}

/* A whole Llama-style decoder stack for one step, in one call: for each layer
 *   x = RMSNorm(h); q, k, v = x Wq, x Wk, x Wv (+ biases); rotary on q and k; K/V to the cache;
 *   a = tree attention; h = h + a Wo; x = RMSNorm(h); h = h + (SiLU(x Wg) * (x Wu)) Wd
 * and the final RMSNorm, for T rows at once (a step's new tokens of every request). The values
 * are rounded to bf16 where a bf16 Hugging Face model rounds them (every linear output, each
 * product and sum of the rotary, the normed rows before and after their weight, SiLU, its
 * product, each residual sum), and each output is computed by one fixed sequence whatever T is:
 * the linear layers and the attention are the kernels above, and the row-wise parts (RMSNorm's
 * sum of squares, SiLU, the rotary) read only their own row. So the stack is batch-invariant as
 * the per-layer path is, and agrees with it up to RMSNorm's summation order.
 *
 * One OpenMP region for the whole stack: every thread runs every phase on its share, with a
 * barrier between phases, instead of a parallel region (and a Python call) per operator.
 *
 * hidden   [T, H] bf16: the embeddings in, the final normed rows out
 * weights  per layer, W_COUNT pointers (enum below): bf16 matrices in nn.Linear layout and bf16
 *          norm weights; the q/k/v biases fp32 (exact widenings) or NULL
 * cos, sin [T, D] bf16 rotary tables of each row's position (the model's own, as HF casts them)
 * caches   [layers, S, Hkv, L, D] bf16; row t writes position row_prefix[t] + row_index[t] of
 *          row row_slot[t] and attends as treespec_tree_attention_bf16 does
 * layer_out  [layers] pointers, each [T, H] bf16 or NULL: the residual stream after layer i
 * A NULL input norm (W_IN_NORM) feeds the layer its rows unnormed, and a NULL final_norm leaves
 * the last residual stream as it is: an EAGLE-1 head's layer, which has neither. */
enum { W_IN_NORM, W_Q, W_K, W_V, W_O, W_POST_NORM, W_GATE, W_UP, W_DOWN, W_Q_BIAS, W_K_BIAS, W_V_BIAS, W_COUNT };

/* Rows r0..r1 of h [., H] bf16: RMSNorm with weight w, into out_f (fp32 widenings of the bf16
 * result, what the next linear reads) and, when out_b, the bf16 rows themselves. */
static void rmsnorm_rows(const uint16_t *h, const uint16_t *w, float eps, int64_t r0, int64_t r1, int64_t H,
                         float *out_f, uint16_t *out_b) {
    const int64_t H8 = H & ~(int64_t)7;
    if (!w) { /* no norm (an EAGLE-1 head's layer): the rows as they are */
        for (int64_t e = r0 * H; e < r1 * H; e++) {
            out_f[e] = widen_one(h[e]);
            if (out_b) out_b[e] = h[e];
        }
        return;
    }
    for (int64_t r = r0; r < r1; r++) {
        const uint16_t *row = h + r * H;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t k = 0; k < H8; k += 8) {
            const __m256 v = widen_bf16(row + k);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float sum = lanes_sum(acc);
        for (int64_t k = H8; k < H; k++) sum = __builtin_fmaf(widen_one(row[k]), widen_one(row[k]), sum);
        const float inv = 1.0f / sqrtf(sum / (float)H + eps);
        for (int64_t k = 0; k < H; k++) {
            const uint16_t normed = round_bf16(widen_one(row[k]) * inv);
            const uint16_t scaled = round_bf16(widen_one(w[k]) * widen_one(normed));
            out_f[r * H + k] = widen_one(scaled);
            if (out_b) out_b[r * H + k] = scaled;
        }
    }
}

static inline uint16_t bf16_mul(uint16_t a, uint16_t b) { return round_bf16(widen_one(a) * widen_one(b)); }
static inline uint16_t bf16_add(uint16_t a, uint16_t b) { return round_bf16(widen_one(a) + widen_one(b)); }

/* HF's rotary, rounded as a bf16 model rounds it: x * cos + rotate_half(x) * sin, with
 * rotate_half(x) = (-x[D/2:], x[:D/2]); src and dst one head's D values (fp32 linear outputs). */
static inline void rotary(const float *src, const uint16_t *cos, const uint16_t *sin, int64_t D, uint16_t *dst) {
    const int64_t half = D / 2;
    for (int64_t d = 0; d < D; d++) {
        const uint16_t x = round_bf16(src[d]);
        const uint16_t other = round_bf16(d < half ? -src[d + half] : src[d - half]);
        dst[d] = bf16_add(bf16_mul(x, cos[d]), bf16_mul(other, sin[d]));
    }
}

/* Where a step's time goes, phase by phase (built with -DTREESPEC_PHASE_TIMES only, by
 * scripts/profile_step.py --phases): thread 0's wall time from barrier to barrier, summed. */
#ifdef TREESPEC_PHASE_TIMES
double treespec_phase_seconds[16];
static double phase_last;
#define MARK(i)                                                             \
    do {                                                                    \
        if (me == 0) {                                                      \
            const double now = omp_get_wtime();                             \
            treespec_phase_seconds[i] += now - phase_last;                  \
            phase_last = now;                                               \
        }                                                                   \
    } while (0)
#define MARK_START() (phase_last = omp_get_wtime())
#else
#define MARK(i) ((void)0)
#define MARK_START() ((void)0)
#endif

int treespec_decoder_bf16(uint16_t *hidden, const void *const *weights, const uint16_t *final_norm,
                           int64_t num_layers, int64_t T, int64_t H, int64_t I, int64_t Hq, int64_t Hkv, int64_t D,
                           float eps, float sm_scale, const uint16_t *cos, const uint16_t *sin, uint16_t *k_cache,
                           uint16_t *v_cache, int64_t S, int64_t L, const int64_t *row_slot,
                           const int64_t *row_prefix, const int64_t *row_index, const int64_t *row_new,
                           const int32_t *mask, int64_t W, uint16_t *const *layer_out) {
    const int64_t QD = Hq * D, KD = Hkv * D, layer_cache = S * Hkv * L * D;
    const int64_t widest_in = H > I ? (H > QD ? H : QD) : (I > QD ? I : QD);
    const int64_t widest_out = QD + 2 * KD > 2 * I ? QD + 2 * KD : 2 * I;
    float *x = malloc(sizeof(float) * T * widest_in);                      /* the next linear's input */
    float *y = malloc(sizeof(float) * T * (widest_out > H ? widest_out : H)); /* linear outputs */
    uint16_t *xb = malloc(sizeof(uint16_t) * T * widest_in); /* the same input in bf16 (AVX512-BF16 road) */
    uint16_t *qb = malloc(sizeof(uint16_t) * T * QD), *attn = malloc(sizeof(uint16_t) * T * QD);
    const int team = omp_get_max_threads();
    const int64_t pack = share_scratch(xb, T, widest_in); /* xb is set whenever it matters */
    uint32_t *xp = pack ? malloc(sizeof(uint32_t) * pack * team) : 0;
    const int64_t cap = T * (Hq / Hkv) / AMX_COLUMNS + T + 1;
    int64_t *items = amx_attention(D) ? malloc(sizeof(int64_t) * 3 * cap) : 0;
    attention_scratch *pool =
        x && xb && y && qb && attn && (xp || !pack) && (items || !amx_attention(D)) ? scratch_pool(L, D, team) : 0;
    if (!pool) { /* nothing computed, nothing left allocated */
        free(items);
        free(xp);
        free(x);
        free(xb);
        free(y);
        free(qb);
        free(attn);
        return TREESPEC_NO_MEMORY;
    }
    const int64_t n_qkv[3] = {QD, KD, KD}, n_gu[2] = {I, I}, n_h[1] = {H};
    int64_t fq_qkv[4], fq_gu[3], fq_h[2], fq_down[2];
    group_offsets(3, n_qkv, fq_qkv);
    group_offsets(2, n_gu, fq_gu);
    group_offsets(1, n_h, fq_h);
    group_offsets(1, n_h, fq_down);
    float *y_qkv[3] = {y, y + T * QD, y + T * (QD + KD)}, *y_gu[2] = {y, y + T * I}, *y_h[1] = {y};
    const int64_t count = items ? amx_items(T, Hq / Hkv, row_slot, row_prefix, row_new, items, items + cap, items + 2 * cap) : 0;
    MARK_START();
#pragma omp parallel num_threads(team)
    {
        const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t r0 = T * me / threads, r1 = T * (me + 1) / threads;
        const attention_scratch s = pool[me];
        uint32_t *my_xp = xp ? xp + me * pack : 0;
        for (int64_t layer = 0; layer < num_layers; layer++) {
            const void *const *lw = weights + layer * W_COUNT;
            uint16_t *kc = k_cache + layer * layer_cache, *vc = v_cache + layer * layer_cache;
            rmsnorm_rows(hidden, lw[W_IN_NORM], eps, r0, r1, H, x, xb);
#pragma omp barrier
            MARK(0);
            const uint16_t *w_qkv[3] = {lw[W_Q], lw[W_K], lw[W_V]};
            const float *b_qkv[3] = {lw[W_Q_BIAS], lw[W_K_BIAS], lw[W_V_BIAS]};
            linear_share(me, threads, x, xb, T, H, 3, w_qkv, b_qkv, y_qkv, n_qkv, fq_qkv, my_xp);
#pragma omp barrier
            MARK(1);
            /* rotary on q and k, K/V into the cache: one (row, head) item at a time */
            for (int64_t item = (T * (Hq + Hkv)) * me / threads; item < (T * (Hq + Hkv)) * (me + 1) / threads; item++) {
                const int64_t t = item / (Hq + Hkv), head = item % (Hq + Hkv);
                const uint16_t *c = cos + t * D, *sn = sin + t * D;
                if (head < Hq) {
                    rotary(y_qkv[0] + t * QD + head * D, c, sn, D, qb + t * QD + head * D);
                } else {
                    const int64_t kvh = head - Hq, at = ((row_slot[t] * Hkv + kvh) * L + row_prefix[t] + row_index[t]) * D;
                    rotary(y_qkv[1] + t * KD + kvh * D, c, sn, D, kc + at);
                    const float *v = y_qkv[2] + t * KD + kvh * D;
                    for (int64_t d = 0; d < D; d++) vc[at + d] = round_bf16(v[d]);
                }
            }
#pragma omp barrier
            MARK(2);
            if (items)
                attend_items(me, threads, count, items, cap, qb, kc, vc, attn, row_slot, row_prefix, row_index, row_new,
                             mask, W, Hq, Hkv, L, D, sm_scale, s);
            else
                for (int64_t item = (T * Hkv) * me / threads; item < (T * Hkv) * (me + 1) / threads; item++)
                    attend_item(item / Hkv, item % Hkv, qb, kc, vc, attn, row_slot, row_prefix, row_index, row_new,
                                mask, W, Hq, Hkv, L, D, sm_scale, s);
#pragma omp barrier
            MARK(3);
            if (g_isa == ISA_AVX2) {
                for (int64_t e = (T * QD) * me / threads; e < (T * QD) * (me + 1) / threads; e++)
                    x[e] = widen_one(attn[e]);
#pragma omp barrier
            MARK(4);
            }
            const uint16_t *w_o[1] = {lw[W_O]};
            const float *no_bias[2] = {0, 0};
            linear_share(me, threads, x, attn, T, QD, 1, w_o, no_bias, y_h, n_h, fq_h, my_xp);
#pragma omp barrier
            MARK(5);
            for (int64_t e = T * H * me / threads; e < T * H * (me + 1) / threads; e++)
                hidden[e] = bf16_add(hidden[e], round_bf16(y[e]));
#pragma omp barrier
            MARK(6);
            rmsnorm_rows(hidden, lw[W_POST_NORM], eps, r0, r1, H, x, xb);
#pragma omp barrier
            MARK(7);
            const uint16_t *w_gu[2] = {lw[W_GATE], lw[W_UP]};
            linear_share(me, threads, x, xb, T, H, 2, w_gu, no_bias, y_gu, n_gu, fq_gu, my_xp);
#pragma omp barrier
            MARK(8);
            {
                const int64_t runs = (T * I + 7) / 8, e0 = 8 * (runs * me / threads), e1 = 8 * (runs * (me + 1) / threads);
                for (int64_t e = e0; e < e1 && e < T * I; e += 8) {
                    const int64_t n = T * I - e < 8 ? T * I - e : 8;
                    if (n == 8) { /* the scalar sequence below, eight lanes at a time: the same bits */
                        const __m256 gate = widen_rounded8(_mm256_loadu_ps(y_gu[0] + e));
                        const __m256 ex = exp8(_mm256_xor_ps(gate, _mm256_set1_ps(-0.0f)));
                        const __m256 act = widen_rounded8(_mm256_div_ps(gate, _mm256_add_ps(_mm256_set1_ps(1.0f), ex)));
                        const __m256i prod = round_bf16x8(_mm256_mul_ps(act, widen_rounded8(_mm256_loadu_ps(y_gu[1] + e))));
                        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(prod, prod), 0x08);
                        _mm_storeu_si128((__m128i *)(xb + e), _mm256_castsi256_si128(packed));
                        _mm256_storeu_ps(x + e, _mm256_castsi256_ps(_mm256_slli_epi32(prod, 16)));
                        continue;
                    }
                    float gate[8], minus[8], ex[8];
                    for (int64_t j = 0; j < n; j++) {
                        gate[j] = widen_one(round_bf16(y_gu[0][e + j]));
                        minus[j] = -gate[j];
                    }
                    exp_run(minus, ex, n);
                    for (int64_t j = 0; j < n; j++) {
                        const uint16_t act = round_bf16(gate[j] / (1.0f + ex[j]));
                        xb[e + j] = bf16_mul(act, round_bf16(y_gu[1][e + j]));
                        x[e + j] = widen_one(xb[e + j]);
                    }
                }
            }
#pragma omp barrier
            MARK(9);
            const uint16_t *w_d[1] = {lw[W_DOWN]};
            linear_share(me, threads, x, xb, T, I, 1, w_d, no_bias, y_h, n_h, fq_down, my_xp);
#pragma omp barrier
            MARK(10);
            for (int64_t e = T * H * me / threads; e < T * H * (me + 1) / threads; e++) {
                hidden[e] = bf16_add(hidden[e], round_bf16(y[e]));
                if (layer_out[layer]) layer_out[layer][e] = hidden[e];
            }
#pragma omp barrier
            MARK(11);
        }
        if (final_norm) rmsnorm_rows(hidden, final_norm, eps, r0, r1, H, x, hidden); /* each row reads only itself */
#pragma omp barrier
        MARK(12);
    }
    scratch_pool_free(pool, team);
    free(items);
    free(xp);
    free(x);
    free(xb);
    free(y);
    free(qb);
    free(attn);
    return 0;
}

/* The arithmetic peak of a road, for the kernel micro-benchmark (scripts/bench_cpu_kernels.py):
 * every thread runs twelve independent chains of fp32 FMAs (AVX2: 16 flops each) or of bf16 dot
 * products (AVX512-BF16: 64 flops each) from registers, `iterations` times, or on the AMX road
 * four chains of tile products (16,384 flops each) iterations / 64 times. Returns flops per
 * second over all threads. */
BF16_TARGET static double peak_bf16(int64_t iterations) {
    __m512 acc[12];
    const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3c00);
    for (int i = 0; i < 12; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t n = 0; n < iterations; n++)
        for (int i = 0; i < 12; i++) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
    float sink = 0.0f, dots[4];
    for (int i = 0; i < 12; i += 4) {
        sums4(acc[i], acc[i + 1], acc[i + 2], acc[i + 3], dots);
        sink += dots[0] + dots[1] + dots[2] + dots[3];
    }
    return sink;
}

AMX_TARGET static double peak_amx(int64_t iterations) { /* four independent accumulator tiles */
    static const uint16_t zeros[16 * 32] = {0};
    float out[256];
    amx_configure();
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, zeros, 64);
    _tile_loadd(5, zeros, 64);
    for (int64_t n = 0; n < iterations; n++) {
        _tile_dpbf16ps(0, 5, 4);
        _tile_dpbf16ps(1, 5, 4);
        _tile_dpbf16ps(2, 5, 4);
        _tile_dpbf16ps(3, 5, 4);
    }
    _tile_stored(0, out, 64);
    _tile_release();
    return out[0];
}

static double peak_fma(int64_t iterations) {
    __m256 acc[12];
    const __m256 a = _mm256_set1_ps(1.0f), b = _mm256_set1_ps(1e-8f);
    for (int i = 0; i < 12; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t n = 0; n < iterations; n++)
        for (int i = 0; i < 12; i++) acc[i] = _mm256_fmadd_ps(a, b, acc[i]);
    float sink = 0.0f;
    for (int i = 0; i < 12; i++) sink += lanes_sum(acc[i]);
    return sink;
}

double treespec_peak_flops(int isa, int64_t iterations) {
    double start = 0.0, seconds = 0.0, sink = 0.0;
    int threads = 1;
#pragma omp parallel reduction(+ : sink)
    {
#pragma omp single
        threads = omp_get_num_threads();
#pragma omp barrier
#pragma omp master
        start = omp_get_wtime();
        sink += isa == ISA_AMX ? peak_amx(iterations / 64) : isa == ISA_AVX512_BF16 ? peak_bf16(iterations) : peak_fma(iterations);
#pragma omp barrier
#pragma omp master
        seconds = omp_get_wtime() - start;
    }
    if (sink == -1.0) return 0.0; /* keeps the chains live */
    if (isa == ISA_AMX) return (double)threads * (double)(iterations / 64) * 4.0 * 16384.0 / seconds;
    return (double)threads * (double)iterations * 12.0 * (isa == ISA_AVX512_BF16 ? 64.0 : 16.0) / seconds;
}

/* A drafter's whole tree in one call: its own file, one translation unit with this one (one build). */
#include "draft_tree.c"
