/* Qwen3-Next's gated delta rule over a packed varlen prefill batch in one parallel region, straight from
 * and into the state pool, with the states at any capture offsets written into their slots
 * (hm_gated_delta_rule_varlen_f32).
 *
 * Per value head h (reading q/k head h / (Hv / Hk)), with state S [Dk][Dv], log decay g_t, write
 * strength beta_t, q and k optionally L2-normalised (q_t / sqrt(|q_t|^2 + 1e-6)) and q scaled:
 *     S'_t = exp(g_t) S_{t-1}
 *     S_t  = S'_t + k_t (x) beta_t (v_t - S'_t^T k_t)
 *     o_t  = S_t^T q_t = exp(g_t) S_{t-1}^T q_t + (q_t . k_t) beta_t (v_t - S'_t^T k_t)
 *
 * The recurrent form, token by token, not the reference's chunked WY form: per token and state element
 * it costs four vector operations (two products read from S in one pass, its decay and rank-one write
 * in a second), against about three of the chunked form's GEMMs plus its within-chunk Q x Q products
 * (five Q x D products per token), so at Q = 64 it does less arithmetic, and what it does streams a
 * state block that stays in L1. A column of S depends only on that column (the prediction and the
 * write of column j read column j alone), so the work is cut by (sequence, value head, block of BV
 * columns): each block walks its sequence's tokens in order with its Dk x BV slice of S in a local
 * buffer (16 KB at Dk = 128). The per-token norms and decays, shared by the blocks and heads, are
 * made first, in the same region.
 *
 * Layout (float32): q, k [T, Hk, Dk] and val [T, Hv, Dv], each with its own token stride (heads and
 * head dims contiguous); g, beta [T, Hv] with token strides (heads contiguous); out [T, Hv, Dv]
 * contiguous; pool [num_slots, Hv, Dk, Dv] contiguous. Sequence b's tokens are rows cu_seqlens[b] ..
 * cu_seqlens[b+1]; it starts from pool[state_slots[b]] when prefix[b] > 0 (else zeros, its slot never
 * read) and ends there; its captures (offset, slot) are entries cu_captures[b] .. cu_captures[b+1] of
 * capture_offsets / capture_slots, sorted by offset: the state after `offset` new tokens goes into
 * `slot`. A block reads its initial slice before it writes anything.
 * Returns 0; -1 when a slot is outside the pool (nothing is written then); -2 when out of memory.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"

#define BV 32 /* columns of S per work item: two vectors */
#define NV (BV / 16)
#define ACC 4 /* independent sums per product, so the multiply-adds need not wait on each other */

typedef struct {
    const float *q, *k, *val, *g, *beta;
    int64_t q_st, k_st, v_st, g_st, beta_st;
    float *pool, *out;
    const int64_t *state_slots, *prefix, *cu_seqlens, *cu_captures, *capture_offsets, *capture_slots;
    int64_t k_heads, v_heads, k_dim, v_dim, blocks;
    /* Per token: q's scale over its norm, k's inverse norm and q . k after both [T][Hk]; exp(g) [T][Hv]. */
    float *q_scale, *k_scale, *qk, *decay;
} Rule;

/* x . y over n floats, 16 lanes at a time. */
static float dot(const float *x, const float *y, int64_t n) {
    v16 acc = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) acc += *(const v16 *)(x + i) * *(const v16 *)(y + i);
    float sum = 0.0f;
    for (; i < n; i++) sum += x[i] * y[i];
    const v8 h = fold(acc);
    for (int j = 0; j < 8; j++) sum += h[j];
    return sum;
}

/* The Dk x BV slice of S at columns c0 .. c0 + nv of pool row `at` (contiguous [Dk][Dv]). */
static void load_slice(const Rule *r, const float *at, int64_t c0, int64_t nv, float *s) {
    for (int64_t i = 0; i < r->k_dim; i++) {
        memcpy(s + i * BV, at + i * r->v_dim + c0, (size_t)nv * sizeof(float));
        memset(s + i * BV + nv, 0, (size_t)(BV - nv) * sizeof(float));
    }
}

