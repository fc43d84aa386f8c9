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
 * embeds   [T, H] bf16: the rows' token embeddings, read by an EAGLE-3 layer only (else NULL)
 * weights  per layer, W_COUNT pointers (enum below): bf16 matrices in nn.Linear layout and bf16
 *          norm weights; the q/k/v biases fp32 (exact widenings) or NULL
 * cos, sin [T, D] bf16 rotary tables of each row's position (the model's own, as HF casts them)
 * caches   [layers, S, Hkv, L, D] bf16; row t writes position row_prefix[t] + row_index[t] of
 *          row row_slot[t] and attends as treespec_tree_attention_bf16 does
 * layer_out  [layers] pointers, each [T, H] bf16 or NULL: the residual stream after layer i
 * A NULL input norm (W_IN_NORM) feeds the layer its rows unnormed, and a NULL final_norm leaves
 * the last residual stream as it is: an EAGLE-1 head's layer, which has neither.
 * An EAGLE-3 head's layer has W_EMBED_NORM (NULL in every other layer): its projections read
 * [RMSNorm(embeds) with W_EMBED_NORM; RMSNorm(h) with W_IN_NORM], 2H wide, with embeds [T, H] the
 * rows' token embeddings, and h stays the residual. */
enum { W_IN_NORM, W_Q, W_K, W_V, W_O, W_POST_NORM, W_GATE, W_UP, W_DOWN, W_Q_BIAS, W_K_BIAS, W_V_BIAS, W_EMBED_NORM,
       W_COUNT };

/* Rows r0..r1 of h [., H] bf16: RMSNorm with weight w, into out_f (fp32 widenings of the bf16
 * result, what the next linear reads) and, when out_b, the bf16 rows themselves; out row r at
 * r * ld. */
static void rmsnorm_rows(const uint16_t *h, const uint16_t *w, float eps, int64_t r0, int64_t r1, int64_t H,
                         int64_t ld, float *out_f, uint16_t *out_b) {
    const int64_t H8 = H & ~(int64_t)7;
    if (!w) { /* no norm (an EAGLE-1 head's layer): the rows as they are */
        for (int64_t r = r0; r < r1; r++)
            for (int64_t k = 0; k < H; k++) {
                out_f[r * ld + k] = widen_one(h[r * H + k]);
                if (out_b) out_b[r * ld + k] = h[r * H + k];
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
            out_f[r * ld + k] = widen_one(scaled);
            if (out_b) out_b[r * ld + k] = scaled;
        }
    }
}

/* treespec_rmsnorm_bf16: out [T, H] = RMSNorm of h [T, H] with weight w, the bits the stack's
 * norms give (an EAGLE-3 head's read-out norm on the level-by-level path). Returns 0 or
 * TREESPEC_NO_MEMORY. */
