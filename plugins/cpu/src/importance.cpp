// Importance eviction (ov_kvcrush/methods/importance.py): StreamingLLM, H2O, SnapKV, PyramidKV and
// MiniKV's selection. Per layer and KV head, keep the sinks, the recent window and the tokens with
// the highest scores between (the op's per-query-head accumulated probabilities summed over the
// KV head's group), `budget` in all. SnapKV scores the prompt with the last `window` queries only,
// max/avg-pooled along tokens; decode queries keep adding to the scores. Eviction runs after the
// prompt and whenever a step leaves the head above its budget, unless the selection is frozen
// (MiniKV): then only the prompt is selected. Over the 2-bit store a decode step drops whole
// flushed chunks instead (evict_quant_chunks), as the reference does.
#include "importance.hpp"

#include <algorithm>
#include <limits>
#include <numeric>

#include "selection.hpp"

namespace ovkc {

void pool_layer_scores(Sequence& seq, int layer, int64_t kernel, bool avg) {
    const PoolConfig& cfg = seq.pool().config();
    const int G = cfg.group();
    for (int g = 0; g < cfg.kv_heads; ++g) {
        HeadCache& hc = seq.head(layer, g);
        for (int gi = 0; gi < G; ++gi) pool_scores(hc.scores.data() + gi, hc.size(), G, kernel, avg);
    }
}

void ImportancePolicy::pool_prompt_scores(Sequence& seq, int layer) const {
    if (scoring == Scoring::snapkv) pool_layer_scores(seq, layer, pool_kernel, pool_avg);
}

void ImportancePolicy::after_attention(Sequence& seq, int layer, bool prefill, int64_t /*L*/) const {
    if (prefill) pool_prompt_scores(seq, layer);
    if (!prefill && quant() && !frozen) {
        evict_quant_chunks(seq, layer, budget(layer), sinks, recent);
        return;
    }
    if (prefill || !frozen)
        evict_by_slot_scores(seq, layer, prefill, budget(layer), sinks, recent, scoring != Scoring::none, block_wise);
}

void evict_by_slot_scores(Sequence& seq, int layer, bool prefill, int64_t budget, int64_t sinks, int64_t recent,
                          bool by_scores, bool block_wise) {
    const PoolConfig& cfg = seq.pool().config();
    const int G = cfg.group();
    for (int g = 0; g < cfg.kv_heads; ++g) {
        HeadCache& hc = seq.head(layer, g);
        const int64_t n = hc.size() - hc.holes;  // the tokens held, in slot (= position) order
        if (!budget || n <= budget) continue;
        if (block_wise) {  // whole blocks: the block table is rewritten, nothing copied, no holes
            std::vector<float> combined(static_cast<size_t>(n), 0.0f);
            if (by_scores) group_sums(hc.scores.data(), n, G, combined.data());
            keep_blocks(seq, hc, keep_block_indices(combined.data(), n, budget, sinks, recent, cfg.block_size));
            continue;
        }
        if (!prefill && n - budget <= kFewDrops) {
            // a decode step drops one token (or a few): the worst of the middle, straight from the
            // slots, no index lists. The middle: after the first `sinks` and before the last
            // `recent` tokens held; holes score +inf there, so they are never picked again.
            int64_t lo = 0, hi = hc.size();
            for (int64_t c = 0; c < sinks; ++lo) c += !hc.hole(lo);
            for (int64_t c = 0; c < recent;) c += !hc.hole(--hi);
            std::vector<float>& mid = tls_combined();
            mid.assign(static_cast<size_t>(hi - lo), 0.0f);
            if (by_scores) group_sums(hc.scores.data() + lo * G, hi - lo, G, mid.data());
            if (hc.holes)
                for (int64_t i = lo; i < hi; ++i)
                    if (hc.bias[static_cast<size_t>(i)] == HeadCache::kHole) mid[static_cast<size_t>(i - lo)] = std::numeric_limits<float>::infinity();
            int64_t worst[kFewDrops];
            worst_tokens(mid.data(), hi - lo, n - budget, worst);
            for (int64_t r = 0; r < n - budget; ++r) worst[r] += lo;
            make_holes(seq, hc, worst, n - budget);
            continue;
        }
        const std::vector<int64_t> live = live_slots(hc);
        std::vector<float> combined(static_cast<size_t>(n), 0.0f);
        if (by_scores)
            for (int64_t i = 0; i < n; ++i) group_sums(hc.scores.data() + live[static_cast<size_t>(i)] * G, 1, G, &combined[static_cast<size_t>(i)]);
        std::vector<int64_t> keep = keep_indices(combined.data(), n, budget, sinks, recent);
        for (int64_t& k : keep) k = live[static_cast<size_t>(k)];
        if (prefill)
            keep_slots(seq, hc, keep);
        else
            evict_slots(seq, hc, keep);
    }
}

void evict_quant_chunks(Sequence& seq, int layer, int64_t budget, int64_t sinks, int64_t recent, bool shared) {
    const PoolConfig& cfg = seq.pool().config();
    const int G = cfg.group();
    const int64_t R = cfg.policy->quant_residual(), T = cfg.block_size, per = R / T;
    const int64_t newest = seq.seen(layer) - 1;
    if (!budget) return;
    for (int g = 0; g < cfg.kv_heads; ++g) {  // most steps: some head is not a chunk over its budget
        const HeadCache& hc = seq.head(layer, g);
        if (hc.held() - budget < R || static_cast<int64_t>(hc.qpos.size()) < R) return;
    }
    // per head: each chunk's summed scores and whether it must stay; every head then drops the
    // same number of chunks (the reference's heads stay one width)
    std::vector<std::vector<float>> score(static_cast<size_t>(cfg.kv_heads));
    std::vector<std::vector<char>> stays(static_cast<size_t>(cfg.kv_heads));
    int64_t drop = std::numeric_limits<int64_t>::max();
    for (int g = 0; g < cfg.kv_heads; ++g) {
        const HeadCache& hc = seq.head(layer, g);
        const int64_t chunks = static_cast<int64_t>(hc.qpos.size()) / R;
        auto& sc = score[static_cast<size_t>(g)];
        auto& st = stays[static_cast<size_t>(g)];
        sc.assign(static_cast<size_t>(chunks), 0.0f);
        st.assign(static_cast<size_t>(chunks), 0);
        int64_t movable = 0;
        for (int64_t c = 0; c < chunks; ++c) {
            for (int64_t j = c * R; j < (c + 1) * R; ++j) {
                const int64_t pos = hc.qpos[static_cast<size_t>(j)];
                if (pos < sinks || pos > newest - recent) st[static_cast<size_t>(c)] = 1;
                if (!hc.qscores.empty()) {
                    float s = 0.0f;
                    group_sums(hc.qscores.data() + j * G, 1, G, &s);
                    sc[static_cast<size_t>(c)] += s;
                }
            }
            movable += !st[static_cast<size_t>(c)];
        }
        drop = std::min({drop, std::max<int64_t>(0, (hc.held() - budget) / R), movable});
    }
    if (drop <= 0) return;
    if (shared && cfg.kv_heads > 1) {  // the heads' chunks hold the same positions: rank their sum
        std::vector<float> total(score[0].size(), 0.0f);
        for (const auto& sc : score)
            for (size_t c = 0; c < total.size(); ++c) total[c] += sc[c];
        for (auto& sc : score) sc = total;
    }
    for (int g = 0; g < cfg.kv_heads; ++g) {
        HeadCache& hc = seq.head(layer, g);
        const auto& sc = score[static_cast<size_t>(g)];
        const auto& st = stays[static_cast<size_t>(g)];
        const int64_t chunks = static_cast<int64_t>(sc.size());
        std::vector<int64_t> order(static_cast<size_t>(chunks));
        std::iota(order.begin(), order.end(), int64_t(0));
        // lowest summed score first, ties to the older chunk; chunks that stay last
        std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
            const size_t ia = static_cast<size_t>(a), ib = static_cast<size_t>(b);
            if (st[ia] != st[ib]) return st[ia] < st[ib];
            return sc[ia] < sc[ib];
        });
        std::vector<char> gone(static_cast<size_t>(chunks), 0);
        for (int64_t i = 0; i < drop; ++i) gone[static_cast<size_t>(order[static_cast<size_t>(i)])] = 1;
        size_t qb = 0, slot = 0;
        for (int64_t c = 0; c < chunks; ++c) {  // kept chunks move down, in order
            const size_t from_qb = static_cast<size_t>(c * per), from_slot = static_cast<size_t>(c * R);
            if (gone[static_cast<size_t>(c)]) {
                for (int64_t b = 0; b < per; ++b) seq.pool().release_q(hc.qblocks[from_qb + static_cast<size_t>(b)]);
                continue;
            }
            std::copy_n(hc.qblocks.begin() + static_cast<std::ptrdiff_t>(from_qb), per, hc.qblocks.begin() + static_cast<std::ptrdiff_t>(qb));
            std::copy_n(hc.qpos.begin() + static_cast<std::ptrdiff_t>(from_slot), R, hc.qpos.begin() + static_cast<std::ptrdiff_t>(slot));
            if (!hc.qscores.empty())
                std::copy_n(hc.qscores.begin() + static_cast<std::ptrdiff_t>(from_slot) * G, R * G,
                            hc.qscores.begin() + static_cast<std::ptrdiff_t>(slot) * G);
            qb += static_cast<size_t>(per);
            slot += static_cast<size_t>(R);
        }
        hc.qblocks.resize(qb);
        hc.qpos.resize(slot);
        if (!hc.qscores.empty()) hc.qscores.resize(slot * static_cast<size_t>(G));
    }
}

