// KVCrush (ov_kvcrush/methods/kvcrush.py), the faithful per-head version, at token or block
// granularity.
//
// Every token gets an H-bit signature, one bit per query head of the layer: would that head keep
// it on its own (its top budget - sinks - recent by its own scores, or score >= its mean)?
// `budget - representatives` important tokens (sinks, recent, top scores summed over heads) are
// kept; the other tokens are ordered by their Hamming distance (hardware popcount) to the
// anchor(s), ties by position, cut into `representatives` contiguous near-equal buckets, and each
// bucket keeps one token (its highest-scoring, or its first). Every KV head of the layer keeps the
// same tokens (scope=layer), or each KV head selects the same way from its own query group's
// scores, with its group's bits of the layer's anchors (scope=head, as SnapKV selects per head).
// Block-wise: scores are summed per block, whole blocks are kept, the trailing partial block
// always stays, and eviction just rewrites the block table.
#include "kvcrush.hpp"

#include <algorithm>
#include <numeric>

#include "selection.hpp"

namespace ovkc {

namespace {

using Words = std::vector<uint64_t>;

Words pack(const std::vector<uint8_t>& bits) {
    Words w((bits.size() + 63) / 64, 0);
    for (size_t h = 0; h < bits.size(); ++h)
        if (bits[h]) w[h / 64] |= uint64_t(1) << (h % 64);
    return w;
}

int64_t hamming(const uint64_t* a, const uint64_t* b, size_t words) {
    int64_t d = 0;
    for (size_t i = 0; i < words; ++i) d += __builtin_popcountll(a[i] ^ b[i]);
    return d;
}

}  // namespace

std::vector<int64_t> kvcrush_select(const float* scores, int H, int64_t n, int64_t budget, int64_t sinks,
                                    int64_t recent, int64_t reps, const KVCrushParams& p) {
    // Runs at every decode step of a full head (n = budget + 1), so every stage is linear in n but
    // the ordering of the evictable tokens (about `reps` of them): no sort of the whole head.
    std::vector<int64_t> all(static_cast<size_t>(n));
    std::iota(all.begin(), all.end(), int64_t(0));
    if (budget >= n) return all;
    if (reps > budget - sinks - recent)
        throw Error("method.representatives=" + std::to_string(reps) +
                    " is invalid: allowed at most budget - sinks - recent = " + std::to_string(budget - sinks - recent));
    std::vector<float> combined(scores, scores + n);
    for (int h = 1; h < H; ++h)
        for (int64_t i = 0; i < n; ++i) combined[static_cast<size_t>(i)] += scores[h * n + i];
    std::vector<uint8_t> kept(static_cast<size_t>(n), 0);
    for (int64_t i : keep_indices(combined.data(), n, budget - reps, sinks, recent)) kept[static_cast<size_t>(i)] = 1;

    // signatures: bit h of a middle token = head h's own decision (sinks and recent stay 0). A
    // decode step's head keeps all middle tokens but one (or a few): start from all ones and
    // clear the few it drops.
    const int64_t per_head_keep = std::max<int64_t>(budget - sinks - recent, 0);
    const int64_t lo = sinks, mid = n - recent - sinks;
    const size_t W = (static_cast<size_t>(H) + 63) / 64;
    std::vector<uint64_t> token_sig(static_cast<size_t>(n) * W, 0);
    auto bit_of = [&](int64_t i, int h) -> uint64_t& { return token_sig[(static_cast<size_t>(lo + i)) * W + h / 64]; };
    const int64_t few = mid - std::min(per_head_keep, mid);
    if (!p.signature_threshold && few <= kFewDrops) {
        for (size_t w = 0; w < W; ++w) {
            const int bits = std::min(64, H - static_cast<int>(w) * 64);
            const uint64_t full = bits == 64 ? ~uint64_t(0) : (uint64_t(1) << bits) - 1;
            for (int64_t i = 0; i < mid; ++i) token_sig[static_cast<size_t>(lo + i) * W + w] = full;
        }
        int64_t worst[kFewDrops];
        for (int h = 0; h < H; ++h) {
            worst_tokens(scores + h * n + lo, mid, few, worst);
            for (int64_t r = 0; r < few; ++r) bit_of(worst[r], h) &= ~(uint64_t(1) << (h % 64));
        }
    } else {
        std::vector<uint8_t> decision(static_cast<size_t>(mid));
        for (int h = 0; h < H; ++h) {
            const float* s = scores + h * n + lo;
            if (p.signature_threshold) {
                float mean = 0.0f;
                for (int64_t i = 0; i < mid; ++i) mean += s[i];
                mean /= static_cast<float>(mid);
                for (int64_t i = 0; i < mid; ++i) decision[static_cast<size_t>(i)] = s[i] >= mean;
            } else {
                topk_mask(s, mid, per_head_keep, decision.data());
            }
            for (int64_t i = 0; i < mid; ++i) bit_of(i, h) |= uint64_t(decision[static_cast<size_t>(i)]) << (h % 64);
        }
    }
    std::vector<int64_t> evictable;
    evictable.reserve(static_cast<size_t>(n - budget + reps));
    for (int64_t i = 0; i < n; ++i)
        if (!kept[static_cast<size_t>(i)]) evictable.push_back(i);
    const int64_t m = static_cast<int64_t>(evictable.size());
    auto sig = [&](int64_t e) { return token_sig.data() + static_cast<size_t>(evictable[static_cast<size_t>(e)]) * W; };

    // anchors (the mean anchor: per-bit majority of the evictable tokens)
    std::vector<int64_t> ones(static_cast<size_t>(H), 0);
    const bool mean_anchor = std::any_of(p.anchors.begin(), p.anchors.end(), [](const Anchor& a) { return a.mean; });
    for (int64_t e = 0; e < m && mean_anchor; ++e)
        for (size_t w = 0; w < W; ++w)
            for (uint64_t x = sig(e)[w]; x; x &= x - 1) ++ones[w * 64 + static_cast<size_t>(__builtin_ctzll(x))];
    const size_t A = p.anchors.size();
    std::vector<Words> anchors;
    for (const Anchor& a : p.anchors) {
        if (a.mean) {
            std::vector<uint8_t> bits(static_cast<size_t>(H));
            for (int h = 0; h < H; ++h) bits[static_cast<size_t>(h)] = m > 0 && 2 * ones[static_cast<size_t>(h)] >= m;
            anchors.push_back(pack(bits));
        } else {
            if (static_cast<int>(a.bits.size()) != H)
                throw Error("method.anchors has " + std::to_string(a.bits.size()) + " bits: allowed one per query head (" +
                            std::to_string(H) + ")");
            anchors.push_back(pack(a.bits));
        }
    }
    std::vector<int64_t> dist(static_cast<size_t>(m) * A);
    for (int64_t e = 0; e < m; ++e)
        for (size_t a = 0; a < A; ++a) dist[static_cast<size_t>(e) * A + a] = hamming(sig(e), anchors[a].data(), W);

    // bucket order: by distance (tuple of distances, or nearest anchor then its distance), ties by
    // position. Distances are at most H, so the order is a counting sort on one small integer key
    // whenever the key range is small; a comparison sort otherwise (many heads and anchors).
    const int64_t* D = dist.data();
    const int64_t base = H + 1;
    std::vector<int64_t> key(static_cast<size_t>(m));
    int64_t key_range = 1;
    bool small = true;
    if (p.multi_nearest && A > 1) {
        key_range = static_cast<int64_t>(A) * base;
        for (int64_t e = 0; e < m; ++e) {
            size_t best = 0;
            for (size_t a = 1; a < A; ++a)
                if (D[e * A + a] < D[e * A + best]) best = a;
            key[static_cast<size_t>(e)] = static_cast<int64_t>(best) * base + D[e * A + best];
        }
    } else {
        for (size_t a = 0; a < A && small; ++a) small = (key_range *= base) <= (int64_t(1) << 20);
        if (small)
            for (int64_t e = 0; e < m; ++e) {
                int64_t k = 0;
                for (size_t a = 0; a < A; ++a) k = k * base + D[e * A + a];
                key[static_cast<size_t>(e)] = k;
            }
    }
    std::vector<int64_t> order(static_cast<size_t>(m));
    if (small && key_range <= 4 * m + 1024) {
        std::vector<int64_t> start(static_cast<size_t>(key_range) + 1, 0);
        for (int64_t k : key) ++start[static_cast<size_t>(k) + 1];
        for (int64_t k = 0; k < key_range; ++k) start[static_cast<size_t>(k) + 1] += start[static_cast<size_t>(k)];
        for (int64_t e = 0; e < m; ++e) order[static_cast<size_t>(start[static_cast<size_t>(key[static_cast<size_t>(e)])]++)] = e;
    } else {
        std::iota(order.begin(), order.end(), int64_t(0));
        if (small)
            std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return key[x] < key[y]; });
        else
            std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
                for (size_t a = 0; a < A; ++a)
                    if (D[x * A + a] != D[y * A + a]) return D[x * A + a] < D[y * A + a];
                return false;
            });
    }

    // one representative per bucket
    const int64_t buckets = std::min(reps, m);
    auto member = [&](int64_t i) { return evictable[static_cast<size_t>(order[static_cast<size_t>(i)])]; };
    for (int64_t j = 0; j < buckets; ++j) {
        const int64_t s = j * m / buckets, e = (j + 1) * m / buckets;
        int64_t best = s;
        if (!p.representative_first)
            for (int64_t i = s + 1; i < e; ++i)
                if (combined[static_cast<size_t>(member(i))] > combined[static_cast<size_t>(member(best))]) best = i;
        kept[static_cast<size_t>(member(best))] = 1;
    }
    std::vector<int64_t> keep;
    keep.reserve(static_cast<size_t>(budget));
    for (int64_t i = 0; i < n; ++i)
        if (kept[static_cast<size_t>(i)]) keep.push_back(i);
    return keep;
}

