/* The linear layer's entry points and its work split over threads, on whichever road the process
 * takes (linear_avx2.c, linear_avx512bf16.c, linear_amx.c). */

/* Whether a linear over x (xb: its bf16 copy, or NULL) runs on the AVX2 road's panels: always on
 * that road, and on the others where x comes in fp32 only (their products take x in bf16). The
 * caller hands such a linear its weights in panels (cpu_kernels.road_weight). */
static inline int avx2_panels(const uint16_t *xb) { return g_isa == ISA_AVX2 || !xb; }

/* The scratch one thread of linear_share needs for M rows of K columns, in 4-byte words (AMX's
 * pairs; the other roads read x as it is). */
static int64_t share_scratch(const uint16_t *xb, int64_t M, int64_t K) {
    return g_isa == ISA_AMX && xb ? amx_pack_size(M, K) : 0;
}

/* The weight rows in one unit of the work split: a panel on the AVX2 road, four tiles of four on
 * the AVX512-BF16 road. */
#define GROUP PANEL

/* One thread's share of y_i = x W_i^T + bias_i for `count` matrices read from the same x (fp32
 * [M, K], and xb its bf16 copy or NULL): thread `me` of `threads` takes a contiguous range of the
 * matrices' groups of GROUP weight rows (matrix i owns groups first_group[i] .. first_group[i+1]-1)
 * and computes them for every row of x, by blocks of ROW_BLOCK rows. y_i are fp32 [M, N_i]; biases
 * fp32 (each may be NULL). scratch: share_scratch(xb, M, K) words of this thread's own. */
static void linear_share(int64_t me, int64_t threads, const float *x, const uint16_t *xb, int64_t M, int64_t K,
                         int count, const uint16_t *const *w, const float *const *bias, float *const *y,
                         const int64_t *N, const int64_t *first_group, void *scratch) {
    if (g_isa == ISA_AMX && xb) {
        int64_t first_block[count + 1];
        block_offsets(count, N, first_block);
        amx_share(me, threads, xb, M, K, count, w, bias, y, N, first_block, scratch);
        return;
    }
    const int panels = avx2_panels(xb);
    const int64_t groups = first_group[count];
    const int64_t g0 = groups * me / threads, g1 = groups * (me + 1) / threads;
    for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK) {
        const int64_t m1 = m0 + ROW_BLOCK < M ? m0 + ROW_BLOCK : M;
        int i = 0;
        for (int64_t g = g0; g < g1;) {
            while (g >= first_group[i + 1]) i++;
            const int64_t n = GROUP * (g - first_group[i]);
            const float *b = bias[i] ? bias[i] + n : 0;
            if (panels) { /* this range's panels of matrix i in one sweep */
                const int64_t end = first_group[i + 1] < g1 ? first_group[i + 1] : g1;
                const int64_t last = GROUP * (end - first_group[i]);
                panel_rows(x + m0 * K, w[i] + n * K, b, y[i] + m0 * N[i] + n, m1 - m0, N[i], K, end - g,
                           (last < N[i] ? last : N[i]) - n);
                g = end;
                continue;
            }
            const int G = N[i] - n < GROUP ? (int)(N[i] - n) : GROUP; /* AVX512-BF16: tiles of four rows */
            for (int c = 0; c < G; c += 4)
                block_rows_bf16(xb, w[i] + (n + c) * K, b ? b + c : 0, y[i] + n + c, m0, m1, N[i], K,
                                G - c < 4 ? G - c : 4);
            g++;
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
    const int widen = x_bf16 && g_isa == ISA_AVX2; /* the panels read x in fp32 */
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
