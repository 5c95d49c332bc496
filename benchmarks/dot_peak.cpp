// The CPU's ceilings for the prompt step's attention: how many multiply-adds per second its cores
// retire in AVX512-BF16 dot products (vdpbf16ps: 32 bf16 products into 16 floats, what our bf16
// prefill kernel and native's spend their time in) and in f32 FMAs (vfmadd231ps: 16), with no
// memory traffic: 16 independent accumulators per thread, unrolled so they stay in registers (a
// loop over an array keeps them in memory, and store-to-load forwarding then bounds the loop).
//
//   g++ -O2 -mavx512f -mavx512bf16 -pthread -o /tmp/dot_peak benchmarks/dot_peak.cpp
//   /tmp/dot_peak [threads]        (default: one per core the process may run on)
#include <immintrin.h>
#include <sched.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

namespace {
constexpr long kSteps = 20'000'000;  // 16 instructions each

float bf16_dot_products() {
    __m512 acc[16];
    for (auto& a : acc) a = _mm512_setzero_ps();
    const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80), y = (__m512bh)_mm512_set1_epi32(0x3c003c00);
    for (long n = 0; n < kSteps; ++n) {
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], x, y);
    }
    float sum = 0.0f;  // used, so the loop is not removed
    for (auto& a : acc) sum += _mm512_reduce_add_ps(a);
    return sum;
}

float f32_fmas() {
    __m512 acc[16];
    for (auto& a : acc) a = _mm512_set1_ps(1.0f);
    const __m512 x = _mm512_set1_ps(1.0000001f), y = _mm512_set1_ps(1e-9f);
    for (long n = 0; n < kSteps; ++n) {
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) acc[i] = _mm512_fmadd_ps(acc[i], x, y);
    }
    float sum = 0.0f;
    for (auto& a : acc) sum += _mm512_reduce_add_ps(a);
    return sum;
}

// `threads` threads each running `work`; the instructions per second over all of them
double rate(int threads, float (*work)()) {
    std::vector<float> sums(static_cast<size_t>(threads));
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) pool.emplace_back([&sums, t, work] { sums[static_cast<size_t>(t)] = work(); });
    for (auto& th : pool) th.join();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (sums[0] == 0.0f) std::printf("(unexpected zero)\n");
    return static_cast<double>(kSteps) * 16 * threads / s;
}
}  // namespace

int main(int argc, char** argv) {
    cpu_set_t set;
    sched_getaffinity(0, sizeof(set), &set);
    const int threads = argc > 1 ? std::atoi(argv[1]) : CPU_COUNT(&set);
    const double bf16 = rate(threads, bf16_dot_products), f32 = rate(threads, f32_fmas);
    std::printf("%d threads: vdpbf16ps %.2f G/s = %.1f GMAC/s; vfmadd231ps %.2f G/s = %.1f GMAC/s\n", threads,
                bf16 / 1e9, bf16 * 32 / 1e9, f32 / 1e9, f32 * 16 / 1e9);
    return 0;
}
