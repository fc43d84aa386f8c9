/* An EAGLE-2 tree drafted whole: one call per tree (EAGLE-1 heads, Llama-style draft models and
 * Medusa heads). Part of the kernel library: cpu_kernels.c includes this file last, so it
 * uses the linear layer (linear.c), the decoder stack (decoder.c) and the exponential
 * (cpu_common.h), and the library stays one build.
 *
 * What Python did per level (embedding rows, fc, the rotary tables, the decoder layer, the
 * read-out, log-softmax, top-k, cumulative scores, the next frontier, the ancestor masks) and
 * once per tree (the rerank to the tree's size, its masks) runs here with no PyTorch operator in
 * between, so the head's 17 MB of weights stay in the last-level cache from level to level and a
 * level costs its arithmetic plus a few microseconds.
 *
 * The arithmetic is the fused EAGLE path's (treespec.target.fused.FusedEagleLayer): the same fc,
 * decoder layer and read-out calls on the same rows, so the head's outputs and the read-out's
 * fp32 logits are the same bits; log-softmax sums with exp8 instead of PyTorch's exponential, so
 * scores can differ in their last bit and a near tie between two candidates can fall the other
 * way. The target verifies whatever is drafted: the output never depends on it.
 *
 * The tree (tree/builders.py, build_dynamic_tree): the root's top-k children are the first
 * frontier; each of depth - 1 expansions runs the k frontier nodes of every request through the
 * head (K/V written past the request's committed length at run index (level - 1) * k + slot,
 * attending to the context and their run ancestors), gives each its top-k children (score: the
 * parent's plus the child's log-prob) and keeps the best k of the k * k as the next frontier.
 * Every drafted node is then reranked by (score desc, drafting order) and the best num_nodes + 1
 * kept (the root first: scores only fall along a path, so the kept set is closed under
 * ancestors), in drafting order.
 *
 * Drafting at its floor: before each level, a frontier node whose score is at most the
 * num_nodes + 1-th best score drafted so far is not run, since none of its descendants can be
 * kept (their scores are at most its own, and on a tie the earlier id wins); the level stops the
 * tree when no node is left to run. The tree is the one the full expansion builds, bit for bit;
 * only the rows that cannot change it are skipped. */

/* max + log(sum exp(v - max)) over a row of n logits: exp8 in eight lanes, summed in a fixed order. */
static float log_sum_exp(const float *v, int64_t n) {
    float top = v[0];
    int64_t i = 0;
    if (n >= 8) {
        __m256 m = _mm256_loadu_ps(v);
        for (i = 8; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(v + i));
        float lanes[8];
        _mm256_storeu_ps(lanes, m);
        for (int j = 0; j < 8; j++) top = lanes[j] > top ? lanes[j] : top;
    }
    for (; i < n; i++) top = v[i] > top ? v[i] : top;
    const __m256 shift = _mm256_set1_ps(top);
    __m256 acc = _mm256_setzero_ps();
    for (i = 0; i + 8 <= n; i += 8) acc = _mm256_add_ps(acc, exp8(_mm256_sub_ps(_mm256_loadu_ps(v + i), shift)));
    float sum = lanes_sum(acc);
    if (i < n) {
        float in[8], out[8];
        for (int64_t j = i; j < n; j++) in[j - i] = v[j] - top;
        exp_run(in, out, n - i);
        for (int64_t j = 0; j < n - i; j++) sum += out[j];
    }
    return top + logf(sum); /* sum >= 1 (the maximum's own term): every log-prob is <= 0 */
}

/* The k largest of v[0 .. n-1] by (value desc, index asc), best first. */
static void top_k(const float *v, int64_t n, int64_t k, int64_t *index, float *value) {
    int64_t filled = 0;
    for (int64_t i = 0; i < n; i++) {
        const float x = v[i];
        if (filled == k && !(x > value[k - 1])) continue; /* a tie keeps the earlier index */
        int64_t p = filled < k ? filled++ : k - 1;
        for (; p > 0 && x > value[p - 1]; p--) {
            value[p] = value[p - 1];
            index[p] = index[p - 1];
        }
        value[p] = x;
        index[p] = i;
    }
}

/* Each of `rows` rows of logits [rows, V]: its top k columns (best first) and their log-probs. */
static void rows_top_k(const float *logits, int64_t rows, int64_t V, int64_t k, int64_t *index, float *logprob) {
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        const float *row = logits + t * V;
        top_k(row, V, k, index + t * k, logprob + t * k);
        const float lse = log_sum_exp(row, V);
        for (int64_t j = 0; j < k; j++) logprob[t * k + j] -= lse;
    }
}