static void store_slice(const Rule *r, const float *s, int64_t c0, int64_t nv, float *at) {
    for (int64_t i = 0; i < r->k_dim; i++) memcpy(at + i * r->v_dim + c0, s + i * BV, (size_t)nv * sizeof(float));
}

/* Columns c0 .. c0 + BV (or to Dv) of value head h of sequence b. Padded columns of the slice start at
 * zero and see v = 0, so they stay zero. */
static void rule_block(const Rule *r, int64_t b, int64_t h, int64_t c0, float *s) {
    const int64_t Dk = r->k_dim, Dv = r->v_dim, Hv = r->v_heads, Hk = r->k_heads;
    const int64_t hk = h / (Hv / Hk), nv = Dv - c0 < BV ? Dv - c0 : BV;
    const int64_t slot = r->state_slots[b], row_size = Hv * Dk * Dv;
    if (r->prefix[b] > 0)
        load_slice(r, r->pool + slot * row_size + h * Dk * Dv, c0, nv, s);
    else
        memset(s, 0, (size_t)(Dk * BV) * sizeof(float));
    const int64_t first = r->cu_seqlens[b], length = r->cu_seqlens[b + 1] - first;
    int64_t cap = r->cu_captures[b];
    const int64_t cap_end = r->cu_captures[b + 1];
    for (int64_t t = 0; t < length; t++) {
        const int64_t row = first + t;
        const float *qr = r->q + row * r->q_st + hk * Dk, *kr = r->k + row * r->k_st + hk * Dk;
        const float iq = r->q_scale[row * Hk + hk], ik = r->k_scale[row * Hk + hk], e = r->decay[row * Hv + h];
        const float qk = r->qk[row * Hk + hk];
        const float bt = r->beta[row * r->beta_st + h];
        float vrow[BV] = {0};
        memcpy(vrow, r->val + row * r->v_st + h * Dv + c0, (size_t)nv * sizeof(float));
        /* Pass 1 (reads S): S^T k and S^T q, over the raw rows (their scales applied after). */
        v16 ks[ACC][NV], qs[ACC][NV];
        for (int a = 0; a < ACC; a++)
            for (int n = 0; n < NV; n++) ks[a][n] = (v16){0}, qs[a][n] = (v16){0};
        int64_t i = 0;
        for (; i + ACC <= Dk; i += ACC)
            for (int a = 0; a < ACC; a++) {
                const float *si = s + (i + a) * BV;
                for (int n = 0; n < NV; n++) {
                    const v16 sv = *(const v16 *)(si + 16 * n);
                    ks[a][n] += kr[i + a] * sv;
                    qs[a][n] += qr[i + a] * sv;
                }
            }
        for (; i < Dk; i++) {
            const float *si = s + i * BV;
            for (int n = 0; n < NV; n++) {
                const v16 sv = *(const v16 *)(si + 16 * n);
                ks[0][n] += kr[i] * sv;
                qs[0][n] += qr[i] * sv;
            }
        }
        /* The write u = beta (v - exp(g) S^T k) and the output; then pass 2: S = exp(g) S + k (x) u. */
        v16 uk[NV];
        float ob[BV];
        for (int n = 0; n < NV; n++) {
            v16 kt = ks[0][n], qt = qs[0][n];
            for (int a = 1; a < ACC; a++) kt += ks[a][n], qt += qs[a][n];
            const v16 u = bt * (*(const v16 *)(vrow + 16 * n) - (e * ik) * kt);
            *(v16 *)(ob + 16 * n) = (e * iq) * qt + qk * u;
            uk[n] = ik * u;
        }
        memcpy(r->out + (row * Hv + h) * Dv + c0, ob, (size_t)nv * sizeof(float));
        for (int64_t j = 0; j < Dk; j++) {
            float *sj = s + j * BV;
            for (int n = 0; n < NV; n++) *(v16 *)(sj + 16 * n) = e * *(v16 *)(sj + 16 * n) + kr[j] * uk[n];
        }
        for (; cap < cap_end && r->capture_offsets[cap] == t + 1; cap++)
            store_slice(r, s, c0, nv, r->pool + r->capture_slots[cap] * row_size + h * Dk * Dv);
    }
    store_slice(r, s, c0, nv, r->pool + slot * row_size + h * Dk * Dv);
}

