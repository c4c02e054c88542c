/* Shared by the native kernels: 16-float vectors (GCC/Clang vector extensions, compiled for this
 * CPU by -march=native), a vectorised exp (and SiLU on it), and a small row-major GEMM. */
#ifndef HIMAMBA_VECTOR_MATH_H
#define HIMAMBA_VECTOR_MATH_H

#include <math.h>
#include <stdint.h>

/* 16 floats; aligned(4) makes every load and store through it an unaligned one. */
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));

/* exp(x), 16 at a time, with x clamped to [-87, 80] first (as the PyTorch scans clamp their decay
 * exponents): Cody-Waite reduction and Cephes' degree-6 expf polynomial, within 2 ulp. libm's
 * expf is one call per element. */
static inline v16 exp16(v16 x) {
    const v16i below = x < -87.0f, above = x > 80.0f; /* all ones where true */
    x = (v16)((below & (v16i)(x - x - 87.0f)) | (above & (v16i)(x - x + 80.0f)) | (~(below | above) & (v16i)x));
    const v16 magic = x - x + 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    const v16 n = (x * 1.44269504088896341f + magic) - magic;
    const v16 r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    v16 p = r - r + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const v16i bits = (__builtin_convertvector(n, v16i) + 127) << 23;
    return p * (v16)bits;
}

/* SiLU, v * sigmoid(v), as v / (1 + exp(-v)): 16 at a time, and one. */
static inline v16 silu16(v16 v) { return v / (1.0f + exp16(-v)); }

/* torch's softplus (beta 1, threshold 20). */
static inline float softplus(float v) { return v > 20.0f ? v : log1pf(expf(v)); }

/* log(1 + y) for y in [0, 1], 16 at a time: Cephes' logf polynomial on 1 + y, plus the rounding of
 * 1 + y carried as a first-order correction (so a tiny y keeps its digits). */
static inline v16 log1p16_unit(v16 y) {
    const v16 w = 1.0f + y;
    const v16 lost = (y - (w - 1.0f)) / w; /* 1 + y = w (1 + lost), and log(1 + lost) ~ lost */
    const v16i bits = (v16i)w;
    v16 e = __builtin_convertvector(((bits >> 23) & 0xff) - 126, v16);
    const v16 m = (v16)((bits & 0x807fffff) | 0x3f000000); /* w = m * 2^e, m in [0.5, 1) */
    const v16i small = m < 0.707106781186547524f;
    e -= (v16)(small & (v16i)(e - e + 1.0f));
    const v16 x = m - 1.0f + (v16)(small & (v16i)m); /* m - 1, or 2m - 1 below sqrt(1/2) */
    const v16 z = x * x;
    v16 p = x - x + 7.0376836292e-2f;
    p = p * x - 1.1514610310e-1f;
    p = p * x + 1.1676998740e-1f;
    p = p * x - 1.2420140846e-1f;
    p = p * x + 1.4249322787e-1f;
    p = p * x - 1.6668057665e-1f;
    p = p * x + 2.0000714765e-1f;
    p = p * x - 2.4999993993e-1f;
    p = p * x + 3.3333331174e-1f;
    v16 r = p * x * z + e * -2.12194440e-4f - 0.5f * z;
    return x + r + e * 0.693359375f + lost;
}

/* torch's softplus, 16 at a time: max(v, 0) + log(1 + exp(-|v|)), and v itself above 20; within 2 ulp
 * of torch's for v >= -87 (below, exp16's clamp gives 1.6e-38 where torch gives a denormal or 0). */
static inline v16 softplus16(v16 v) {
    const v16i neg = v < 0.0f, above = v > 20.0f;
    const v16 minus_abs = (v16)(((v16i)v & neg) | ((v16i)-v & ~neg)), positive = (v16)((v16i)v & ~neg);
    const v16 soft = positive + log1p16_unit(exp16(minus_abs));
    return (v16)((above & (v16i)v) | (~above & (v16i)soft));
}

