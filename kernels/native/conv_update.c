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

void hm_conv_update_f32(const float *x, int64_t x_stride, float *conv_state, const float *weight, const float *bias,
                        int64_t silu, float *out, int64_t batch, int64_t channels, int64_t width) {
    const int64_t keep = width - 1;
#pragma omp parallel for schedule(static) if (batch * channels * width >= (1 << 20))
    for (int64_t b = 0; b < batch; b++) {
        const float *xr = x + b * x_stride;
        float *win = conv_state + b * channels * keep;
        float *o = out + b * channels;
        for (int64_t c = 0; c < channels; c++, win += keep) {
            const float *w = weight + c * width;
            const float xv = xr[c];
            float acc = keep > 0 ? win[0] * w[0] : xv * w[0];
            for (int64_t k = 1; k < keep; k++) acc += win[k] * w[k];
            if (keep > 0) acc += xv * w[keep];
            if (bias != NULL) acc += bias[c];
            if (silu) acc = acc / (1.0f + expf(-acc));
            o[c] = acc;
            for (int64_t k = 0; k + 1 < keep; k++) win[k] = win[k + 1];
            if (keep > 0) win[keep - 1] = xv;
        }
    }
}
