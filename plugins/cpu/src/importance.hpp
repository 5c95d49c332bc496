// Importance eviction (ov_kvcrush/methods/importance.py): StreamingLLM, H2O, SnapKV, PyramidKV;
// MiniKV (minikv.cpp) and KVCrush (kvcrush.cpp) build on it.
#pragma once

#include <cstdint>

#include "policy.hpp"

namespace ovkc {

enum class Scoring : int { none, h2o, snapkv };

class ImportancePolicy : public Policy {
public:
    // Reads sinks, recent, scoring, frozen, and with SnapKV scoring window, pool_kernel, pool.
    ImportancePolicy(Spec& spec, const ModelShape& shape, PolicyCommon common);

    bool keeps_slot_scores() const override;
    bool scores_step(bool prefill) const override;
    int64_t score_rows_from(bool prefill, int64_t L) const override;
    void after_attention(Sequence& seq, int layer, bool prefill, int64_t L) const override;

    // SnapKV: pool the prompt's window scores of every query head of the layer (no-op otherwise)
    void pool_prompt_scores(Sequence& seq, int layer) const;

    int64_t sinks = 0;
    int64_t recent = 0;
    Scoring scoring = Scoring::none;
    bool frozen = false;  // selection made once at prefill (MiniKV, or any method over the 2-bit store)
    bool block_wise = false;  // keep whole blocks of the pool (spans of block_size tokens)
    int64_t window = 0;   // SnapKV observation window (last prompt queries)
    int64_t pool_kernel = 1;
    bool pool_avg = false;
};

// Pool the slot scores of every query head of the layer's KV heads along their tokens (SnapKV's
// pooling of the prompt's window scores; selection.py: pool_scores).
void pool_layer_scores(Sequence& seq, int layer, int64_t kernel, bool avg);

// Keep each KV head of the layer within `budget` (0: unbounded): the sinks, the recent window and
// the highest group-summed slot scores between (by_scores false: no scores, i.e. the oldest go).
// A prompt's selection is compacted in place; a decode step's drops become holes. `block_wise`:
// whole blocks of the pool are kept (selection.hpp: keep_block_indices), no holes.
void evict_by_slot_scores(Sequence& seq, int layer, bool prefill, int64_t budget, int64_t sinks, int64_t recent,
                          bool by_scores, bool block_wise = false);

// Over the 2-bit store, a decode step's budget: while every KV head of the layer holds at least
// one flushed chunk (`residual` tokens) more than `budget`, each drops its lowest-scoring chunks
// (their tokens' group-summed scores; ties to the older), never one that holds a sink or one of
// the `recent` newest positions. Their 2-bit blocks go back to the pool. `shared`: one ranking
// for the layer (the heads' chunk scores summed; they hold the same tokens: KVCrush per layer).
void evict_quant_chunks(Sequence& seq, int layer, int64_t budget, int64_t sinks, int64_t recent,
                        bool shared = false);

}  // namespace ovkc
