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

int64_t hamming(const uint64_t* a, const uint64_t* b, size_t words) {
    int64_t d = 0;
    for (size_t i = 0; i < words; ++i) d += __builtin_popcountll(a[i] ^ b[i]);
    return d;
}

}  // namespace

// The steps below are the reference's, one for one (methods/kvcrush.py: head_decisions,
// pack_signatures, make_anchors, hamming, bucket_order, bucket_bounds, _representatives). They
// run at every decode step of a full head (n = budget + 1), so each is linear in n but the
// ordering of the evictable tokens (about `reps` of them): no sort of the whole head.

std::vector<uint8_t> head_decisions(const float* scores, int H, int64_t n, int64_t lo, int64_t mid, int64_t keep,
                                    bool threshold) {
    const int64_t few = mid - std::min(std::max<int64_t>(keep, 0), mid);
    const bool all_but_few = !threshold && few <= kFewDrops;  // a decode step: each head drops one or a few
    std::vector<uint8_t> decision(static_cast<size_t>(H) * static_cast<size_t>(mid), uint8_t(all_but_few));
    for (int h = 0; h < H; ++h) {
        const float* s = scores + h * n + lo;
        uint8_t* d = decision.data() + static_cast<size_t>(h) * static_cast<size_t>(mid);
        if (threshold) {
            float mean = 0.0f;
            for (int64_t i = 0; i < mid; ++i) mean += s[i];
            mean /= static_cast<float>(mid);
            for (int64_t i = 0; i < mid; ++i) d[i] = s[i] >= mean;
        } else if (all_but_few) {  // keeps all (set above) but its few lowest: clear those
            int64_t worst[kFewDrops];
            worst_tokens(s, mid, few, worst);
            for (int64_t r = 0; r < few; ++r) d[worst[r]] = 0;
        } else {
            topk_mask(s, mid, keep, d);
        }
    }
    return decision;
}

Signatures pack_signatures(const std::vector<uint8_t>& decision, int H, int64_t n, int64_t lo, int64_t mid) {
    Signatures sig{(static_cast<size_t>(H) + 63) / 64, {}};
    sig.words.assign(static_cast<size_t>(n) * sig.W, 0);
    for (int h = 0; h < H; ++h) {
        const uint8_t* d = decision.data() + static_cast<size_t>(h) * static_cast<size_t>(mid);
        uint64_t* w = sig.words.data() + static_cast<size_t>(lo) * sig.W + static_cast<size_t>(h / 64);
        const int shift = h % 64;
        if (sig.W == 1)  // up to 64 heads: one word per token, a loop the compiler vectorises
            for (int64_t i = 0; i < mid; ++i) w[i] |= uint64_t(d[i]) << shift;
        else
            for (int64_t i = 0; i < mid; ++i) w[static_cast<size_t>(i) * sig.W] |= uint64_t(d[i]) << shift;
    }
    return sig;
}

std::vector<Words> make_anchors(const Signatures& sig, const std::vector<int64_t>& evictable, int H,
                                const std::vector<Anchor>& modes) {
    const int64_t m = static_cast<int64_t>(evictable.size());
    std::vector<int64_t> ones(static_cast<size_t>(H), 0);  // the mean anchor: per-bit majority of the evictable
    if (std::any_of(modes.begin(), modes.end(), [](const Anchor& a) { return a.mean; }))
        for (int64_t t : evictable)
            for (size_t w = 0; w < sig.W; ++w)
                for (uint64_t x = sig.of(t)[w]; x; x &= x - 1) ++ones[w * 64 + static_cast<size_t>(__builtin_ctzll(x))];
    std::vector<Words> anchors;
    for (const Anchor& a : modes) {
        std::vector<uint8_t> bits = a.bits;
        if (a.mean) {
            bits.assign(static_cast<size_t>(H), 0);
            for (int h = 0; h < H; ++h) bits[static_cast<size_t>(h)] = m > 0 && 2 * ones[static_cast<size_t>(h)] >= m;
        } else if (static_cast<int>(bits.size()) != H) {
            throw Error("method.anchors has " + std::to_string(bits.size()) + " bits: allowed one per query head (" +
                        std::to_string(H) + ")");
        }
        Words packed(sig.W, 0);
        for (size_t h = 0; h < bits.size(); ++h)
            if (bits[h]) packed[h / 64] |= uint64_t(1) << (h % 64);
        anchors.push_back(std::move(packed));
    }
    return anchors;
}

std::vector<int64_t> anchor_distances(const Signatures& sig, const std::vector<int64_t>& evictable,
                                      const std::vector<Words>& anchors) {
    const size_t A = anchors.size();
    std::vector<int64_t> dist(evictable.size() * A);
    for (size_t e = 0; e < evictable.size(); ++e)
        for (size_t a = 0; a < A; ++a) dist[e * A + a] = hamming(sig.of(evictable[e]), anchors[a].data(), sig.W);
    return dist;
}