// ---- the table: StreamingLLM, H2O, SnapKV, PyramidKV (MiniKV: minikv.cpp) ---------------------

ImportancePolicy::ImportancePolicy(Spec& spec, const ModelShape& /*shape*/, PolicyCommon common)
    : Policy(std::move(common)) {
    const int64_t kMax = int64_t(1) << 20;
    sinks = spec.integer("sinks", 0, kMax);
    recent = spec.integer("recent", 0, kMax);
    const std::string s = spec.choice("scoring", {"none", "h2o", "snapkv"});
    scoring = s == "h2o" ? Scoring::h2o : s == "snapkv" ? Scoring::snapkv : Scoring::none;
    frozen = spec.flag("frozen");
    block_wise = spec.flag("block_wise");
    if (scoring == Scoring::snapkv) {  // the window and pooling score the prompt
        window = spec.integer("window", 1, 1 << 16);
        pool_kernel = spec.integer("pool_kernel", 1, 129);
        if (pool_kernel % 2 == 0)
            throw Error(Spec::invalid("pool_kernel", std::to_string(pool_kernel), "an odd integer in [1, 129]"));
        pool_avg = spec.choice("pool", {"max", "avg"}) == "avg";
    }
    require_budgets_at_least(sinks + recent, "sinks + recent");
}

bool ImportancePolicy::keeps_slot_scores() const { return scoring != Scoring::none; }

bool ImportancePolicy::scores_step(bool prefill) const { return scoring != Scoring::none && (prefill || !frozen); }

int64_t ImportancePolicy::score_rows_from(bool prefill, int64_t L) const {
    return prefill && scoring == Scoring::snapkv ? std::max<int64_t>(0, L - window) : 0;
}

namespace {
std::unique_ptr<Policy> make_importance(Spec& spec, const ModelShape& shape, PolicyCommon common) {
    return std::make_unique<ImportancePolicy>(spec, shape, std::move(common));
}
}  // namespace

OVKC_REGISTER_POLICY("streamingllm", make_importance);
OVKC_REGISTER_POLICY("h2o", make_importance);
OVKC_REGISTER_POLICY("snapkv", make_importance);
OVKC_REGISTER_POLICY("pyramidkv", make_importance);

}  // namespace ovkc
