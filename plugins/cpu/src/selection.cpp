// Selection helpers shared by the methods that keep tokens by score (importance, KVCrush, Chelsea):
// top-k in the reference's order (highest first, ties to the lower index), in linear time.
#include <algorithm>
#include <functional>
#include <limits>
#include <numeric>

#if defined(__AVX512F__)
#    include <immintrin.h>
#endif

#include "selection.hpp"

#include <string>

#include "paged_cache.hpp"

namespace ovkc {

namespace {

// out[i] = s[i][0] + s[i][1] + ... (in that order, as the reference sums a group's heads), for
// rows of G floats; G known at compile time for the usual group sizes, so the loop vectorizes.
template <int G>
void group_sums_of(const float* s, int64_t n, float* out) {
    for (int64_t i = 0; i < n; ++i) {
        float sum = s[i * G];
        for (int gi = 1; gi < G; ++gi) sum += s[i * G + gi];
        out[i] = sum;
    }
}

}  // namespace

void group_sums(const float* s, int64_t n, int G, float* out) {
    switch (G) {
        case 1: return group_sums_of<1>(s, n, out);
        case 2: return group_sums_of<2>(s, n, out);
        case 3: return group_sums_of<3>(s, n, out);
        case 4: return group_sums_of<4>(s, n, out);
        case 8: return group_sums_of<8>(s, n, out);
        default:
            for (int64_t i = 0; i < n; ++i) {
                float sum = s[i * G];
                for (int gi = 1; gi < G; ++gi) sum += s[i * G + gi];
                out[i] = sum;
            }
    }
}

std::vector<float>& tls_combined() {
    thread_local std::vector<float> buf;
    return buf;
}

namespace {

float min_value(const float* x, int64_t n) {
    float v = std::numeric_limits<float>::infinity();
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 m = _mm512_set1_ps(v);
    for (; i + 16 <= n; i += 16) m = _mm512_min_ps(m, _mm512_loadu_ps(x + i));
    v = _mm512_reduce_min_ps(m);
#endif
    for (; i < n; ++i) v = x[i] < v ? x[i] : v;
    return v;
}

}  // namespace

void worst_tokens(const float* scores, int64_t n, int64_t count, int64_t* out) {
    // the worst each time: the lowest score, the latest token on ties; a vector min, then a
    // backward scan for its token
    std::vector<float> work;  // the scores with the tokens already taken at +inf (count > 1)
    const float* x = scores;
    for (int64_t r = 0; r < count; ++r) {
        const float v = min_value(x, n);
        int64_t i = n - 1;
        while (i > 0 && !(x[i] == v && std::find(out, out + r, i) == out + r)) --i;
        out[r] = i;
        if (r + 1 < count) {
            if (work.empty()) work.assign(scores, scores + n);
            x = work.data();
            work[static_cast<size_t>(i)] = std::numeric_limits<float>::infinity();
        }
    }
}

void topk_mask(const float* scores, int64_t n, int64_t k, uint8_t* mask) {
    // the reference's order: highest score first, ties to the lower index
    k = std::clamp<int64_t>(k, 0, n);
    const int64_t drop = n - k;
    if (k == 0 || drop == 0) {
        std::fill(mask, mask + n, static_cast<uint8_t>(drop == 0));
        return;
    }
    if (drop <= kFewDrops) {  // a decode step of a full head drops one token, or a few
        int64_t worst[kFewDrops];
        worst_tokens(scores, n, drop, worst);
        std::fill(mask, mask + n, uint8_t(1));
        for (int64_t r = 0; r < drop; ++r) mask[worst[r]] = 0;
        return;
    }
    // otherwise everything above the k-th highest value is kept, then the equal ones in index order
    std::vector<float> copy(scores, scores + n);
    std::nth_element(copy.begin(), copy.begin() + (k - 1), copy.end(), std::greater<float>());
    const float t = copy[static_cast<size_t>(k - 1)];
    int64_t equal = k;  // how many tokens at the threshold value are kept
    for (int64_t i = 0; i < n; ++i) {
        mask[i] = scores[i] > t;
        equal -= mask[i];
    }
    for (int64_t i = 0; i < n && equal > 0; ++i)
        if (scores[i] == t) {
            mask[i] = 1;
            --equal;
        }
}

std::vector<int64_t> topk_indices(const float* scores, int64_t n, int64_t k) {
    std::vector<uint8_t> mask(static_cast<size_t>(n));
    topk_mask(scores, n, k, mask.data());
    std::vector<int64_t> idx;
    idx.reserve(static_cast<size_t>(std::clamp<int64_t>(k, 0, n)));
    for (int64_t i = 0; i < n; ++i)
        if (mask[static_cast<size_t>(i)]) idx.push_back(i);
    return idx;
}

std::vector<int64_t> keep_indices(const float* scores, int64_t n, int64_t budget, int64_t sinks, int64_t recent) {
    std::vector<int64_t> keep;
    if (budget >= n) {
        keep.resize(static_cast<size_t>(n));
        std::iota(keep.begin(), keep.end(), int64_t(0));
        return keep;
    }
    const int64_t heavy = budget - sinks - recent;
    keep.reserve(static_cast<size_t>(budget));
    for (int64_t i = 0; i < sinks; ++i) keep.push_back(i);
    for (int64_t i : topk_indices(scores + sinks, n - recent - sinks, heavy)) keep.push_back(i + sinks);
    for (int64_t i = n - recent; i < n; ++i) keep.push_back(i);
    return keep;
}

std::vector<int64_t> SpanPlan::tokens(const std::vector<int64_t>& spans) const {
    std::vector<int64_t> keep;
    keep.reserve(spans.size() * static_cast<size_t>(block) + static_cast<size_t>(partial));
    for (int64_t b : spans)
        for (int64_t i = 0; i < block; ++i) keep.push_back(b * block + i);
    for (int64_t i = full * block; i < n; ++i) keep.push_back(i);
    return keep;
}

SpanPlan plan_spans(const float* scores, int rows, int64_t n, int64_t block, int64_t budget, int64_t sinks,
                    int64_t recent, int64_t reserved, const char* what) {
    SpanPlan p;
    p.block = block;
    p.n = n;
    p.full = n / block;
    p.partial = n - p.full * block;
    p.sink = (sinks + block - 1) / block;
    p.recent = (std::max<int64_t>(recent - p.partial, 0) + block - 1) / block;
    p.budget = (budget - p.partial) / block;
    if (p.sink + p.recent + reserved > p.budget)
        throw Error("method.budgets=" + std::to_string(budget) + " is invalid: allowed room for " + what + " of " +
                    std::to_string(block) + " tokens (" +
                    std::to_string((p.sink + p.recent + reserved) * block + p.partial) + " tokens here)");
    p.scores.assign(static_cast<size_t>(rows) * p.full, 0.0f);
    for (int h = 0; h < rows; ++h)
        for (int64_t b = 0; b < p.full; ++b) {
            float s = 0.0f;
            for (int64_t i = 0; i < block; ++i) s += scores[h * n + b * block + i];
            p.scores[static_cast<size_t>(h * p.full + b)] = s;
        }
    return p;
}

std::vector<int64_t> keep_block_indices(const float* scores, int64_t n, int64_t budget, int64_t sinks, int64_t recent,
                                        int64_t block) {
    if (budget >= n) return keep_indices(scores, n, budget, sinks, recent);
    const SpanPlan p = plan_spans(scores, 1, n, block, budget, sinks, recent, 0, "the sink and recent spans");
    return p.tokens(keep_indices(p.scores.data(), p.full, p.budget, p.sink, p.recent));
}

void pool_scores(float* scores, int64_t n, int64_t stride, int64_t kernel, bool avg) {
    if (kernel <= 1 || n == 0) return;
    const int64_t half = kernel / 2;
    std::vector<float> src(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) src[static_cast<size_t>(i)] = scores[i * stride];
    for (int64_t i = 0; i < n; ++i) {
        const int64_t lo = std::max<int64_t>(0, i - half), hi = std::min<int64_t>(n - 1, i + half);
        float acc = avg ? 0.0f : -std::numeric_limits<float>::infinity();
        for (int64_t j = lo; j <= hi; ++j) acc = avg ? acc + src[static_cast<size_t>(j)] : std::max(acc, src[static_cast<size_t>(j)]);
        scores[i * stride] = avg ? acc / static_cast<float>(hi - lo + 1) : acc;
    }
}

}  // namespace ovkc
