// Spherical (cosine) k-means, ClusterKV's clustering (ov_kvcrush/methods/clusterkv.py:
// kmeans_cosine, init_order): the reference's seeded initial picks, labels by the first maximum
// similarity, centroids as plain means; Hamerly-style bounds skip rows whose label cannot change
// (bounded=false recomputes everything: the tests' brute-force oracle).
#include "kmeans.hpp"

#include <tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>

#include "kernels.hpp"

#if defined(__AVX512F__)
#    include <immintrin.h>
#endif

namespace ovkc {

namespace {

uint64_t splitmix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// The maximum of st[0..k) (st padded to kp, a multiple of 16).
float max_value(const float* st, int64_t k, int64_t kp) {
#if defined(__AVX512F__)
    __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t c = 0; c < kp; c += 16) {
        const __mmask16 valid = c + 16 <= k ? 0xFFFF : static_cast<__mmask16>((1u << std::max<int64_t>(k - c, 0)) - 1);
        best = _mm512_mask_max_ps(best, valid, best, _mm512_loadu_ps(st + c));
    }
    return _mm512_reduce_max_ps(best);
#else
    (void)kp;
    return *std::max_element(st, st + k);
#endif
}

// First index of the maximum of st[0..k) (st padded to kp, a multiple of 16).
int64_t first_argmax(const float* st, int64_t k, int64_t kp) {
#if defined(__AVX512F__)
    const __m512 m = _mm512_set1_ps(max_value(st, k, kp));
    for (int64_t c = 0; c < kp; c += 16) {
        const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(st + c), m, _CMP_EQ_OQ);
        if (hit) return std::min<int64_t>(c + __builtin_ctz(hit), k - 1);
    }
    return 0;
#else
    (void)kp;
    int64_t best = 0;
    for (int64_t c = 1; c < k; ++c)
        if (st[c] > st[best]) best = c;
    return best;
#endif
}

// For the rows idx[0..m) of xn: label (first maximum), best and second-best similarity against
// the directions transposed, dT [D][kp] (kp a multiple of 16, k real columns).
void assign_rows(const float* xn, const int64_t* idx, int64_t m, int D, const float* dT, int64_t k, int64_t kp,
                 int32_t* labels, float* best, float* second) {
    std::vector<float> s(static_cast<size_t>(4 * kp));
    const float kNegInf = -std::numeric_limits<float>::infinity();
    for (int64_t i0 = 0; i0 < m; i0 += 4) {
        const float* x[4];
        for (int t = 0; t < 4; ++t) x[t] = xn + idx[std::min(i0 + t, m - 1)] * D;
#if defined(__AVX512F__)
        int64_t c0 = 0;
        for (; c0 + 64 <= kp; c0 += 64) {
            __m512 acc[4][4];
            for (auto& a : acc)
                for (auto& u : a) u = _mm512_setzero_ps();
            for (int d = 0; d < D; ++d) {
                const float* row = dT + static_cast<size_t>(d) * kp + c0;
                const __m512 w0 = _mm512_loadu_ps(row), w1 = _mm512_loadu_ps(row + 16);
                const __m512 w2 = _mm512_loadu_ps(row + 32), w3 = _mm512_loadu_ps(row + 48);
                for (int t = 0; t < 4; ++t) {
                    const __m512 b = _mm512_set1_ps(x[t][d]);
                    acc[t][0] = _mm512_fmadd_ps(b, w0, acc[t][0]);
                    acc[t][1] = _mm512_fmadd_ps(b, w1, acc[t][1]);
                    acc[t][2] = _mm512_fmadd_ps(b, w2, acc[t][2]);
                    acc[t][3] = _mm512_fmadd_ps(b, w3, acc[t][3]);
                }
            }
            for (int t = 0; t < 4; ++t)
                for (int u = 0; u < 4; ++u) _mm512_storeu_ps(s.data() + t * kp + c0 + 16 * u, acc[t][u]);
        }
        for (; c0 < kp; c0 += 16) {
            __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
            for (int d = 0; d < D; ++d) {
                const __m512 w = _mm512_loadu_ps(dT + static_cast<size_t>(d) * kp + c0);
                for (int t = 0; t < 4; ++t) acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(x[t][d]), w, acc[t]);
            }
            for (int t = 0; t < 4; ++t) _mm512_storeu_ps(s.data() + t * kp + c0, acc[t]);
        }
#else
        for (int t = 0; t < 4; ++t) {
            float* st = s.data() + t * kp;
            std::fill(st, st + kp, 0.0f);
            for (int d = 0; d < D; ++d) {
                const float* row = dT + static_cast<size_t>(d) * kp;
                for (int64_t c = 0; c < kp; ++c) st[c] += x[t][d] * row[c];
            }
        }
#endif
        for (int t = 0; t < 4 && i0 + t < m; ++t) {
            float* st = s.data() + t * kp;
            const int64_t i = idx[i0 + t];
            const int64_t b = first_argmax(st, k, kp);
            labels[i] = static_cast<int32_t>(b);
            best[i] = st[b];
            st[b] = kNegInf;
            second[i] = k > 1 ? max_value(st, k, kp) : kNegInf;
        }
    }
}

