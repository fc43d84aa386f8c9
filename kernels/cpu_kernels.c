/* y = x W^T for bf16 weights on an x86-64 CPU with AVX2 and FMA: the few-row products of a
 * decode or tree step.
 *
 * x is [M, K] fp32, W is [N, K] bf16 (the nn.Linear layout), y is [M, N] fp32. The weight stays
 * bf16 in memory (half the bytes of an fp32 copy: a one-row step is bound by reading it) and is
 * widened to fp32 in registers (bf16 is the top half of an fp32, so widening is a shift and
 * exact); products accumulate in fp32.
 *
 * Batch invariance: every output y[m, n] is computed by the same sequence of operations whatever
 * M is and wherever row m falls: eight fp32 lanes accumulate x[m, k:k+8] * W[n, k:k+8] with
 * fused multiply-adds in increasing k, the lanes are summed in one fixed order, and the K % 8
 * tail is added last, one fused multiply-add per k. A row scored alone (an autoregressive step)
 * and the same row scored among a tree's rows give the same bits. Built with
 * -ffp-contract=off, so the compiler adds no fusions of its own.
 *
 * Work split: threads take contiguous ranges of weight-row pairs (OpenMP, the process's own
 * runtime: PyTorch's libgomp is already loaded and serves this library too); within a range,
 * rows of x go by blocks of 64 (a block stays in L2 while the weight streams past it), and
 * register tiles of up to four weight rows by four x rows do the arithmetic.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define ROW_BLOCK 64

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

/* R rows of x (stride K) against C rows of W (stride K) into y (row stride N), plus the bias. */
static inline __attribute__((always_inline)) void tile(const float *x, const uint16_t *w, const float *bias,
                                                       float *y, int64_t N, int64_t K, const int R, const int C,
                                                       const char *prefetch) {
    __m256 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();
    const int64_t K8 = K & ~(int64_t)7;
    for (int64_t k = 0; k < K8; k += 8) {
        if (prefetch) _mm_prefetch(prefetch + k * 8, _MM_HINT_T0); /* one line of the next weight rows */
        __m256 wv[4];
        for (int c = 0; c < C; c++) wv[c] = widen_bf16(w + c * K + k);
        for (int r = 0; r < R; r++) {
            __m256 xv = _mm256_loadu_ps(x + r * K + k);
            for (int c = 0; c < C; c++) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            float dot = add_tail(x + r * K, w + c * K, K8, K, lanes_sum(acc[r][c]));
            y[r * N + c] = bias ? dot + bias[c] : dot;
        }
}

/* R rows of x against all C <= 4 weight rows at once (C known only at run time: one tile per C). */
static inline __attribute__((always_inline)) void all_columns(const float *x, const uint16_t *w, const float *bias,
                                                              float *y, int64_t N, int64_t K, const int R, int C,
                                                              const char *prefetch) {
    switch (C) {
        case 4: tile(x, w, bias, y, N, K, R, 4, prefetch); break;
        case 3: tile(x, w, bias, y, N, K, R, 3, prefetch); break;
        case 2: tile(x, w, bias, y, N, K, R, 2, prefetch); break;
        default: tile(x, w, bias, y, N, K, R, 1, prefetch); break;
    }
}

/* Rows m0..m1 of x against C <= 4 consecutive rows of W. Tiles of 4 x rows take the weight rows
 * two at a time (16 registers would not hold 4 x 4 accumulators); the last one to three rows take
 * them all at once (more independent accumulators for the one-row step, which is latency-bound
 * otherwise). The tile shape never changes what is computed for an output, only how many are
 * computed together. */
static void block_rows(const float *x, const uint16_t *w, const float *bias, float *y, int64_t m0, int64_t m1,
                       int64_t N, int64_t K, int C) {
    /* While the first tile streams these C rows of W, it prefetches the next four rows (one cache
     * line per 8 columns: the next block's bytes, spread over this block's loop), so that reading
     * the weight from memory, which bounds a step of a few rows, keeps more lines in flight. */
    const char *next = (const char *)(w + C * K);
    int64_t m = m0;
    for (; m + 4 <= m1; m += 4)
        for (int c = 0; c < C; c += 2) {
            const char *pf = m == m0 ? next + c * K * 2 : 0;
            if (c + 1 < C)
                tile(x + m * K, w + c * K, bias ? bias + c : 0, y + m * N + c, N, K, 4, 2, pf);
            else
                tile(x + m * K, w + c * K, bias ? bias + c : 0, y + m * N + c, N, K, 4, 1, pf);
        }
    for (; m + 2 <= m1; m += 2) all_columns(x + m * K, w, bias, y + m * N, N, K, 2, C, m == m0 ? next : 0);
    for (; m < m1; m++) all_columns(x + m * K, w, bias, y + m * N, N, K, 1, C, m == m0 ? next : 0);
}

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

/* For each of `count` matrices i: y_i[M, N_i] = x[M, K] W_i[N_i, K]^T + bias_i[N_i], in one
 * parallel pass (q/k/v or gate/up of a layer read the same x: one call instead of three). x and
 * the y_i are bf16 when x_bf16 / y_bf16, else fp32; the W_i and the biases (each may be NULL) are
 * bf16. Every output is computed exactly as a call for its matrix alone would compute it. */
void treespec_linear_bf16_many(const void *x_in, int x_bf16, int count, const uint16_t *const *w,
                               const uint16_t *const *bias_in, void *const *y_out, int y_bf16, int64_t M,
                               const int64_t *N, int64_t K) {
    float *x = x_bf16 ? malloc(sizeof(float) * M * K) : (float *)x_in;
    if (x_bf16 && !x) abort();
    if (x_bf16)
        for (int64_t i = 0; i < M * K; i++) x[i] = widen_one(((const uint16_t *)x_in)[i]);
    float *y[count], *bias[count];
    int64_t first_quad[count + 1]; /* matrix i owns global quads first_quad[i] .. first_quad[i+1]-1 */
    first_quad[0] = 0;
    for (int i = 0; i < count; i++) {
        y[i] = y_bf16 ? malloc(sizeof(float) * M * N[i]) : (float *)y_out[i];
        bias[i] = bias_in[i] ? malloc(sizeof(float) * N[i]) : 0;
        if ((y_bf16 && !y[i]) || (bias_in[i] && !bias[i])) abort();
        if (bias[i])
            for (int64_t n = 0; n < N[i]; n++) bias[i][n] = widen_one(bias_in[i][n]);
        first_quad[i + 1] = first_quad[i] + (N[i] + 3) / 4;
    }
    const int64_t quads = first_quad[count];
#pragma omp parallel
    {
        const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t q0 = quads * me / threads, q1 = quads * (me + 1) / threads;
        for (int64_t m0 = 0; m0 < M; m0 += ROW_BLOCK) {
            const int64_t m1 = m0 + ROW_BLOCK < M ? m0 + ROW_BLOCK : M;
            int i = 0;
            for (int64_t q = q0; q < q1; q++) {
                while (q >= first_quad[i + 1]) i++;
                const int64_t n = 4 * (q - first_quad[i]);
                block_rows(x, w[i] + n * K, bias[i] ? bias[i] + n : 0, y[i] + n, m0, m1, N[i], K,
                           N[i] - n < 4 ? (int)(N[i] - n) : 4);
            }
        }
        if (y_bf16) {
#pragma omp barrier
            for (int i = 0; i < count; i++) {
                uint16_t *out = y_out[i];
                const int64_t size = M * N[i];
                for (int64_t e = size * me / threads; e < size * (me + 1) / threads; e++) out[e] = round_bf16(y[i][e]);
            }
        }
    }
    if (x_bf16) free(x);
    for (int i = 0; i < count; i++) {
        if (y_bf16) free(y[i]);
        free(bias[i]);
    }
}

/* One matrix: y[M, N] = x[M, K] W[N, K]^T + bias[N] (see treespec_linear_bf16_many). */
void treespec_linear_bf16(const void *x_in, int x_bf16, const uint16_t *w, const uint16_t *bias_in, void *y_out,
                          int y_bf16, int64_t M, int64_t N, int64_t K) {
    treespec_linear_bf16_many(x_in, x_bf16, 1, &w, &bias_in, &y_out, y_bf16, M, &N, K);
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

static inline int key_visible(const int32_t *mask_row, int64_t j, int64_t row_index) {
    if (!mask_row) return j <= row_index;
    return (int)(((uint32_t)mask_row[j >> 5] >> (j & 31)) & 1u);
}

/* The dot products of one query (fp32) with four keys (bf16), each in the fixed order. */
static inline void dot4(const float *q, const uint16_t *k0, const uint16_t *k1, const uint16_t *k2,
                        const uint16_t *k3, int64_t D, float *s) {
    const int64_t D8 = D & ~(int64_t)7;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (int64_t d = 0; d < D8; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(qv, widen_bf16(k0 + d), a0);
        a1 = _mm256_fmadd_ps(qv, widen_bf16(k1 + d), a1);
        a2 = _mm256_fmadd_ps(qv, widen_bf16(k2 + d), a2);
        a3 = _mm256_fmadd_ps(qv, widen_bf16(k3 + d), a3);
    }
    s[0] = add_tail(q, k0, D8, D, lanes_sum(a0));
    s[1] = add_tail(q, k1, D8, D, lanes_sum(a1));
    s[2] = add_tail(q, k2, D8, D, lanes_sum(a2));
    s[3] = add_tail(q, k3, D8, D, lanes_sum(a3));
}

static inline float dot1(const float *q, const uint16_t *k, int64_t D) {
    const int64_t D8 = D & ~(int64_t)7;
    __m256 a = _mm256_setzero_ps();
    for (int64_t d = 0; d < D8; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), widen_bf16(k + d), a);
    return add_tail(q, k, D8, D, lanes_sum(a));
}

void treespec_tree_attention_bf16(const uint16_t *q, const uint16_t *k_cache, const uint16_t *v_cache, uint16_t *out,
                                  const int64_t *row_slot, const int64_t *row_prefix, const int64_t *row_index,
                                  const int64_t *row_new, const int32_t *mask, int64_t W, int64_t T, int64_t Hq,
                                  int64_t Hkv, int64_t L, int64_t D, float sm_scale) {
    const int64_t group = Hq / Hkv;
    const int64_t D8 = D & ~(int64_t)7;
#pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * (L + 4));
        int64_t *keys = malloc(sizeof(int64_t) * (L + 4));
        float *qf = malloc(sizeof(float) * D), *acc = malloc(sizeof(float) * D);
        if (!scores || !keys || !qf || !acc) abort();
#pragma omp for schedule(static)
        for (int64_t item = 0; item < T * Hkv; item++) { /* one row, one KV head, its group of query heads */
            const int64_t t = item / Hkv, kvh = item % Hkv;
            const uint16_t *kbase = k_cache + (row_slot[t] * Hkv + kvh) * L * D;
            const uint16_t *vbase = v_cache + (row_slot[t] * Hkv + kvh) * L * D;
            const int32_t *mask_row = mask ? mask + t * W : 0;
            int64_t n = 0;
            for (int64_t p = 0; p < row_prefix[t]; p++) keys[n++] = p;
            for (int64_t j = 0; j < row_new[t]; j++)
                if (key_visible(mask_row, j, row_index[t])) keys[n++] = row_prefix[t] + j;
            for (int64_t h = kvh * group; h < (kvh + 1) * group; h++) {
                const int64_t head = t * Hq + h;
                for (int64_t d = 0; d < D; d++) qf[d] = widen_one(q[head * D + d]);
                int64_t i = 0;
                for (; i + 4 <= n; i += 4)
                    dot4(qf, kbase + keys[i] * D, kbase + keys[i + 1] * D, kbase + keys[i + 2] * D,
                         kbase + keys[i + 3] * D, D, scores + i);
                for (; i < n; i++) scores[i] = dot1(qf, kbase + keys[i] * D, D);
                float best = -INFINITY;
                for (i = 0; i < n; i++) {
                    scores[i] *= sm_scale;
                    if (scores[i] > best) best = scores[i];
                }
                float total = 0.0f;
                for (int64_t d = 0; d < D; d++) acc[d] = 0.0f;
                for (i = 0; i < n; i++) {
                    const float e = expf(scores[i] - best);
                    total += e;
                    const uint16_t *v = vbase + keys[i] * D;
                    const __m256 ev = _mm256_set1_ps(e);
                    int64_t d = 0;
                    for (; d < D8; d += 8)
                        _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(ev, widen_bf16(v + d), _mm256_loadu_ps(acc + d)));
                    for (; d < D; d++) acc[d] = __builtin_fmaf(e, widen_one(v[d]), acc[d]);
                }
                for (int64_t d = 0; d < D; d++) out[head * D + d] = round_bf16(acc[d] / total);
            }
        }
        free(scores);
        free(keys);
        free(qf);
        free(acc);
    }
}
