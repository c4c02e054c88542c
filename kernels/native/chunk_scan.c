/* Mamba2's chunked SSD scan (prefill) in one parallel region: a batch of equal-length sequences
 * (hm_ssd_scan_f32), or a packed varlen batch straight from and into the state pool, with the states
 * at any capture offsets written into their slots (hm_ssd_scan_varlen_f32).
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
 * Varlen: sequence b's tokens are rows cu_seqlens[b] .. cu_seqlens[b+1] of the packed inputs. It is cut
 * at its capture offsets into segments, and each segment into equal chunks of at most max_chunk tokens
 * (as few as that allows: what `ssd_scan` would choose for that segment), so the state after a
 * segment is exactly the state of a prefill of that prefix; that state is written into the capture
 * slots of its offset. A capture off a chunk boundary costs one more, shorter chunk in that sequence.
 *
 * Layout (float32): x [Bt, L, H, P] (varlen: [T, H, P]) with batch / token strides (H, P contiguous);
 * dt [Bt, L, H] likewise; B and C [Bt, L, G, N] with one pair of strides for both (G, N contiguous);
 * A, D, dt_bias [H] (D, dt_bias may be NULL); initial_state [Bt, H, P, N] contiguous or NULL; y
 * [Bt, L, H, P] (varlen [T, H, P]) and final_state [Bt, H, P, N] contiguous. Varlen states live in
 * pool [num_slots, H, P, N] (contiguous): sequence b starts from pool[state_slots[b]] when prefix[b] > 0
 * (else zeros) and ends there; its captures (offset, slot) are entries cu_captures[b] ..
 * cu_captures[b+1] of capture_offsets / capture_slots, sorted by offset.
 * Returns 0; -1 when a slot is outside the pool (nothing is written then); -2 when out of memory.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"

/* Chunk of q tokens of sequence b, from its token t0; `ends` is the sequence offset t0 + q when the
 * chunk ends a segment with captures there, else 0. */
typedef struct {
    int64_t b, t0, q, ends;
} Chunk;

typedef struct {
    const float *x, *dt, *A, *B, *C, *D, *dt_bias;
    int64_t x_st, dt_st, bc_st;
    int64_t dt_softplus, clamp;
    float low, high;
    float *y;
    int64_t batch, heads, head_dim, groups, state_size, chunk; /* chunk: the longest chunk */
    /* Per sequence: where its token 0 lies in x, dt, B/C and y (elements); its first chunk
     * (cu_chunks[b] .. cu_chunks[b+1]); the state it starts from (NULL: zeros) and ends in. */
    int64_t *x_at, *dt_at, *bc_at, *y_at, *cu_chunks;
    const float **initial;
    float **final;
    Chunk *chunks;
    /* Varlen captures (NULL in a batch): the pool and the (offset, slot) entries of each sequence. */
    float *pool;
    const int64_t *cu_captures, *capture_offsets, *capture_slots;
    float *bt, *cb; /* per (chunk, group): B of the chunk transposed [N][Q], and C·B [Q][Q] */
} Scan;

static float *bt_of(const Scan *s, int64_t k, int64_t g) {
    return s->bt + (k * s->groups + g) * s->state_size * s->chunk;
}

static float *cb_of(const Scan *s, int64_t k, int64_t g) { return s->cb + (k * s->groups + g) * s->chunk * s->chunk; }

