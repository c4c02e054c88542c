/* Mamba1's selective scan (prefill) of a packed varlen batch in one parallel region, straight from and
 * into the state pool, with the states at any capture offsets written into their slots
 * (hm_selective_scan_varlen_f32).
 *
 * Per channel d with state h[d] [N] (A [D, N], B_t and C_t [N] shared by every channel):
 *     dt_t = softplus(delta_t + delta_bias)                     (bias and softplus optional)
 *     h_t  = exp(dt_t * A) * h_{t-1} + dt_t * u_t * B_t
 *     y_t  = (h_t . C_t + D * u_t) * silu(z_t)                   (D and z optional)
 * The decay differs per (d, n), so there is no chunked shortcut worth its arithmetic (see
 * reference/selective_scan.py): the scan steps one token at a time. The PyTorch reference makes four
 * small ops per token on the [D, N] state, and the segment loop one call per piece between capture
 * offsets; here every (sequence, block of 16 channels) walks its tokens in order with its state
 * [N][16] in a local buffer, the 16 channels in the lanes of one vector (so the C product is a
 * multiply-add per n, with no horizontal sum), and writes y once. Stepping one token at a time, a
 * capture at any offset costs a copy of the state there and nothing else.
 *
 * Layout (float32): u, delta, z [T, D] and B, C [T, N], each with a token stride (channels / N
 * contiguous: views into the rows of a projection; B and C share one stride); A [D, N] contiguous;
 * D, delta_bias [D] (NULL: none); z NULL for no gate; y [T, D] contiguous. States live in pool
 * [num_slots, D, N] (contiguous): sequence b (rows cu_seqlens[b] .. cu_seqlens[b+1]) starts from
 * pool[state_slots[b]] when prefix[b] > 0 (else zeros) and ends there; its captures (offset, slot)
 * are entries cu_captures[b] .. cu_captures[b+1] of capture_offsets / capture_slots, sorted by offset.
 * Every initial state is copied out before any state is written, so a slot that one sequence
 * captures into and another starts from is read as it was before the call.
 * Returns 0; -1 when a slot is outside the pool (nothing is written then); -2 when out of memory.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "vector_math.h"

#define LANES 16

typedef struct {
    const float *u, *delta, *A, *B, *C, *D, *delta_bias, *z;
    int64_t u_st, delta_st, bc_st, z_st, softplus;
    float *pool, *y;
    const int64_t *state_slots, *prefix, *cu_seqlens, *cu_captures, *capture_offsets, *capture_slots;
    int64_t channels, state_size, blocks;
    float *work; /* per (sequence, block): the state [N][16], then A of the block [N][16] */
} Scan;

/* `w` (<= 16) floats from src into the lanes of a vector, zeros beyond. */
static inline v16 load_lanes(const float *src, int64_t w) {
    if (w == LANES) return *(const v16 *)src;
    v16 v = {0};
    for (int64_t i = 0; i < w; i++) v[i] = src[i];
    return v;
}

static inline void store_lanes(float *dst, v16 v, int64_t w) {
    if (w == LANES) {
        *(v16 *)dst = v;
        return;
    }
    for (int64_t i = 0; i < w; i++) dst[i] = v[i];
}

/* Channels d0 .. d0 + w of a [D, N] state, from the lanes of h [N][16], at dst (a pool row). */
static void store_state(const Scan *s, const v16 *h, int64_t d0, int64_t w, float *dst) {
    const int64_t N = s->state_size;
    for (int64_t i = 0; i < w; i++)
        for (int64_t n = 0; n < N; n++) dst[(d0 + i) * N + n] = h[n][i];
}

static int64_t block_width(const Scan *s, int64_t blk) {
    const int64_t left = s->channels - blk * LANES;
    return left < LANES ? left : LANES;
}

/* The task's state (its slot's rows, or zeros) and A, transposed into its work buffer. */
static void load_task(const Scan *s, int64_t b, int64_t blk) {
    const int64_t N = s->state_size, d0 = blk * LANES, w = block_width(s, blk);
    v16 *h = (v16 *)(s->work + (b * s->blocks + blk) * 2 * N * LANES), *a = h + N;
    const float *init = s->prefix[b] > 0 ? s->pool + s->state_slots[b] * s->channels * N : NULL;
    for (int64_t n = 0; n < N; n++) h[n] = a[n] = (v16){0};
    for (int64_t i = 0; i < w; i++)
        for (int64_t n = 0; n < N; n++) {
            a[n][i] = s->A[(d0 + i) * N + n];
            if (init != NULL) h[n][i] = init[(d0 + i) * N + n];
        }
}

