/* Dense projections, y = x @ W^T (+ bias), over a weight packed once into column panels.
 *
 * A decode step's projections are matrix-vector products that only stream their weights: oneDNN
 * and MKL read them at 12-17 GB/s on a 2-core AMD EPYC, where a plain sequential read reaches
 * 25-30 GB/s. Packed into panels of 16 output columns, [N/16][K][16], a panel is one sequential
 * stream; each k loads its 16 weights once and multiplies them into every row of x (a broadcast),
 * so the same loop reads weights at the stream's rate for a few rows and is compute bound, at the
 * FMA rate, for many (prefill).
 *
 * Every output is one fused multiply-add chain over k in order, started from zero (the bias added
 * last), whatever the rows, tiles or threads: a row's result does not depend on what else is in
 * the batch. (Blocking k as well, as large GEMMs do, measured no faster here up to K = 4096.)
 *
 * Layout (float32): x rows of K contiguous floats, `x_stride` apart; panels [ceil(N/16)][K][16]
 * (the columns past N zero); bias [N] or NULL; y [M][N] contiguous.
 */
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "vector_math.h"

#define PANEL 16
#define TILE_ROWS 8 /* rows of x per tile */
#define BLOCK_ROWS 64 /* rows of x kept in cache while a thread's panels pass over them */

/* The 16 columns from `col` of a row (fewer at the right edge, the rest zero). */
static inline v16 load_cols(const float *row, int64_t col, int64_t n) {
    if (col + PANEL <= n) return *(const v16 *)(row + col);
    v16 v = {0};
    for (int64_t j = col; j < n; j++) v[j - col] = row[j];
    return v;
}

static inline void store_cols(float *row, int64_t col, int64_t n, v16 v) {
    if (col + PANEL <= n) {
        *(v16 *)(row + col) = v;
        return;
    }
    for (int64_t j = col; j < n; j++) row[j] = v[j - col];
}

/* y[r][col + 16j ..] for rows r < R of x and panels j < P of `p`: R x P chains over k, in
 * registers. R and P are constants where it is inlined (every loop here unrolls). */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t x_stride, const float *p, int64_t K,
                                                       const float *bias, float *y, int64_t n, int64_t col,
                                                       const int R, const int P) {
    v16 acc[TILE_ROWS][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < P; j++) acc[r][j] = (v16){0};
    for (int64_t k = 0; k < K; k++) {
        v16 w[4];
        for (int j = 0; j < P; j++) w[j] = *(const v16 *)(p + (j * K + k) * PANEL);
        for (int r = 0; r < R; r++) {
            const float xv = x[r * x_stride + k];
            for (int j = 0; j < P; j++) acc[r][j] += w[j] * xv;
        }
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < P; j++) {
            const v16 b = bias != NULL ? load_cols(bias, col + j * PANEL, n) : (v16){0};
            store_cols(y + r * n, col + j * PANEL, n, acc[r][j] + b);
        }
}

/* Four panels only ever go with up to four rows (run_panels), so only those tiles are built. */
#define TILE_CASE(R_)                                                    \
    case R_:                                                             \
        if (R_ <= 4 && P == 4) tile(x, x_stride, p, K, bias, y, n, col, R_, 4);     \
        else if (P == 2) tile(x, x_stride, p, K, bias, y, n, col, R_, 2); \
        else tile(x, x_stride, p, K, bias, y, n, col, R_, 1);            \
        break;

static void tile_any(const float *x, int64_t x_stride, const float *p, int64_t K, const float *bias, float *y,
                     int64_t n, int64_t col, int R, int P) {
    switch (R) {
        TILE_CASE(1)
        TILE_CASE(2)
        TILE_CASE(3)
        TILE_CASE(4)
        TILE_CASE(5)
        TILE_CASE(6)
        TILE_CASE(7)
        TILE_CASE(8)
    }
}

/* Panels [p0, p1) of every row: one thread's share. Panels go in groups: four for a few rows (four
 * chains per row in flight), two for a decode batch's full tiles (fewer passes over x); for prefill
 * one, where each x value is used once and the compiler folds its broadcast into the multiply-add
 * (a separate broadcast takes an FP pipe on AMD Zen 4: 8 x 2 tiles ran 5-10% below oneDNN at
 * 512-2048 rows, 8 x 1 level with it), except over long rows (K > 2048), where two panels halve how
 * often the tile's x rows are read from L2. */
static void run_panels(const float *x, int64_t x_stride, const float *panels, const float *bias, float *y, int64_t M,
                       int64_t N, int64_t K, int64_t p0, int64_t p1) {
    const int group = M <= 4 ? 4 : M < 32 || K > 2048 ? 2 : 1;
    for (int64_t m0 = 0; m0 < M; m0 += BLOCK_ROWS) {
        const int64_t m1 = M - m0 < BLOCK_ROWS ? M : m0 + BLOCK_ROWS;
        for (int64_t pb = p0; pb < p1;) {
            const int P = p1 - pb >= group ? group : 1;
            for (int64_t m = m0; m < m1; m += TILE_ROWS) {
                const int R = m1 - m < TILE_ROWS ? (int)(m1 - m) : TILE_ROWS;
                tile_any(x + m * x_stride, x_stride, panels + pb * K * PANEL, K, bias, y + m * N, N, pb * PANEL, R, P);
            }
            pb += P;
        }
    }
}

void hm_linear_f32(const float *x, int64_t x_stride, const float *panels, const float *bias, float *y, int64_t M,
                   int64_t N, int64_t K) {
    const int64_t n_panels = (N + PANEL - 1) / PANEL;
    /* Waking the other threads costs tens of microseconds (sleeping threads, on a VM): worth it for a
     * weight of 4 MB or more, or for as many multiply-adds as 32 rows of a 2 MB one. */
#pragma omp parallel if (N * K >= (1 << 20) || M * N * K >= (1 << 24))
    {
#ifdef _OPENMP
        const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
#else
        const int64_t t = 0, threads = 1;
#endif
        /* Whole pairs of panels per thread, so that group boundaries fall alike. */
        const int64_t pairs = (n_panels + 1) / 2;
        int64_t p0 = 2 * (pairs * t / threads), p1 = 2 * (pairs * (t + 1) / threads);
        if (p1 > n_panels) p1 = n_panels;
        if (p0 < p1) run_panels(x, x_stride, panels, bias, y, M, N, K, p0, p1);
    }
}
