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

static inline int key_visible(const int32_t *mask_row, int64_t j, int64_t row_index) {
    if (!mask_row) return j <= row_index;
    return (int)(((uint32_t)mask_row[j >> 5] >> (j & 31)) & 1u);
}

/* Per-thread scratch of the attention: scores for up to COLUMNS (row, query head) columns against
 * up to L + 4 keys, the columns' queries in fp32; on the AMX road its tile operands. */
enum { COLUMNS = 16 }; /* (row, query head) columns that share each key and value load */
typedef struct {
    float *scores;       /* AVX2: [key][COLUMNS] S; AMX: per column its visible scores, L + 4 apart */
    float *qf;           /* AVX2: the columns' queries widened to fp32, [COLUMNS][D] */
    float *tile_scores;  /* AMX road: [L + 16 keys][16 columns] fp32, the tile products' S^T */
    uint32_t *q_pairs;   /* AMX road: 16 queries in AMX's pair layout, per block of 32 dims */
    uint16_t *key_tail;  /* AMX road: the last keys of a cache row, zero-padded to 16 */
} attention_scratch;

static void scratch_pool_free(attention_scratch *pool, int count) {
    for (int i = 0; i < count; i++) {
        free(pool[i].scores);
        free(pool[i].qf);
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
        pool[i] = (attention_scratch){malloc(sizeof(float) * COLUMNS * (L + 4)), malloc(sizeof(float) * COLUMNS * D),
                                      amx ? malloc(sizeof(float) * 16 * (L + 16)) : 0,
                                      amx ? malloc(sizeof(uint32_t) * 256 * ((D + 31) / 32)) : 0,
                                      amx ? malloc(sizeof(uint16_t) * 16 * D) : 0};
        if (!pool[i].scores || !pool[i].qf || (amx && (!pool[i].tile_scores || !pool[i].q_pairs || !pool[i].key_tail))) {
            scratch_pool_free(pool, count);
            return 0;
        }
    }
    return pool;
}

/* lanes_sum of eight accumulators at once, each in lanes_sum's own order ((0+4, 1+5, 2+6, 3+7),
 * then (0+2, 1+3), then the last pair): the same additions of the same values, so the same bits,
 * for about a third of the instructions. Returns [a0 a2 a4 a6 | a1 a3 a5 a7]. */
