/* One decode step of the causal depthwise conv, in one pass over each channel's window.
 *
 * The reference spends K multiply-adds, a bias add, the activation and K-1 column copies over the
 * whole [B, C] batch, a dozen ops each touching every channel; here each channel's window is read
 * once, its output written and the window shifted while it is in registers.
 *
 * Layout (float32): x rows [C], `x_stride` floats apart; conv_state [B, C, K-1] contiguous; weight
 * [C, K] contiguous; bias [C] or NULL; out [B, C] contiguous. silu: apply x * sigmoid(x).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "vector_math.h"

/* One batch row's channels [0, channels) with a window of `keep` columns; inlined with keep constant
 * for the usual kernel widths, where the channel loop vectorises. */
static inline __attribute__((always_inline)) void conv_row(const float *xr, float *win, const float *weight,
                                                           const float *bias, float *o, int64_t channels,
                                                           const int64_t keep) {
    const int64_t width = keep + 1;
    for (int64_t c = 0; c < channels; c++) {
        const float *w = weight + c * width;
        float *wc = win + c * keep;
        const float xv = xr[c];
        float acc = 0.0f; /* the products in the reference's order, the bias last */
        for (int64_t k = 0; k < keep; k++) acc += wc[k] * w[k];
        acc += xv * w[keep];
        o[c] = bias != NULL ? acc + bias[c] : acc;
        for (int64_t k = 0; k + 1 < keep; k++) wc[k] = wc[k + 1];
        if (keep > 0) wc[keep - 1] = xv;
    }
}

void hm_conv_update_f32(const float *x, int64_t x_stride, float *conv_state, const float *weight, const float *bias,
                        int64_t silu, float *out, int64_t batch, int64_t channels, int64_t width) {
    const int64_t keep = width - 1;
#pragma omp parallel for schedule(static) if (batch * channels * width >= (1 << 20))
    for (int64_t b = 0; b < batch; b++) {
        const float *xr = x + b * x_stride;
        float *win = conv_state + b * channels * keep;
        float *o = out + b * channels;
        switch (keep) {
        case 3: conv_row(xr, win, weight, bias, o, channels, 3); break;
        case 2: conv_row(xr, win, weight, bias, o, channels, 2); break;
        case 1: conv_row(xr, win, weight, bias, o, channels, 1); break;
        default: conv_row(xr, win, weight, bias, o, channels, keep);
        }
        /* The activation over the row while it is in L1, 16 at a time (libm's expf, one call a
         * channel, was most of the step's time). */
        if (silu) {
            int64_t c = 0;
            for (; c + 16 <= channels; c += 16) *(v16 *)(o + c) = silu16(*(v16 *)(o + c));
            for (; c < channels; c++) o[c] = silu1(o[c]);
        }
    }
}
