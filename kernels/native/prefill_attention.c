/* Causal attention of a packed batch's new tokens, each sequence over its whole context in the paged
 * KV pool, flash style: a context is read where it lies, never gathered into one tensor, and no score
 * matrix larger than a block is formed. One sequence is the batch of one.
 *
 * Every sequence of the batch runs in one parallel region. First each sequence's context is read once
 * from the pool, the rows of all sequences spread over the threads, into its own buffers in the
 * layouts the two products want. Then a task is one sequence, one kv head and a block of query
 * tokens: the rows of all query heads that share the kv head (grouped-query attention) for those
 * tokens. For each block of context rows it takes the scores as one product, keeps a running maximum
 * and sum per query row (the online softmax), and adds the weighted V rows as a second product.
 * Context blocks past a query's position are skipped; the block on the diagonal is masked. A task's
 * cost grows with the context its last token sees, so the tasks are handed out one at a time, those
 * that see the most first (the last to finish is then a short one).
 *
 * For sequence b with n_b = cu_seqlens[b + 1] - cu_seqlens[b] new tokens after prefix[b] cached ones,
 * out[cu_seqlens[b] + i, h] = softmax_j(scale * q[cu_seqlens[b] + i, h] . K_b[j]) V_b[j] over
 * j = 0 .. prefix[b] + i, where K_b[j] / V_b[j] are the pool rows at slot_table[b, j], kv head
 * h / (Hq / Hkv).
 *
 * Layout (float32, contiguous): q [T, Hq, D] packed (sequence b's tokens are rows cu_seqlens[b] ..
 * cu_seqlens[b + 1] - 1); k_cache / v_cache [S, Hkv, D]; slot_table [B, width] (int64, rows
 * table_stride apart): row b's first prefix[b] + n_b entries are sequence b's context slots in order,
 * the new tokens' K/V already written at the last n_b; cu_seqlens [B + 1], prefix [B] (int64);
 * out [T, Hq, D]. Returns 0; -1 when a length or a slot of any sequence is out of range (nothing is
 * written then); -2 when out of memory.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"

enum { QUERY_TOKENS = 32, CONTEXT_BLOCK = 64 };

typedef struct {
    const float *q, *k_cache, *v_cache;
    float *out;
    int64_t q_heads, kv_heads, head_dim;
    float scale;
} Batch;

typedef struct {
    const int64_t *slots;
    int64_t start, tokens, prefix, context, blocks; /* start: its first row of q and out */
    /* Its context of each kv head read once, in the layouts the two products want: K transposed
     * block by block ([Hkv][context blocks][D][CONTEXT_BLOCK]: rows a block apart, not a whole
     * context, which would put them in the same cache sets) and V row by row ([Hkv][context][D]). */
    float *kt, *v;
} Sequence;

/* A sequence's block of query tokens; `visible` is the context its last token sees (the cost). */
typedef struct {
    int64_t seq, t0, visible;
} Task;

/* Buffers of one task: the query rows (scaled), the scores, and per query row the output
 * accumulator, running maximum and sum. */
typedef struct {
    float *qb, *s, *o, *m, *l;
} Blocks;

static int blocks_alloc(Blocks *b, int64_t rows, int64_t d) {
    const size_t floats = (size_t)(rows * d + rows * CONTEXT_BLOCK + rows * d + 2 * rows);
    float *p = malloc(floats * sizeof(float));
    if (p == NULL) return -1;
    b->qb = p;
    b->s = b->qb + rows * d;
    b->o = b->s + rows * CONTEXT_BLOCK;
    b->m = b->o + rows * d;
    b->l = b->m + rows;
    return 0;
}