int treespec_rmsnorm_bf16(const uint16_t *h, const uint16_t *w, float eps, int64_t T, int64_t H, uint16_t *out) {
    float *widened = malloc(sizeof(float) * T * H);
    if (!widened) return TREESPEC_NO_MEMORY;
    rmsnorm_rows(h, w, eps, 0, T, H, H, widened, out);
    free(widened);
    return 0;
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

/* What every phase of a step reads: the sizes, the step's rows, the shared buffers (x and xb the
 * next linear's input in fp32 and bf16, y the linear outputs, qb the rotated queries, attn the
 * attention's output) and the attention's work items. */
typedef struct {
    int64_t T, H, I, Hq, Hkv, D, QD, KD, L, W;
    float eps, sm_scale;
    const uint16_t *embeds; /* an EAGLE-3 layer's token embeddings [T, H] (NULL: no such layer) */
    const uint16_t *cos, *sin;
    const int64_t *row_slot, *row_prefix, *row_index, *row_new;
    const int32_t *mask;
    float *x, *y;
    uint16_t *xb, *qb, *attn;
    const int64_t *items; /* the attention's (column_items) */
    int64_t count, cap;
    int64_t n_qkv[3], n_gu[2], n_h[1], g_qkv[4], g_gu[3], g_h[2], g_down[2]; /* outputs, weight groups */
} step_state;

/* One thread's part of a phase: its index among `threads`, its rows r0..r1 of the row-wise
 * phases, its attention scratch and linear scratch. */
typedef struct {
    int64_t me, threads, r0, r1;
    attention_scratch scratch;
    uint32_t *linear_scratch;
} step_thread;

/* norm: RMSNorm of this thread's rows of h with weight w into x / xb (out: xb, or h itself for
 * the final norm). */
static void phase_norm(const step_state *st, const step_thread *th, uint16_t *h, const uint16_t *w, uint16_t *out) {
    rmsnorm_rows(h, w, st->eps, th->r0, th->r1, st->H, st->H, st->x, out);
}

/* norm, an EAGLE-3 layer's: [RMSNorm(embeds) with W_EMBED_NORM; RMSNorm(h) with W_IN_NORM] into x / xb, 2H wide. */
static void phase_norm_pair(const step_state *st, const step_thread *th, const uint16_t *h, const void *const *lw) {
    const int64_t H = st->H;
    rmsnorm_rows(st->embeds, lw[W_EMBED_NORM], st->eps, th->r0, th->r1, H, 2 * H, st->x, st->xb);
    rmsnorm_rows(h, lw[W_IN_NORM], st->eps, th->r0, th->r1, H, 2 * H, st->x + H, st->xb + H);
}

/* qkv: q, k, v = x Wq, x Wk, x Wv (+ biases) into y (x 2H wide in an EAGLE-3 layer). */
static void phase_qkv(const step_state *st, const step_thread *th, const void *const *lw) {
    const uint16_t *w[3] = {lw[W_Q], lw[W_K], lw[W_V]};
    const float *bias[3] = {lw[W_Q_BIAS], lw[W_K_BIAS], lw[W_V_BIAS]};
    float *y[3] = {st->y, st->y + st->T * st->QD, st->y + st->T * (st->QD + st->KD)};
    const int64_t K = lw[W_EMBED_NORM] ? 2 * st->H : st->H;
    linear_share(th->me, th->threads, st->x, st->xb, st->T, K, 3, w, bias, y, st->n_qkv, st->g_qkv,
                 th->linear_scratch);
}

/* rotary+cache: rotary on q (into qb) and k, K/V into the layer's cache, one (row, head) item at a time. */
static void phase_rotary_cache(const step_state *st, const step_thread *th, uint16_t *kc, uint16_t *vc) {
    const int64_t T = st->T, Hq = st->Hq, Hkv = st->Hkv, D = st->D, QD = st->QD, KD = st->KD;
    const float *q = st->y, *k = st->y + T * QD, *v = st->y + T * (QD + KD);
    for (int64_t item = (T * (Hq + Hkv)) * th->me / th->threads; item < (T * (Hq + Hkv)) * (th->me + 1) / th->threads;
         item++) {
        const int64_t t = item / (Hq + Hkv), head = item % (Hq + Hkv);
        const uint16_t *c = st->cos + t * D, *sn = st->sin + t * D;
        if (head < Hq) {
            rotary(q + t * QD + head * D, c, sn, D, st->qb + t * QD + head * D);
        } else {
            const int64_t kvh = head - Hq,
                          at = ((st->row_slot[t] * Hkv + kvh) * st->L + st->row_prefix[t] + st->row_index[t]) * D;
            rotary(k + t * KD + kvh * D, c, sn, D, kc + at);
            for (int64_t d = 0; d < D; d++) vc[at + d] = round_bf16(v[t * KD + kvh * D + d]);
        }
    }
}

/* attention: the tree attention of every row over the layer's cache into attn. */
static void phase_attention(const step_state *st, const step_thread *th, const uint16_t *kc, const uint16_t *vc) {
    attend_items(th->me, th->threads, st->count, st->items, st->cap, st->qb, kc, vc, st->attn, st->row_slot,
                 st->row_prefix, st->row_index, st->row_new, st->mask, st->W, st->Hq, st->Hkv, st->L, st->D,
                 st->sm_scale, th->scratch);
}

/* widen: the attention's bf16 output into x in fp32 (the AVX2 road's o_proj input). */
static void phase_widen(const step_state *st, const step_thread *th) {
    const int64_t n = st->T * st->QD;
    for (int64_t e = n * th->me / th->threads; e < n * (th->me + 1) / th->threads; e++) st->x[e] = widen_one(st->attn[e]);
}

/* o_proj: y = attn Wo. */
static void phase_o_proj(const step_state *st, const step_thread *th, const void *const *lw) {
    const uint16_t *w[1] = {lw[W_O]};
    const float *no_bias[1] = {0};
    float *y[1] = {st->y};
    linear_share(th->me, th->threads, st->x, st->attn, st->T, st->QD, 1, w, no_bias, y, st->n_h, st->g_h,
                 th->linear_scratch);
}

/* residual: h = h + y (rounded to bf16), and a copy of h into out where it is asked for. */
static void phase_residual(const step_state *st, const step_thread *th, uint16_t *hidden, uint16_t *out) {
    const int64_t n = st->T * st->H;
    for (int64_t e = n * th->me / th->threads; e < n * (th->me + 1) / th->threads; e++) {
        hidden[e] = bf16_add(hidden[e], round_bf16(st->y[e]));
        if (out) out[e] = hidden[e];
    }
}

/* gate/up: y = x Wg, x Wu. */
static void phase_gate_up(const step_state *st, const step_thread *th, const void *const *lw) {
    const uint16_t *w[2] = {lw[W_GATE], lw[W_UP]};
    const float *no_bias[2] = {0, 0};
    float *y[2] = {st->y, st->y + st->T * st->I};
    linear_share(th->me, th->threads, st->x, st->xb, st->T, st->H, 2, w, no_bias, y, st->n_gu, st->g_gu,
                 th->linear_scratch);
}

/* silu*up: x, xb = SiLU(gate) * up, each value rounded where a bf16 model rounds it. */
static void phase_silu_up(const step_state *st, const step_thread *th) {
    const int64_t size = st->T * st->I, runs = (size + 7) / 8;
    const int64_t e0 = 8 * (runs * th->me / th->threads), e1 = 8 * (runs * (th->me + 1) / th->threads);
    const float *gate_y = st->y, *up_y = st->y + size;
    float *x = st->x;
    uint16_t *xb = st->xb;
    for (int64_t e = e0; e < e1 && e < size; e += 8) {
        const int64_t n = size - e < 8 ? size - e : 8;
        if (n == 8) { /* the scalar sequence below, eight lanes at a time: the same bits */
            const __m256 gate = widen_rounded8(_mm256_loadu_ps(gate_y + e));
            const __m256 ex = exp8(_mm256_xor_ps(gate, _mm256_set1_ps(-0.0f)));
            const __m256 act = widen_rounded8(_mm256_div_ps(gate, _mm256_add_ps(_mm256_set1_ps(1.0f), ex)));
            const __m256i prod = round_bf16x8(_mm256_mul_ps(act, widen_rounded8(_mm256_loadu_ps(up_y + e))));
            const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(prod, prod), 0x08);
            _mm_storeu_si128((__m128i *)(xb + e), _mm256_castsi256_si128(packed));
            _mm256_storeu_ps(x + e, _mm256_castsi256_ps(_mm256_slli_epi32(prod, 16)));
            continue;
        }
        float gate[8], minus[8], ex[8];
        for (int64_t j = 0; j < n; j++) {
            gate[j] = widen_one(round_bf16(gate_y[e + j]));
            minus[j] = -gate[j];
        }
        exp_run(minus, ex, n);
        for (int64_t j = 0; j < n; j++) {
            const uint16_t act = round_bf16(gate[j] / (1.0f + ex[j]));
            xb[e + j] = bf16_mul(act, round_bf16(up_y[e + j]));
            x[e + j] = widen_one(xb[e + j]);
        }
    }
}

