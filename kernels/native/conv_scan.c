/* The causal depthwise conv over a prefill segment, with its activation, in one pass.
 *
 * The reference (time-major inputs) concatenates the carried window and the segment into a new
 * tensor, runs oneDNN's depthwise conv, the activation as a second pass and the final window as a
 * third; here each output row reads its K input rows where they lie (the segment's rows, or the
 * carried window for the first K-1), adds the bias and applies SiLU while the row is in registers.
 *
 * Layout (float32): x [B, L, C] with batch / token strides (channels contiguous: the time-major
 * rows of a projection); weight [C, K] contiguous; bias [C] or NULL; initial_state [B, C, K-1]
 * contiguous or NULL (zeros); out [B, L, C] and final_state [B, C, K-1] contiguous.
 * Returns 0, or -2 when out of memory.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector_math.h"

int64_t hm_conv_scan_f32(const float *x, int64_t x_sb, int64_t x_st, const float *weight, const float *bias,
                         const float *initial_state, int64_t silu, float *out, float *final_state, int64_t batch,
                         int64_t length, int64_t channels, int64_t width) {
    const int64_t keep = width - 1, C = channels;
    /* The weights tap-major ([K][C]) and each sequence's carried window time-major ([K-1][C]), so
     * that every access below runs along the channels. */
    float *taps = malloc((size_t)(width * C + batch * keep * C + 1) * sizeof(float));
    if (taps == NULL) return -2;
    float *windows = taps + width * C;
    for (int64_t c = 0; c < C; c++)
        for (int64_t k = 0; k < width; k++) taps[k * C + c] = weight[c * width + k];
    for (int64_t b = 0; b < batch; b++)
        for (int64_t j = 0; j < keep; j++)
            for (int64_t c = 0; c < C; c++)
                windows[(b * keep + j) * C + c] =
                    initial_state != NULL ? initial_state[(b * C + c) * keep + j] : 0.0f;
#pragma omp parallel for schedule(static) collapse(2) if (batch * length * C * width >= (1 << 16))
    for (int64_t b = 0; b < batch; b++) {
        for (int64_t t = 0; t < length; t++) {
            /* Input row tau of sequence b: the segment's for tau >= 0, else the carried window's. */
#define ROW(tau) ((tau) >= 0 ? x + b * x_sb + (tau) * x_st : windows + (b * keep + keep + (tau)) * C)
            float *o = out + (b * length + t) * C;
            int64_t c = 0;
            for (; c + 16 <= C; c += 16) {
                v16 acc = bias != NULL ? *(const v16 *)(bias + c) : (v16){0};
                for (int64_t k = 0; k < width; k++)
                    acc += *(const v16 *)(taps + k * C + c) * *(const v16 *)(ROW(t - keep + k) + c);
                *(v16 *)(o + c) = silu ? silu16(acc) : acc;
            }
            for (; c < C; c++) {
                float acc = bias != NULL ? bias[c] : 0.0f;
                for (int64_t k = 0; k < width; k++) acc += taps[k * C + c] * ROW(t - keep + k)[c];
                o[c] = silu ? silu1(acc) : acc;
            }
        }
    }
    /* The window that continues the sequence: its last K-1 inputs. */
    for (int64_t b = 0; b < batch; b++)
        for (int64_t j = 0; j < keep; j++) {
            const float *row = ROW(length - keep + j);
            for (int64_t c = 0; c < C; c++) final_state[(b * C + c) * keep + j] = row[c];
        }
#undef ROW
    free(taps);
    return 0;
}
