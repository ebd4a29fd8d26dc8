/* Row-wise Adagrad over a batch's gradient rows in one pass (loaded by job/native/__init__.py via ctypes), and
 * per-coordinate ("full") Adagrad in the same pass (``entity_optimizer: adagrad``: a sum per coordinate, state of
 * dim floats per row where PBG's row-wise form keeps one).
 *
 * The torch form of the same step (job/train/batch/optim.py) is five passes over the batch's gradient rows: a norm,
 * a gather of the state, a scale, and an index_add_ whose CPU kernel expands its index to every element.
 * Here each distinct row is read once and its table row read and written once.
 *
 * Rows may repeat, within a list and across lists (a row drawn twice, or on both sides of a batch): every
 * repeat's gradient is added into the row's last occurrence, which alone takes the step, so each distinct row
 * gets one step with its summed gradient (a merged sparse gradient, as PBG's RowAdagrad steps it). The
 * gradient rows are consumed: their contents afterwards are unspecified.
 *
 * Returns 0, or -1 - k when list k holds an id outside [0, num_rows) (nothing is written then, except slots).
 */
#include <math.h>
#include <stdint.h>

#include "bg_clones.h"

/* rows ahead whose table row is fetched while this one is updated: the table rows are scattered, and a
 * 2-vCPU VM's memory latency, not its bandwidth, bounds an update that waits for each in turn */
#define AHEAD 8

/* FULL: 0 for PBG's row-wise step (state[id] += mean(g^2), one step size per row), 1 for the per-coordinate one
 * (state[id * dim + j] += g[j]^2, a step size per coordinate); a constant, so each form compiles to its own loop. */
#define ROW_ADAGRAD(NAME, T, SQRT, FULL)                                                                    \
    BG_CLONES int NAME(int32_t num_lists, int64_t *const *ids, T *const *grads, const int64_t *counts,      \
                    int64_t dim, T *weight, T *state, int64_t num_rows, int32_t *slots, double lr,          \
                    double eps) {                                                                           \
        int32_t position = 0;                                                                               \
        for (int32_t k = 0; k < num_lists; k++) {                                                           \
            for (int64_t i = 0; i < counts[k]; i++) {                                                       \
                int64_t id = ids[k][i];                                                                     \
                if (id < 0 || id >= num_rows) return -1 - k;                                                \
                slots[id] = position++;                                                                     \
            }                                                                                               \
        }                                                                                                   \
        position = 0;                                                                                       \
        for (int32_t k = 0; k < num_lists; k++) {                                                           \
            for (int64_t i = 0; i < counts[k]; i++, position++) {                                           \
                int32_t last = slots[ids[k][i]];                                                            \
                if (last == position) continue;                                                             \
                int32_t list = 0;                                                                           \
                int64_t row = last;                                                                         \
                while (row >= counts[list]) row -= counts[list++];                                          \
                T *into = grads[list] + row * dim;                                                          \
                const T *from = grads[k] + i * dim;                                                         \
                _Pragma("omp simd") for (int64_t j = 0; j < dim; j++) into[j] += from[j];                   \
            }                                                                                               \
        }                                                                                                   \
        position = 0;                                                                                       \
        for (int32_t k = 0; k < num_lists; k++) {                                                           \
            for (int64_t i = 0; i < counts[k]; i++, position++) {                                           \
                int64_t id = ids[k][i];                                                                     \
                if (i + AHEAD < counts[k]) {                                                                \
                    const char *next = (const char *)(weight + ids[k][i + AHEAD] * dim);                    \
                    for (int64_t b = 0; b < dim * (int64_t)sizeof(T); b += 64)                              \
                        __builtin_prefetch(next + b, 1, 0);                                                 \
                    if (FULL) {                                                                             \
                        const char *sums = (const char *)(state + ids[k][i + AHEAD] * dim);                 \
                        for (int64_t b = 0; b < dim * (int64_t)sizeof(T); b += 64)                          \
                            __builtin_prefetch(sums + b, 1, 0);                                             \
                    }                                                                                       \
                }                                                                                           \
                if (slots[id] != position) continue;                                                        \
                const T *g = grads[k] + i * dim;                                                            \
                T *w = weight + id * dim;                                                                   \
                if (FULL) {                                                                                 \
                    T *s = state + id * dim;                                                                \
                    _Pragma("omp simd") for (int64_t j = 0; j < dim; j++) {                                 \
                        T sum = s[j] + g[j] * g[j];                                                         \
                        s[j] = sum;                                                                         \
                        w[j] -= (T)lr * g[j] / (SQRT(sum) + (T)eps);                                        \
                    }                                                                                       \
                    continue;                                                                               \
                }                                                                                           \
                T squares = 0;                                                                              \
                _Pragma("omp simd reduction(+ : squares)") for (int64_t j = 0; j < dim; j++)                \
                    squares += g[j] * g[j];                                                                 \
                T sum = state[id] + squares / (T)dim;                                                       \
                state[id] = sum;                                                                            \
                T step = (T)(-lr) / (SQRT(sum) + (T)eps);                                                   \
                _Pragma("omp simd") for (int64_t j = 0; j < dim; j++) w[j] += step * g[j];                  \
            }                                                                                               \
        }                                                                                                   \
        return 0;                                                                                           \
    }

ROW_ADAGRAD(row_adagrad_f32, float, sqrtf, 0)
ROW_ADAGRAD(row_adagrad_f64, double, sqrt, 0)
ROW_ADAGRAD(full_adagrad_f32, float, sqrtf, 1)
ROW_ADAGRAD(full_adagrad_f64, double, sqrt, 1)

/* What the loader (job/native) reads back: the digest of the sources this library was built from (a library of
 * other sources is not loaded), and which clones the resolver picks on this CPU, for its log line. */
#ifndef BG_SOURCE_DIGEST
#define BG_SOURCE_DIGEST ""
#endif
const char bg_source_digest[] = BG_SOURCE_DIGEST;

/* 4: the x86-64-v4 (AVX-512) clones run, 3: the x86-64-v3 (AVX2) ones, 0: the baseline, the only code of a build
 * without clones; -1: clones whose choice this compiler does not report */
int bg_clone_level(void) {
#if BG_HAS_CLONES && defined(__GNUC__) && !defined(__clang__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("x86-64-v4")) return 4;
    if (__builtin_cpu_supports("x86-64-v3")) return 3;
    return 0;
#elif BG_HAS_CLONES
    return -1;
#else
    return 0;
#endif
}
