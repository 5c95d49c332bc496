// Knorm (ov_kvcrush/methods/knorm.py; Devoto et al., arXiv 2406.11430): per layer and KV head,
// keep the sinks, the recent window and, between them, the tokens whose keys have the smallest
// L2 norm. A token's score is -||k||, computed once when it arrives (from the key as the pool
// stores it) and kept in the first column of its slot's scores, so it moves with the token on
// every compaction; the selection is importance.cpp's. The attention adds no probabilities. Over
// the 2-bit store (frozen) only the prompt is selected.
#include <cmath>
#include <vector>

#include "importance.hpp"
#include "kernels.hpp"

namespace ovkc {

namespace {

class KnormPolicy : public Policy {
public:
    KnormPolicy(Spec& spec, const ModelShape& /*shape*/, PolicyCommon common) : Policy(std::move(common)) {
        const int64_t kMax = int64_t(1) << 20;
        sinks = spec.integer("sinks", 0, kMax);
        recent = spec.integer("recent", 0, kMax);
        frozen = spec.flag("frozen");
        if (quant() && !frozen) throw Error(Spec::invalid("frozen", "0", "1 over the 2-bit store"));
        require_budgets_at_least(sinks + recent, "sinks + recent");
    }

    // the slot scores hold the norms, not attention: a pool cannot also ask for attention scores
    bool keeps_slot_scores() const override { return true; }
    bool allows_score_output() const override { return false; }

    void after_attention(Sequence& seq, int layer, bool prefill, int64_t L) const override {
        if (!prefill && frozen) return;  // over the 2-bit store the prompt's selection is final
        const PoolConfig& cfg = seq.pool().config();
        const int G = cfg.group(), D = cfg.head_dim;
        std::vector<float> k(static_cast<size_t>(D)), v(static_cast<size_t>(D));
        for (int g = 0; g < cfg.kv_heads; ++g) {
            HeadCache& hc = seq.head(layer, g);
            for (int64_t slot = hc.size() - L; slot < hc.size(); ++slot) {  // the step's tokens
                load_token(cfg, seq.pool(), hc, slot, k.data(), v.data());
                double sum = 0.0;
                for (int d = 0; d < D; ++d) sum += static_cast<double>(k[static_cast<size_t>(d)]) * k[static_cast<size_t>(d)];
                hc.scores[static_cast<size_t>(slot * G)] = -static_cast<float>(std::sqrt(sum));
            }
        }
        evict_by_slot_scores(seq, layer, prefill, budget(layer), sinks, recent, true);
    }

private:
    int64_t sinks = 0, recent = 0;
    bool frozen = false;
};

std::unique_ptr<Policy> make_knorm(Spec& spec, const ModelShape& shape, PolicyCommon common) {
    return std::make_unique<KnormPolicy>(spec, shape, std::move(common));
}

}  // namespace

OVKC_REGISTER_POLICY("knorm", make_knorm);

}  // namespace ovkc
