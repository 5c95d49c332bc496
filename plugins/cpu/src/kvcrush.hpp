// KVCrush (ov_kvcrush/methods/kvcrush.py): its settings, its selection functions (the C API
// exposes them alone, for the shared test vectors) and its policy over importance scores.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "importance.hpp"

namespace ovkc {

struct Anchor {
    bool mean = false;          // per-bit majority of the evictable tokens' signatures
    std::vector<uint8_t> bits;  // otherwise a fixed pattern, one entry per query head
};

struct KVCrushParams {
    int64_t representatives = 0;
    bool signature_threshold = false;  // a head's bit: score >= its mean (else: its own top-k)
    bool multi_nearest = false;        // several anchors: order by the nearest (else: the tuple)
    bool representative_first = false; // a bucket's first token (else: its highest-scoring)
    std::vector<Anchor> anchors;
};

using Words = std::vector<uint64_t>;

// Packed signatures [token][W words]: bit h of a token's signature is head h's decision.
struct Signatures {
    size_t W = 0;
    std::vector<uint64_t> words;
    const uint64_t* of(int64_t token) const { return words.data() + static_cast<size_t>(token) * W; }
};

// What kvcrush_select decided on the way (tests compare each with the reference's step).
struct KVCrushTrace {
    Signatures signatures;              // of all n tokens (sinks and recent are 0)
    std::vector<Words> anchors;         // packed like the signatures
    std::vector<int64_t> evictable;     // the tokens that are not important, ascending
    std::vector<int64_t> distances;     // [evictable][anchor]
    std::vector<int64_t> order;         // positions into `evictable`, bucketing order
    std::vector<int64_t> representatives;  // one token per bucket, in bucket order
};

// The reference's steps (methods/kvcrush.py), one for one. Scores are [H][n]; the middle tokens
// are [lo, lo + mid).
// Would head h keep middle token i on its own: [H][mid] (its top `keep`, or score >= its mean).
std::vector<uint8_t> head_decisions(const float* scores, int H, int64_t n, int64_t lo, int64_t mid, int64_t keep,
                                    bool threshold);
Signatures pack_signatures(const std::vector<uint8_t>& decision, int H, int64_t n, int64_t lo, int64_t mid);
// The anchors' signatures (a mean anchor: the per-bit majority of the evictable tokens').
std::vector<Words> make_anchors(const Signatures& sig, const std::vector<int64_t>& evictable, int H,
                                const std::vector<Anchor>& modes);
// Hamming distance of each evictable token to each anchor: [evictable][anchor].
std::vector<int64_t> anchor_distances(const Signatures& sig, const std::vector<int64_t>& evictable,
                                      const std::vector<Words>& anchors);
std::vector<int64_t> bucket_order(const std::vector<int64_t>& dist, int64_t m, size_t A, int H, bool nearest);
// `m` ordered items cut into min(buckets, m) contiguous near-equal ranges [start, end).
std::vector<std::pair<int64_t, int64_t>> bucket_bounds(int64_t m, int64_t buckets);
// One token of `members` (the bucketing order) per bucket: its first, or its highest `score`.
std::vector<int64_t> representatives(const std::vector<int64_t>& members, const float* score,
                                     const std::vector<std::pair<int64_t, int64_t>>& bounds, bool first);

// The kept token indices (ascending) for per-query-head scores [H][n]; `trace`, when given,
// receives the steps' results.
std::vector<int64_t> kvcrush_select(const float* scores, int H, int64_t n, int64_t budget, int64_t sinks,
                                    int64_t recent, int64_t reps, const KVCrushParams& p,
                                    KVCrushTrace* trace = nullptr);
std::vector<int64_t> kvcrush_select_blocks(const float* scores, int H, int64_t n, int64_t block, int64_t budget,
                                           int64_t sinks, int64_t recent, int64_t reps, const KVCrushParams& p);

class KVCrushPolicy : public ImportancePolicy {
public:
    // Reads the importance fields and representatives, signature, multi_anchor, representative,
    // anchors (block_wise is ImportancePolicy's).
    KVCrushPolicy(Spec& spec, const ModelShape& shape, PolicyCommon common);
    void after_attention(Sequence& seq, int layer, bool prefill, int64_t L) const override;
    KVCrushParams kv;
    // scope=head: each KV head selects for itself from its query group's scores, with its
    // group's bits of the layer's anchors (group_params, one entry per KV head); scope=layer:
    // one choice from all the layer's query heads, kept by every KV head
    bool head_scope = false;
    std::vector<KVCrushParams> group_params;

private:
    void select_layer(Sequence& seq, int layer, bool prefill, int64_t budget) const;
    void select_heads(Sequence& seq, int layer, bool prefill, int64_t budget) const;
    // KVCrush's choice over scores [H][live tokens]: block-wise, token indices into `live`;
    // token-wise, the slots kept
    std::vector<int64_t> choose(const float* scores, int H, const std::vector<int64_t>& live, int64_t block,
                                int64_t budget, const KVCrushParams& p) const;
    // what `choose` returned, applied to one head (blocks rewritten, or slots kept / evicted)
    void keep_in(Sequence& seq, HeadCache& hc, const std::vector<int64_t>& keep, bool prefill) const;
};

}  // namespace ovkc