/* B of chunk k transposed, and C·B of the chunk (row t, column s). */
static void pair_products(const Scan *s, int64_t k, int64_t g) {
    const int64_t Q = s->chunk, N = s->state_size, q = s->chunks[k].q;
    const int64_t at = s->bc_at[s->chunks[k].b] + s->chunks[k].t0 * s->bc_st + g * N;
    float *bt = bt_of(s, k, g);
    for (int64_t t = 0; t < q; t++)
        for (int64_t n = 0; n < N; n++) bt[n * Q + t] = s->B[at + t * s->bc_st + n];
    gemm(s->C + at, s->bc_st, bt, Q, cb_of(s, k, g), Q, q, q, N, 0);
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

/* Head h's state [P][N] at `out`, from the transposed one. */
static void store_state(const Work *w, int64_t P, int64_t N, float *out) {
    for (int64_t p = 0; p < P; p++)
        for (int64_t n = 0; n < N; n++) out[p * N + n] = w->state_t[n * P + p];
}

static void scan_head(const Scan *s, int64_t b, int64_t h, Work *w) {
    const int64_t Q = s->chunk, P = s->head_dim, N = s->state_size, H = s->heads;
    const int64_t g = h / (H / s->groups);
    const float A = s->A[h];
    if (s->initial[b] != NULL) {
        const float *init = s->initial[b] + h * P * N;
        for (int64_t p = 0; p < P; p++)
            for (int64_t n = 0; n < N; n++) w->state_t[n * P + p] = init[p * N + n];
    } else {
        memset(w->state_t, 0, (size_t)(N * P) * sizeof(float));
    }
    for (int64_t k = s->cu_chunks[b]; k < s->cu_chunks[b + 1]; k++) {
        const int64_t t0 = s->chunks[k].t0, q = s->chunks[k].q;
        double run = 0.0;
        for (int64_t t = 0; t < q; t++) {
            float d = s->dt[s->dt_at[b] + (t0 + t) * s->dt_st + h];
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
        const float *cb = cb_of(s, k, g);
        for (int64_t t = 0; t < q; t++) {
            float *e = w->exps + t * Q;
            for (int64_t j = 0; j <= t; j++) e[j] = (float)(w->cs[t] - w->cs[j]);
            exp_rows(e, e, t + 1);
            float *row = w->scores + t * Q;
            for (int64_t j = 0; j <= t; j++) row[j] = cb[t * Q + j] * e[j] * w->dt[j];
            for (int64_t j = t + 1; j < q; j++) row[j] = 0.0f;
        }
        const float *xc = s->x + s->x_at[b] + t0 * s->x_st + h * P;
        float *yc = s->y + s->y_at[b] + (t0 * H + h) * P;
        gemm(w->scores, Q, xc, s->x_st, yc, H * P, q, P, q, 0);
        /* The entering state's share: (exp(cs_t) C_t) . h_in. */
        const float *Cc = s->C + s->bc_at[b] + t0 * s->bc_st + g * N;
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
        gemm(bt_of(s, k, g), Q, w->xw, P, w->state_t, P, N, P, q, 1);
        if (s->chunks[k].ends)
            for (int64_t j = s->cu_captures[b]; j < s->cu_captures[b + 1]; j++)
                if (s->capture_offsets[j] == s->chunks[k].ends)
                    store_state(w, P, N, s->pool + (s->capture_slots[j] * H + h) * P * N);
    }
    store_state(w, P, N, s->final[b] + h * P * N);
}

/* The scan of every (sequence, head); the chunk tables are filled. */
static int64_t run_scan(Scan *s) {
    const int64_t chunks = s->cu_chunks[s->batch];
    s->bt = malloc((size_t)(chunks * s->groups * s->state_size * s->chunk + 1) * sizeof(float));
    s->cb = malloc((size_t)(chunks * s->groups * s->chunk * s->chunk + 1) * sizeof(float));
    int64_t failed = s->bt == NULL || s->cb == NULL;
    if (!failed) {
        const int64_t batch = s->batch, heads = s->heads, groups = s->groups;
#pragma omp parallel
        {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < chunks * groups; i++) pair_products(s, i / groups, i % groups);
            Work w = {0};
            const int ok = work_alloc(&w, s) == 0;
            if (!ok) {
#pragma omp atomic write
                failed = 1;
            }
            /* Every thread has its buffers, or none scans: a varlen scan writes the pool in place, and a
             * half-run scan would leave some of its states advanced. */
#pragma omp barrier
            int64_t any_failed;
#pragma omp atomic read
            any_failed = failed;
            if (!any_failed) {
#pragma omp for schedule(static)
                for (int64_t i = 0; i < batch * heads; i++) scan_head(s, i / heads, i % heads, &w);
            }
            if (ok) work_free(&w);
        }
    }
    free(s->bt);
    free(s->cb);
    return failed ? -2 : 0;
}

/* Per-sequence tables for `batch` sequences and up to `chunks` chunks, in one block; NULL when out of memory. */
static void *tables_alloc(Scan *s, int64_t batch, int64_t chunks) {
    const size_t ints = (size_t)(5 * batch + 1), ptrs = (size_t)(2 * batch);
    char *block = malloc(ints * sizeof(int64_t) + ptrs * sizeof(float *) + (size_t)(chunks + 1) * sizeof(Chunk));
    if (block == NULL) return NULL;
    int64_t *at = (int64_t *)block;
    s->x_at = at, s->dt_at = at + batch, s->bc_at = at + 2 * batch, s->y_at = at + 3 * batch;
    s->cu_chunks = at + 4 * batch;
    s->initial = (const float **)(block + ints * sizeof(int64_t));
    s->final = (float **)(s->initial + batch);
    s->chunks = (Chunk *)(s->final + batch);
    return block;
}

int64_t hm_ssd_scan_f32(const float *x, int64_t x_sb, int64_t x_st, const float *dt, int64_t dt_sb, int64_t dt_st,
                        const float *A, const float *Bm, const float *Cm, int64_t bc_sb, int64_t bc_st, const float *D,
                        const float *dt_bias, int64_t dt_softplus, float low, float high, int64_t clamp,
                        const float *initial_state, float *y, float *final_state, int64_t batch, int64_t length,
                        int64_t heads, int64_t head_dim, int64_t groups, int64_t state_size, int64_t chunk) {
    Scan s = {
        .x = x, .dt = dt, .A = A, .B = Bm, .C = Cm, .D = D, .dt_bias = dt_bias, .x_st = x_st, .dt_st = dt_st,
        .bc_st = bc_st, .dt_softplus = dt_softplus, .clamp = clamp, .low = low, .high = high, .y = y,
        .batch = batch, .heads = heads, .head_dim = head_dim, .groups = groups, .state_size = state_size,
        .chunk = chunk,
    };
    const int64_t per_seq = (length + chunk - 1) / chunk, row = heads * head_dim * state_size;
    void *tables = tables_alloc(&s, batch, batch * per_seq);
    if (tables == NULL) return -2;
    for (int64_t b = 0; b < batch; b++) {
        s.x_at[b] = b * x_sb, s.dt_at[b] = b * dt_sb, s.bc_at[b] = b * bc_sb, s.y_at[b] = b * length * heads * head_dim;
        s.initial[b] = initial_state != NULL ? initial_state + b * row : NULL;
        s.final[b] = final_state + b * row;
        s.cu_chunks[b] = b * per_seq;
        for (int64_t c = 0; c < per_seq; c++) {
            const int64_t t0 = c * chunk;
            s.chunks[b * per_seq + c] = (Chunk){b, t0, length - t0 < chunk ? length - t0 : chunk, 0};
        }
    }
    s.cu_chunks[batch] = batch * per_seq;
    const int64_t status = run_scan(&s);
    free(tables);
    return status;
}

int64_t hm_ssd_scan_varlen_f32(const float *x, int64_t x_st, const float *dt, int64_t dt_st, const float *A,
                               const float *Bm, const float *Cm, int64_t bc_st, const float *D, const float *dt_bias,
                               int64_t dt_softplus, float low, float high, int64_t clamp, float *pool,
                               int64_t num_slots, const int64_t *state_slots, const int64_t *prefix,
                               const int64_t *cu_seqlens, const int64_t *cu_captures, const int64_t *capture_offsets,
                               const int64_t *capture_slots, float *y, int64_t batch, int64_t heads,
                               int64_t head_dim, int64_t groups, int64_t state_size, int64_t max_chunk) {
    for (int64_t b = 0; b < batch; b++)
        if (state_slots[b] < 0 || state_slots[b] >= num_slots) return -1;
    for (int64_t j = 0; j < cu_captures[batch]; j++)
        if (capture_slots[j] < 0 || capture_slots[j] >= num_slots) return -1;
    Scan s = {
        .x = x, .dt = dt, .A = A, .B = Bm, .C = Cm, .D = D, .dt_bias = dt_bias, .x_st = x_st, .dt_st = dt_st,
        .bc_st = bc_st, .dt_softplus = dt_softplus, .clamp = clamp, .low = low, .high = high, .y = y,
        .batch = batch, .heads = heads, .head_dim = head_dim, .groups = groups, .state_size = state_size,
        .chunk = max_chunk, .pool = pool, .cu_captures = cu_captures, .capture_offsets = capture_offsets,
        .capture_slots = capture_slots,
    };
    /* At most one chunk per max_chunk tokens, plus one per segment (each capture offset). */
    const int64_t total = cu_seqlens[batch], row = heads * head_dim * state_size;
    void *tables = tables_alloc(&s, batch, total / max_chunk + batch + cu_captures[batch]);
    if (tables == NULL) return -2;
    int64_t k = 0;
    for (int64_t b = 0; b < batch; b++) {
        const int64_t first = cu_seqlens[b], length = cu_seqlens[b + 1] - first;
        s.x_at[b] = first * x_st, s.dt_at[b] = first * dt_st, s.bc_at[b] = first * bc_st;
        s.y_at[b] = first * heads * head_dim;
        s.initial[b] = prefix[b] > 0 ? pool + state_slots[b] * row : NULL;
        s.final[b] = pool + state_slots[b] * row;
        s.cu_chunks[b] = k;
        int64_t start = 0, j = cu_captures[b];
        while (start < length) {
            while (j < cu_captures[b + 1] && capture_offsets[j] <= start) j++;
            const int64_t end = j < cu_captures[b + 1] ? capture_offsets[j] : length;
            const int64_t n = end - start, pieces = (n + max_chunk - 1) / max_chunk, q = (n + pieces - 1) / pieces;
            for (int64_t t0 = start; t0 < end; t0 += q)
                s.chunks[k++] = (Chunk){b, t0, end - t0 < q ? end - t0 : q, t0 + q >= end && j < cu_captures[b + 1] ? end : 0};
            start = end;
        }
    }
    s.cu_chunks[batch] = k;
    const int64_t status = run_scan(&s);
    free(tables);
    return status;
}
