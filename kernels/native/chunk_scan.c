/* Mamba2's chunked SSD scan (prefill) in one parallel region.
 *
 * The PyTorch reference builds the scan from batched products and elementwise passes over
 * [heads, chunks, Q, Q] decay tensors: dozens of ops, each a parallel region that wakes the
 * OpenMP team, and each a pass through memory. Here the work is cut by head: every (sequence,
 * head) walks its chunks in order with its state in a local buffer, and each chunk is three small
 * products (within-chunk outputs, the entering state's contribution, the state's update) on data
 * that stays in cache. The C·B products, shared by the heads of a group, are made first.
 *
 * Per chunk of q tokens (cs: the running sum of dt * A within the chunk, in double precision):
 *     y_t     = sum_{s<=t} exp(cs_t - cs_s) (C_t . B_s) dt_s x_s + exp(cs_t) C_t . h_in + D x_t
 *     h_out   = exp(cs_q) h_in + sum_s exp(cs_q - cs_s) dt_s x_s (x) B_s
 * with dt = clamp(softplus(dt_raw + dt_bias)) as in the decode step.
 *
 * Layout (float32): x [Bt, L, H, P] with batch / token strides (H, P contiguous); dt [Bt, L, H]
 * likewise; B and C [Bt, L, G, N] with one pair of strides for both (G, N contiguous); A, D,
 * dt_bias [H] (D, dt_bias may be NULL); initial_state [Bt, H, P, N] contiguous or NULL; y
 * [Bt, L, H, P] and final_state [Bt, H, P, N] contiguous. Returns 0, or -2 when out of memory.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"

typedef struct {
    const float *x, *dt, *A, *B, *C, *D, *dt_bias, *initial_state;
    int64_t x_sb, x_st, dt_sb, dt_st, bc_sb, bc_st;
    int64_t dt_softplus, clamp;
    float low, high;
    float *y, *final_state;
    int64_t batch, length, heads, head_dim, groups, state_size, chunk, chunks;
    float *bt, *cb; /* per (b, g, c): B of the chunk transposed [N][Q], and C·B [Q][Q] */
} Scan;

static float *bt_of(const Scan *s, int64_t b, int64_t g, int64_t c) {
    return s->bt + ((b * s->groups + g) * s->chunks + c) * s->state_size * s->chunk;
}

static float *cb_of(const Scan *s, int64_t b, int64_t g, int64_t c) {
    return s->cb + ((b * s->groups + g) * s->chunks + c) * s->chunk * s->chunk;
}

/* B of chunk c transposed, and C·B of the chunk (row t, column s). */
static void pair_products(const Scan *s, int64_t b, int64_t g, int64_t c) {
    const int64_t Q = s->chunk, N = s->state_size, t0 = c * Q;
    const int64_t q = s->length - t0 < Q ? s->length - t0 : Q;
    const float *Bc = s->B + b * s->bc_sb + t0 * s->bc_st + g * N;
    const float *Cc = s->C + b * s->bc_sb + t0 * s->bc_st + g * N;
    float *bt = bt_of(s, b, g, c);
    for (int64_t t = 0; t < q; t++)
        for (int64_t n = 0; n < N; n++) bt[n * Q + t] = Bc[t * s->bc_st + n];
    gemm(Cc, s->bc_st, bt, Q, cb_of(s, b, g, c), Q, q, q, N, 0);
}

typedef struct {
    float *state_t; /* [N][P]: the state transposed, so that both products below read it row-major */
    float *dt, *scores, *exps, *xw, *cs_rows, *decay;
    double *cs;
} Work;

static int work_alloc(Work *w, const Scan *s) {
    const int64_t Q = s->chunk, P = s->head_dim, N = s->state_size;
    const size_t floats = (size_t)(N * P + Q + 2 * Q * Q + Q * P + Q * N + Q);
    float *block = malloc(floats * sizeof(float));
    double *cs = malloc((size_t)Q * sizeof(double));
    if (block == NULL || cs == NULL) {
        free(block);
        free(cs);
        return -1;
    }
    w->state_t = block;
    w->dt = w->state_t + N * P;
    w->scores = w->dt + Q;
    w->exps = w->scores + Q * Q;
    w->xw = w->exps + Q * Q;
    w->cs_rows = w->xw + Q * P;
    w->decay = w->cs_rows + Q * N;
    w->cs = cs;
    return 0;
}

static void work_free(Work *w) {
    free(w->state_t);
    free(w->cs);
}

