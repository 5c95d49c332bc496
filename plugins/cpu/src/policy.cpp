#include "policy.hpp"

#include <algorithm>
#include <numeric>

#include "clusterkv.hpp"
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

bool step_scores(const PoolConfig& cfg, bool prefill) {
    if (cfg.scores) return true;
    const MethodParams& p = *cfg.method;
    return p.needs_scores() && (prefill || !p.frozen);
}

int64_t score_rows_from(const PoolConfig& cfg, bool prefill, int64_t L) {
    const MethodParams& p = *cfg.method;
    if (!cfg.scores && prefill && p.scoring == Scoring::snapkv) return std::max<int64_t>(0, L - p.window);
    return 0;
}

void before_attention(Sequence& seq, int layer, bool prefill, int64_t L) {
    const MethodParams& p = *seq.pool().config().method;
    // ClusterKV clusters the pending tokens as the store was before this step (and its flush)
    if (p.method == Method::clusterkv && !prefill) clusterkv_before_decode(seq, layer, L);
    // Chelsea merges once a decode step brings a head to budget + g, before attending
    if (p.method == Method::chelsea && !prefill) chelsea_step(seq, layer, false);
    if (p.quant && !prefill) quant_flush(seq, layer);
}

void after_attention(Sequence& seq, int layer, bool prefill) {
    const MethodParams& p = *seq.pool().config().method;
    switch (p.method) {
        case Method::streamingllm:
        case Method::h2o:
        case Method::snapkv:
        case Method::pyramidkv:
        case Method::minikv:
            importance_step(seq, layer, prefill);
            break;
        case Method::kvcrush:
            kvcrush_step(seq, layer, prefill);
            break;
        case Method::chelsea:  // the prompt attends whole, then is merged
            if (prefill) chelsea_step(seq, layer, true);
            break;
        case Method::clusterkv:  // the prompt's keys are clustered before the flush quantizes them
            if (prefill) clusterkv_after_prefill(seq, layer);
            break;
        default:
            break;
    }
    if (p.quant && prefill) quant_flush(seq, layer);
}

}  // namespace ovkc