int64_t hm_gated_delta_rule_varlen_f32(const float *q, int64_t q_st, const float *k, int64_t k_st, const float *val,
                                       int64_t v_st, const float *g, int64_t g_st, const float *beta, int64_t beta_st,
                                       int64_t l2norm, float scale, float *pool, int64_t num_slots,
                                       const int64_t *state_slots, const int64_t *prefix, const int64_t *cu_seqlens,
                                       const int64_t *cu_captures, const int64_t *capture_offsets,
                                       const int64_t *capture_slots, float *out, int64_t batch, int64_t k_heads,
                                       int64_t v_heads, int64_t k_dim, int64_t v_dim) {
    for (int64_t b = 0; b < batch; b++)
        if (state_slots[b] < 0 || state_slots[b] >= num_slots) return -1;
    for (int64_t j = 0; j < cu_captures[batch]; j++)
        if (capture_slots[j] < 0 || capture_slots[j] >= num_slots) return -1;
    const int64_t total = cu_seqlens[batch];
    Rule r = {
        .q = q, .k = k, .val = val, .g = g, .beta = beta, .q_st = q_st, .k_st = k_st, .v_st = v_st, .g_st = g_st,
        .beta_st = beta_st, .pool = pool, .out = out, .state_slots = state_slots, .prefix = prefix,
        .cu_seqlens = cu_seqlens, .cu_captures = cu_captures, .capture_offsets = capture_offsets,
        .capture_slots = capture_slots, .k_heads = k_heads, .v_heads = v_heads, .k_dim = k_dim, .v_dim = v_dim,
        .blocks = (v_dim + BV - 1) / BV,
    };
    float *scales = malloc((size_t)(total * (3 * k_heads + v_heads) + 1) * sizeof(float));
    if (scales == NULL) return -2;
    r.q_scale = scales, r.k_scale = scales + total * k_heads, r.qk = scales + 2 * total * k_heads;
    r.decay = scales + 3 * total * k_heads;
    const int64_t items = batch * v_heads * r.blocks;
    int64_t failed = 0; /* any thread without its slice buffer: then no thread writes anything */
#pragma omp parallel
    {
        float *s = malloc((size_t)(k_dim * BV + 1) * sizeof(float));
        if (s == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < total; t++) {
            for (int64_t h = 0; h < k_heads; h++) {
                const float *qr = q + t * q_st + h * k_dim, *kr = k + t * k_st + h * k_dim;
                float iq = 1.0f, ik = 1.0f;
                if (l2norm) {
                    iq = 1.0f / sqrtf(sum_squares(qr, k_dim) + 1e-6f);
                    ik = 1.0f / sqrtf(sum_squares(kr, k_dim) + 1e-6f);
                }
                r.q_scale[t * k_heads + h] = iq * scale;
                r.k_scale[t * k_heads + h] = ik;
                r.qk[t * k_heads + h] = iq * scale * ik * dot(qr, kr, k_dim);
            }
            for (int64_t h = 0; h < v_heads; h++) r.decay[t * v_heads + h] = expf(g[t * g_st + h]);
        }
        /* The loop's closing barrier orders every thread's check above before the read below. */
        int64_t stop;
#pragma omp atomic read
        stop = failed;
        if (!stop) {
#pragma omp for schedule(dynamic)
            for (int64_t i = 0; i < items; i++)
                rule_block(&r, i / (v_heads * r.blocks), i / r.blocks % v_heads, i % r.blocks * BV, s);
        }
        free(s);
    }
    free(scales);
    return failed ? -2 : 0;
}
