/* BG_CLONES: the hot entry points compiled once per x86-64 level (AVX-512, AVX2 + FMA, baseline SSE2), the best
 * the running CPU supports chosen when the library loads (an ifunc resolver; GCC, and clang where it has the
 * attribute). One build serves every machine a wheel or an image lands on, where -march would tie it to one.
 * Elsewhere (another architecture or compiler, or -DBG_NO_CLONES, the baseline bench/ab_bench.py compares
 * against) the functions are compiled once, for the compiler's default target. */
#ifndef BG_CLONES_H
#define BG_CLONES_H

#if defined(__has_attribute)
#if __has_attribute(target_clones) && defined(__x86_64__) && defined(__linux__) && !defined(BG_NO_CLONES)
#define BG_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#define BG_HAS_CLONES 1
#endif
#endif

#ifndef BG_CLONES
#define BG_CLONES
#define BG_HAS_CLONES 0
#endif

#endif
