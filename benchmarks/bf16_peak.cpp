// The CPU's ceiling for the prompt step's attention: how many AVX512-BF16 dot products
// (vdpbf16ps: 32 multiply-adds into 16 floats) its cores retire per second, with no memory
// traffic (16 independent accumulators per thread, so latency never stalls the loop).
// Our bf16 prefill kernel and native's both spend most of a long prompt's attention in these.
//
//   g++ -O2 -mavx512f -mavx512bf16 -pthread -o /tmp/bf16_peak benchmarks/bf16_peak.cpp
//   /tmp/bf16_peak [threads]        (default: one per core the process may run on)
#include <immintrin.h>
#include <sched.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

namespace {
constexpr long kSteps = 20'000'000;  // 16 instructions each

float dot_products() {
    __m512 acc[16];
    for (auto& a : acc) a = _mm512_setzero_ps();
    const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80), y = (__m512bh)_mm512_set1_epi32(0x3c003c00);
    for (long n = 0; n < kSteps; ++n)
        for (auto& a : acc) a = _mm512_dpbf16_ps(a, x, y);
    float sum = 0.0f;  // used, so the loop is not removed
    for (auto& a : acc) sum += _mm512_reduce_add_ps(a);
    return sum;
}
}  // namespace

int main(int argc, char** argv) {
    cpu_set_t set;
    sched_getaffinity(0, sizeof(set), &set);
    const int threads = argc > 1 ? std::atoi(argv[1]) : CPU_COUNT(&set);
    std::vector<float> sums(static_cast<size_t>(threads));
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) pool.emplace_back([&sums, t] { sums[static_cast<size_t>(t)] = dot_products(); });
    for (auto& th : pool) th.join();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double instructions = static_cast<double>(kSteps) * 16 * threads;
    std::printf("%d threads: %.2f G vdpbf16ps/s, %.1f GMAC/s (check %g)\n", threads, instructions / s / 1e9,
                instructions * 32 / s / 1e9, static_cast<double>(sums[0]));
    return 0;
}