// assign_rows over the listed rows, chunks of them in parallel (a layer has fewer KV heads than
// a machine has cores, often).
void assign(const float* xn, const std::vector<int64_t>& idx, int D, const float* dT, int64_t k, int64_t kp,
            int32_t* labels, float* best, float* second) {
    constexpr int64_t kChunk = 512;
    const int64_t m = static_cast<int64_t>(idx.size());
    tbb::parallel_for(int64_t(0), (m + kChunk - 1) / kChunk, [&](int64_t c) {
        assign_rows(xn, idx.data() + c * kChunk, std::min(kChunk, m - c * kChunk), D, dT, k, kp, labels, best, second);
    });
}

}  // namespace

std::vector<int64_t> init_order(int64_t seed, int64_t row, int64_t n, int64_t k) {
    const uint64_t base = splitmix64((static_cast<uint64_t>(seed) << 32) + static_cast<uint64_t>(row));
    std::vector<uint64_t> key(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) key[static_cast<size_t>(i)] = splitmix64(base + static_cast<uint64_t>(i));
    std::vector<int64_t> idx(static_cast<size_t>(n));
    std::iota(idx.begin(), idx.end(), 0);
    k = std::min(k, n);
    std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int64_t a, int64_t b) {
        const uint64_t ka = key[static_cast<size_t>(a)], kb = key[static_cast<size_t>(b)];
        return ka != kb ? ka < kb : a < b;
    });
    idx.resize(static_cast<size_t>(k));
    return idx;
}

