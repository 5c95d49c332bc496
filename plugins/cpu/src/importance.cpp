// Importance eviction (ov_kvcrush/methods/importance.py): StreamingLLM, H2O, SnapKV, PyramidKV and
// MiniKV's selection. Per layer and KV head, keep the sinks, the recent window and the tokens with
// the highest scores between (the op's per-query-head accumulated probabilities summed over the
// KV head's group), `budget` in all. SnapKV scores the prompt with the last `window` queries only,
// max/avg-pooled along tokens; decode queries keep adding to the scores. Eviction runs after the
// prompt and whenever a step leaves the head above its budget, unless the selection is frozen
// (MiniKV, the 2-bit store): then only the prompt is selected.
#include <algorithm>
#include <limits>
#include <numeric>

#include "policy.hpp"

namespace ovkc {

std::vector<int64_t> topk_indices(const float* scores, int64_t n, int64_t k) {
    // the reference's order: highest score first, ties to the lower index; returned ascending
    std::vector<int64_t> idx(static_cast<size_t>(n));
    std::iota(idx.begin(), idx.end(), int64_t(0));
    auto better = [scores](int64_t a, int64_t b) {
        return scores[a] > scores[b] || (scores[a] == scores[b] && a < b);
    };
    k = std::min(k, n);
    if (k < n) std::nth_element(idx.begin(), idx.begin() + k, idx.end(), better);
    idx.resize(static_cast<size_t>(k));
    std::sort(idx.begin(), idx.end());
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

void pool_prompt_scores(Sequence& seq, int layer) {
    const PoolConfig& cfg = seq.pool().config();
    const MethodParams& p = *cfg.method;
    if (p.scoring != Scoring::snapkv) return;
    const int G = cfg.group();
    for (int g = 0; g < cfg.kv_heads; ++g) {
        HeadCache& hc = seq.head(layer, g);
        for (int gi = 0; gi < G; ++gi) pool_scores(hc.scores.data() + gi, hc.size(), G, p.pool_kernel, p.pool_avg);
    }
}

void importance_step(Sequence& seq, int layer, bool prefill) {
    const PoolConfig& cfg = seq.pool().config();
    const MethodParams& p = *cfg.method;
    const int64_t budget = p.budget(layer);
    const int G = cfg.group();
    if (prefill) pool_prompt_scores(seq, layer);
    for (int g = 0; g < cfg.kv_heads; ++g) {
        HeadCache& hc = seq.head(layer, g);
        const int64_t n = hc.size();
        if (!budget || n <= budget || (!prefill && p.frozen)) continue;
        std::vector<float> combined(static_cast<size_t>(n), 0.0f);
        if (p.scoring != Scoring::none)
            for (int64_t i = 0; i < n; ++i) {
                float s = 0.0f;
                for (int gi = 0; gi < G; ++gi) s += hc.scores[static_cast<size_t>(i * G + gi)];
                combined[static_cast<size_t>(i)] = s;
            }
        keep_slots(seq, hc, keep_indices(combined.data(), n, budget, p.sinks, p.recent));
    }
}

}  // namespace ovkc