static void attend_block(const Batch *p, const Sequence *sq, int64_t g, int64_t t0, Blocks *b) {
    const int64_t D = p->head_dim, rep = p->q_heads / p->kv_heads;
    const int64_t nt = sq->tokens - t0 < QUERY_TOKENS ? sq->tokens - t0 : QUERY_TOKENS, rows = nt * rep;
    /* Query row i * rep + r: token t0 + i, query head g * rep + r. */
    for (int64_t i = 0; i < nt; i++)
        for (int64_t r = 0; r < rep; r++) {
            const float *src = p->q + ((sq->start + t0 + i) * p->q_heads + g * rep + r) * D;
            float *dst = b->qb + (i * rep + r) * D;
            for (int64_t d = 0; d < D; d++) dst[d] = src[d] * p->scale;
        }
    memset(b->o, 0, (size_t)(rows * D) * sizeof(float));
    for (int64_t r = 0; r < rows; r++) b->m[r] = -INFINITY, b->l[r] = 0.0f;
    const int64_t visible = sq->prefix + t0 + nt; /* context rows the block's last token sees */
    for (int64_t j0 = 0; j0 < visible; j0 += CONTEXT_BLOCK) {
        const int64_t nk = visible - j0 < CONTEXT_BLOCK ? visible - j0 : CONTEXT_BLOCK;
        const float *kt = sq->kt + (g * sq->blocks + j0 / CONTEXT_BLOCK) * D * CONTEXT_BLOCK;
        const float *v = sq->v + (g * sq->context + j0) * D;
        gemm(b->qb, D, kt, CONTEXT_BLOCK, b->s, CONTEXT_BLOCK, rows, nk, D, 0);
        const int masked = j0 + nk > sq->prefix + t0 + 1; /* some row sees only part of the block */
        for (int64_t i = 0; i < nt; i++) {
            const int64_t last = sq->prefix + t0 + i - j0; /* last visible column of token i's rows */
            for (int64_t r = 0; r < rep; r++) {
                const int64_t row = i * rep + r;
                float *s = b->s + row * CONTEXT_BLOCK;
                const int64_t n = masked ? (last + 1 < nk ? last + 1 : nk) : nk;
                if (n <= 0) {
                    for (int64_t j = 0; j < nk; j++) s[j] = 0.0f;
                    continue;
                }
                const float mx = row_max(s, n, b->m[row]);
                const float sum = exp_shifted_sum(s, n, mx);
                for (int64_t j = n; j < nk; j++) s[j] = 0.0f;
                const float rescale = b->m[row] == -INFINITY ? 0.0f : exp1(b->m[row] - mx);
                b->l[row] = b->l[row] * rescale + sum;
                b->m[row] = mx;
                if (rescale != 1.0f) {
                    float *o = b->o + row * D;
                    for (int64_t d = 0; d < D; d++) o[d] *= rescale;
                }
            }
        }
        gemm(b->s, CONTEXT_BLOCK, v, D, b->o, D, rows, D, nk, 1);
    }
    for (int64_t i = 0; i < nt; i++)
        for (int64_t r = 0; r < rep; r++) {
            const int64_t row = i * rep + r;
            const float inv = 1.0f / b->l[row];
            float *dst = p->out + ((sq->start + t0 + i) * p->q_heads + g * rep + r) * D;
            for (int64_t d = 0; d < D; d++) dst[d] = b->o[row * D + d] * inv;
        }
}

/* Context row j of the sequence it falls in: K into its transposed block, V into its row. */
static void read_row(const Batch *p, const Sequence *sq, int64_t j) {
    const int64_t D = p->head_dim, slot = sq->slots[j];
    for (int64_t g = 0; g < p->kv_heads; g++) {
        const float *k = p->k_cache + (slot * p->kv_heads + g) * D;
        float *kt = sq->kt + (g * sq->blocks + j / CONTEXT_BLOCK) * D * CONTEXT_BLOCK + j % CONTEXT_BLOCK;
        for (int64_t d = 0; d < D; d++) kt[d * CONTEXT_BLOCK] = k[d];
        memcpy(sq->v + (g * sq->context + j) * D, p->v_cache + (slot * p->kv_heads + g) * D, (size_t)D * sizeof(float));
    }
}

/* The last b with first[b] <= x, for first[] ascending from first[0] = 0 <= x. */
static int64_t last_at_or_below(const int64_t *first, int64_t n, int64_t x) {
    int64_t lo = 0, hi = n; /* first[lo] <= x; the answer lies in [lo, hi) */
    while (hi - lo > 1) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (first[mid] <= x) lo = mid;
        else hi = mid;
    }
    return lo;
}

static int by_visible_descending(const void *a, const void *b) {
    const int64_t va = ((const Task *)a)->visible, vb = ((const Task *)b)->visible;
    return (va < vb) - (va > vb);
}

/* Every length and slot in range, checked before anything is read or written. */
static int valid(const int64_t *slot_table, const int64_t *cu_seqlens, const int64_t *prefix, int64_t batch,
                 int64_t tokens, int64_t table_width, int64_t table_stride, int64_t num_slots) {
    if (batch < 0 || cu_seqlens[0] != 0 || cu_seqlens[batch] != tokens) return 0;
    for (int64_t b = 0; b < batch; b++) {
        const int64_t n = cu_seqlens[b + 1] - cu_seqlens[b];
        if (n < 0 || prefix[b] < 0 || prefix[b] + n > table_width) return 0;
        const int64_t *slots = slot_table + b * table_stride;
        for (int64_t j = 0; j < prefix[b] + n; j++)
            if (slots[j] < 0 || slots[j] >= num_slots) return 0;
    }
    return 1;
}