/* The catch-up before a tree: each request's counts[b] rows committed since its last tree (an
 * EAGLE head's pairs (token, target feature: [H] wide for EAGLE-1, the three layers' [3H] for
 * EAGLE-3, which fc fuses alone), a draft model's tokens), run as a causal chain past
 * its committed length, their K/V written at committed + j (the caller commits them after the
 * call). Request b's row j reads rotary row first_row[b] + j. The last row of each request gives
 * the root: an EAGLE head's output into root_h [B, H], or a draft model's final normed row read
 * out in fp32 into root_logits [B, V]. The same calls on the same rows as the fused path's own
 * catch-up (FusedEagleLayer.forward, FusedDecoder.forward then the fp32 read-out), so the same
 * bits. Returns 0 or TREESPEC_NO_MEMORY (nothing committed). */
static int catch_up(const uint16_t *embed, const uint16_t *fc_w, const uint16_t *fc_b, const void *const *layers,
                    int64_t num_layers, const uint16_t *final_norm, int64_t H, int64_t I, int64_t Hq, int64_t Hkv,
                    int64_t D, float eps, float sm_scale, const uint16_t *readout, int64_t V, const uint16_t *cos,
                    const uint16_t *sin, uint16_t *k_cache, uint16_t *v_cache, int64_t S, int64_t L, int64_t B,
                    const int64_t *slots, const int64_t *committed, const int64_t *tokens, const uint16_t *features,
                    const int64_t *counts, const int64_t *first_row, uint16_t *root_h, float *root_logits) {
    int64_t C = 0;
    for (int64_t b = 0; b < B; b++) C += counts[b];
    uint16_t *x_in = fc_w ? malloc(sizeof(uint16_t) * C * 2 * H) : 0, *h = malloc(sizeof(uint16_t) * C * H);
    uint16_t *cos_c = malloc(sizeof(uint16_t) * C * D), *sin_c = malloc(sizeof(uint16_t) * C * D);
    uint16_t *last = malloc(sizeof(uint16_t) * B * H);
    int64_t *row = malloc(sizeof(int64_t) * 4 * C);
    uint16_t **no_out = calloc(num_layers, sizeof(uint16_t *));
    int code = TREESPEC_NO_MEMORY;
    if ((fc_w && !x_in) || !h || !cos_c || !sin_c || !last || !row || !no_out) goto done;
    const int eagle3 = layers[W_EMBED_NORM] != 0;
    int64_t *row_slot = row, *row_prefix = row + C, *row_index = row + 2 * C, *row_new = row + 3 * C;
    for (int64_t b = 0, t = 0; b < B; b++)
        for (int64_t j = 0; j < counts[b]; j++, t++) {
            if (eagle3) { /* EAGLE-3: the embeddings beside the stack, fc over the features alone */
                memcpy(x_in + t * H, embed + tokens[t] * H, sizeof(uint16_t) * H);
            } else if (fc_w) { /* EAGLE-1: [embedding; the target's feature] */
                memcpy(x_in + t * 2 * H, embed + tokens[t] * H, sizeof(uint16_t) * H);
                memcpy(x_in + t * 2 * H + H, features + t * H, sizeof(uint16_t) * H);
            } else {
                memcpy(h + t * H, embed + tokens[t] * H, sizeof(uint16_t) * H);
            }
            memcpy(cos_c + t * D, cos + (first_row[b] + j) * D, sizeof(uint16_t) * D);
            memcpy(sin_c + t * D, sin + (first_row[b] + j) * D, sizeof(uint16_t) * D);
            row_slot[t] = slots[b], row_prefix[t] = committed[b], row_index[t] = j, row_new[t] = counts[b];
        }
    if ((eagle3 && (code = treespec_linear_bf16(features, 1, fc_w, fc_b, h, 1, C, H, 3 * H))) ||
        (fc_w && !eagle3 && (code = treespec_linear_bf16(x_in, 1, fc_w, fc_b, h, 1, C, H, 2 * H))) ||
        (code = treespec_decoder_bf16(h, eagle3 ? x_in : 0, layers, final_norm, num_layers, C, H, I, Hq, Hkv, D, eps, sm_scale, cos_c,
                                      sin_c, k_cache, v_cache, S, L, row_slot, row_prefix, row_index, row_new, 0, 0,
                                      no_out)))
        goto done;
    for (int64_t b = 0, end = 0; b < B; b++) {
        end += counts[b];
        memcpy((root_h ? root_h : last) + b * H, h + (end - 1) * H, sizeof(uint16_t) * H);
    }
    code = root_h ? 0 : treespec_linear_bf16(last, 1, readout, 0, root_logits, 0, B, V, H);
done:
    free(x_in), free(h), free(cos_c), free(sin_c), free(last), free(row), free(no_out);
    return code;
}

