/* A side's loss over its score blocks, one row at a time while the row is in cache (loaded with rowkernels.c).
 *
 * The torch form (job/model/fused_losses.py) is ~25 passes over a side's (B x k) score blocks: the positives
 * taken off the batch product's diagonal, the diagonal and the chunk padding masked, the violators counted,
 * then for softmax a max, a subtraction, an exponential, a sum, a log, a division and a scale, each its own op.
 * On a batch of cheap products (d=100, 50 + 50 negatives) those ops, not the products, were the largest part
 * of the batch's time after the products (bench/RESULTS.md). Here each row is read from memory once and
 * written once, its loss term and gradient computed in between.
 *
 * Layout (all row-major, contiguous):
 *   batch   (chunks x chunk x chunk) or NULL: row r = c * chunk + i scores anchor r against the chunk's
 *           positives; entry i is the positive's own score (read from there), columns of positives past
 *           num_pos (the last chunk's padding) are not negatives;
 *   uniform (padded x num_uniform) or NULL: row r's uniform negatives, every entry a negative (shifts added);
 *   pos_in  (padded): the positives' scores, read only when batch is NULL.
 * Rows r >= num_pos are padding: they add nothing and their gradients are zero.
 *
 * On return the blocks hold the loss's gradient with respect to each score, the batch diagonal the
 * positive's; pos_out / d_pos_out (padded) the positives' scores and gradients; sums[0] the loss, sums[1] the
 * violators (negatives scoring above their positive). Masked entries (the diagonal as a negative, padding)
 * are skipped: the torch form scores them at -1e9, which no loss here lets contribute.
 *
 * Returns 0, or -1 for a loss it does not compute (nothing written).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bg_clones.h"

enum { LOSS_SOFTMAX = 0, LOSS_RANKING = 1 };

/* exp(x) for x <= 0 in float32, within a few ulp of expf, in a form the compiler vectorises (libm's expf is
 * a call per element): x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, so that n ln2 is exact), exp(r) by
 * its Taylor series to r^7, 2^n from the exponent bits. Below -87 (expf's results turn denormal at -87.34) it
 * returns 0: a score that far under the row's largest (whose term is 1) adds nothing to a float32 sum. A NaN
 * stays NaN, as the torch form's would, so a diverged model still shows a NaN loss. */
static inline float exp_nonpositive(float x) {
    float clamped = x >= -87.0f ? x : -87.0f; /* NaN too: no NaN reaches the integer conversion below */
    /* n = round(x / ln2) by adding and taking away 1.5 * 2^23 (floorf is a libm call on baseline x86-64) */
    float n = (clamped * 1.44269504f + 12582912.0f) - 12582912.0f;
    float r = clamped - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union {
        int32_t i;
        float f;
    } scale;
    scale.i = ((int32_t)n + 127) << 23;
    return x < -87.0f ? 0.0f : x == x ? p * scale.f : x;
}

/* float64 keeps libm's exp: it serves the float64 tests and runs, not speed */
static inline double exp_nonpositive_f64(double x) { return exp(x); }

/* ranking over one segment of a row (its batch or its uniform negatives): each score's hinge against the
 * positive's, counted into the caller's row_loss, active and above, and overwritten by its gradient (0 or 1) */
#define RANKING_SEGMENT(T, x, n)                                                                               \
    _Pragma("omp simd reduction(+ : row_loss, active, above)") for (int64_t j = 0; j < (n); j++) {             \
        above += x[j] > p;                                                                                      \
        T v = x[j] + threshold;                                                                                 \
        T on = v > 0 ? (T)1 : (T)0;                                                                             \
        row_loss += v > 0 || v != v ? v : (T)0; /* NaN kept, as torch's clamp keeps it */                       \
        active += on;                                                                                           \
        x[j] = on;                                                                                              \
    }

