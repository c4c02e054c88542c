/* Decode attention over the paged KV pool, reading each context's K/V rows where they lie.
 *
 * The PyTorch reference gathers every context into a fresh [B, Hkv, L, Dh] tensor and masks the
 * padding; on CPU that gather (twice: K and V) costs as much as the attention itself. Here a task
 * reads its rows through the slot table: scores for its query heads, a softmax, and the weighted sum
 * of V rows. A batch's task is one sequence with all its heads, so that every K and V row of the pool
 * is read whole, one contiguous stretch per slot (a decode step's KV comes from memory, not cache:
 * the step's weights passed through since; reading each kv head's half-rows apart ran 1.3-1.7x
 * slower, 8 x 576 rows). A single sequence's tasks are its kv heads, for two threads to share.
 *
 * Layout (float32, contiguous): q [B, Hq, D], k_cache / v_cache [S, Hkv, D], slot_table [B, L]
 * (int64), seq_lens [B] (int64), out [B, Hq, D]. Query head h reads kv head h / (Hq / Hkv).
 * Returns 0; -1 when a length or a slot is out of range (nothing is written then); -2 when the
 * scores could not be allocated.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"

enum { V_BLOCK = 32 }; /* V rows per block of the weighted sum (32 x 2 kv heads x 64 floats: 16 KB) */

static inline float dot(const float *a, const float *b, int64_t n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* The four rows a[0..3] (`stride` apart) · b, for lengths that are a multiple of 16: four 16-lane
 * partial sums folded together, instead of folding each product's 16 lanes on its own. */
static inline void dot4(const float *a, int64_t stride, const float *b, int64_t n, float *out) {
    v16 acc0 = {0}, acc1 = {0}, acc2 = {0}, acc3 = {0};
    for (int64_t i = 0; i < n; i += 16) {
        const v16 bv = *(const v16 *)(b + i);
        acc0 += *(const v16 *)(a + i) * bv;
        acc1 += *(const v16 *)(a + stride + i) * bv;
        acc2 += *(const v16 *)(a + 2 * stride + i) * bv;
        acc3 += *(const v16 *)(a + 3 * stride + i) * bv;
    }
    const v8 h0 = fold(acc0), h1 = fold(acc1), h2 = fold(acc2), h3 = fold(acc3);
    const v8 q01 = __builtin_shufflevector(h0, h1, 0, 1, 2, 3, 8, 9, 10, 11) +
                   __builtin_shufflevector(h0, h1, 4, 5, 6, 7, 12, 13, 14, 15);
    const v8 q23 = __builtin_shufflevector(h2, h3, 0, 1, 2, 3, 8, 9, 10, 11) +
                   __builtin_shufflevector(h2, h3, 4, 5, 6, 7, 12, 13, 14, 15);
    const v8 p = __builtin_shufflevector(q01, q23, 0, 2, 4, 6, 8, 10, 12, 14) +
                 __builtin_shufflevector(q01, q23, 1, 3, 5, 7, 9, 11, 13, 15);
    out[0] = p[0] + p[1];
    out[1] = p[2] + p[3];
    out[2] = p[4] + p[5];
    out[3] = p[6] + p[7];
}

/* Row s[0..len) -> its softmax, in place. */
static void softmax(float *s, int64_t len) {
    const float inv = 1.0f / exp_shifted_sum(s, len, row_max(s, len, s[0]));
#pragma omp simd
    for (int64_t i = 0; i < len; i++) s[i] *= inv;
}

static int64_t check(const int64_t *slot_table, const int64_t *seq_lens, int64_t batch, int64_t max_len,
                     int64_t num_slots) {
    for (int64_t b = 0; b < batch; b++) {
        int64_t len = seq_lens[b];
        if (len < 1 || len > max_len) return -1;
        const int64_t *row = slot_table + b * max_len;
        for (int64_t j = 0; j < len; j++)
            if (row[j] < 0 || row[j] >= num_slots) return -1;
    }
    return 0;
}

/* One task: `heads` kv heads (from the one `k_cache` / `v_cache` point at) of one sequence, each with
 * `rep` query rows, against `len` context rows `row_stride` floats apart in the pool. `q` and `out`
 * point at the task's first query head; `work` holds heads * rep * len probabilities. */
static void attend(const float *q, const float *k_cache, const float *v_cache, const int64_t *slots, int64_t len,
                   int64_t rep, int64_t heads, int64_t row_stride, int64_t head_dim, float scale, float *work,
                   float *out) {
    const int64_t rows = heads * rep, quads = head_dim % 16 == 0 ? rep / 4 * 4 : 0;
    for (int64_t j = 0; j < len; j++) {
        const float *krow = k_cache + slots[j] * row_stride;
        /* Start the V row on its way now: the weighted sum below reads it a column block at a time. */
        const char *vrow = (const char *)(v_cache + slots[j] * row_stride);
        for (int64_t b = 0; b < heads * head_dim * (int64_t)sizeof(float); b += 64) __builtin_prefetch(vrow + b, 0, 2);
        for (int64_t g = 0; g < heads; g++) {
            const float *k = krow + g * head_dim, *qg = q + g * rep * head_dim;
            float *w = work + g * rep * len;
            int64_t r = 0;
            for (; r < quads; r += 4) {
                float d[4];
                dot4(qg + r * head_dim, head_dim, k, head_dim, d);
                for (int64_t i = 0; i < 4; i++) w[(r + i) * len + j] = d[i] * scale;
            }
            for (; r < rep; r++) w[r * len + j] = dot(qg + r * head_dim, k, head_dim) * scale;
        }
    }
    for (int64_t r = 0; r < rows; r++) softmax(work + r * len, len);
    memset(out, 0, (size_t)(rows * head_dim) * sizeof(float));
    /* The weighted sum of V rows, a block of rows at a time (in L2 since the prefetch, then in L1):
     * 16 columns of four query rows stay in registers over the block. Every output adds its rows in
     * order, from zero. */
    for (int64_t j0 = 0; j0 < len; j0 += V_BLOCK) {
        const int64_t j1 = len - j0 < V_BLOCK ? len : j0 + V_BLOCK;
        for (int64_t g = 0; g < heads; g++) {
            const float *vg = v_cache + g * head_dim;
            int64_t r = g * rep;
            for (; r < g * rep + quads; r += 4) {
                const float *p0 = work + r * len, *p1 = p0 + len, *p2 = p1 + len, *p3 = p2 + len;
                for (int64_t c = 0; c < head_dim; c += 16) {
                    float *o = out + r * head_dim + c;
                    v16 o0 = *(v16 *)o, o1 = *(v16 *)(o + head_dim), o2 = *(v16 *)(o + 2 * head_dim);
                    v16 o3 = *(v16 *)(o + 3 * head_dim);
                    for (int64_t j = j0; j < j1; j++) {
                        const v16 v = *(const v16 *)(vg + slots[j] * row_stride + c);
                        o0 += p0[j] * v;
                        o1 += p1[j] * v;
                        o2 += p2[j] * v;
                        o3 += p3[j] * v;
                    }
                    *(v16 *)o = o0, *(v16 *)(o + head_dim) = o1, *(v16 *)(o + 2 * head_dim) = o2;
                    *(v16 *)(o + 3 * head_dim) = o3;
                }
            }
            for (; r < (g + 1) * rep; r++) {
                float *o = out + r * head_dim;
                const float *p = work + r * len;
                for (int64_t j = j0; j < j1; j++) {
                    const float *v = vg + slots[j] * row_stride;
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; d++) o[d] += p[j] * v[d];
                }
            }
        }
    }
}