/* The read-out of rows h [rows, H] into fp32 logits [rows, V]: through RMSNorm with norm first
 * where it is not NULL (an EAGLE-3 head's own norm, as EagleHead.logits applies it; normed_f and
 * normed_b hold [rows, H]), then the read-out matrix. */
static int read_out(const uint16_t *h, const uint16_t *norm, float eps, int64_t rows, int64_t H,
                    const uint16_t *readout, int64_t V, float *logits, float *normed_f, uint16_t *normed_b) {
    if (norm) {
        rmsnorm_rows(h, norm, eps, 0, rows, H, H, normed_f, normed_b);
        h = normed_b;
    }
    return treespec_linear_bf16(h, 1, readout, 0, logits, 0, rows, V, H);
}

/* Conditioned Medusa head i (Hydra's kind: MedusaHeads.head_features then the read-out) over
 * rows x_in [rows, (i + 2) H] = [the target's state; the embeddings of the root and of the i
 * tokens drafted on each row's path]: its input layer into h, then its blocks, each
 * h + SiLU(W h + b) with every value rounded to bf16 where the bf16 modules round it (the
 * layer's output, the activation, the sum), SiLU through exp8. ``table`` holds per head its
 * input layer (weight, bias), then (weight, bias) per block. h and y are [rows, H]. */
static int medusa_head(const void *const *table, int64_t blocks, int64_t i, const uint16_t *x_in, int64_t rows,
                       int64_t H, uint16_t *h, uint16_t *y) {
    const void *const *w = table + i * (2 + 2 * blocks);
    int code = treespec_linear_bf16(x_in, 1, w[0], w[1], h, 1, rows, H, (i + 2) * H);
    for (int64_t l = 0; l < blocks && !code; l++) {
        if ((code = treespec_linear_bf16(h, 1, w[2 + 2 * l], w[3 + 2 * l], y, 1, rows, H, H))) break;
        for (int64_t e = 0; e < rows * H; e += 8) {
            const int64_t n = rows * H - e < 8 ? rows * H - e : 8;
            float lin[8] = {0}, minus[8] = {0}, ex[8];
            for (int64_t j = 0; j < n; j++) lin[j] = widen_one(y[e + j]), minus[j] = -lin[j];
            exp_run(minus, ex, n);
            for (int64_t j = 0; j < n; j++) {
                const float act = widen_one(round_bf16(lin[j] / (1.0f + ex[j])));
                h[e + j] = round_bf16(widen_one(h[e + j]) + act);
            }
        }
    }
    return code;
}

