/* The causal depthwise conv over prefill tokens, with its activation, in one pass: a batch of
 * equal-length segments (hm_conv_scan_f32), or a packed varlen batch straight from and into the state
 * pool, with the windows at any capture offsets written into their slots (hm_conv_varlen_f32).
 *
 * The reference (time-major inputs) concatenates the carried window and the segment into a new
 * tensor, runs oneDNN's depthwise conv, the activation as a second pass and the final window as a
 * third; here each output row reads its K input rows where they lie (the sequence's rows, or the
 * carried window for the first K-1), adds the bias and applies SiLU while the row is in registers:
 *     out_t[c] = act(bias[c] + sum_k weight[c][k] * in_{t-K+1+k}[c]),  in_tau = window row K-1+tau for tau < 0
 * The state after offset o is the window of its last K-1 inputs (in_{o-K+1} .. in_{o-1}), the same
 * whether the conv ran in one call or cut at o.
 *
 * Layout (float32): x [B, L, C] with batch / token strides (varlen: [T, C] with a token stride;
 * channels contiguous: the time-major rows of a projection); weight [C, K] contiguous; bias [C] or
 * NULL; initial_state [B, C, K-1] contiguous or NULL (zeros); out [B, L, C] (varlen [T, C]) and
 * final_state [B, C, K-1] contiguous. Varlen windows live in pool [num_slots, C, K-1] (contiguous):
 * sequence b (rows cu_seqlens[b] .. cu_seqlens[b+1]) starts from pool[state_slots[b]] when
 * prefix[b] > 0 (else zeros) and ends there; its captures (offset, slot) are entries cu_captures[b] ..
 * cu_captures[b+1] of capture_offsets / capture_slots.
 * Returns 0; -1 when a slot is outside the pool (nothing is written then); -2 when out of memory.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"

typedef struct {
    const float *x, *bias;
    int64_t x_st, silu, batch, C, width;
    const int64_t *x_at, *cu; /* per sequence: its row 0 in x (elements); its rows of out, cu[b] .. cu[b+1] */
    float *out;
    /* The weights tap-major ([K][C]) and each sequence's carried window time-major ([K-1][C]), so
     * that every access below runs along the channels. */
    float *taps, *windows;
} Conv;

/* Input row tau of sequence b: its own for tau >= 0, else the carried window's. */
static const float *row_of(const Conv *s, int64_t b, int64_t tau) {
    const int64_t keep = s->width - 1;
    return tau >= 0 ? s->x + s->x_at[b] + tau * s->x_st : s->windows + (b * keep + keep + tau) * s->C;
}

/* The taps and windows (from `initial[b]`, a [C, K-1] window or NULL for zeros); -2 when out of memory. */
static int64_t conv_alloc(Conv *s, const float *weight, const float *const *initial) {
    const int64_t C = s->C, width = s->width, keep = width - 1;
    s->taps = malloc((size_t)(width * C + s->batch * keep * C + 1) * sizeof(float));
    if (s->taps == NULL) return -2;
    s->windows = s->taps + width * C;
    for (int64_t c = 0; c < C; c++)
        for (int64_t k = 0; k < width; k++) s->taps[k * C + c] = weight[c * width + k];
    for (int64_t b = 0; b < s->batch; b++)
        for (int64_t j = 0; j < keep; j++)
            for (int64_t c = 0; c < C; c++)
                s->windows[(b * keep + j) * C + c] = initial[b] != NULL ? initial[b][c * keep + j] : 0.0f;
    return 0;
}

static void conv_rows(const Conv *s) {
    const int64_t C = s->C, width = s->width, keep = width - 1, total = s->cu[s->batch];
#pragma omp parallel for schedule(static) if (total * C * width >= (1 << 16))
    for (int64_t i = 0; i < total; i++) {
        int64_t lo = 0, hi = s->batch; /* the sequence of row i: cu[b] <= i < cu[b + 1] */
        while (hi - lo > 1) {
            const int64_t mid = (lo + hi) / 2;
            if (s->cu[mid] <= i) lo = mid;
            else hi = mid;
        }
        const int64_t b = lo, t = i - s->cu[b];
        float *o = s->out + i * C;
        int64_t c = 0;
        for (; c + 16 <= C; c += 16) {
            v16 acc = s->bias != NULL ? *(const v16 *)(s->bias + c) : (v16){0};
            for (int64_t k = 0; k < width; k++)
                acc += *(const v16 *)(s->taps + k * C + c) * *(const v16 *)(row_of(s, b, t - keep + k) + c);
            *(v16 *)(o + c) = s->silu ? silu16(acc) : acc;
        }
        for (; c < C; c++) {
            float acc = s->bias != NULL ? s->bias[c] : 0.0f;
            for (int64_t k = 0; k < width; k++) acc += s->taps[k * C + c] * row_of(s, b, t - keep + k)[c];
            o[c] = s->silu ? silu1(acc) : acc;
        }
    }
}