static inline float exp1(float x) {
    v16 v = {0};
    v[0] = x;
    return exp16(v)[0];
}

static inline float silu1(float v) { return v / (1.0f + exp1(-v)); }

/* The 16 lanes of a folded onto 8: lanes i and i + 8 added. */
static inline v8 fold(v16 a) {
    return __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
}

/* dst[i] = exp(src[i]) (clamped as exp16). */
static inline void exp_rows(const float *src, float *dst, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) *(v16 *)(dst + i) = exp16(*(const v16 *)(src + i));
    for (; i < n; i++) dst[i] = exp1(src[i]);
}

/* max(floor, s[0..n)), 16 lanes at a time. */
static inline float row_max(const float *s, int64_t n, float floor) {
    v16 m16 = (v16){0} + s[0]; /* every lane s[0] */
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        const v16 v = *(const v16 *)(s + j);
        m16 = (v16)(((v16i)(v > m16) & (v16i)v) | (~(v16i)(v > m16) & (v16i)m16));
    }
    float mx = floor;
    for (int i = 0; i < 16; i++) mx = m16[i] > mx ? m16[i] : mx;
    for (; j < n; j++) mx = s[j] > mx ? s[j] : mx;
    return mx;
}

/* s[j] = exp(s[j] - shift) for j < n; returns their sum. */
static inline float exp_shifted_sum(float *s, int64_t n, float shift) {
    v16 sum16 = {0};
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        const v16 e = exp16(*(v16 *)(s + j) - shift);
        *(v16 *)(s + j) = e;
        sum16 += e;
    }
    float sum = 0.0f;
    for (int i = 0; i < 16; i++) sum += sum16[i];
    for (; j < n; j++) {
        s[j] = exp1(s[j] - shift);
        sum += s[j];
    }
    return sum;
}

/* The sum of x[i]^2 over n floats. */
static inline float sum_squares(const float *x, int64_t n) {
    v16 acc = {0};
    float tail = 0.0f;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const v16 v = *(const v16 *)(x + i);
        acc += v * v;
    }
    for (; i < n; i++) tail += x[i] * x[i];
    const v8 h = fold(acc);
    float s = tail;
    for (int k = 0; k < 8; k++) s += h[k];
    return s;
}

/* C[m x n] = A[m x k] @ B[k x n] (or += when `accumulate`), all row-major with leading dims.
 * Eight rows of C at a time with AVX-512 (then four), their columns in registers while k runs; sizes
 * need not be multiples of anything. Each output is one multiply-add chain over k in order, from
 * zero (C added last), whichever rows it falls in. Eight rows by 16 columns made the prefill
 * attention 1.14-1.23x and the SSD scan up to 1.5x faster than four rows by 32 (2 threads). */
