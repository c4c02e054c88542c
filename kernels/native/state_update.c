/* One decode step of Mamba2's recurrence, in one pass over each head's state.
 *
 * The PyTorch reference makes five passes over the [B, H, P, N] state (decay, input, the C
 * product as a batched matmul, D, the cast) plus a handful of small ops for dt; a decode step
 * does nothing else with the state, so here each (sequence, head) reads and writes its state once:
 *
 *     dt = clamp(softplus(dt_raw + dt_bias), low, high)        (softplus and clamp optional)
 *     h  = exp(dt * A) * h + (dt * x) ⊗ B;   y = h · C + D * x
 *
 * Layout (float32): state [B, H, P, N] contiguous; x rows [H * P], dt rows [H], B and C rows
 * [G * N], each row `*_stride` floats after the previous one (they are views into one projection's
 * output); A, D, dt_bias [H] (D and dt_bias may be NULL); y [B, H, P] contiguous.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "vector_math.h"


void hm_ssd_state_update_f32(float *state, const float *x, int64_t x_stride, const float *dt, int64_t dt_stride,
                             const float *A, const float *Bm, const float *Cm, int64_t bc_stride, const float *D,
                             const float *dt_bias, int64_t dt_softplus, float low, float high, int64_t clamp,
                             float *y, int64_t batch, int64_t heads, int64_t head_dim, int64_t groups,
                             int64_t state_size) {
    const int64_t rep = heads / groups, tasks = batch * heads;
#pragma omp parallel for schedule(static) if (tasks * head_dim * state_size >= (1 << 20))
    for (int64_t t = 0; t < tasks; t++) {
        const int64_t b = t / heads, h = t % heads, g = h / rep;
        float d = dt[b * dt_stride + h];
        if (dt_bias != NULL) d += dt_bias[h];
        if (dt_softplus) d = softplus(d);
        if (clamp) d = d < low ? low : (d > high ? high : d);
        const float decay = expf(d * A[h]);
        const float *xr = x + b * x_stride + h * head_dim;
        const float *bn = Bm + b * bc_stride + g * state_size;
        const float *cn = Cm + b * bc_stride + g * state_size;
        float *s = state + t * head_dim * state_size;
        float *yr = y + t * head_dim;
        for (int64_t p = 0; p < head_dim; p++, s += state_size) {
            const float xdt = xr[p] * d;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int64_t n = 0; n < state_size; n++) {
                const float v = s[n] * decay + xdt * bn[n];
                s[n] = v;
                acc += v * cn[n];
            }
            yr[p] = D != NULL ? acc + D[h] * xr[p] : acc;
        }
    }
}