int64_t hm_paged_attention_prefill_varlen_f32(const float *q, const float *k_cache, const float *v_cache,
                                              const int64_t *slot_table, const int64_t *cu_seqlens,
                                              const int64_t *prefix, float *out, int64_t batch, int64_t tokens,
                                              int64_t table_width, int64_t table_stride, int64_t q_heads,
                                              int64_t kv_heads, int64_t head_dim, int64_t num_slots, float scale) {
    if (!valid(slot_table, cu_seqlens, prefix, batch, tokens, table_width, table_stride, num_slots)) return -1;
    if (tokens == 0) return 0;
    const int64_t D = head_dim;
    const Batch p = {.q = q, .k_cache = k_cache, .v_cache = v_cache, .out = out, .q_heads = q_heads,
                     .kv_heads = kv_heads, .head_dim = D, .scale = scale};
    /* Per sequence its description and the first of its context rows among the batch's
     * (first_row[batch]: all of them); its query blocks as tasks (at most one per token). */
    Sequence *seqs = malloc((size_t)batch * sizeof(Sequence) + (size_t)(batch + 1) * sizeof(int64_t) +
                            (size_t)tokens * sizeof(Task));
    if (seqs == NULL) return -2;
    int64_t *first_row = (int64_t *)(seqs + batch);
    Task *tasks = (Task *)(first_row + batch + 1);
    int64_t floats = 0, num_tasks = 0;
    first_row[0] = 0;
    for (int64_t b = 0; b < batch; b++) {
        Sequence *sq = &seqs[b];
        sq->slots = slot_table + b * table_stride;
        sq->start = cu_seqlens[b];
        sq->tokens = cu_seqlens[b + 1] - cu_seqlens[b];
        sq->prefix = prefix[b];
        sq->context = sq->tokens > 0 ? sq->prefix + sq->tokens : 0; /* no query reads a context alone */
        sq->blocks = (sq->context + CONTEXT_BLOCK - 1) / CONTEXT_BLOCK;
        floats += kv_heads * D * (sq->blocks * CONTEXT_BLOCK + sq->context);
        first_row[b + 1] = first_row[b] + sq->context;
        for (int64_t t0 = 0; t0 < sq->tokens; t0 += QUERY_TOKENS) {
            const int64_t nt = sq->tokens - t0 < QUERY_TOKENS ? sq->tokens - t0 : QUERY_TOKENS;
            tasks[num_tasks++] = (Task){.seq = b, .t0 = t0, .visible = sq->prefix + t0 + nt};
        }
    }
    float *buffers = malloc((size_t)floats * sizeof(float));
    if (buffers == NULL) {
        free(seqs);
        return -2;
    }
    for (int64_t b = 0, at = 0; b < batch; b++) {
        seqs[b].kt = buffers + at;
        seqs[b].v = seqs[b].kt + kv_heads * seqs[b].blocks * D * CONTEXT_BLOCK;
        at += kv_heads * D * (seqs[b].blocks * CONTEXT_BLOCK + seqs[b].context);
    }
    qsort(tasks, (size_t)num_tasks, sizeof(Task), by_visible_descending);
    const int64_t rows = QUERY_TOKENS * (q_heads / kv_heads), all_rows = first_row[batch];
    const int64_t all_tasks = num_tasks * kv_heads;
    int64_t failed = 0;
#pragma omp parallel reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (int64_t j = 0; j < all_rows; j++) {
            const int64_t b = last_at_or_below(first_row, batch, j);
            read_row(&p, &seqs[b], j - first_row[b]);
        }
        Blocks blk = {0};
        const int ok = blocks_alloc(&blk, rows, head_dim) == 0;
        failed |= !ok;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < all_tasks; t++) {
            const Task *task = &tasks[t / kv_heads];
            if (ok) attend_block(&p, &seqs[task->seq], t % kv_heads, task->t0, &blk);
        }
        if (ok) free(blk.qb);
    }
    free(buffers);
    free(seqs);
    return failed ? -2 : 0;
}

int64_t hm_paged_attention_prefill_f32(const float *q, const float *k_cache, const float *v_cache,
                                       const int64_t *seq_slots, float *out, int64_t tokens, int64_t prefix,
                                       int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t num_slots,
                                       float scale) {
    const int64_t cu_seqlens[2] = {0, tokens}, width = prefix + tokens;
    return hm_paged_attention_prefill_varlen_f32(q, k_cache, v_cache, seq_slots, cu_seqlens, &prefix, out, 1, tokens,
                                                 width, width, q_heads, kv_heads, head_dim, num_slots, scale);
}