/* down: y = x Wd. */
static void phase_down(const step_state *st, const step_thread *th, const void *const *lw) {
    const uint16_t *w[1] = {lw[W_DOWN]};
    const float *no_bias[1] = {0};
    float *y[1] = {st->y};
    linear_share(th->me, th->threads, st->x, st->xb, st->T, st->I, 1, w, no_bias, y, st->n_h, st->g_down,
                 th->linear_scratch);
}

int treespec_decoder_bf16(uint16_t *hidden, const uint16_t *embeds, const void *const *weights, const uint16_t *final_norm,
                           int64_t num_layers, int64_t T, int64_t H, int64_t I, int64_t Hq, int64_t Hkv, int64_t D,
                           float eps, float sm_scale, const uint16_t *cos, const uint16_t *sin, uint16_t *k_cache,
                           uint16_t *v_cache, int64_t S, int64_t L, const int64_t *row_slot,
                           const int64_t *row_prefix, const int64_t *row_index, const int64_t *row_new,
                           const int32_t *mask, int64_t W, uint16_t *const *layer_out) {
    const int64_t QD = Hq * D, KD = Hkv * D, layer_cache = S * Hkv * L * D;
    const int64_t in = embeds ? 2 * H : H; /* an EAGLE-3 layer's projections read 2H */
    const int64_t widest_in = in > I ? (in > QD ? in : QD) : (I > QD ? I : QD);
    const int64_t widest_out = QD + 2 * KD > 2 * I ? QD + 2 * KD : 2 * I;
    float *x = malloc(sizeof(float) * T * widest_in);                      /* the next linear's input */
    float *y = malloc(sizeof(float) * T * (widest_out > H ? widest_out : H)); /* linear outputs */
    uint16_t *xb = malloc(sizeof(uint16_t) * T * widest_in); /* the same input in bf16 (AVX512-BF16 road) */
    uint16_t *qb = malloc(sizeof(uint16_t) * T * QD), *attn = malloc(sizeof(uint16_t) * T * QD);
    const int team = omp_get_max_threads();
    const int64_t pack = share_scratch(xb, T, widest_in); /* xb is set whenever it matters */
    uint32_t *xp = pack ? malloc(sizeof(uint32_t) * pack * team) : 0;
    const int64_t cap = column_cap(T, Hq / Hkv);
    int64_t *items = malloc(sizeof(int64_t) * 3 * cap);
    attention_scratch *pool = x && xb && y && qb && attn && (xp || !pack) && items ? scratch_pool(L, D, team) : 0;
    if (!pool) goto done; /* nothing computed, nothing left allocated */
    step_state st = {.T = T, .H = H, .I = I, .Hq = Hq, .Hkv = Hkv, .D = D, .QD = QD, .KD = KD, .L = L,
                     .W = W, .eps = eps, .sm_scale = sm_scale, .embeds = embeds, .cos = cos, .sin = sin, .row_slot = row_slot,
                     .row_prefix = row_prefix, .row_index = row_index, .row_new = row_new, .mask = mask, .x = x,
                     .y = y, .xb = xb, .qb = qb, .attn = attn, .items = items, .cap = cap,
                     .n_qkv = {QD, KD, KD}, .n_gu = {I, I}, .n_h = {H}};
    group_offsets(3, st.n_qkv, st.g_qkv);
    group_offsets(2, st.n_gu, st.g_gu);
    group_offsets(1, st.n_h, st.g_h);
    group_offsets(1, st.n_h, st.g_down);
    st.count = column_items(T, Hq / Hkv, row_slot, row_prefix, row_new, items, items + cap, items + 2 * cap);
    MARK_START();
#pragma omp parallel num_threads(team)
    {
        const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
        const step_thread th = {me, threads, T * me / threads, T * (me + 1) / threads, pool[me], xp ? xp + me * pack : 0};
        for (int64_t layer = 0; layer < num_layers; layer++) {
            const void *const *lw = weights + layer * W_COUNT;
            uint16_t *kc = k_cache + layer * layer_cache, *vc = v_cache + layer * layer_cache;
            /* each phase, then a barrier (the next reads what every thread wrote), then its mark */
            if (lw[W_EMBED_NORM])
                phase_norm_pair(&st, &th, hidden, lw);
            else
                phase_norm(&st, &th, hidden, lw[W_IN_NORM], xb);
#pragma omp barrier
            MARK(0);
            phase_qkv(&st, &th, lw);
#pragma omp barrier
            MARK(1);
            phase_rotary_cache(&st, &th, kc, vc);
#pragma omp barrier
            MARK(2);
            phase_attention(&st, &th, kc, vc);
#pragma omp barrier
            MARK(3);
            if (g_isa == ISA_AVX2) {
                phase_widen(&st, &th);
#pragma omp barrier
                MARK(4);
            }
            phase_o_proj(&st, &th, lw);
#pragma omp barrier
            MARK(5);
            phase_residual(&st, &th, hidden, 0);
#pragma omp barrier
            MARK(6);
            phase_norm(&st, &th, hidden, lw[W_POST_NORM], xb);
#pragma omp barrier
            MARK(7);
            phase_gate_up(&st, &th, lw);
#pragma omp barrier
            MARK(8);
            phase_silu_up(&st, &th);
#pragma omp barrier
            MARK(9);
            phase_down(&st, &th, lw);
#pragma omp barrier
            MARK(10);
            phase_residual(&st, &th, hidden, layer_out[layer]);
#pragma omp barrier
            MARK(11);
        }
        if (final_norm) phase_norm(&st, &th, hidden, final_norm, hidden); /* each row reads only itself */
#pragma omp barrier
        MARK(12);
    }
    scratch_pool_free(pool, team);
done:
    free(items);
    free(xp);
    free(x);
    free(xb);
    free(y);
    free(qb);
    free(attn);
    return pool ? 0 : TREESPEC_NO_MEMORY;
}
