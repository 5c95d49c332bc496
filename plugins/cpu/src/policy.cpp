#include "policy.hpp"

#include <algorithm>
#include <map>
#include <numeric>

#include "kernels.hpp"

namespace ovkc {

void keep_slots(Sequence& seq, HeadCache& hc, const std::vector<int64_t>& keep) {
    const PoolConfig& cfg = seq.pool().config();
    const int G = cfg.group();
    const int64_t k = static_cast<int64_t>(keep.size());
    // runs of consecutive kept slots move together (one memmove per channel and block segment):
    // evicting one token from a full head then costs a shift of the slots after it
    for (int64_t j = 0; j < k;) {
        const int64_t i = keep[static_cast<size_t>(j)];
        int64_t run = 1;
        while (j + run < k && keep[static_cast<size_t>(j + run)] == i + run) ++run;
        if (i != j) {
            move_slots(cfg, seq.pool(), hc, i, j, run);
            std::copy_n(hc.pos.begin() + i, run, hc.pos.begin() + j);
            if (!hc.scores.empty())
                std::copy_n(hc.scores.begin() + i * G, run * G, hc.scores.begin() + j * G);
            if (!hc.degree.empty()) std::copy_n(hc.degree.begin() + i, run, hc.degree.begin() + j);
            if (!hc.bias.empty()) std::copy_n(hc.bias.begin() + i, run, hc.bias.begin() + j);
        }
        j += run;
    }
    hc.pos.resize(static_cast<size_t>(k));
    if (!hc.scores.empty()) hc.scores.resize(static_cast<size_t>(k) * G);
    if (!hc.degree.empty()) hc.degree.resize(static_cast<size_t>(k));
    if (!hc.bias.empty()) hc.bias.resize(static_cast<size_t>(k));
    hc.holes = 0;  // kept slots are live ones
    if (hc.degree.empty()) hc.bias.clear();  // no Chelsea: the bias only marked holes
    seq.trim_blocks(hc);
}

std::vector<int64_t> live_slots(const HeadCache& hc) {
    std::vector<int64_t> live(static_cast<size_t>(hc.size() - hc.holes));
    if (!hc.holes) {
        std::iota(live.begin(), live.end(), int64_t(0));
        return live;
    }
    size_t j = 0;
    for (int64_t i = 0; i < hc.size(); ++i)
        if (hc.bias[static_cast<size_t>(i)] != HeadCache::kHole) live[j++] = i;
    return live;
}

void compact(Sequence& seq, HeadCache& hc) {
    if (hc.holes) keep_slots(seq, hc, live_slots(hc));
}

void make_holes(Sequence& seq, HeadCache& hc, const int64_t* slots, int64_t count) {
    if (hc.bias.empty()) hc.bias.assign(static_cast<size_t>(hc.size()), 0.0f);
    for (int64_t r = 0; r < count; ++r) {
        float& b = hc.bias[static_cast<size_t>(slots[r])];
        if (b != HeadCache::kHole) {
            b = HeadCache::kHole;
            ++hc.holes;
        }
    }
    if (hc.holes >= seq.pool().config().block_size) compact(seq, hc);
}

void evict_slots(Sequence& seq, HeadCache& hc, const std::vector<int64_t>& keep) {
    std::vector<int64_t> drop;
    size_t j = 0;
    for (int64_t i = 0; i < hc.size(); ++i) {
        if (j < keep.size() && keep[j] == i)
            ++j;
        else if (!hc.hole(i))
            drop.push_back(i);
    }
    make_holes(seq, hc, drop.data(), static_cast<int64_t>(drop.size()));
}

void keep_blocks(Sequence& seq, HeadCache& hc, const std::vector<int64_t>& keep) {
    const PoolConfig& cfg = seq.pool().config();
    const int64_t bs = cfg.block_size;
    const int G = cfg.group();
    std::vector<char> kept(hc.blocks.size(), 0);
    std::vector<int32_t> table;
    for (size_t j = 0; j < keep.size(); j += static_cast<size_t>(bs)) {
        const int64_t blk = keep[j] / bs;
        kept[static_cast<size_t>(blk)] = 1;
        table.push_back(hc.blocks[static_cast<size_t>(blk)]);
    }
    for (size_t b = 0; b < hc.blocks.size(); ++b)
        if (!kept[b]) seq.pool().release(hc.blocks[b]);
    hc.blocks = std::move(table);
    std::vector<int64_t> pos(keep.size());
    std::vector<float> scores(hc.scores.empty() ? 0 : keep.size() * G);
    for (size_t j = 0; j < keep.size(); ++j) {
        const size_t i = static_cast<size_t>(keep[j]);
        pos[j] = hc.pos[i];
        if (!scores.empty()) std::copy_n(hc.scores.begin() + i * G, G, scores.begin() + j * G);
    }
    hc.pos = std::move(pos);
    hc.scores = std::move(scores);
}

void Policy::require_budgets_at_least(int64_t floor, const std::string& what) const {
    for (int64_t b : common_.budgets)
        if (b && b < floor)
            throw Error(Spec::invalid("budgets", std::to_string(b), "at least " + what + " = " + std::to_string(floor)));
}

bool step_scores(const PoolConfig& cfg, bool prefill) { return cfg.scores || cfg.policy->scores_step(prefill); }

int64_t score_rows_from(const PoolConfig& cfg, bool prefill, int64_t L) {
    return cfg.scores ? 0 : cfg.policy->score_rows_from(prefill, L);
}

int64_t held_prompt_tokens(const PoolConfig& cfg, int64_t n) {
    int64_t cut = n - 1;
    constexpr int64_t kLong = int64_t{1} << 40;
    if (step_scores(cfg, true) && score_rows_from(cfg, true, kLong) > 0)  // a window of scoring rows
        cut = std::min(cut, score_rows_from(cfg, true, n));               // (0 when it covers all n)
    if (cfg.sparse.on()) cut = std::min(cut, n - cfg.sparse.last_dense_tokens);
    return std::max<int64_t>(0, cut);
}

void run_before_attention(Sequence& seq, int layer, bool prefill, int64_t L) {
    const Policy& p = *seq.pool().config().policy;
    p.before_attention(seq, layer, prefill, L);
    if (p.quant() && !p.defers_quant_flush() && !prefill) quant_flush(seq, layer, false);
}

void run_after_attention(Sequence& seq, int layer, bool prefill, int64_t L) {
    const Policy& p = *seq.pool().config().policy;
    p.after_attention(seq, layer, prefill, L);
    if (p.quant() && !p.defers_quant_flush() && prefill) quant_flush(seq, layer, true);
}

// ---- the table ------------------------------------------------------------------------------------

namespace {
std::map<std::string, PolicyFactory>& table() {
    static std::map<std::string, PolicyFactory> t;  // filled at load time, read-only afterwards
    return t;
}
}  // namespace

bool register_policy(const char* name, PolicyFactory make) {
    table()[name] = make;
    return true;
}

std::vector<std::string> policy_names() {
    std::vector<std::string> out;
    for (const auto& [name, make] : table()) out.push_back(name);
    return out;
}

std::shared_ptr<const Policy> make_policy(const std::string& text, const ModelShape& shape) {
    Spec spec(text);
    const int64_t kMax = int64_t(1) << 20;
    PolicyCommon common;
    common.name = spec.text("method");
    auto it = table().find(common.name);
    if (it == table().end()) {
        std::string names;
        for (const auto& n : policy_names()) names += (names.empty() ? "" : ", ") + n;
        throw Error(Spec::invalid("method", common.name, names));
    }
    common.budgets = spec.integers("budgets", 0, kMax);
    if (static_cast<int>(common.budgets.size()) != shape.layers)
        throw Error(Spec::invalid("budgets", std::to_string(common.budgets.size()) + " entries",
                                  "one per layer (" + std::to_string(shape.layers) + ")"));
    common.quant = spec.flag("quant");
    if (common.quant) {
        common.group = spec.integer("group", 16, 128);
        const std::string g = std::to_string(common.group);
        common.residual = spec.integer("residual", 16, 1 << 16);
        common.tail = spec.integer("tail", 0, 1 << 16);
        for (auto [field, out] : {std::pair<const char*, int64_t*>{"key_bits", &common.key_bits},
                                  std::pair<const char*, int64_t*>{"value_bits", &common.value_bits}}) {
            *out = spec.integer(field, 2, 4);
            if (*out == 3) throw Error(Spec::invalid(field, "3", "2 or 4"));
        }
        if (shape.head_dim % common.group)
            throw Error(Spec::invalid("group", g, "a divisor of head_dim=" + std::to_string(shape.head_dim)));
        if (shape.block_size % common.group)
            throw Error(Spec::invalid("group", g, "a divisor of the KV block size " + std::to_string(shape.block_size)));
        if (common.residual % shape.block_size)
            throw Error(Spec::invalid("residual", std::to_string(common.residual),
                                      "a multiple of the KV block size " + std::to_string(shape.block_size)));
    }
    std::shared_ptr<const Policy> policy = it->second(spec, shape, std::move(common));
    spec.finish();
    return policy;
}

}  // namespace ovkc