/* The window that continues sequence b after `offset` of its tokens, as [C][K-1] at dst. */
static void store_window(const Conv *s, int64_t b, int64_t offset, float *dst) {
    const int64_t keep = s->width - 1;
    for (int64_t j = 0; j < keep; j++) {
        const float *row = row_of(s, b, offset - keep + j);
        for (int64_t c = 0; c < s->C; c++) dst[c * keep + j] = row[c];
    }
}

int64_t hm_conv_scan_f32(const float *x, int64_t x_sb, int64_t x_st, const float *weight, const float *bias,
                         const float *initial_state, int64_t silu, float *out, float *final_state, int64_t batch,
                         int64_t length, int64_t channels, int64_t width) {
    const int64_t keep = width - 1, C = channels;
    int64_t *ints = malloc((size_t)(2 * batch + 1) * sizeof(int64_t));
    const float **initial = malloc((size_t)(batch + 1) * sizeof(float *));
    Conv s = {.x = x, .bias = bias, .x_st = x_st, .silu = silu, .batch = batch, .C = C, .width = width, .out = out};
    int64_t status = ints == NULL || initial == NULL ? -2 : 0;
    if (status == 0) {
        for (int64_t b = 0; b <= batch; b++) ints[batch + b] = b * length;
        for (int64_t b = 0; b < batch; b++) {
            ints[b] = b * x_sb;
            initial[b] = initial_state != NULL ? initial_state + b * C * keep : NULL;
        }
        s.x_at = ints, s.cu = ints + batch;
        status = conv_alloc(&s, weight, initial);
    }
    if (status == 0) {
        conv_rows(&s);
        for (int64_t b = 0; b < batch; b++) store_window(&s, b, length, final_state + b * C * keep);
        free(s.taps);
    }
    free(ints);
    free(initial);
    return status;
}

int64_t hm_conv_varlen_f32(const float *x, int64_t x_st, const float *weight, const float *bias, float *pool,
                           int64_t num_slots, const int64_t *state_slots, const int64_t *prefix,
                           const int64_t *cu_seqlens, const int64_t *cu_captures, const int64_t *capture_offsets,
                           const int64_t *capture_slots, int64_t silu, float *out, int64_t batch, int64_t channels,
                           int64_t width) {
    for (int64_t b = 0; b < batch; b++)
        if (state_slots[b] < 0 || state_slots[b] >= num_slots) return -1;
    for (int64_t j = 0; j < cu_captures[batch]; j++)
        if (capture_slots[j] < 0 || capture_slots[j] >= num_slots) return -1;
    const int64_t keep = width - 1, C = channels, row = C * keep;
    int64_t *x_at = malloc((size_t)(batch + 1) * sizeof(int64_t));
    const float **initial = malloc((size_t)(batch + 1) * sizeof(float *));
    Conv s = {.x = x, .bias = bias, .x_st = x_st, .silu = silu, .batch = batch, .C = C, .width = width,
              .x_at = x_at, .cu = cu_seqlens, .out = out};
    int64_t status = x_at == NULL || initial == NULL ? -2 : 0;
    if (status == 0) {
        for (int64_t b = 0; b < batch; b++) {
            x_at[b] = cu_seqlens[b] * x_st;
            initial[b] = prefix[b] > 0 ? pool + state_slots[b] * row : NULL;
        }
        status = conv_alloc(&s, weight, initial); /* the windows are copied out before any is written */
    }
    if (status == 0) {
        conv_rows(&s);
        for (int64_t b = 0; b < batch; b++) {
            for (int64_t j = cu_captures[b]; j < cu_captures[b + 1]; j++)
                store_window(&s, b, capture_offsets[j], pool + capture_slots[j] * row);
            store_window(&s, b, cu_seqlens[b + 1] - cu_seqlens[b], pool + state_slots[b] * row);
        }
        free(s.taps);
    }
    free(x_at);
    free(initial);
    return status;
}
