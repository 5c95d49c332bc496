// One sequence's step on one layer of the PagedAttention op, in the stages it runs:
//
//   decide_step ─ what the step is (a prompt, a chunk of one, a decode token, a scoring-pass
//                 step, a sliding-window layer's), decided once into a StepMode
//   append_step ─ the step's keys and values (and zeroed score slots) go into every head
//   the method's hooks before attention (selection a recall method prepares, ...)
//   sparse_prefill_mask ─ a prompt step's key blocks per query block, when the pool's sparse
//                 prefill is on (XAttention's estimate; sparse_prefill.cpp)
//   attend      ─ attend_recalled (a recall method's working set), attend_decode (a token over
//                 chunks of blocks, partial softmaxes merged), or attend_prompt (tiles of
//                 queries: bf16 staging, AMX tiles, f32 rows; a scoring step's ranges)
//   accumulate_step_scores ─ the per-head scores the method ranks by (when attention did not
//                 add them itself)
//   drop_scoring_step / keep_window_ring ─ a scoring step's tokens go again; a local layer
//                 keeps a ring of its window
//   the method's hooks after attention (eviction, the 2-bit store's flush)
//
// PagedAttention::attend_sequence is the driver over these; each stage is one function here.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels.hpp"
#include "paged_cache.hpp"
#include "sparse_prefill.hpp"

namespace ovkc {

// What a step is, decided once from the sequence's state before the step.
struct StepMode {
    int layer = 0;
    int64_t past = 0;        // tokens the layer had seen before the step
    int64_t L = 0;           // the step's tokens
    int64_t prompt_end = 0;  // a prompt prefilled in chunks ends here (0: prompts come whole)
    bool chunk = false;      // a chunk of such a prompt
    bool scoring = false;    // a step of the method's scoring pass (KVzip): attended, scored, dropped
    int64_t window = 0;      // a sliding-window layer's span (0: a global layer, the method's)
    bool hooks = false;      // the method's hooks run (a whole prompt, its last chunk, a decode step)
    int64_t hook_tokens = 0;  // the tokens the hooks see as the step's (a chunked prompt: all of it)
    bool prefill = false;    // a prompt or a chunk of one
    bool scores = false;     // the step computes per-head scores
    bool ranged = false;     // a scoring step on a global layer: attends sinks, its chunk and itself
    bool prompt_attention = false;  // attended as a prompt (its own tokens exact), not as a decode token
    int phase = 0;           // 0: prompt (or scoring) time, 1: decode time
};

// What every stage of a step reads and writes: the sequence, its layer, the step's tensors.
struct StepContext {
    StepContext(Sequence& s, const PoolConfig& c, const StepMode& m, const float* query, float* output, int64_t hq,
                int64_t hkv, int64_t d, LogitMap lg)
        : seq(s), cfg(c), mode(m), q(query), out(output), Hq(hq), Hkv(hkv), D(d), G(c.group()), logit(lg) {}

    Sequence& seq;
    const PoolConfig& cfg;
    StepMode mode;
    const float* q;  // [Hq, L, D]
    float* out;      // [Hq, L, D]
    int64_t Hq = 0, Hkv = 0, D = 0;
    int G = 1;  // query heads per KV head
    LogitMap logit;  // the op's scale and soft-capping
    std::vector<int64_t> held_before;  // per KV head, slots held before the step
    std::vector<float> lse;            // per (query head, row): log-sum-exp, for the score pass
    // a scoring step attends (and scores) its chunk's slots [slot_lo, slot_hi), the sinks
    // [0, slot_sinks) and itself
    std::vector<int64_t> slot_lo, slot_hi, slot_sinks;
    // per KV head, its blocks as f32 for the step (attend_prompt's f32 staging; HeadCache::step.staged)
    std::vector<std::vector<float>> f32_heads;

    HeadCache& head(int64_t g) const { return seq.head(mode.layer, static_cast<int>(g)); }
};

// Clears the heads' step tokens (HeadCache::step) when the step ends, however it ends: they
// point into the step's inputs.
struct StepTokensCleared {
    explicit StepTokensCleared(const StepContext& c) : ctx(c) {}
    ~StepTokensCleared() {
        for (int64_t g = 0; g < ctx.Hkv; ++g) ctx.head(g).step = StepTokens{};
    }
    StepTokensCleared(const StepTokensCleared&) = delete;
    StepTokensCleared& operator=(const StepTokensCleared&) = delete;
    const StepContext& ctx;
};

StepMode decide_step(Sequence& seq, const PoolConfig& cfg, int layer, int64_t L);
void append_step(StepContext& ctx, const float* kd, const float* vd);
void score_slot_ranges(StepContext& ctx);
// returns whether the attention added the step's probabilities to the scores itself
bool attend_decode(StepContext& ctx);
// The pool's sparse prefill mask for a prompt step (empty: dense), rows from `scored_from` on
// dense, estimated in bf16 on the bf16 path (sparse_prefill.cpp); attend_prompt attends by it.
BlockMask sparse_prefill_mask(StepContext& ctx, int64_t scored_from, bool bf16);
bool attend_prompt(StepContext& ctx, bool bf16);
void accumulate_step_scores(StepContext& ctx);
void drop_scoring_step(StepContext& ctx);
void keep_window_ring(StepContext& ctx);

using StepClock = std::chrono::steady_clock;
inline int64_t ns_since(StepClock::time_point t0) {
    return static_cast<int64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(StepClock::now() - t0).count());
}

}  // namespace ovkc