KMeans kmeans_cosine(const float* x, int64_t n, int D, int64_t k, int64_t max_iters, int64_t seed, int64_t row,
                     bool bounded) {
    if (n <= 0) throw Error("kmeans_cosine needs at least one vector");
    KMeans km;
    k = std::min(k, n);
    km.k = k;
    const int64_t np = (n + 3) / 4 * 4, kp = (k + 15) / 16 * 16;
    std::vector<float> xn(static_cast<size_t>(np) * D, 0.0f);
    normalize_rows(x, n, D, xn.data());  // rows past n stay zero (the 4-row padding)
    std::vector<float> dir(static_cast<size_t>(k) * D), old(static_cast<size_t>(k) * D);
    std::vector<float> dT(static_cast<size_t>(D) * kp, 0.0f);
    const auto init = init_order(seed, row, n, k);
    for (int64_t c = 0; c < k; ++c)
        std::copy_n(xn.data() + init[static_cast<size_t>(c)] * D, D, dir.data() + c * D);
    km.labels.assign(static_cast<size_t>(n), -1);
    std::vector<int32_t> fresh(static_cast<size_t>(n));
    std::vector<float> sums(static_cast<size_t>(k) * D), drift(static_cast<size_t>(k), 0.0f);
    // Hamerly's bounds, for unit vectors: lo[i] <= x_i . dir[label_i], hi[i] >= x_i . dir[c] for
    // every other c. A direction moving by |delta| changes any similarity by at most |delta|, so
    // after an update a row whose bounds stay apart (by more than float noise) keeps its label and
    // is not recomputed: the same labels as recomputing every row, at a fraction of the work.
    std::vector<float> lo(static_cast<size_t>(n)), hi(static_cast<size_t>(n));
    std::vector<int64_t> todo(static_cast<size_t>(n));
    std::iota(todo.begin(), todo.end(), 0);
    constexpr float kMargin = 1e-4f;  // well above the rounding of a D-term float dot product
    while (km.iterations < max_iters) {
        ++km.iterations;
        for (int64_t c = 0; c < k; ++c)
            for (int d = 0; d < D; ++d) dT[static_cast<size_t>(d) * kp + c] = dir[static_cast<size_t>(c * D + d)];
        if (km.iterations > 1 && bounded) {
            // the other centroids' largest drift: the two largest, as a row's own may be the first
            int64_t top = 0;
            for (int64_t c = 1; c < k; ++c)
                if (drift[static_cast<size_t>(c)] > drift[static_cast<size_t>(top)]) top = c;
            float next = 0.0f;
            for (int64_t c = 0; c < k; ++c)
                if (c != top) next = std::max(next, drift[static_cast<size_t>(c)]);
            todo.clear();
            for (int64_t i = 0; i < n; ++i) {
                const int32_t own = fresh[static_cast<size_t>(i)];
                lo[static_cast<size_t>(i)] -= drift[static_cast<size_t>(own)];
                hi[static_cast<size_t>(i)] += own == top ? next : drift[static_cast<size_t>(top)];
                if (lo[static_cast<size_t>(i)] - hi[static_cast<size_t>(i)] <= kMargin) todo.push_back(i);
            }
        }
        assign(xn.data(), todo, D, dT.data(), k, kp, fresh.data(), lo.data(), hi.data());
        km.rows_assigned += static_cast<int64_t>(todo.size());
        if (fresh == km.labels) break;
        km.labels = fresh;
        std::fill(sums.begin(), sums.end(), 0.0f);
        for (int64_t i = 0; i < n; ++i) {
            float* sc = sums.data() + static_cast<size_t>(km.labels[static_cast<size_t>(i)]) * D;
            const float* xi = xn.data() + i * D;
            for (int d = 0; d < D; ++d) sc[d] += xi[d];
        }
        old = dir;
        drift.assign(static_cast<size_t>(k), 0.0f);
        for (int64_t c = 0; c < k; ++c) {
            float* sc = sums.data() + c * D;
            float ss = 0.0f;
            for (int d = 0; d < D; ++d) ss += sc[d] * sc[d];
            const float norm = std::sqrt(ss);
            if (norm > 0.0f)
                for (int d = 0; d < D; ++d) dir[static_cast<size_t>(c * D + d)] = sc[d] / std::max(norm, 1e-30f);
            float dd = 0.0f;
            for (int d = 0; d < D; ++d) {
                const float e = dir[static_cast<size_t>(c * D + d)] - old[static_cast<size_t>(c * D + d)];
                dd += e * e;
            }
            drift[static_cast<size_t>(c)] = std::sqrt(dd) * 1.0001f + 1e-7f;  // rounded up
        }
    }
    km.sizes.assign(static_cast<size_t>(k), 0);
    km.centroids.assign(static_cast<size_t>(k) * D, 0.0f);
    for (int64_t i = 0; i < n; ++i) {
        const int32_t c = km.labels[static_cast<size_t>(i)];
        ++km.sizes[static_cast<size_t>(c)];
        float* mu = km.centroids.data() + static_cast<size_t>(c) * D;
        for (int d = 0; d < D; ++d) mu[d] += x[i * D + d];
    }
    for (int64_t c = 0; c < k; ++c) {
        const float inv = 1.0f / static_cast<float>(std::max<int64_t>(km.sizes[static_cast<size_t>(c)], 1));
        for (int d = 0; d < D; ++d) km.centroids[static_cast<size_t>(c * D + d)] *= inv;
    }
    return km;
}

}  // namespace ovkc