std::vector<int64_t> kvcrush_select_blocks(const float* scores, int H, int64_t n, int64_t block, int64_t budget,
                                           int64_t sinks, int64_t recent, int64_t reps, const KVCrushParams& p) {
    std::vector<int64_t> all(static_cast<size_t>(n));
    std::iota(all.begin(), all.end(), int64_t(0));
    if (budget >= n) return all;
    const int64_t reps_b = reps / block;
    const SpanPlan plan =
        plan_spans(scores, H, n, block, budget, sinks, recent, reps_b, "sink, recent and representative blocks");
    return plan.tokens(kvcrush_select(plan.scores.data(), H, plan.full, plan.budget, plan.sink, plan.recent, reps_b, p));
}

void KVCrushPolicy::after_attention(Sequence& seq, int layer, bool prefill, int64_t /*L*/) const {
    const int64_t budget = this->budget(layer);
    if (prefill) pool_prompt_scores(seq, layer);
    if (!budget || (!prefill && frozen)) return;
    if (!prefill && quant()) {  // whole flushed chunks; per layer, every head drops the same ones
        evict_quant_chunks(seq, layer, budget, sinks, recent, group_params.empty());
        return;
    }
    if (group_params.empty())
        select_layer(seq, layer, prefill, budget);
    else
        select_heads(seq, layer, prefill, budget);
}