/* treespec_draft_tree_bf16: B requests' trees of num_nodes drafted nodes each, drafted by an
 * EAGLE-1 head (fc_w not NULL), an EAGLE-3 head (its layer has W_EMBED_NORM) or a draft model
 * (fc_w NULL).
 *
 * The drafter: embed [vocab, H] (the target's input embeddings, which both read); an EAGLE-1
 * head's fc [H, 2H] and its bias (or NULL) over [embedding; feature]; the decoder stack's
 * num_layers * W_COUNT pointers (as treespec_decoder_bf16 reads them: an EAGLE-1 layer has no input
 * norm) and its final norm (NULL: none, EAGLE), the sizes (H, I, Hq, Hkv, D), eps and sm_scale;
 * the read-out [V, H] (an LM head, the rows of a reduced draft vocabulary, or an EAGLE-3 head's
 * own), column_ids [V] (the token of each column; NULL: column c is token c), read out in fp32,
 * through readout_norm first where it is not NULL (an EAGLE-3 head's norm: its layer's output is
 * the next level's feature, the normed rows only what it reads out). An EAGLE-3 head's fc
 * [H, 3H] fuses the target's three layers in the catch-up; its levels feed each node its
 * parent's output as the residual and the node's embedding beside it. cos, sin [R, D]:
 * rotary rows, level s of request b (at position committed + s - 1) reading row
 * first_row[b] + s - 1. The drafter's KV cache [num_layers, S, Hkv, L, D], each request's slot and
 * committed length, its root token and either root_logits [B, V] fp32 (a draft model's, from its
 * catch-up) or, where that is NULL, root_h [B, H] (an EAGLE head's output at the root's pair,
 * read out here). An EAGLE level feeds each node its parent's output as the feature; a draft
 * model's nodes see their ancestors through its cache alone. With heads > 0 (Medusa), nothing
 * runs: root_logits is [B, heads, V], the root's children come from head 0 and every depth-s
 * node's from head s (depth <= heads); embed, the stack and the cache are unused. Conditioned
 * Medusa heads (heads > 0 and layers not NULL): layers is medusa_head's table (num_layers
 * blocks a head), root_h [B, H] the target's state behind each root, and head s runs on each
 * depth-s node's row [root_h; the embeddings of its path from the root] before its read-out;
 * fc, the cache and the rotary rows are unused.
 *
 * With catch_tokens (not NULL; EAGLE heads and draft models), the call first runs each
 * request's catch-up (catch_up above: catch_counts[b] >= 1 rows, an EAGLE head's catch_features
 * [rows, H] beside the tokens, request b's row j at rotary row catch_row[b] + j), takes its root
 * feature or logits from it (root_h and root_logits are then ignored) and drafts the levels past
 * committed[b] + catch_counts[b]; *catch_seconds gets the catch-up's wall time.
 *
 * Out, per request b at b * (num_nodes + 1): tokens, parents (within the tree, -1 at the root),
 * depths and the ancestor-and-self mask [num_nodes + 1, W] (W = ceil((num_nodes + 1) / 32) words). Needs
 * 1 <= num_nodes <= k + (depth - 1) k^2, k <= V and room for (depth - 1) k rows past every
 * committed length (the caller checks). Returns 0, or TREESPEC_NO_MEMORY (the tree not written). */
