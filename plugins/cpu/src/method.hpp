// The compression method a KV pool runs, as the Python side describes it.
//
// ov_kvcrush's reference configs (ov_kvcrush/methods/) are the single source of the semantics;
// the Python engine turns the chosen config into a flat spec string ("key=value;key=value",
// lists comma-separated) with everything already resolved (per-layer budgets of a pyramid,
// random KVCrush anchors drawn with the reference's generator), so the C++ side never
// re-derives a default. parse() validates every field and names the bad one.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ovkc {

enum class Method : int { full, streamingllm, h2o, snapkv, pyramidkv, kvcrush, clusterkv, chelsea, minikv };
enum class Scoring : int { none, h2o, snapkv };

struct Anchor {
    bool mean = false;           // per-bit majority of the evictable tokens' signatures
    std::vector<uint8_t> bits;   // otherwise a fixed pattern, one entry per query head
};

struct MethodParams {
    Method method = Method::full;
    std::string name = "full";
    std::vector<int64_t> budgets;  // tokens per KV head, per layer (0: unbounded / dense layer)
    int64_t sinks = 0;
    int64_t recent = 0;

    // importance (H2O / SnapKV / PyramidKV / StreamingLLM / MiniKV selection)
    Scoring scoring = Scoring::none;
    int64_t window = 32;      // SnapKV observation window (last prompt queries)
    int64_t pool_kernel = 7;  // odd; 1 disables pooling
    bool pool_avg = false;
    bool frozen = false;      // selection made once at prefill (MiniKV, or any method over the 2-bit store)

    // KVCrush
    int64_t representatives = 0;
    bool signature_threshold = false;
    bool multi_nearest = false;
    bool representative_first = false;
    bool block_wise = false;  // whole blocks of the pool's block size
    std::vector<Anchor> anchors;

    // MiniKV's 2-bit store
    bool quant = false;
    int64_t group = 16;
    int64_t residual = 128;

    // ClusterKV
    int64_t tokens_per_cluster = 80;
    int64_t n_clusters = 0;  // 0: derived from tokens_per_cluster
    int64_t new_clusters = 4;
    int64_t cluster_every = 320;
    int64_t max_iters = 20;
    int64_t seed = 0;
    int64_t cache_steps = 1;

    // Chelsea
    int64_t chunk = 256;
    int64_t merge_interval = 32;
    std::vector<int64_t> outliers;  // flattened (layer, kv_head) pairs

    bool needs_scores() const {
        return scoring != Scoring::none && (method != Method::clusterkv && method != Method::chelsea);
    }
    bool evicts() const {
        return method == Method::streamingllm || method == Method::h2o || method == Method::snapkv ||
               method == Method::pyramidkv || method == Method::kvcrush || method == Method::minikv;
    }
    int64_t budget(int layer) const {
        return layer < static_cast<int>(budgets.size()) ? budgets[static_cast<size_t>(layer)] : 0;
    }
    bool outlier(int layer, int kv_head) const {
        for (size_t i = 0; i + 1 < outliers.size(); i += 2)
            if (outliers[i] == layer && outliers[i + 1] == kv_head) return true;
        return false;
    }

    // Parse and validate a spec for a model with `layers` layers and `q_heads` query heads.
    static MethodParams parse(const std::string& spec, int layers, int q_heads, int kv_heads, int block_size,
                              int head_dim);
};

}  // namespace ovkc