namespace {

// One KV head's scores of its G query heads as [gi][token] over its live slots (the head keeps
// them as [slot][gi]), written at `out`.
void gather_group_scores(const HeadCache& hc, const std::vector<int64_t>& live, int G, float* out) {
    const int64_t n = static_cast<int64_t>(live.size());
    for (int gi = 0; gi < G; ++gi)
        for (int64_t i = 0; i < n; ++i)
            out[gi * n + i] = hc.scores[static_cast<size_t>(live[static_cast<size_t>(i)] * G + gi)];
}

}  // namespace

std::vector<int64_t> KVCrushPolicy::choose(const float* scores, int H, const std::vector<int64_t>& live,
                                           int64_t block, int64_t budget, const KVCrushParams& p) const {
    const int64_t n = static_cast<int64_t>(live.size());
    if (block_wise)  // whole blocks, indices of the live tokens (no holes: blocks are dropped whole)
        return kvcrush_select_blocks(scores, H, n, block, budget, sinks, recent, p.representatives, p);
    auto keep = kvcrush_select(scores, H, n, budget, sinks, recent, p.representatives, p);
    for (int64_t& k : keep) k = live[static_cast<size_t>(k)];  // slots
    return keep;
}

void KVCrushPolicy::keep_in(Sequence& seq, HeadCache& hc, const std::vector<int64_t>& keep, bool prefill) const {
    if (block_wise)
        keep_blocks(seq, hc, keep);
    else if (prefill)
        keep_slots(seq, hc, keep);
    else
        evict_slots(seq, hc, keep);
}