std::vector<int64_t> bucket_order(const std::vector<int64_t>& dist, int64_t m, size_t A, int H, bool nearest) {
    // By distance (the tuple of distances, or the nearest anchor then its distance), ties by
    // position. Distances are at most H, so the order is a counting sort on one small integer key
    // whenever the key range is small; a comparison sort otherwise (many heads and anchors).
    const int64_t* D = dist.data();
    const int64_t base = H + 1;
    std::vector<int64_t> key(static_cast<size_t>(m));
    int64_t key_range = 1;
    bool small = true;
    if (nearest && A > 1) {
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
        return order;
    }
    std::iota(order.begin(), order.end(), int64_t(0));
    if (small)
        std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return key[x] < key[y]; });
    else
        std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
            for (size_t a = 0; a < A; ++a)
                if (D[x * A + a] != D[y * A + a]) return D[x * A + a] < D[y * A + a];
            return false;
        });
    return order;
}

std::vector<std::pair<int64_t, int64_t>> bucket_bounds(int64_t m, int64_t buckets) {
    buckets = std::min(buckets, m);
    std::vector<std::pair<int64_t, int64_t>> bounds;
    for (int64_t j = 0; j < buckets; ++j) bounds.emplace_back(j * m / buckets, (j + 1) * m / buckets);
    return bounds;
}

std::vector<int64_t> representatives(const std::vector<int64_t>& members, const float* score,
                                     const std::vector<std::pair<int64_t, int64_t>>& bounds, bool first) {
    std::vector<int64_t> reps;
    for (const auto& [s, e] : bounds) {
        int64_t best = s;  // the bucket's first token, or its highest-scoring (the first on ties)
        if (!first)
            for (int64_t i = s + 1; i < e; ++i)
                if (score[members[static_cast<size_t>(i)]] > score[members[static_cast<size_t>(best)]]) best = i;
        reps.push_back(members[static_cast<size_t>(best)]);
    }
    return reps;
}

std::vector<int64_t> kvcrush_select(const float* scores, int H, int64_t n, int64_t budget, int64_t sinks,
                                    int64_t recent, int64_t reps, const KVCrushParams& p, KVCrushTrace* trace) {
    std::vector<int64_t> all(static_cast<size_t>(n));
    std::iota(all.begin(), all.end(), int64_t(0));
    if (budget >= n) return all;
    if (reps > budget - sinks - recent)
        throw Error("method.representatives=" + std::to_string(reps) +
                    " is invalid: allowed at most budget - sinks - recent = " + std::to_string(budget - sinks - recent));
    // the important tokens: sinks, recent and the top scores summed over the heads
    std::vector<float> combined(scores, scores + n);
    for (int h = 1; h < H; ++h)
        for (int64_t i = 0; i < n; ++i) combined[static_cast<size_t>(i)] += scores[h * n + i];
    std::vector<uint8_t> kept(static_cast<size_t>(n), 0);
    for (int64_t i : keep_indices(combined.data(), n, budget - reps, sinks, recent)) kept[static_cast<size_t>(i)] = 1;
    // the signatures of the middle tokens (sinks and recent stay 0)
    const int64_t mid = n - recent - sinks;
    const auto decision =
        head_decisions(scores, H, n, sinks, mid, std::max<int64_t>(budget - sinks - recent, 0), p.signature_threshold);
    const Signatures sig = pack_signatures(decision, H, n, sinks, mid);
    std::vector<int64_t> evictable;
    evictable.reserve(static_cast<size_t>(n - budget + reps));
    for (int64_t i = 0; i < n; ++i)
        if (!kept[static_cast<size_t>(i)]) evictable.push_back(i);
    const int64_t m = static_cast<int64_t>(evictable.size());
    // the buckets: the evictable tokens by their distance to the anchors, cut into `reps` ranges
    const std::vector<Words> anchors = make_anchors(sig, evictable, H, p.anchors);
    const std::vector<int64_t> dist = anchor_distances(sig, evictable, anchors);
    const std::vector<int64_t> order = bucket_order(dist, m, anchors.size(), H, p.multi_nearest);
    std::vector<int64_t> members(static_cast<size_t>(m));
    for (int64_t i = 0; i < m; ++i) members[static_cast<size_t>(i)] = evictable[static_cast<size_t>(order[static_cast<size_t>(i)])];
    const auto reps_kept = representatives(members, combined.data(), bucket_bounds(m, reps), p.representative_first);
    for (int64_t t : reps_kept) kept[static_cast<size_t>(t)] = 1;
    std::vector<int64_t> keep;
    keep.reserve(static_cast<size_t>(budget));
    for (int64_t i = 0; i < n; ++i)
        if (kept[static_cast<size_t>(i)]) keep.push_back(i);
    if (trace) *trace = KVCrushTrace{sig, anchors, evictable, dist, order, reps_kept};
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
        evict_quant_chunks(seq, layer, budget, sinks, recent, !head_scope);
        return;
    }
    if (head_scope)
        select_heads(seq, layer, prefill, budget);
    else
        select_layer(seq, layer, prefill, budget);
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
    head_scope = spec.choice("scope", {"layer", "head"}) == "head";
    if (head_scope) {
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
