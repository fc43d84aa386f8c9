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