int64_t hm_paged_attention_decode_f32(const float *q, const float *k_cache, const float *v_cache,
                                      const int64_t *slot_table, const int64_t *seq_lens, float *out, int64_t batch,
                                      int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t max_len,
                                      int64_t num_slots, float scale) {
    if (check(slot_table, seq_lens, batch, max_len, num_slots) != 0) return -1;
    const int64_t rep = q_heads / kv_heads, row_stride = kv_heads * head_dim;
    /* A task per sequence; one sequence alone is split by kv head. */
    const int64_t heads = batch > 1 ? kv_heads : 1, tasks = batch > 1 ? batch : kv_heads;
    int64_t failed = 0;
    /* A parallel region only when there is work for two threads: each region wakes the team. */
#pragma omp parallel for schedule(static) reduction(| : failed) if (tasks > 1 && batch * max_len >= 4096)
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t b = batch > 1 ? t : 0, g = batch > 1 ? 0 : t, len = seq_lens[b];
        float *work = malloc((size_t)(heads * rep * len) * sizeof(float));
        if (work == NULL) {
            failed = 1;
            continue;
        }
        const int64_t first = (b * q_heads + g * rep) * head_dim;
        attend(q + first, k_cache + g * head_dim, v_cache + g * head_dim, slot_table + b * max_len, len, rep, heads,
               row_stride, head_dim, scale, work, out + first);
        free(work);
    }
    return failed ? -2 : 0;
}
