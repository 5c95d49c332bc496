// ClusterKV's per-head state in the op (ov_kvcrush/methods/clusterkv.py is the reference).
#pragma once

#include <cstdint>
#include <deque>
#include <vector>

#include "kernels.hpp"
#include "kmeans.hpp"
#include "paged_cache.hpp"

namespace ovkc {

// One (layer, KV head): the cluster index over the clustered tokens [sinks, pending_from) (token
// index == position: ClusterKV never evicts), where each cluster sits (a slot range of the
// full-precision store, or a slab dequantized from the 2-bit store) and the recall counters.
struct ClusterHead : HeadState {
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

    size_t working_set_bytes() const;
    void check_truncate(int64_t tokens) const override;
    void truncated() override { pending_slab.clear(); }
};

// The head's ClusterKV state (null for other methods, dense layers and before the prompt).
inline ClusterHead* cluster_of(HeadCache& hc) { return dynamic_cast<ClusterHead*>(hc.state.get()); }
inline const ClusterHead* cluster_of(const HeadCache& hc) { return dynamic_cast<const ClusterHead*>(hc.state.get()); }

// Tokens the last decode step attended (ascending): sinks, recalled, pending.
std::vector<int64_t> recalled_tokens(const ClusterHead& ch);

}  // namespace ovkc
