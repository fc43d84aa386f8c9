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

/* The phases MARK counts, in order (what treespec bench cpu-kernels prints: it reads the names
 * here through treespec_phase_name). */
static const char *const PHASES[] = {"norm",     "qkv",      "rotary+cache", "attention", "widen",
                                     "o_proj",   "residual", "norm",         "gate/up",   "silu*up",
                                     "down",     "residual", "final norm"};
int treespec_phase_count(void) { return (int)(sizeof PHASES / sizeof PHASES[0]); }
const char *treespec_phase_name(int i) { return PHASES[i]; }

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