int treespec_draft_tree_bf16(const uint16_t *embed, const uint16_t *fc_w, const uint16_t *fc_b,
                             const void *const *layers, int64_t num_layers, const uint16_t *final_norm, int64_t H,
                             int64_t I, int64_t Hq, int64_t Hkv, int64_t D, float eps, float sm_scale,
                             const uint16_t *readout, int64_t V, const int64_t *column_ids,
                             const uint16_t *readout_norm, const uint16_t *cos, const uint16_t *sin, uint16_t *k_cache, uint16_t *v_cache, int64_t S,
                             int64_t L, int64_t B, const int64_t *slots, const int64_t *committed,
                             const int64_t *first_row, const int64_t *roots, const uint16_t *root_h,
                             const float *root_logits, const int64_t *catch_tokens, const uint16_t *catch_features,
                             const int64_t *catch_counts, const int64_t *catch_row, double *catch_seconds,
                             int64_t heads, int64_t k, int64_t depth, int64_t num_nodes, int64_t *tokens,
                             int64_t *parents, int64_t *depths, int32_t *mask) {
    const int64_t T = B * k, levels = depth - 1, run = levels * k; /* rows per level; nodes run per request */
    const int64_t P = 1 + k + levels * k * k, kept = num_nodes + 1; /* drafted nodes per request, root included */
    const int64_t RW = run > 0 ? (run + 31) / 32 : 1, W = (kept + 31) / 32;
    const int64_t rows_out = B > T ? B : T;
    const int conditioned = heads > 0 && layers != 0; /* Medusa heads that read their path */
    const int64_t in_width = conditioned && heads + 1 > 2 ? heads + 1 : 2; /* x_in's row, in H */
    /* one block for everything: bf16 rows, fp32 logits, the pool, the frontier, the masks */
    const size_t bytes = sizeof(uint16_t) * (rows_out * in_width * H + 2 * rows_out * H + 2 * T * D) +
                         sizeof(float) * rows_out * V + sizeof(void *) * num_layers +
                         sizeof(int64_t) * (4 * T + rows_out * k + 3 * B * P + 5 * T + P + B * k) +
                         sizeof(float) * (rows_out * k + B * P + T + P + B * k) + sizeof(int32_t) * (T * RW) +
                         sizeof(uint32_t) * (B * run * RW + kept * W) + sizeof(uint16_t) * B * H +
                         sizeof(float) * B * V + sizeof(int64_t) * B +
                         (sizeof(float) + sizeof(uint16_t)) * rows_out * H + 64 * 40; /* each TAKE aligns to 64 bytes */
    char *block = malloc(bytes), *next = block;
    if (!block) return TREESPEC_NO_MEMORY;
#define TAKE(type, count) ((type *)(next = (char *)(((uintptr_t)(next) + 63) & ~(uintptr_t)63) + sizeof(type) * (count)) - (count))
    uint16_t *x_in = TAKE(uint16_t, rows_out * in_width * H), *h = TAKE(uint16_t, rows_out * H),
             *h_prev = TAKE(uint16_t, rows_out * H);
    uint16_t *cos_l = TAKE(uint16_t, T * D), *sin_l = TAKE(uint16_t, T * D);
    float *logits = TAKE(float, rows_out * V), *child_lp = TAKE(float, rows_out * k);
    uint16_t **no_out = TAKE(uint16_t *, num_layers);
    int64_t *row_slot = TAKE(int64_t, T), *row_prefix = TAKE(int64_t, T), *row_index = TAKE(int64_t, T),
            *row_new = TAKE(int64_t, T), *child = TAKE(int64_t, rows_out * k);
    int64_t *pool_tok = TAKE(int64_t, B * P), *pool_parent = TAKE(int64_t, B * P), *pool_depth = TAKE(int64_t, B * P);
    float *pool_score = TAKE(float, B * P), *f_score = TAKE(float, T);
    int64_t *f_id = TAKE(int64_t, T), *f_tok = TAKE(int64_t, T), *f_slot = TAKE(int64_t, T);
    int64_t *row_of = TAKE(int64_t, T), *prev_row_of = TAKE(int64_t, T), *rank_id = TAKE(int64_t, P);
    float *rank_score = TAKE(float, P), *head_lp = TAKE(float, B * k);
    int64_t *head_child = TAKE(int64_t, B * k);
    int32_t *level_mask = TAKE(int32_t, T * RW);
    uint32_t *anc = TAKE(uint32_t, B * run * RW), *bits = TAKE(uint32_t, kept * W);
    uint16_t *caught_h = TAKE(uint16_t, B * H);
    float *caught_logits = TAKE(float, B * V);
    int64_t *caught_length = TAKE(int64_t, B);
    float *normed_f = TAKE(float, rows_out * H);
    uint16_t *normed_b = TAKE(uint16_t, rows_out * H);
#undef TAKE
    const int eagle3 = !heads && num_layers > 0 && layers[W_EMBED_NORM] != 0;
    memset(no_out, 0, sizeof(void *) * num_layers);
#define COLUMN(c) (column_ids ? column_ids[c] : (c))

    int code = 0;
    if (catch_tokens) { /* the catch-up first: the roots come from it, the levels run past it */
        const double start = omp_get_wtime();
        if ((code = catch_up(embed, fc_w, fc_b, layers, num_layers, final_norm, H, I, Hq, Hkv, D, eps, sm_scale, readout, V,
                             cos, sin, k_cache, v_cache, S, L, B, slots, committed, catch_tokens, catch_features,
                             catch_counts, catch_row, fc_w ? caught_h : 0, caught_logits)))
            goto done;
        *catch_seconds = omp_get_wtime() - start;
        for (int64_t b = 0; b < B; b++) caught_length[b] = committed[b] + catch_counts[b];
        committed = caught_length;
        root_h = fc_w ? caught_h : 0;
        root_logits = fc_w ? 0 : caught_logits;
    }

    /* the root's children: the first frontier */
    if (conditioned) { /* head 0 on [root_h; E(root)] */
        for (int64_t b = 0; b < B; b++) {
            memcpy(x_in + b * 2 * H, root_h + b * H, sizeof(uint16_t) * H);
            memcpy(x_in + b * 2 * H + H, embed + roots[b] * H, sizeof(uint16_t) * H);
        }
        if ((code = medusa_head(layers, num_layers, 0, x_in, B, H, h, h_prev)) ||
            (code = read_out(h, 0, eps, B, H, readout, V, logits, normed_f, normed_b)))
            goto done;
    } else if (root_logits) /* a draft model's [B, V], or Medusa's heads [B, heads, V] (head 0 for the root) */
        for (int64_t b = 0; b < B; b++) memcpy(logits + b * V, root_logits + b * (heads ? heads : 1) * V, sizeof(float) * V);
    else if ((code = read_out(root_h, readout_norm, eps, B, H, readout, V, logits, normed_f, normed_b)))
        goto done;
    rows_top_k(logits, B, V, k, child, child_lp);
    for (int64_t b = 0; b < B; b++) {
        int64_t *tok = pool_tok + b * P, *par = pool_parent + b * P, *dep = pool_depth + b * P;
        float *sc = pool_score + b * P;
        tok[0] = roots[b], par[0] = -1, dep[0] = 0, sc[0] = 0.0f;
        for (int64_t j = 0; j < k; j++) {
            const int64_t f = b * k + j;
            tok[1 + j] = f_tok[f] = COLUMN(child[f]);
            sc[1 + j] = f_score[f] = child_lp[f];
            par[1 + j] = 0, dep[1 + j] = 1;
            f_id[f] = 1 + j, f_slot[f] = -1;
        }
    }
    int64_t first_id = 1 + k; /* the pool's next id: every id below it is drafted */
    for (int64_t s = 1; s <= levels; s++) { /* run the depth-s frontier; draft depth s + 1 */
        int64_t rows = 0;
        for (int64_t b = 0; b < B; b++) {
            /* A frontier node whose score is at most the kept-th best so far has no descendant
             * that can be kept (scores only fall, and a later id loses a tie): it is not run, and
             * the tree is the one the full expansion builds. */
            float bar = -INFINITY;
            if (first_id >= kept) {
                top_k(pool_score + b * P, first_id, kept, rank_id, rank_score);
                bar = rank_score[kept - 1];
            }
            for (int64_t j = 0; j < k; j++) {
                const int64_t f = b * k + j, r = (s - 1) * k + j, t = rows;
                row_of[f] = -1;
                if (!(f_score[f] > bar)) continue;
                row_of[f] = t, rows++;
                if (conditioned) { /* [root_h; E(path from the root)], the path walked up the pool */
                    uint16_t *x = x_in + t * (s + 2) * H;
                    memcpy(x, root_h + b * H, sizeof(uint16_t) * H);
                    for (int64_t id = f_id[f], d = s; d >= 0; id = pool_parent[b * P + id], d--)
                        memcpy(x + (1 + d) * H, embed + pool_tok[b * P + id] * H, sizeof(uint16_t) * H);
                    continue;
                }
                if (heads) continue; /* Medusa: nothing runs, head s scores every node of the level */
                const uint16_t *feature = !fc_w ? 0 : s == 1 ? root_h + b * H : h_prev + prev_row_of[b * k + f_slot[f]] * H;
                if (eagle3) { /* EAGLE-3: the parent's output the residual, the embedding beside it */
                    memcpy(x_in + t * H, embed + f_tok[f] * H, sizeof(uint16_t) * H);
                    memcpy(h + t * H, feature, sizeof(uint16_t) * H);
                } else if (fc_w) { /* EAGLE-1: [embedding; the parent's output] */
                    memcpy(x_in + t * 2 * H, embed + f_tok[f] * H, sizeof(uint16_t) * H);
                    memcpy(x_in + t * 2 * H + H, feature, sizeof(uint16_t) * H);
                } else { /* a draft model: the embedding; its ancestors are in its cache */
                    memcpy(h + t * H, embed + f_tok[f] * H, sizeof(uint16_t) * H);
                }
                memcpy(cos_l + t * D, cos + (first_row[b] + s - 1) * D, sizeof(uint16_t) * D);
                memcpy(sin_l + t * D, sin + (first_row[b] + s - 1) * D, sizeof(uint16_t) * D);
                row_slot[t] = slots[b], row_prefix[t] = committed[b], row_index[t] = r, row_new[t] = s * k;
                uint32_t *mine = anc + (b * run + r) * RW;
                if (s == 1)
                    memset(mine, 0, sizeof(uint32_t) * RW);
                else
                    memcpy(mine, anc + (b * run + (s - 2) * k + f_slot[f]) * RW, sizeof(uint32_t) * RW);
                mine[r >> 5] |= 1u << (r & 31);
                memcpy(level_mask + t * RW, mine, sizeof(uint32_t) * RW);
            }
        }
        if (rows == 0) break; /* no request's tree can change any more */
        if (conditioned) { /* head s on each run node's path, read out */
            if ((code = medusa_head(layers, num_layers, s, x_in, rows, H, h, h_prev)) ||
                (code = read_out(h, 0, eps, rows, H, readout, V, logits, normed_f, normed_b)))
                goto done;
            rows_top_k(logits, rows, V, k, child, child_lp);
        } else if (heads) { /* Medusa: head s's top-k once per request, the children of each of its nodes */
            for (int64_t b = 0; b < B; b++) memcpy(logits + b * V, root_logits + (b * heads + s) * V, sizeof(float) * V);
            rows_top_k(logits, B, V, k, head_child, head_lp);
            for (int64_t f = 0; f < T; f++)
                if (row_of[f] >= 0) {
                    memcpy(child + row_of[f] * k, head_child + f / k * k, sizeof(int64_t) * k);
                    memcpy(child_lp + row_of[f] * k, head_lp + f / k * k, sizeof(float) * k);
                }
        } else if ((fc_w && !eagle3 && (code = treespec_linear_bf16(x_in, 1, fc_w, fc_b, h, 1, rows, H, 2 * H))) ||
            (code = treespec_decoder_bf16(h, eagle3 ? x_in : 0, layers, final_norm, num_layers, rows, H, I, Hq, Hkv, D,
                                          eps, sm_scale, cos_l, sin_l, k_cache, v_cache, S, L, row_slot, row_prefix,
                                          row_index, row_new, level_mask, RW, no_out)) ||
            (code = read_out(h, readout_norm, eps, rows, H, readout, V, logits, normed_f, normed_b)))
            goto done; /* out of memory: nothing committed, the tree not written */
        else
            rows_top_k(logits, rows, V, k, child, child_lp);
        for (int64_t b = 0; b < B; b++) {
            int64_t *tok = pool_tok + b * P, *par = pool_parent + b * P, *dep = pool_depth + b * P;
            float *sc = pool_score + b * P;
            for (int64_t c = 0; c < k * k; c++) { /* child c = i * k + j: rank j under frontier slot i */
                const int64_t i = c / k, f = b * k + i, id = first_id + c, t = row_of[f];
                tok[id] = t < 0 ? 0 : COLUMN(child[t * k + c % k]);
                sc[id] = t < 0 ? -INFINITY : f_score[f] + child_lp[t * k + c % k]; /* never kept */
                par[id] = f_id[f], dep[id] = s + 1;
            }
            top_k(sc + first_id, k * k, k, rank_id, rank_score);
            for (int64_t m = 0; m < k; m++) {
                const int64_t f = b * k + m;
                f_id[f] = first_id + rank_id[m], f_slot[f] = rank_id[m] / k;
                f_tok[f] = tok[first_id + rank_id[m]], f_score[f] = rank_score[m];
            }
        }
        first_id += k * k;
        uint16_t *swap = h;
        h = h_prev, h_prev = swap;
        int64_t *swap_rows = row_of;
        row_of = prev_row_of, prev_row_of = swap_rows;
    }
#undef COLUMN

    /* the rerank: the best num_nodes + 1 of each request's pool, in drafting order */
    for (int64_t b = 0; b < B; b++) {
        const int64_t *tok = pool_tok + b * P, *par = pool_parent + b * P, *dep = pool_depth + b * P;
        const float *sc = pool_score + b * P;
        int64_t chosen[kept], where[P];
        float chosen_score[kept];
        top_k(sc, first_id, kept, chosen, chosen_score);
        for (int64_t i = 1; i < kept; i++) /* insertion sort into drafting order (kept is small) */
            for (int64_t p = i; p > 0 && chosen[p - 1] > chosen[p]; p--) {
                const int64_t swap = chosen[p];
                chosen[p] = chosen[p - 1], chosen[p - 1] = swap;
            }
        for (int64_t p = 0; p < first_id; p++) where[p] = -1;
        for (int64_t i = 0; i < kept; i++) where[chosen[i]] = i;
        memset(bits, 0, sizeof(uint32_t) * kept * W);
        for (int64_t i = 0; i < kept; i++) {
            const int64_t node = b * kept + i, id = chosen[i], parent = par[id] < 0 ? -1 : where[par[id]];
            tokens[node] = tok[id], parents[node] = parent, depths[node] = dep[id];
            if (parent >= 0) memcpy(bits + i * W, bits + parent * W, sizeof(uint32_t) * W);
            bits[i * W + (i >> 5)] |= 1u << (i & 31);
        }
        memcpy(mask + b * kept * W, bits, sizeof(uint32_t) * kept * W);
    }
done:
    free(block);
    return code;
}
