/* simd.h: GT_CLONES marks a plain-C loop to be compiled for AVX-512, AVX2 and
 * generic x86-64, the right one picked at load time (GCC function multiversioning).
 * Where that is unavailable it is a plain function. No -ffast-math anywhere, so
 * the clones compute exactly the same results as the plain loop. */
#ifndef GT_SIMD_H
#define GT_SIMD_H
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__linux__)
#define GT_CLONES __attribute__((target_clones("avx512f", "arch=x86-64-v3", "default")))
#else
#define GT_CLONES
#endif
#endif