static void scan_head(const Scan *s, int64_t b, int64_t h, Work *w) {
    const int64_t Q = s->chunk, P = s->head_dim, N = s->state_size, H = s->heads;
    const int64_t g = h / (H / s->groups);
    const float A = s->A[h];
    if (s->initial_state != NULL) {
        const float *init = s->initial_state + (b * H + h) * P * N;
        for (int64_t p = 0; p < P; p++)
            for (int64_t n = 0; n < N; n++) w->state_t[n * P + p] = init[p * N + n];
    } else {
        memset(w->state_t, 0, (size_t)(N * P) * sizeof(float));
    }
    for (int64_t c = 0; c < s->chunks; c++) {
        const int64_t t0 = c * Q, q = s->length - t0 < Q ? s->length - t0 : Q;
        double run = 0.0;
        for (int64_t t = 0; t < q; t++) {
            float d = s->dt[b * s->dt_sb + (t0 + t) * s->dt_st + h];
            if (s->dt_bias != NULL) d += s->dt_bias[h];
            if (s->dt_softplus) d = softplus(d);
            if (s->clamp) d = d < s->low ? s->low : (d > s->high ? s->high : d);
            w->dt[t] = d;
            run += (double)(d * A);
            w->cs[t] = run;
            w->decay[t] = (float)run; /* exp below: the decay from the chunk's start */
        }
        exp_rows(w->decay, w->decay, q);
        /* Within-chunk scores: row t holds exp(cs_t - cs_s) (C_t . B_s) dt_s for s <= t. */
        const float *cb = cb_of(s, b, g, c);
        for (int64_t t = 0; t < q; t++) {
            float *e = w->exps + t * Q;
            for (int64_t j = 0; j <= t; j++) e[j] = (float)(w->cs[t] - w->cs[j]);
            exp_rows(e, e, t + 1);
            float *row = w->scores + t * Q;
            for (int64_t j = 0; j <= t; j++) row[j] = cb[t * Q + j] * e[j] * w->dt[j];
            for (int64_t j = t + 1; j < q; j++) row[j] = 0.0f;
        }
        const float *xc = s->x + b * s->x_sb + t0 * s->x_st + h * P;
        float *yc = s->y + ((b * s->length + t0) * H + h) * P;
        gemm(w->scores, Q, xc, s->x_st, yc, H * P, q, P, q, 0);
        /* The entering state's share: (exp(cs_t) C_t) . h_in. */
        const float *Cc = s->C + b * s->bc_sb + t0 * s->bc_st + g * N;
        for (int64_t t = 0; t < q; t++)
            for (int64_t n = 0; n < N; n++) w->cs_rows[t * N + n] = Cc[t * s->bc_st + n] * w->decay[t];
        gemm(w->cs_rows, N, w->state_t, P, yc, H * P, q, P, N, 1);
        if (s->D != NULL) {
            const float skip = s->D[h];
            for (int64_t t = 0; t < q; t++)
                for (int64_t p = 0; p < P; p++) yc[t * H * P + p] += skip * xc[t * s->x_st + p];
        }
        /* The state after the chunk: exp(cs_q) h_in + B^T (exp(cs_q - cs_s) dt_s x_s). */
        for (int64_t t = 0; t < q; t++) w->exps[t] = (float)(w->cs[q - 1] - w->cs[t]);
        exp_rows(w->exps, w->exps, q);
        for (int64_t t = 0; t < q; t++) {
            const float f = w->exps[t] * w->dt[t];
            for (int64_t p = 0; p < P; p++) w->xw[t * P + p] = xc[t * s->x_st + p] * f;
        }
        const float carry = w->decay[q - 1];
        for (int64_t i = 0; i < N * P; i++) w->state_t[i] *= carry;
        gemm(bt_of(s, b, g, c), Q, w->xw, P, w->state_t, P, N, P, q, 1);
    }
    float *out = s->final_state + (b * H + h) * P * N;
    for (int64_t p = 0; p < P; p++)
        for (int64_t n = 0; n < N; n++) out[p * N + n] = w->state_t[n * P + p];
}

int64_t hm_ssd_scan_f32(const float *x, int64_t x_sb, int64_t x_st, const float *dt, int64_t dt_sb, int64_t dt_st,
                        const float *A, const float *Bm, const float *Cm, int64_t bc_sb, int64_t bc_st, const float *D,
                        const float *dt_bias, int64_t dt_softplus, float low, float high, int64_t clamp,
                        const float *initial_state, float *y, float *final_state, int64_t batch, int64_t length,
                        int64_t heads, int64_t head_dim, int64_t groups, int64_t state_size, int64_t chunk) {
    Scan s = {
        .x = x, .dt = dt, .A = A, .B = Bm, .C = Cm, .D = D, .dt_bias = dt_bias, .initial_state = initial_state,
        .x_sb = x_sb, .x_st = x_st, .dt_sb = dt_sb, .dt_st = dt_st, .bc_sb = bc_sb, .bc_st = bc_st,
        .dt_softplus = dt_softplus, .clamp = clamp, .low = low, .high = high, .y = y, .final_state = final_state,
        .batch = batch, .length = length, .heads = heads, .head_dim = head_dim, .groups = groups,
        .state_size = state_size, .chunk = chunk, .chunks = (length + chunk - 1) / chunk,
    };
    const int64_t pairs = batch * groups * s.chunks;
    s.bt = malloc((size_t)(pairs * state_size * chunk) * sizeof(float));
    s.cb = malloc((size_t)(pairs * chunk * chunk) * sizeof(float));
    int64_t failed = s.bt == NULL || s.cb == NULL;
    if (!failed) {
#pragma omp parallel reduction(| : failed)
        {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < pairs; i++)
                pair_products(&s, i / (groups * s.chunks), i / s.chunks % groups, i % s.chunks);
            Work w = {0};
            const int ok = work_alloc(&w, &s) == 0;
            failed |= !ok;
#pragma omp for schedule(static)
            for (int64_t i = 0; i < batch * heads; i++)
                if (ok) scan_head(&s, i / heads, i % heads, &w);
            if (ok) work_free(&w);
        }
    }
    free(s.bt);
    free(s.cb);
    return failed ? -2 : 0;
}
