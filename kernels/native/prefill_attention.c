/* Causal attention of one sequence's new tokens over its whole context in the paged KV pool, flash
 * style: the context is read block by block where it lies, never gathered into one tensor, and no
 * score matrix larger than a block is formed.
 *
 * A task is one kv head and a block of query tokens: the rows of all query heads that share the kv
 * head (grouped-query attention) for those tokens. For each block of context rows it takes the
 * scores as one product, keeps a running maximum and sum per query row (the online softmax), and
 * adds the weighted V rows as a second product. Context blocks past a query's position are skipped;
 * the block on the diagonal is masked.
 *
 * Layout (float32, contiguous): q [T, Hq, D]; k_cache / v_cache [S, Hkv, D]; seq_slots
 * [prefix + T] (int64): the context's slots in order, the new tokens' K/V already written at the last
 * T; out [T, Hq, D]. Query token i sees context positions 0 .. prefix + i. Returns 0; -1 when a slot
 * is out of range (nothing is written then); -2 when out of memory.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"

enum { QUERY_TOKENS = 32, CONTEXT_BLOCK = 64 };

typedef struct {
    const float *q, *k_cache, *v_cache;
    const int64_t *slots;
    float *out;
    int64_t tokens, prefix, context, blocks, q_heads, kv_heads, head_dim;
    float scale;
    /* The context of each kv head read once, in the layouts the two products want: K transposed
     * block by block ([Hkv][context blocks][D][CONTEXT_BLOCK]: rows a block apart, not a whole
     * context, which would put them in the same cache sets) and V row by row ([Hkv][context][D]). */
    float *kt, *v;
} Prefill;

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

static void attend_block(const Prefill *p, int64_t g, int64_t t0, Blocks *b) {
    const int64_t D = p->head_dim, rep = p->q_heads / p->kv_heads;
    const int64_t nt = p->tokens - t0 < QUERY_TOKENS ? p->tokens - t0 : QUERY_TOKENS, rows = nt * rep;
    /* Query row i * rep + r: token t0 + i, query head g * rep + r. */
    for (int64_t i = 0; i < nt; i++)
        for (int64_t r = 0; r < rep; r++) {
            const float *src = p->q + ((t0 + i) * p->q_heads + g * rep + r) * D;
            float *dst = b->qb + (i * rep + r) * D;
            for (int64_t d = 0; d < D; d++) dst[d] = src[d] * p->scale;
        }
    memset(b->o, 0, (size_t)(rows * D) * sizeof(float));
    for (int64_t r = 0; r < rows; r++) b->m[r] = -INFINITY, b->l[r] = 0.0f;
    const int64_t visible = p->prefix + t0 + nt; /* context rows the block's last token sees */
    for (int64_t j0 = 0; j0 < visible; j0 += CONTEXT_BLOCK) {
        const int64_t nk = visible - j0 < CONTEXT_BLOCK ? visible - j0 : CONTEXT_BLOCK;
        const float *kt = p->kt + (g * p->blocks + j0 / CONTEXT_BLOCK) * D * CONTEXT_BLOCK;
        const float *v = p->v + (g * p->context + j0) * D;
        gemm(b->qb, D, kt, CONTEXT_BLOCK, b->s, CONTEXT_BLOCK, rows, nk, D, 0);
        const int masked = j0 + nk > p->prefix + t0 + 1; /* some row sees only part of the block */
        for (int64_t i = 0; i < nt; i++) {
            const int64_t last = p->prefix + t0 + i - j0; /* last visible column of token i's rows */
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
            float *dst = p->out + ((t0 + i) * p->q_heads + g * rep + r) * D;
            for (int64_t d = 0; d < D; d++) dst[d] = b->o[row * D + d] * inv;
        }
}

int64_t hm_paged_attention_prefill_f32(const float *q, const float *k_cache, const float *v_cache,
                                       const int64_t *seq_slots, float *out, int64_t tokens, int64_t prefix,
                                       int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t num_slots,
                                       float scale) {
    for (int64_t j = 0; j < prefix + tokens; j++)
        if (seq_slots[j] < 0 || seq_slots[j] >= num_slots) return -1;
    const int64_t context = prefix + tokens, D = head_dim;
    Prefill p = {.q = q, .k_cache = k_cache, .v_cache = v_cache, .slots = seq_slots, .out = out, .tokens = tokens,
                 .prefix = prefix, .context = context, .q_heads = q_heads, .kv_heads = kv_heads, .head_dim = D,
                 .scale = scale};
    p.blocks = (context + CONTEXT_BLOCK - 1) / CONTEXT_BLOCK;
    p.kt = malloc((size_t)(kv_heads * D * (p.blocks * CONTEXT_BLOCK + context)) * sizeof(float));
    if (p.kt == NULL) return -2;
    p.v = p.kt + kv_heads * p.blocks * D * CONTEXT_BLOCK;
    const int64_t blocks = (tokens + QUERY_TOKENS - 1) / QUERY_TOKENS, tasks = kv_heads * blocks;
    const int64_t rows = QUERY_TOKENS * (q_heads / kv_heads);
    int64_t failed = 0;
#pragma omp parallel reduction(| : failed)
    {
#pragma omp for schedule(static)
        for (int64_t j = 0; j < context; j++)
            for (int64_t g = 0; g < kv_heads; g++) {
                const float *k = k_cache + (seq_slots[j] * kv_heads + g) * D;
                float *kt = p.kt + (g * p.blocks + j / CONTEXT_BLOCK) * D * CONTEXT_BLOCK + j % CONTEXT_BLOCK;
                for (int64_t d = 0; d < D; d++) kt[d * CONTEXT_BLOCK] = k[d];
                memcpy(p.v + (g * context + j) * D, v_cache + (seq_slots[j] * kv_heads + g) * D, (size_t)D * sizeof(float));
            }
        Blocks b = {0};
        const int ok = blocks_alloc(&b, rows, head_dim) == 0;
        failed |= !ok;
        /* Later query blocks see more context: hand the tasks out one at a time, last first. */
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < tasks; t++) {
            const int64_t task = tasks - 1 - t;
            if (ok) attend_block(&p, task % kv_heads, task / kv_heads * QUERY_TOKENS, &b);
        }
        if (ok) free(b.qb);
    }
    free(p.kt);
    return failed ? -2 : 0;
}
