// What the op does around attention for the pool's method, and the cache edits methods share.
//
// The op calls before_attention() once the step's tokens are appended (Chelsea merges here when
// a decode step brings the layer to budget + g, as the reference does before attending) and
// after_attention() once the attention and the per-head scores are done (eviction: prefill
// selection and decode-time budget enforcement; the 2-bit store's flush). Each method lives in
// its own file named like its reference module in ov_kvcrush/methods/.
#pragma once

#include <cstdint>
#include <vector>

#include "paged_cache.hpp"

namespace ovkc {

// Keep the slots `keep` (ascending) of a head, in that order: tokens move down, their position,
// scores and degree with them; blocks past the new end go back to the pool.
void keep_slots(Sequence& seq, HeadCache& hc, const std::vector<int64_t>& keep);

// Drop the slots of a head not in `keep` (ascending), after a decode step's eviction: they become
// holes (masked in the attention, not counted as held) and the head is compacted with keep_slots
// only once a block's worth of holes has gathered. One eviction per step would otherwise shift
// every later slot of the head, step after step: a copy of about half the head per step.
void evict_slots(Sequence& seq, HeadCache& hc, const std::vector<int64_t>& keep);
// Turn `count` live slots of a head into holes (then compact if a block's worth has gathered).
void make_holes(Sequence& seq, HeadCache& hc, const int64_t* slots, int64_t count);
// Compact the holes away (before a multi-token step, a flush or a merge); no-op without holes.
void compact(Sequence& seq, HeadCache& hc);
// The slots of a head that are not holes, ascending.
std::vector<int64_t> live_slots(const HeadCache& hc);

// Keep whole blocks: `keep` lists token slots made of complete blocks (ascending) plus, possibly,
// the trailing partial block. The block table is rewritten, no key/value is copied.
void keep_blocks(Sequence& seq, HeadCache& hc, const std::vector<int64_t>& keep);

// Rows of the step whose probabilities feed the scores (SnapKV's prefill: the last window).
int64_t score_rows_from(const PoolConfig& cfg, bool prefill, int64_t L);
// Whether this step accumulates scores at all.
bool step_scores(const PoolConfig& cfg, bool prefill);

void before_attention(Sequence& seq, int layer, bool prefill, int64_t L);
void after_attention(Sequence& seq, int layer, bool prefill);

// importance.cpp
// The `count` (<= kFewDrops) lowest-ranked tokens, worst first, in the reference's order (the
// lowest score, the latest token on ties): what a decode step drops from a full head.
constexpr int64_t kFewDrops = 8;
void worst_tokens(const float* scores, int64_t n, int64_t count, int64_t* out);
// mask[i] = 1 for the k highest scores (ties to the lower index), the reference's top-k; O(n)
void topk_mask(const float* scores, int64_t n, int64_t k, uint8_t* mask);
// the same tokens as ascending indices
std::vector<int64_t> topk_indices(const float* scores, int64_t n, int64_t k);
std::vector<int64_t> keep_indices(const float* scores, int64_t n, int64_t budget, int64_t sinks, int64_t recent);
void pool_scores(float* scores, int64_t n, int64_t stride, int64_t kernel, bool avg);
// SnapKV: pool the prompt's window scores of every query head of the layer (no-op for other scorings)
void pool_prompt_scores(Sequence& seq, int layer);
void importance_step(Sequence& seq, int layer, bool prefill);

// kvcrush.cpp
std::vector<int64_t> kvcrush_select(const float* scores, int H, int64_t n, int64_t budget, int64_t sinks,
                                    int64_t recent, int64_t reps, const MethodParams& p);
std::vector<int64_t> kvcrush_select_blocks(const float* scores, int H, int64_t n, int64_t block, int64_t budget,
                                           int64_t sinks, int64_t recent, int64_t reps, const MethodParams& p);
void kvcrush_step(Sequence& seq, int layer, bool prefill);

// chelsea.cpp: merge a head down to `target` tokens (returns the matching passes); the layer's step
int64_t chelsea_compress(Sequence& seq, HeadCache& hc, int64_t target);
void chelsea_step(Sequence& seq, int layer, bool prefill);

// minikv.cpp: move every whole `residual` chunk of full-precision tokens into 2-bit blocks
void quant_flush(Sequence& seq, int layer);

}  // namespace ovkc
