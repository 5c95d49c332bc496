// KVzip (ov_kvcrush/methods/kvzip.py; Kim et al., arXiv 2505.23416): query-agnostic eviction.
// A prompt is held whole; the engine then runs a scoring pass (Sequence::scoring: the op attends
// a reconstruction of the context over what is held and keeps, per slot and query head, the
// largest probability any of its queries gave the slot) and calls finish_scoring_pass, which
// keeps `budget x kv_heads` tokens per layer (allocation "layer") or their sum over all layers
// ("global", the paper): every head's first `sinks` positions and last `recent` slots, then the
// highest scores (a slot's score: the max over its group's query heads), ties to the lower
// (layer, head, slot), as the reference's stable sort. Heads keep different counts. Decode steps
// only append: generated tokens wait for the next prompt's pass. Over the 2-/4-bit store, each
// head then quantizes whole `residual` runs of what it keeps; quantized tokens are frozen and
// count against a later pass's budget.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "policy.hpp"

namespace ovkc {

namespace {

class KVzipPolicy : public Policy {
public:
    KVzipPolicy(Spec& spec, const ModelShape& /*shape*/, PolicyCommon common) : Policy(std::move(common)) {
        const int64_t kMax = int64_t(1) << 20;
        sinks = spec.integer("sinks", 0, kMax);
        recent = spec.integer("recent", 0, kMax);
        global = spec.choice("allocation", {"global", "layer"}) == "global";
        // the question comes after the pass: nothing of a prompt is pinned in full precision
        if (quant() && quant_tail()) throw Error(Spec::invalid("tail", std::to_string(quant_tail()), "0 for kvzip"));
        require_budgets_at_least(std::max<int64_t>(1, sinks + recent), "sinks + recent");
    }

    // the slot scores hold the scoring pass's maxima, not accumulated attention
    bool keeps_slot_scores() const override { return true; }
    bool allows_score_output() const override { return false; }
    bool has_scoring_pass() const override { return true; }
    int64_t scoring_sinks() const override { return sinks; }

    // the scoring pass keeps a prompt whole until it has selected: no flush before (the store's
    // quantized tokens are frozen), the kept tokens' flush after
    bool defers_quant_flush() const override { return true; }

    void finish_scoring_pass(Sequence& seq) const override {
        const PoolConfig& cfg = seq.pool().config();
        if (global) {
            select(seq, 0, cfg.layers);
        } else {
            for (int layer = 0; layer < cfg.layers; ++layer)
                if (!cfg.window(layer)) select(seq, layer, layer + 1);
        }
        for (int layer = 0; layer < cfg.layers; ++layer)
            if (!cfg.window(layer)) quant_flush(seq, layer, false);
    }

private:
    struct Entry {
        float score;
        int64_t flat;  // (layer, head, slot) order
    };

    // Keep the budget of layers [first, last) over their heads by the slots' scores (sliding-
    // window layers are not the method's: they keep their ring).
    void select(Sequence& seq, int first, int last) const {
        const PoolConfig& cfg = seq.pool().config();
        const int G = cfg.group();
        int64_t total = 0;
        std::vector<Entry> entries;
        for (int layer = first; layer < last; ++layer) {
            if (cfg.window(layer)) continue;
            total += budget(layer) * cfg.kv_heads;
            for (int g = 0; g < cfg.kv_heads; ++g) {
                HeadCache& hc = seq.head(layer, g);
                total -= static_cast<int64_t>(hc.qpos.size());  // quantized: frozen, and counted
                compact(seq, hc);
                const int64_t n = hc.size();
                for (int64_t slot = 0; slot < n; ++slot) {
                    float s = -std::numeric_limits<float>::infinity();
                    for (int gi = 0; gi < G; ++gi) s = std::max(s, hc.scores[static_cast<size_t>(slot * G + gi)]);
                    if (hc.pos[static_cast<size_t>(slot)] < sinks || slot >= n - recent)
                        s = std::numeric_limits<float>::infinity();
                    entries.push_back({s, static_cast<int64_t>(entries.size())});
                }
            }
        }
        total = std::max<int64_t>(0, total);
        if (static_cast<int64_t>(entries.size()) <= total) return;
        auto before = [](const Entry& a, const Entry& b) { return a.score > b.score || (a.score == b.score && a.flat < b.flat); };
        std::nth_element(entries.begin(), entries.begin() + total, entries.end(), before);
        std::vector<char> kept(entries.size(), 0);
        for (int64_t i = 0; i < total; ++i) kept[static_cast<size_t>(entries[static_cast<size_t>(i)].flat)] = 1;
        int64_t flat = 0;
        for (int layer = first; layer < last; ++layer) {
            if (cfg.window(layer)) continue;
            for (int g = 0; g < cfg.kv_heads; ++g) {
                HeadCache& hc = seq.head(layer, g);
                std::vector<int64_t> keep;
                for (int64_t slot = 0; slot < hc.size(); ++slot, ++flat)
                    if (kept[static_cast<size_t>(flat)]) keep.push_back(slot);
                keep_slots(seq, hc, keep);
            }
        }
    }

    int64_t sinks = 0, recent = 0;
    bool global = true;
};

std::unique_ptr<Policy> make_kvzip(Spec& spec, const ModelShape& shape, PolicyCommon common) {
    return std::make_unique<KVzipPolicy>(spec, shape, std::move(common));
}

}  // namespace

OVKC_REGISTER_POLICY("kvzip", make_kvzip);

}  // namespace ovkc
