// KVCrush (ov_kvcrush/methods/kvcrush.py): its settings, its selection functions (the C API
// exposes them alone, for the shared test vectors) and its policy over importance scores.
#pragma once

#include <cstdint>
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

// The kept token indices (ascending) for per-query-head scores [H][n].
std::vector<int64_t> kvcrush_select(const float* scores, int H, int64_t n, int64_t budget, int64_t sinks,
                                    int64_t recent, int64_t reps, const KVCrushParams& p);
std::vector<int64_t> kvcrush_select_blocks(const float* scores, int H, int64_t n, int64_t block, int64_t budget,
                                           int64_t sinks, int64_t recent, int64_t reps, const KVCrushParams& p);

class KVCrushPolicy : public ImportancePolicy {
public:
    // Reads the importance fields and representatives, signature, multi_anchor, representative,
    // anchors (block_wise is ImportancePolicy's).
    KVCrushPolicy(Spec& spec, const ModelShape& shape, PolicyCommon common);
    void after_attention(Sequence& seq, int layer, bool prefill, int64_t L) const override;
    KVCrushParams kv;
    // scope=head: each KV head selects for itself from its query group's scores, its anchors the
    // group's bits of the layer's (one entry per KV head); empty with scope=layer
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
