// ClusterKV's per-head state in the op (ov_kvcrush/methods/clusterkv.py is the reference).
#pragma once

#include <cstdint>
#include <deque>
#include <vector>

#include "kernels.hpp"
#include "paged_cache.hpp"

namespace ovkc {

// Spherical k-means of n vectors x [n][D] into min(k, n) clusters (kmeans_cosine in the reference).
struct KMeans {
    int64_t k = 0;
    std::vector<int32_t> labels;   // [n]
    std::vector<float> centroids;  // [k][D]: plain mean of each cluster's vectors (zeros if empty)
    std::vector<int64_t> sizes;    // [k]
    int64_t iterations = 0;
    int64_t rows_assigned = 0;  // rows whose similarities were computed, over all iterations
};
// bounded=false recomputes every similarity at every iteration (the tests' oracle for the bounds).
KMeans kmeans_cosine(const float* x, int64_t n, int D, int64_t k, int64_t max_iters, int64_t seed, int64_t row,
                     bool bounded = true);
// The first k entries of the reference's init_order(seed)[row] (a seeded permutation of range(n)).
std::vector<int64_t> init_order(int64_t seed, int64_t row, int64_t n, int64_t k);

// One (layer, KV head): the cluster index over the clustered tokens [sinks, pending_from) (token
// index == position: ClusterKV never evicts), where each cluster sits (a slot range of the
// full-precision store, or a slab dequantized from the 2-bit store) and the recall counters.
struct ClusterHead {
    int64_t sinks = 0;
    int64_t pending_from = 0;  // tokens >= this are not clustered yet
    int64_t C = 0;
    std::vector<float> centroids;  // [C][D]
    std::vector<int64_t> sizes;    // [C]
    std::vector<int64_t> offsets;  // [C + 1]
    std::vector<int64_t> sorted;   // clustered tokens sorted by label, ties by token
    std::vector<int32_t> labels;   // label of token sinks + i
    std::vector<int64_t> slot_begin;  // [C] full-precision store: first slot of each cluster's tokens
    std::vector<Slab> slabs;       // [C] 2-bit store: recalled clusters kept for recall_cache_steps steps
    Slab sink_slab, pending_slab;
    std::deque<std::vector<int32_t>> recent;  // cluster ids recalled at the last cache_steps steps
    // the last decode step's recall: clusters, tokens taken of each, tokens held (-1: none yet)
    std::vector<int32_t> last_chosen;
    std::vector<int64_t> last_take;
    int64_t last_n = -1;
    int64_t steps = 0, clusterings = 0, iterations = 0, lookups = 0, hits = 0, tokens_loaded = 0;
    int64_t ws_loads = 0;  // tokens physically gathered into slabs (misses, stale slabs, sinks, pending)
};

// Whether this layer's decode steps go through ClusterKV's working set.
bool clusterkv_recalls(Sequence& seq, int layer, bool prefill);
// Prefill: cluster the prompt's keys of every head (before the 2-bit flush reads them away).
void clusterkv_after_prefill(Sequence& seq, int layer);
// Decode: cluster the pending tokens once cluster_every have gathered (before this step's flush).
void clusterkv_before_decode(Sequence& seq, int layer, int64_t L);
// Decode: rank the clusters with the step's queries q [Hq][L][D], recall whole clusters up to the
// budget, load the misses into slabs and attend sinks + recalled + pending into out [Hq][L][D].
// The selection/loading time is added to seq.policy_ns[1].
void clusterkv_attend(Sequence& seq, int layer, const float* q, int64_t L, int64_t past, float scale, float* out);

// Tokens the last decode step attended (ascending): sinks, recalled, pending.
std::vector<int64_t> recalled_tokens(const ClusterHead& ch);

}  // namespace ovkc