static void scan_task(const Scan *s, int64_t b, int64_t blk) {
    const int64_t N = s->state_size, D = s->channels, d0 = blk * LANES, w = block_width(s, blk);
    v16 *h = (v16 *)(s->work + (b * s->blocks + blk) * 2 * N * LANES);
    const v16 *a = h + N;
    const v16 bias = s->delta_bias != NULL ? load_lanes(s->delta_bias + d0, w) : (v16){0};
    const v16 skip = s->D != NULL ? load_lanes(s->D + d0, w) : (v16){0};
    const int64_t first = s->cu_seqlens[b], length = s->cu_seqlens[b + 1] - first;
    const int64_t cap_end = s->cu_captures[b + 1];
    int64_t cap = s->cu_captures[b];
    for (int64_t t = 0; t < length; t++) {
        const int64_t row = first + t;
        const v16 u = load_lanes(s->u + row * s->u_st + d0, w);
        v16 dt = load_lanes(s->delta + row * s->delta_st + d0, w) + bias;
        if (s->softplus) dt = softplus16(dt);
        const v16 du = dt * u;
        const float *Bt = s->B + row * s->bc_st, *Ct = s->C + row * s->bc_st;
        v16 y = {0};
        for (int64_t n = 0; n < N; n++) {
            const v16 hn = exp16(dt * a[n]) * h[n] + du * Bt[n];
            h[n] = hn;
            y += hn * Ct[n];
        }
        if (s->D != NULL) y += skip * u;
        if (s->z != NULL) y *= silu16(load_lanes(s->z + row * s->z_st + d0, w));
        store_lanes(s->y + row * D + d0, y, w);
        for (; cap < cap_end && s->capture_offsets[cap] == t + 1; cap++)
            store_state(s, h, d0, w, s->pool + s->capture_slots[cap] * D * N);
    }
    store_state(s, h, d0, w, s->pool + s->state_slots[b] * D * N);
}

int64_t hm_selective_scan_varlen_f32(const float *u, int64_t u_st, const float *delta, int64_t delta_st,
                                     const float *A, const float *Bm, const float *Cm, int64_t bc_st, const float *D,
                                     const float *delta_bias, int64_t delta_softplus, const float *z, int64_t z_st,
                                     float *pool, int64_t num_slots, const int64_t *state_slots,
                                     const int64_t *prefix, const int64_t *cu_seqlens, const int64_t *cu_captures,
                                     const int64_t *capture_offsets, const int64_t *capture_slots, float *y,
                                     int64_t batch, int64_t channels, int64_t state_size) {
    for (int64_t b = 0; b < batch; b++)
        if (state_slots[b] < 0 || state_slots[b] >= num_slots) return -1;
    for (int64_t j = 0; j < cu_captures[batch]; j++)
        if (capture_slots[j] < 0 || capture_slots[j] >= num_slots) return -1;
    const int64_t blocks = (channels + LANES - 1) / LANES, tasks = batch * blocks;
    Scan s = {
        .u = u, .delta = delta, .A = A, .B = Bm, .C = Cm, .D = D, .delta_bias = delta_bias, .z = z, .u_st = u_st,
        .delta_st = delta_st, .bc_st = bc_st, .z_st = z_st, .softplus = delta_softplus, .pool = pool, .y = y,
        .state_slots = state_slots, .prefix = prefix, .cu_seqlens = cu_seqlens, .cu_captures = cu_captures,
        .capture_offsets = capture_offsets, .capture_slots = capture_slots, .channels = channels,
        .state_size = state_size, .blocks = blocks,
    };
    s.work = aligned_alloc(64, (size_t)(tasks * 2 * state_size + 1) * LANES * sizeof(float));
    if (s.work == NULL) return -2;
#pragma omp parallel
    {
        /* Every initial state is read (the barrier ending this loop) before any task writes the pool. */
#pragma omp for schedule(static)
        for (int64_t i = 0; i < tasks; i++) load_task(&s, i / blocks, i % blocks);
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < tasks; i++) scan_task(&s, i / blocks, i % blocks);
    }
    free(s.work);
    return 0;
}