static inline __m256 lanes_sum8(const __m256 a[8]) {
    __m256 b[4]; /* b[i]: a[2i]'s four halves' sums, then a[2i+1]'s */
    for (int i = 0; i < 4; i++)
        b[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x20),
                             _mm256_permute2f128_ps(a[2 * i], a[2 * i + 1], 0x31));
    __m256 c[2]; /* c[i]: (s0+s2, s1+s3) of a[4i], a[4i+2] | of a[4i+1], a[4i+3] */
    for (int i = 0; i < 2; i++)
        c[i] = _mm256_add_ps(_mm256_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    return _mm256_add_ps(_mm256_shuffle_ps(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm256_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* The scores of four fp32 queries (q, D apart) against keys k0 and k1 into s0[0..3] and s1[0..3]:
 * each key widened once for the four, each score one fixed sequence (eight lanes in increasing d,
 * lanes_sum's order, the D % 8 tail last). */
static inline void dots_2x4(const float *q, int64_t D, const uint16_t *k0, const uint16_t *k1, float *s0, float *s1) {
    const int64_t D8 = D & ~(int64_t)7;
    __m256 a[8]; /* a[2j]: query j against k0, a[2j + 1]: against k1 */
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D8; d += 8) {
        const __m256 x0 = widen_bf16(k0 + d), x1 = widen_bf16(k1 + d);
        for (int j = 0; j < 4; j++) {
            const __m256 qv = _mm256_loadu_ps(q + j * D + d);
            a[2 * j] = _mm256_fmadd_ps(qv, x0, a[2 * j]);
            a[2 * j + 1] = _mm256_fmadd_ps(qv, x1, a[2 * j + 1]);
        }
    }
    const __m256 sums = lanes_sum8(a);
    _mm_storeu_ps(s0, _mm256_castps256_ps128(sums));
    _mm_storeu_ps(s1, _mm256_extractf128_ps(sums, 1));
    for (int j = 0; j < 4 && D8 < D; j++) {
        s0[j] = add_tail(q + j * D, k0, D8, D, s0[j]);
        s1[j] = add_tail(q + j * D, k1, D8, D, s1[j]);
    }
}

enum { PV_TILE = 5 }; /* columns per value tile: 2 PV_TILE accumulators, two value vectors, a weight */

/* The values of g columns (g a constant, the accumulators in registers) over dims d0 .. d0 + 15:
 * per column one FMA per visible key in key order (the committed keys, which every column sees,
 * then its visible new ones), each value row widened once for the g columns; e: the weights,
 * [key][COLUMNS] from column j0. Writes acc[j][0..15]. */
static inline __attribute__((always_inline)) void values_16(const int g, const float *e, const uint16_t *vbase,
                                                            int64_t d0, int64_t D, int64_t prefix, int64_t fresh,
                                                            const int32_t *const *mask_row, const int64_t *index,
                                                            float (*acc)[16]) {
    __m256 a[PV_TILE][2];
    for (int j = 0; j < g; j++) a[j][0] = a[j][1] = _mm256_setzero_ps();
    for (int64_t p = 0; p < prefix; p++) {
        const uint16_t *v = vbase + p * D + d0;
        const __m256 v0 = widen_bf16(v), v1 = widen_bf16(v + 8);
        for (int j = 0; j < g; j++) {
            const __m256 w = _mm256_broadcast_ss(e + p * COLUMNS + j);
            a[j][0] = _mm256_fmadd_ps(w, v0, a[j][0]);
            a[j][1] = _mm256_fmadd_ps(w, v1, a[j][1]);
        }
    }
    for (int64_t k = 0; k < fresh; k++) {
        const uint16_t *v = vbase + (prefix + k) * D + d0;
        const __m256 v0 = widen_bf16(v), v1 = widen_bf16(v + 8);
        for (int j = 0; j < g; j++) {
            if (!key_visible(mask_row[j], k, index[j])) continue;
            const __m256 w = _mm256_broadcast_ss(e + (prefix + k) * COLUMNS + j);
            a[j][0] = _mm256_fmadd_ps(w, v0, a[j][0]);
            a[j][1] = _mm256_fmadd_ps(w, v1, a[j][1]);
        }
    }
    for (int j = 0; j < g; j++) {
        _mm256_storeu_ps(acc[j], a[j][0]);
        _mm256_storeu_ps(acc[j] + 8, a[j][1]);
    }
}

/* Attention on the AVX2 (and AVX512-BF16) road for nc <= COLUMNS (row, query head) columns that
 * share a cache row and KV head, as amx_attend_columns takes them (column c: row t0 + c / G, head
 * kvh * G + c % G). The scores of every column against every key come four columns and two keys
 * at a time, so each key is loaded and widened once per four columns; the softmax and the values
 * run across the columns. Each column's output is the sequence of its one-token step: its scores
 * as fixed-order dot products, scaled; the maximum over its visible keys; exp(score - max) with
 * their sum in key order (committed keys, then its visible new ones); one FMA per visible key in
 * key order for the values; one division. No other column's presence changes a bit of it. */
static void avx2_attend_columns(int64_t t0, int64_t c0, int64_t nc, int64_t kvh, const uint16_t *q,
                                const uint16_t *kbase, const uint16_t *vbase, uint16_t *out, int64_t prefix,
                                int64_t fresh, const int64_t *row_index, const int32_t *mask, int64_t W, int64_t Hq,
                                int64_t G, int64_t D, float sm_scale, attention_scratch s) {
    const int64_t n = prefix + fresh, padded = (nc + 3) & ~(int64_t)3;
    const int32_t *mask_row[COLUMNS];
    int64_t index[COLUMNS], head_at[COLUMNS];
    for (int64_t j = 0; j < COLUMNS; j++) { /* columns past nc repeat the last one: computed, never used */
        const int64_t c = c0 + (j < nc ? j : nc - 1), t = t0 + c / G;
        mask_row[j] = mask ? mask + t * W : 0;
        index[j] = row_index[t];
        head_at[j] = (t * Hq + kvh * G + c % G) * D;
    }
    float *qf = s.qf, *e = s.scores;
    for (int64_t j = 0; j < padded; j++)
        for (int64_t d = 0; d < D; d++) qf[j * D + d] = widen_one(q[head_at[j] + d]);
    for (int64_t i = 0; i < n; i += 2) { /* an odd last key is paired with itself */
        const uint16_t *k0 = kbase + i * D, *k1 = kbase + (i + 1 < n ? i + 1 : i) * D;
        for (int64_t j = 0; j < padded; j += 4)
            dots_2x4(qf + j * D, D, k0, k1, e + i * COLUMNS + j, e + (i + 1) * COLUMNS + j);
    }
    float total[COLUMNS];
    const __m256 scale = _mm256_set1_ps(sm_scale);
    for (int64_t j0 = 0; j0 < nc; j0 += 8) { /* eight columns at a time, each in its lane */
        __m256 best = _mm256_set1_ps(-INFINITY);
        for (int64_t i = 0; i < n; i++) {
            const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(e + i * COLUMNS + j0), scale);
            _mm256_storeu_ps(e + i * COLUMNS + j0, v);
            if (i < prefix) best = _mm256_max_ps(v, best); /* v > best ? v : best, as a scalar max */
        }
        float top[8];
        _mm256_storeu_ps(top, best);
        for (int64_t j = 0; j < 8 && j0 + j < nc; j++)
            for (int64_t k = 0; k < fresh; k++)
                if (key_visible(mask_row[j0 + j], k, index[j0 + j]) && e[(prefix + k) * COLUMNS + j0 + j] > top[j])
                    top[j] = e[(prefix + k) * COLUMNS + j0 + j];
        best = _mm256_loadu_ps(top);
        __m256 sum = _mm256_setzero_ps();
        for (int64_t i = 0; i < n; i++) {
            const __m256 w = exp8(_mm256_sub_ps(_mm256_loadu_ps(e + i * COLUMNS + j0), best));
            _mm256_storeu_ps(e + i * COLUMNS + j0, w);
            if (i < prefix) sum = _mm256_add_ps(sum, w);
        }
        _mm256_storeu_ps(total + j0, sum);
        for (int64_t j = 0; j < 8 && j0 + j < nc; j++)
            for (int64_t k = 0; k < fresh; k++)
                if (key_visible(mask_row[j0 + j], k, index[j0 + j])) total[j0 + j] += e[(prefix + k) * COLUMNS + j0 + j];
    }
    const int64_t D16 = D & ~(int64_t)15;
    for (int64_t j0 = 0; j0 < nc; j0 += PV_TILE) {
        const int g = nc - j0 < PV_TILE ? (int)(nc - j0) : PV_TILE;
        for (int64_t d0 = 0; d0 < D16; d0 += 16) {
            float acc[PV_TILE][16];
            switch (g) {
                case 5: values_16(5, e + j0, vbase, d0, D, prefix, fresh, mask_row + j0, index + j0, acc); break;
                case 4: values_16(4, e + j0, vbase, d0, D, prefix, fresh, mask_row + j0, index + j0, acc); break;
                case 3: values_16(3, e + j0, vbase, d0, D, prefix, fresh, mask_row + j0, index + j0, acc); break;
                case 2: values_16(2, e + j0, vbase, d0, D, prefix, fresh, mask_row + j0, index + j0, acc); break;
                default: values_16(1, e + j0, vbase, d0, D, prefix, fresh, mask_row + j0, index + j0, acc); break;
            }
            for (int j = 0; j < g; j++)
                for (int x = 0; x < 16; x++) out[head_at[j0 + j] + d0 + x] = round_bf16(acc[j][x] / total[j0 + j]);
        }
        for (int j = 0; j < g; j++) /* the D % 16 last dims: the same FMA per visible key, one lane at a time */
            for (int64_t d = D16; d < D; d++) {
                const int64_t c = j0 + j;
                float a = 0.0f;
                for (int64_t p = 0; p < prefix; p++) a = __builtin_fmaf(e[p * COLUMNS + c], widen_one(vbase[p * D + d]), a);
                for (int64_t k = 0; k < fresh; k++)
                    if (key_visible(mask_row[c], k, index[c]))
                        a = __builtin_fmaf(e[(prefix + k) * COLUMNS + c], widen_one(vbase[(prefix + k) * D + d]), a);
                out[head_at[c] + d] = round_bf16(a / total[c]);
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

/* Attention on the AMX road, for up to COLUMNS (row, query head) columns that share a cache
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
    float total[COLUMNS];
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

/* The attention's work items for T rows: per run of rows of one request (same cache row, committed
 * length and count of new tokens), its columns (row, query head of one KV head) in chunks of
 * COLUMNS. item_row[i] is the run's first row, item_col[i] its first column in the run,
 * item_cols[i] how many; the items are the same for every KV head. Returns the count; `cap`
 * (column_cap) bounds it. */
static int64_t column_cap(int64_t T, int64_t G) { return T * G / COLUMNS + T + 1; }
static int64_t column_items(int64_t T, int64_t G, const int64_t *row_slot, const int64_t *row_prefix,
                            const int64_t *row_new, int64_t *item_row, int64_t *item_col, int64_t *item_cols) {
    int64_t items = 0;
    for (int64_t t0 = 0; t0 < T;) {
        int64_t t1 = t0 + 1;
        while (t1 < T && row_slot[t1] == row_slot[t0] && row_prefix[t1] == row_prefix[t0] && row_new[t1] == row_new[t0])
            t1++;
        const int64_t columns = (t1 - t0) * G;
        for (int64_t c = 0; c < columns; c += COLUMNS) {
            item_row[items] = t0;
            item_col[items] = c;
            item_cols[items++] = columns - c < COLUMNS ? columns - c : COLUMNS;
        }
        t0 = t1;
    }
    return items;
}

/* Thread me's share of the attention's items (column_items' three arrays, `cap` apart), every
 * item for every KV head: the caches are one layer's [S, Hkv, L, D]. */
static void attend_items(int64_t me, int64_t team, int64_t count, const int64_t *items, int64_t cap, const uint16_t *q,
                         const uint16_t *k_cache, const uint16_t *v_cache, uint16_t *out, const int64_t *row_slot,
                         const int64_t *row_prefix, const int64_t *row_index, const int64_t *row_new,
                         const int32_t *mask, int64_t W, int64_t Hq, int64_t Hkv, int64_t L, int64_t D, float sm_scale,
                         attention_scratch s) {
    const int amx = amx_attention(D);
    for (int64_t item = count * Hkv * me / team; item < count * Hkv * (me + 1) / team; item++) {
        const int64_t i = item / Hkv, kvh = item % Hkv, t0 = items[i], at = (row_slot[t0] * Hkv + kvh) * L * D;
        if (amx)
            amx_attend_columns(t0, items[cap + i], items[2 * cap + i], kvh, q, k_cache + at, v_cache + at, out,
                               row_prefix[t0], row_new[t0], row_index, mask, W, Hq, Hq / Hkv, L, D, sm_scale, s);
        else
            avx2_attend_columns(t0, items[cap + i], items[2 * cap + i], kvh, q, k_cache + at, v_cache + at, out,
                                row_prefix[t0], row_new[t0], row_index, mask, W, Hq, Hq / Hkv, D, sm_scale, s);
    }
}

int treespec_tree_attention_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, uint16_t *out,
                                 const int64_t *row_slot, const int64_t *row_prefix, const int64_t *row_index,
                                 const int64_t *row_new, const int32_t *mask, int64_t W, int64_t T, int64_t Hq,
                                 int64_t Hkv, int64_t L, int64_t D, float sm_scale) {
    const int threads = omp_get_max_threads();
    const int64_t G = Hq / Hkv, cap = column_cap(T, G);
    int64_t *items = malloc(sizeof(int64_t) * 3 * cap);
    attention_scratch *pool = items ? scratch_pool(L, D, threads) : 0;
    if (!pool) {
        free(items);
        return TREESPEC_NO_MEMORY;
    }
    const int64_t count = column_items(T, G, row_slot, row_prefix, row_new, items, items + cap, items + 2 * cap);
#pragma omp parallel num_threads(threads)
    attend_items(omp_get_thread_num(), omp_get_num_threads(), count, items, cap, q, k_cache, v_cache, out, row_slot,
                 row_prefix, row_index, row_new, mask, W, Hq, Hkv, L, D, sm_scale, pool[omp_get_thread_num()]);
    free(items);
    scratch_pool_free(pool, threads);
    return 0;
}