static inline void gemm(const float *A, int64_t lda, const float *B, int64_t ldb, float *C, int64_t ldc, int64_t m,
                        int64_t n, int64_t k, int accumulate) {
    int64_t i = 0;
#ifdef __AVX512F__
    /* Eight rows by 16 columns: each A value feeds one multiply-add, which then loads it broadcast
     * itself (a separate broadcast, as when one value feeds two, takes an FP pipe on AMD Zen 4). */
    for (; i + 8 <= m; i += 8) {
        const float *a = A + i * lda;
        float *c = C + i * ldc;
        int64_t j = 0;
        for (; j + 16 <= n; j += 16) {
            v16 s[8];
            for (int r = 0; r < 8; r++) s[r] = (v16){0};
            for (int64_t p = 0; p < k; p++) {
                const v16 b = *(const v16 *)(B + p * ldb + j);
                for (int r = 0; r < 8; r++) s[r] += a[r * lda + p] * b;
            }
            for (int r = 0; r < 8; r++) {
                if (accumulate) s[r] += *(v16 *)(c + r * ldc + j);
                *(v16 *)(c + r * ldc + j) = s[r];
            }
        }
        for (; j < n; j++)
            for (int r = 0; r < 8; r++) {
                float t = 0;
                for (int64_t p = 0; p < k; p++) t += a[r * lda + p] * B[p * ldb + j];
                c[r * ldc + j] = accumulate ? c[r * ldc + j] + t : t;
            }
    }
#endif
    for (; i + 4 <= m; i += 4) {
        const float *a0 = A + i * lda, *a1 = a0 + lda, *a2 = a1 + lda, *a3 = a2 + lda;
        float *c0 = C + i * ldc, *c1 = c0 + ldc, *c2 = c1 + ldc, *c3 = c2 + ldc;
        int64_t j = 0;
#ifdef __AVX512F__
        for (; j + 32 <= n; j += 32) {
            v16 s00 = {0}, s01 = {0}, s10 = {0}, s11 = {0}, s20 = {0}, s21 = {0}, s30 = {0}, s31 = {0};
            for (int64_t p = 0; p < k; p++) {
                const v16 b0 = *(const v16 *)(B + p * ldb + j), b1 = *(const v16 *)(B + p * ldb + j + 16);
                s00 += a0[p] * b0, s01 += a0[p] * b1;
                s10 += a1[p] * b0, s11 += a1[p] * b1;
                s20 += a2[p] * b0, s21 += a2[p] * b1;
                s30 += a3[p] * b0, s31 += a3[p] * b1;
            }
            if (accumulate) {
                s00 += *(v16 *)(c0 + j), s01 += *(v16 *)(c0 + j + 16), s10 += *(v16 *)(c1 + j);
                s11 += *(v16 *)(c1 + j + 16), s20 += *(v16 *)(c2 + j), s21 += *(v16 *)(c2 + j + 16);
                s30 += *(v16 *)(c3 + j), s31 += *(v16 *)(c3 + j + 16);
            }
            *(v16 *)(c0 + j) = s00, *(v16 *)(c0 + j + 16) = s01, *(v16 *)(c1 + j) = s10;
            *(v16 *)(c1 + j + 16) = s11, *(v16 *)(c2 + j) = s20, *(v16 *)(c2 + j + 16) = s21;
            *(v16 *)(c3 + j) = s30, *(v16 *)(c3 + j + 16) = s31;
        }
#endif
        for (; j + 16 <= n; j += 16) {
            v16 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
            for (int64_t p = 0; p < k; p++) {
                const v16 b = *(const v16 *)(B + p * ldb + j);
                s0 += a0[p] * b, s1 += a1[p] * b, s2 += a2[p] * b, s3 += a3[p] * b;
            }
            if (accumulate) s0 += *(v16 *)(c0 + j), s1 += *(v16 *)(c1 + j), s2 += *(v16 *)(c2 + j), s3 += *(v16 *)(c3 + j);
            *(v16 *)(c0 + j) = s0, *(v16 *)(c1 + j) = s1, *(v16 *)(c2 + j) = s2, *(v16 *)(c3 + j) = s3;
        }
        for (; j < n; j++) {
            float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
            for (int64_t p = 0; p < k; p++) {
                const float b = B[p * ldb + j];
                s0 += a0[p] * b, s1 += a1[p] * b, s2 += a2[p] * b, s3 += a3[p] * b;
            }
            if (accumulate) s0 += c0[j], s1 += c1[j], s2 += c2[j], s3 += c3[j];
            c0[j] = s0, c1[j] = s1, c2[j] = s2, c3[j] = s3;
        }
    }
    for (; i < m; i++) {
        const float *a = A + i * lda;
        float *c = C + i * ldc;
        int64_t j = 0;
        for (; j + 16 <= n; j += 16) {
            v16 s = {0};
            for (int64_t p = 0; p < k; p++) s += a[p] * *(const v16 *)(B + p * ldb + j);
            if (accumulate) s += *(v16 *)(c + j);
            *(v16 *)(c + j) = s;
        }
        for (; j < n; j++) {
            float s = 0;
            for (int64_t p = 0; p < k; p++) s += a[p] * B[p * ldb + j];
            c[j] = accumulate ? c[j] + s : s;
        }
    }
}

#endif
