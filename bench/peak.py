"""The machine's FP32 limit, measured in the sitting of a benchmark (shared by every bench).

A small C loop of 12 independent FMA chains on the widest vectors dispatch uses (zmm with
AVX-512, ymm with AVX2), built here by gcc as the extension is, runs on n threads at once
(cffi releases the GIL), one per core: n cores' FMA throughput, with the clock, the FMA
ports and whatever else the machine runs meanwhile all in it. Benchmarks print their
speed as a fraction of it beside their ratio to the reference, so figures compare across
machines and sittings. The peak is sampled again between measurements (sample()) and the
best sample kept, so a busy moment does not flatter the fractions.

    from peak import Peak
    peak = Peak(threads)                         # measures now
    ...; peak.sample()                           # between the timed runs
    print(peak.describe(), f"{peak.percent(gflops):.0f}% of peak")

    python bench/peak.py [--threads 1,2]
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import threading
import time

from cffi import FFI

from ggtrain.native import lib

_SRC = r"""
#include <immintrin.h>
/* distinct starting values and run-time m, c: the 12 chains cannot be merged */
#define CHAINS(T, SET1, FMA, STORE, W)                                                  \
    T a0 = SET1(s), a1 = SET1(s + 1), a2 = SET1(s + 2), a3 = SET1(s + 3);               \
    T a4 = SET1(s + 4), a5 = SET1(s + 5), a6 = SET1(s + 6), a7 = SET1(s + 7);           \
    T a8 = SET1(s + 8), a9 = SET1(s + 9), a10 = SET1(s + 10), a11 = SET1(s + 11);       \
    const T m = SET1(mf), c = SET1(cf);                                                 \
    for (long i = 0; i < n; i++) {                                                      \
        a0 = FMA(a0, m, c); a1 = FMA(a1, m, c); a2 = FMA(a2, m, c); a3 = FMA(a3, m, c); \
        a4 = FMA(a4, m, c); a5 = FMA(a5, m, c); a6 = FMA(a6, m, c); a7 = FMA(a7, m, c); \
        a8 = FMA(a8, m, c); a9 = FMA(a9, m, c); a10 = FMA(a10, m, c); a11 = FMA(a11, m, c); \
    }                                                                                   \
    float out[W];                                                                       \
    STORE(out, a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11);            \
    return out[0];
__attribute__((target("avx512f"))) static float fma512(long n, float s, float mf, float cf) {
    CHAINS(__m512, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_storeu_ps, 16)
}
__attribute__((target("avx2,fma"))) static float fma256(long n, float s, float mf, float cf) {
    CHAINS(__m256, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_storeu_ps, 8)
}
/* 12 chains x lanes x 2 flops per iteration; the sum keeps the loop alive */
float fma_loop(long n, int wide, float s, float m, float c) {
    return wide ? fma512(n, s, m, c) : fma256(n, s, m, c);
}
"""

_ITERS = 2_500_000
_module = None


def _loop():
    """The compiled probe (built once per process), or None without AVX2."""
    global _module
    if _module is None:
        ffi = FFI()
        ffi.cdef("float fma_loop(long n, int wide, float s, float m, float c);")
        ffi.set_source("_ggtrain_bench_peak", _SRC, extra_compile_args=["-O2"])
        so = ffi.compile(tmpdir=tempfile.mkdtemp(prefix="ggtrain-peak-"), verbose=False)
        spec = importlib.util.spec_from_file_location("_ggtrain_bench_peak", so)
        _module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_module)
    return _module.lib


def _wide() -> int:
    return 1 if lib.gt_cpu_features() & 2 else 0


def measure(threads: int, rounds: int = 20) -> float:
    """FP32 FMA GFLOP/s of `threads` cores running the probe at once: the best of `rounds`
    short runs (a few ms each, like the best-of timings of the benches, so a busy machine
    lowers both alike); NaN without AVX2 (no probe)."""
    if not lib.gt_cpu_features() & 1:
        return float("nan")
    probe, wide = _loop(), _wide()
    lanes = 16 if wide else 8
    probe.fma_loop(_ITERS // 10, wide, 1.0, 0.999999, 1e-7)   # warm the clock up
    best = 0.0
    for _ in range(rounds):
        workers = [threading.Thread(target=probe.fma_loop, args=(_ITERS, wide, 1.0 + i, 0.999999, 1e-7))
                   for i in range(threads)]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = max(best, threads * 12 * lanes * 2 * _ITERS / (time.perf_counter() - t0) / 1e9)
    return best


class Peak:
    """The FP32 peak of `threads` cores in this sitting: the best of its samples."""

    def __init__(self, threads: int):
        self.threads = threads
        self.samples: list = []
        self.sample()

    def sample(self) -> float:
        """Measure again (between timed runs); returns this sample."""
        g = measure(self.threads)
        self.samples.append(g)
        return g

    @property
    def gflops(self) -> float:
        return max(self.samples)

    def percent(self, gflops: float) -> float:
        """gflops as a percentage of the peak."""
        return 100.0 * gflops / self.gflops

    def describe(self) -> str:
        if not lib.gt_cpu_features() & 1:
            return "FP32 peak not measured (no AVX2/AVX-512)"
        width = "zmm" if _wide() else "ymm"
        spread = f", samples {min(self.samples):.0f}..{max(self.samples):.0f}" if len(self.samples) > 1 else ""
        return (f"FP32 peak {self.gflops:.0f} GFLOP/s on {self.threads} thread(s) (measured: 12 {width} FMA "
                f"chains per core{spread})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    args = ap.parse_args()
    for n in (int(t) for t in args.threads.split(",")):
        print(Peak(n).describe())


if __name__ == "__main__":
    sys.exit(main())