void KVCrushPolicy::select_heads(Sequence& seq, int layer, bool prefill, int64_t budget) const {
    const PoolConfig& cfg = seq.pool().config();
    const int G = cfg.group();
    for (int g = 0; g < cfg.kv_heads; ++g) {
        HeadCache& hc = seq.head(layer, g);
        if (hc.size() - hc.holes <= budget) continue;
        const std::vector<int64_t> live = live_slots(hc);
        std::vector<float> scores(static_cast<size_t>(G) * live.size());  // [group query head][token]
        gather_group_scores(hc, live, G, scores.data());
        keep_in(seq, hc, choose(scores.data(), G, live, cfg.block_size, budget, group_params[static_cast<size_t>(g)]),
                prefill);
    }
}

void KVCrushPolicy::select_layer(Sequence& seq, int layer, bool prefill, int64_t budget) const {
    const PoolConfig& cfg = seq.pool().config();
    const int G = cfg.group(), H = cfg.q_heads;
    const HeadCache& first = seq.head(layer, 0);
    const int64_t n = first.size() - first.holes;  // every KV head holds the same tokens (and holes)
    if (n <= budget) return;
    const std::vector<int64_t> live = live_slots(first);
    std::vector<float> scores(static_cast<size_t>(H) * n);  // [q head][token], q head = kv head * G + gi
    for (int g = 0; g < cfg.kv_heads; ++g) {
        const HeadCache& hc = seq.head(layer, g);
        if (hc.size() != first.size() || hc.holes != first.holes)
            throw Error("KVCrush: KV heads of layer " + std::to_string(layer) + " hold different tokens");
        gather_group_scores(hc, live, G, scores.data() + static_cast<size_t>(g) * G * n);
    }
    const std::vector<int64_t> keep = choose(scores.data(), H, live, cfg.block_size, budget, kv);
    for (int g = 0; g < cfg.kv_heads; ++g) keep_in(seq, seq.head(layer, g), keep, prefill);
}

KVCrushPolicy::KVCrushPolicy(Spec& spec, const ModelShape& shape, PolicyCommon common)
    : ImportancePolicy(spec, shape, std::move(common)) {
    kv.representatives = spec.integer("representatives", 0, int64_t(1) << 20);
    kv.signature_threshold = spec.choice("signature", {"topk", "threshold"}) == "threshold";
    kv.multi_nearest = spec.choice("multi_anchor", {"tuple", "nearest"}) == "nearest";
    kv.representative_first = spec.choice("representative", {"max_score", "first"}) == "first";
    for (const auto& a : spec.words("anchors")) {
        Anchor anchor;
        if (a == "mean") {
            anchor.mean = true;
        } else {
            if (static_cast<int>(a.size()) != shape.q_heads || a.find_first_not_of("01") != std::string::npos)
                throw Error(Spec::invalid("anchors", a, "mean or a string of " + std::to_string(shape.q_heads) +
                                                            " bits (one per query head)"));
            for (char c : a) anchor.bits.push_back(c == '1');
        }
        kv.anchors.push_back(anchor);
    }
    if (kv.anchors.empty()) throw Error(Spec::invalid("anchors", "(none)", "one or more anchors"));
    if (spec.choice("scope", {"layer", "head"}) == "head") {
        const int G = shape.q_heads / shape.kv_heads;
        for (int g = 0; g < shape.kv_heads; ++g) {
            KVCrushParams p = kv;
            for (Anchor& a : p.anchors)
                if (!a.mean) a.bits = std::vector<uint8_t>(a.bits.begin() + g * G, a.bits.begin() + (g + 1) * G);
            group_params.push_back(std::move(p));
        }
    }
}

namespace {
std::unique_ptr<Policy> make_kvcrush(Spec& spec, const ModelShape& shape, PolicyCommon common) {
    return std::make_unique<KVCrushPolicy>(spec, shape, std::move(common));
}
}  // namespace

OVKC_REGISTER_POLICY("kvcrush", make_kvcrush);

}  // namespace ovkc
