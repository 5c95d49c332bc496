// Selection helpers shared by the methods that keep tokens by score (importance.cpp, kvcrush.cpp,
// chelsea.cpp, knorm.cpp): the reference's top-k (ov_kvcrush/methods/base.py: topk_indices,
// importance.py: keep_indices, pool_scores), in linear time.
#pragma once

#include <cstdint>
#include <vector>

namespace ovkc {

// The `count` (<= kFewDrops) lowest-ranked tokens, worst first, in the reference's order (the
// lowest score, the latest token on ties): what a decode step drops from a full head.
constexpr int64_t kFewDrops = 8;
void worst_tokens(const float* scores, int64_t n, int64_t count, int64_t* out);
// mask[i] = 1 for the k highest scores (ties to the lower index), the reference's top-k; O(n)
void topk_mask(const float* scores, int64_t n, int64_t k, uint8_t* mask);
// the same tokens as ascending indices
std::vector<int64_t> topk_indices(const float* scores, int64_t n, int64_t k);
// sinks, the top scores between, the recent window: min(budget, n) ascending indices
std::vector<int64_t> keep_indices(const float* scores, int64_t n, int64_t budget, int64_t sinks, int64_t recent);
// A selection over spans of `block` tokens (selection.py: plan_spans), shared by every
// span-granular method: each row's full spans summed ([rows][full]), the trailing partial span
// always kept, sinks and the recent window rounded up to whole spans, and the spans the token
// budget leaves beside the partial tail.
struct SpanPlan {
    int64_t block = 0, n = 0, full = 0, partial = 0, sink = 0, recent = 0, budget = 0;
    std::vector<float> scores;
    // the token indices of kept spans (ascending), then the partial tail
    std::vector<int64_t> tokens(const std::vector<int64_t>& spans) const;
};
// The plan of `rows` score rows of n tokens (budget < n). `reserved` spans must fit beside the sink
// and recent ones (KVCrush's representatives); `what` names them all in the error (naming the
// budget) thrown when they do not.
SpanPlan plan_spans(const float* scores, int rows, int64_t n, int64_t block, int64_t budget, int64_t sinks,
                    int64_t recent, int64_t reserved, const char* what);
// keep_indices over spans of `block` tokens (selection.py: keep_block_indices); ascending token indices.
std::vector<int64_t> keep_block_indices(const float* scores, int64_t n, int64_t budget, int64_t sinks, int64_t recent,
                                        int64_t block);
// SnapKV's 1-D pooling of scores[i * stride] along tokens (odd kernel; max or average)
void pool_scores(float* scores, int64_t n, int64_t stride, int64_t kernel, bool avg);
// out[i] = s[i][0] + ... + s[i][G-1] (the reference's order of a group's query heads)
void group_sums(const float* s, int64_t n, int G, float* out);
// a thread-local scratch vector (the decode step's few-drops path allocates nothing)
std::vector<float>& tls_combined();

}  // namespace ovkc