#define SIDE_LOSS(NAME, T, EXP, LOG)                                                                                \
    BG_CLONES int NAME(int32_t kind, double margin, T *batch, int64_t chunk, T *uniform, int64_t num_uniform,       \
                    const T *pos_in, T *pos_out, T *d_pos_out, int64_t padded, int64_t num_pos, double *sums) {     \
        if (kind != LOSS_SOFTMAX && kind != LOSS_RANKING) return -1;                                                \
        double loss = 0, violators = 0;                                                                             \
        for (int64_t r = 0; r < padded; r++) {                                                                      \
            T *b = batch ? batch + r * chunk : 0;                                                                   \
            T *u = uniform ? uniform + r * num_uniform : 0;                                                         \
            int64_t own = r % chunk;                                                                                \
            if (r >= num_pos) {                                                                                     \
                pos_out[r] = b ? b[own] : pos_in[r];                                                                \
                if (b) memset(b, 0, (size_t)chunk * sizeof(T));                                                     \
                if (u) memset(u, 0, (size_t)num_uniform * sizeof(T));                                               \
                d_pos_out[r] = 0;                                                                                   \
                continue;                                                                                           \
            }                                                                                                       \
            T p = b ? b[own] : pos_in[r];                                                                           \
            pos_out[r] = p;                                                                                         \
            /* the chunk's positives that exist; the own one is no negative of itself */                            \
            int64_t valid = 0;                                                                                      \
            if (b) {                                                                                                \
                valid = num_pos - (r - own);                                                                        \
                valid = valid < chunk ? valid : chunk;                                                              \
                b[own] = -INFINITY;                                                                                 \
                for (int64_t j = valid; j < chunk; j++) b[j] = 0;                                                   \
            }                                                                                                       \
            int32_t above = 0; /* at most a row's negatives */                                                      \
            T d_pos;                                                                                                \
            if (kind == LOSS_SOFTMAX) {                                                                             \
                T top = p;                                                                                          \
                _Pragma("omp simd reduction(max : top) reduction(+ : above)")                                  \
                for (int64_t j = 0; j < valid; j++) {                                                           \
                    top = b[j] > top ? b[j] : top;                                                                  \
                    above += b[j] > p;                                                                              \
                }                                                                                                   \
                _Pragma("omp simd reduction(max : top) reduction(+ : above)")                                  \
                for (int64_t j = 0; j < num_uniform; j++) {                                                     \
                    top = u[j] > top ? u[j] : top;                                                                  \
                    above += u[j] > p;                                                                              \
                }                                                                                                   \
                T total = 0;                                                                                        \
                _Pragma("omp simd reduction(+ : total)") for (int64_t j = 0; j < valid; j++) {                      \
                    T e = EXP(b[j] - top);                                                                          \
                    b[j] = e;                                                                                       \
                    total += e;                                                                                     \
                }                                                                                                   \
                _Pragma("omp simd reduction(+ : total)") for (int64_t j = 0; j < num_uniform; j++) {                \
                    T e = EXP(u[j] - top);                                                                          \
                    u[j] = e;                                                                                       \
                    total += e;                                                                                     \
                }                                                                                                   \
                T own_term = EXP(p - top);                                                                          \
                total += own_term;                                                                                  \
                loss += (double)top + (double)LOG(total) - (double)p;                                               \
                T inverse = (T)1 / total;                                                                           \
                _Pragma("omp simd") for (int64_t j = 0; j < valid; j++) b[j] *= inverse;                            \
                _Pragma("omp simd") for (int64_t j = 0; j < num_uniform; j++) u[j] *= inverse;                      \
                d_pos = own_term * inverse - (T)1;                                                                  \
            } else {                                                                                                \
                T threshold = (T)margin - p;                                                                        \
                T row_loss = 0, active = 0;                                                                         \
                RANKING_SEGMENT(T, b, valid)                                                                        \
                RANKING_SEGMENT(T, u, num_uniform)                                                                  \
                loss += (double)row_loss;                                                                           \
                d_pos = -active;                                                                                    \
            }                                                                                                       \
            violators += (double)above;                                                                             \
            if (b) b[own] = d_pos;                                                                                  \
            d_pos_out[r] = d_pos;                                                                                   \
        }                                                                                                           \
        sums[0] = loss;                                                                                             \
        sums[1] = violators;                                                                                        \
        return 0;                                                                                                   \
    }

SIDE_LOSS(side_loss_f32, float, exp_nonpositive, logf)
SIDE_LOSS(side_loss_f64, double, exp_nonpositive_f64, log)
