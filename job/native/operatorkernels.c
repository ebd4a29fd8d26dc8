/* The complex_diagonal operator (ComplEx) forward and backward in one pass over the rows each (loaded with
 * rowkernels.c).
 *
 * A row holds [real parts | imaginary parts] (h of each); the operator multiplies it by (re + i im), one pair
 * per relation (static: re, im of h entries) or one per row (per_row: rows x h each, dynamic relations). In
 * torch ops the forward is four passes and the backward nine, each its own allocation; a batch applies the
 * operator four times (the positives, the anchors' conjugate, and by hand to two gradients) and differentiates
 * it twice, ~40 small ops a batch (job/model/operators.py, bench/RESULTS.md).
 *
 * complex_diagonal_forward: out = x (re + i im), or times the conjugate (re - i im) when conjugate is set.
 * complex_diagonal_backward: given grad = dL/d out, writes d_x = grad (re - i im) (times (re + i im) for the
 * conjugate's), and d_re, d_im: per row (per_row) or summed over the rows (accumulated in double, then stored).
 */
#include <stdint.h>
#include <stdlib.h>

#include "bg_clones.h"

#define COMPLEX_DIAGONAL(FORWARD, BACKWARD, T)                                                                 \
    BG_CLONES void FORWARD(const T *x, const T *re, const T *im, int32_t per_row, int32_t conjugate, int64_t rows, \
                        int64_t half, T *out) {                                                                 \
        T sign = conjugate ? (T)-1 : (T)1;                                                                      \
        for (int64_t r = 0; r < rows; r++) {                                                                    \
            const T *x_re = x + r * 2 * half, *x_im = x_re + half;                                              \
            const T *a = per_row ? re + r * half : re, *b = per_row ? im + r * half : im;                       \
            T *o_re = out + r * 2 * half, *o_im = o_re + half;                                                  \
            _Pragma("omp simd") for (int64_t j = 0; j < half; j++) {                                            \
                T bj = sign * b[j];                                                                             \
                o_re[j] = x_re[j] * a[j] - x_im[j] * bj;                                                        \
                o_im[j] = x_re[j] * bj + x_im[j] * a[j];                                                        \
            }                                                                                                   \
        }                                                                                                       \
    }                                                                                                           \
                                                                                                                \
    BG_CLONES int BACKWARD(const T *x, const T *re, const T *im, const T *grad, int32_t per_row, int32_t conjugate, \
                        int64_t rows, int64_t half, T *d_x, T *d_re, T *d_im) {                                 \
        T sign = conjugate ? (T)-1 : (T)1;                                                                      \
        double *sum_re = 0, *sum_im = 0;                                                                        \
        if (half <= 0) return 0; /* nothing to write; calloc(0) may answer NULL */                              \
        if (!per_row) {                                                                                         \
            sum_re = calloc((size_t)(2 * half), sizeof(double));                                                \
            if (!sum_re) return -1;                                                                             \
            sum_im = sum_re + half;                                                                             \
        }                                                                                                       \
        for (int64_t r = 0; r < rows; r++) {                                                                    \
            const T *x_re = x + r * 2 * half, *x_im = x_re + half;                                              \
            const T *g_re = grad + r * 2 * half, *g_im = g_re + half;                                           \
            const T *a = per_row ? re + r * half : re, *b = per_row ? im + r * half : im;                       \
            T *dx_re = d_x + r * 2 * half, *dx_im = dx_re + half;                                               \
            _Pragma("omp simd") for (int64_t j = 0; j < half; j++) {                                            \
                T bj = sign * b[j];                                                                             \
                dx_re[j] = g_re[j] * a[j] + g_im[j] * bj;                                                       \
                dx_im[j] = g_im[j] * a[j] - g_re[j] * bj;                                                       \
            }                                                                                                   \
            if (per_row) {                                                                                      \
                T *dr = d_re + r * half, *di = d_im + r * half;                                                 \
                _Pragma("omp simd") for (int64_t j = 0; j < half; j++) {                                        \
                    dr[j] = g_re[j] * x_re[j] + g_im[j] * x_im[j];                                              \
                    di[j] = sign * (g_im[j] * x_re[j] - g_re[j] * x_im[j]);                                     \
                }                                                                                               \
            } else {                                                                                            \
                _Pragma("omp simd") for (int64_t j = 0; j < half; j++) {                                        \
                    sum_re[j] += (double)(g_re[j] * x_re[j] + g_im[j] * x_im[j]);                               \
                    sum_im[j] += (double)(g_im[j] * x_re[j] - g_re[j] * x_im[j]);                               \
                }                                                                                               \
            }                                                                                                   \
        }                                                                                                       \
        if (!per_row) {                                                                                         \
            for (int64_t j = 0; j < half; j++) {                                                                \
                d_re[j] = (T)sum_re[j];                                                                         \
                d_im[j] = (T)(sign * sum_im[j]);                                                                \
            }                                                                                                   \
            free(sum_re);                                                                                       \
        }                                                                                                       \
        return 0;                                                                                               \
    }

COMPLEX_DIAGONAL(complex_diagonal_forward_f32, complex_diagonal_backward_f32, float)
COMPLEX_DIAGONAL(complex_diagonal_forward_f64, complex_diagonal_backward_f64, double)
