/* RMS norms in one pass per row: the residual stream's, and the gated, grouped one of Mamba2 mixers.
 *
 * The references take four to six ops a call (the gate's SiLU, its product, a reduction, the
 * scale, the weight), each a pass over the rows and, on prefill rows, a parallel region; here a
 * row is read once (twice for the gated form: once to sum the squares of each group, once to
 * write), with every product in registers.
 *
 *     rms_norm:       out = weight * x / sqrt(mean(x^2) + eps)
 *     gated_rms_norm: out = weight * u / sqrt(mean_group(u^2) + eps),  u = x * silu(gate)
 *
 * Layout (float32): x and gate rows of `width` contiguous floats, `*_stride` floats apart (gate
 * may be NULL); weight [width]; out [rows, width] contiguous.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "vector_math.h"

void hm_rms_norm_f32(const float *x, int64_t x_stride, const float *weight, float eps, float *out, int64_t rows,
                     int64_t width) {
#pragma omp parallel for schedule(static) if (rows * width >= (1 << 16))
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *o = out + r * width;
        const float inv = 1.0f / sqrtf(sum_squares(xr, width) / (float)width + eps);
        int64_t c = 0;
        for (; c + 16 <= width; c += 16) *(v16 *)(o + c) = *(const v16 *)(xr + c) * inv * *(const v16 *)(weight + c);
        for (; c < width; c++) o[c] = xr[c] * inv * weight[c];
    }
}

void hm_gated_rms_norm_f32(const float *x, int64_t x_stride, const float *gate, int64_t gate_stride,
                           const float *weight, float eps, int64_t group, float *out, int64_t rows, int64_t width) {
#pragma omp parallel for schedule(static) if (rows * width >= (1 << 16))
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        const float *gr = gate != NULL ? gate + r * gate_stride : NULL;
        float *o = out + r * width;
        /* u = x * silu(gate) into the output row, then each group scaled in place. */
        int64_t c = 0;
        for (; c + 16 <= width; c += 16) {
            v16 u = *(const v16 *)(xr + c);
            if (gr != NULL) {
                u *= silu16(*(const v16 *)(gr + c));
            }
            *(v16 *)(o + c) = u;
        }
        for (; c < width; c++) o[c] = gr != NULL ? xr[c] * silu1(gr[c]) : xr[c];
        for (int64_t start = 0; start < width; start += group) {
            float *u = o + start;
            const float *w = weight + start;
            const float inv = 1.0f / sqrtf(sum_squares(u, group) / (float)group + eps);
            int64_t i = 0;
            for (; i + 16 <= group; i += 16) *(v16 *)(u + i) = *(v16 *)(u + i) * inv * *(const v16 *)(w + i);
            for (; i < group; i++) u[i] = u[i] * inv * w[i];
        }
    }
}
