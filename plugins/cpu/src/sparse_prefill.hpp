// Sparse prompt attention by antidiagonal block scoring (XAttention, arXiv 2503.16428): which
// key blocks each query block of a whole prompt attends. The reference, step for step, is
// ov_kvcrush/methods/sparse_prefill.py (its docstring lists the departures from the paper).
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace ovkc {

// The pool's sparse prompt attention (openvino.genai's SparseAttentionConfig names); off when
// block_size is 0.
struct SparsePrefill {
    int64_t block_size = 0;          // queries and keys per block (a multiple of 16 and of stride)
    int64_t stride = 8;              // every stride-th row and column enters the estimate
    double threshold = 0.9;          // the share of a query block's estimated mass it attends
    int64_t last_dense_tokens = 100; // the prompt's last rows attend densely
    int64_t dense_layers = 4;        // the first global layers attend densely
    bool on() const { return block_size > 0; }
    void validate() const;
};

// Per query head, per query block i of a prompt step (first <= i < blocks, by position), the key
// blocks j <= i it attends.
struct BlockMask {
    int64_t block_size = 0, first = 0, blocks = 0, heads = 0;
    std::vector<uint8_t> keep;  // [heads][blocks - first][blocks]
    bool empty() const { return blocks == 0; }
    const uint8_t* row(int64_t h, int64_t i) const {
        return keep.data() + static_cast<size_t>((h * (blocks - first) + i - first) * blocks);
    }
    // The key slots query block i of head h attends, as ascending [begin, end) ranges (kept
    // blocks next to each other merged), clipped to the n slots held (slots are positions).
    std::vector<std::pair<int64_t, int64_t>> key_ranges(int64_t h, int64_t i, int64_t n) const;
    // blocks attended, and the causal blocks a dense step attends (both summed over heads)
    int64_t kept() const;
    int64_t causal() const;
};

// The mask of a prompt step (a whole prompt, or a chunk of one) whose L tokens sit at positions
// [past, past + L): q [Hq][L][D] its unscaled queries, keys[g] the [past + L][D] keys of KV head
// g at every position up to the step's end; `scale` the model's logit scale. Query blocks holding
// a position at or after `first_dense` attend every causal block. `bf16`: the estimate's products
// in bf16 (the scaled queries and the keys rounded, f32 sums), as the step's bf16 prompt attends.
BlockMask prefill_block_mask(const SparsePrefill& cfg, const float* q, const std::vector<const float*>& keys,
                             int64_t Hq, int64_t past, int64_t L, int D, float scale, int64_t first_dense, bool bf16);

}  // namespace ovkc
