// The paged KV cache owned by the attention op.
//
// A Pool is one pipeline's block store: fixed-size blocks (block_size tokens of one KV head of
// one layer: keys transposed [head_dim][block_size], then values [block_size][head_dim], then
// the u8 store's per-slot scales) handed out from a free list. A Sequence holds, per layer and KV head, its own block table and token
// map (the absolute position of each slot), so that heads can later keep different tokens, plus
// optional per-query-head accumulated attention scores for the eviction policies.
//
// Pools and sequences live in a process-wide registry addressed by 64-bit handles: the op finds
// a sequence by the handle the pipeline feeds as an input tensor, and Python reaches the same
// objects through the C API (c_api.cpp). Each pipeline creates its own pool, so pipelines never
// share state unless they pass each other's handles.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "sparse_prefill.hpp"


namespace ovkc {

// Storage of keys and values in the full-precision blocks: f32, f16, or u8 with a per-token
// (per head) minimum and scale for keys and for values, as OpenVINO's CPU plugin stores its KV
// cache by default (x = min + code * scale, code in 0..255).
enum class Precision : int { f32 = 0, f16 = 1, u8 = 2 };

class Policy;  // policy.hpp: the compression method

struct PoolConfig {
    int layers = 0;
    int q_heads = 0;
    int kv_heads = 0;
    int head_dim = 0;
    int block_size = 32;
    Precision precision = Precision::f32;
    // the pool's size, in full-precision blocks (0: unlimited): 2-bit blocks count by their bytes
    // against the same max_blocks * block_bytes(), so a compressed store holds more tokens, never
    // more memory
    int64_t max_blocks = 0;
    bool scores = false;     // accumulate per-q-head attention scores per token
    // a byte probe's pool (equal-memory budgets): keys and values are stored, and every method
    // selects, merges, quantizes and recycles as usual, but no attention or score is computed (the
    // outputs stay zero, the scores too). What a method holds depends on token counts, not on
    // values, so the bytes are a real run's; a probe no longer costs the prompt's attention.
    bool count_only = false;
    // per layer, the sliding-window span of a local layer (Gemma 3's), 0 for a global layer
    // (empty: every layer is global). A local layer attends its last `window` positions and keeps
    // them as a ring of blocks: whole blocks before the window go back to the pool after each
    // step; the method never runs there (its hooks, scores and budgets are for global layers).
    std::vector<int64_t> windows;
    // sparse prompt attention (XAttention's block mask; off unless set): a sequence's prompt,
    // whole or in chunks, attends per query block the key blocks carrying most of its estimated
    // mass (sparse_prefill_mask says when)
    SparsePrefill sparse;
    // the compression method (set before the pool is made); shared, read-only once created
    std::shared_ptr<const Policy> policy;

    void validate() const;
    // bytes of one key or value element (a code, for u8)
    size_t elem_bytes() const { return precision == Precision::f32 ? 4 : precision == Precision::f16 ? 2 : 1; }
    // u8: per slot, the keys' min and scale and the values' min and scale (f32 each), after the
    // codes as 4 rows of block_size floats: [k_min][k_scale][v_min][v_scale]
    size_t param_bytes() const { return precision == Precision::u8 ? 4 * sizeof(float) * static_cast<size_t>(block_size) : 0; }
    size_t block_bytes() const { return 2 * static_cast<size_t>(block_size) * head_dim * elem_bytes() + param_bytes(); }
    // A 2-/4-bit block (MiniKV's store) of block_size tokens: key codes [D][bs/Pk] u32 (P = 32 /
    // bits codes per word), key scale and zero fp16 [bs/g][D], value codes [bs][D/Pv] u32, value
    // scale and zero fp16 [bs][D/g].
    size_t qblock_bytes() const;
    // the quantized store's group (16 when the method keeps no such store) and code widths
    int quant_group() const;
    int quant_key_bits() const;
    int quant_value_bits() const;
    int group() const { return q_heads / kv_heads; }
    int64_t window(int layer) const {
        return static_cast<size_t>(layer) < windows.size() ? windows[static_cast<size_t>(layer)] : 0;
    }
    // a global layer's index among the global layers (the index a method config's per-layer
    // fields use: method_spec.py lays methods over the global layers only)
    int global_index(int layer) const {
        int g = 0;
        for (int i = 0; i < layer; ++i) g += window(i) == 0;
        return g;
    }
    // scores are kept per slot when asked for or when the method selects by them
    bool keeps_scores() const;
};

// A user-facing error (bad handle, bad shape, pool exhausted): the message names what is wrong.
struct Error : std::runtime_error {
    using std::runtime_error::runtime_error;
};

class Pool {
public:
    explicit Pool(const PoolConfig& cfg);
    ~Pool();
    Pool(const Pool&) = delete;
    Pool& operator=(const Pool&) = delete;

    const PoolConfig& config() const { return cfg_; }
    int32_t acquire();
    void release(int32_t block);
    uint8_t* block(int32_t id) const { return fp_.storage[static_cast<size_t>(id)]; }
    // 2-bit blocks (the quantized store), counted separately
    int32_t acquire_q();
    void release_q(int32_t block);
    uint8_t* qblock(int32_t id) const { return q_.storage[static_cast<size_t>(id)]; }

    int64_t blocks_in_use() const;
    int64_t blocks_allocated() const;
    int64_t peak_blocks() const;
    int64_t qblocks_in_use() const;

private:
    PoolConfig cfg_;
    mutable std::mutex mu_;
    // one kind of block (full-precision K/V, or 2-bit): allocations, free list, counters
    struct Blocks {
        size_t bytes = 0;                // of one block
        std::vector<uint8_t*> storage;   // by id; null: given back to the system (its id is vacant)
        std::vector<int32_t> free;       // allocated, not in use
        std::vector<int32_t> vacant;     // ids whose memory went back to make room for the other kind
        int64_t allocated = 0;
        int64_t in_use = 0;
        int64_t peak = 0;
    };
    // take a block from `b` (its free list first); past the pool's bytes, the other kind's free
    // blocks go back to the system first, then the pool is exhausted (an Error)
    int32_t take(Blocks& b, Blocks& other, const char* what);
    void give(Blocks& b, int32_t id);
    int64_t allocated_bytes() const;
    Blocks fp_;
    Blocks q_;
};

// A method's own state of one (layer, KV head), beside the slots (e.g. clusterkv.hpp: ClusterHead).
struct HeadState {
    virtual ~HeadState() = default;
    // Throw (naming why) when the head cannot drop the tokens at position >= tokens.
    virtual void check_truncate(int64_t /*tokens*/) const {}
    // The head has dropped them.
    virtual void truncated() {}
};

// A step's own keys and values, as the op was given them ([count][D] each, positions first ..):
// while a prompt step's attention runs, the head reads these in place of the store's rounded
// copies (head_block_floats), so a prompt attends its tokens exactly at any store precision, as
// native's prefill does; decode reads the store. Set by append_step, cleared after the step.
struct StepTokens {
    const float* k = nullptr;
    const float* v = nullptr;
    int64_t first = 0;
    int64_t count = 0;
    // the head's blocks [0, staged_blocks) converted once for the step (stage_f32_heads): f32
    // blocks (keys [D][bs], values [bs][D]) with the step's tokens exact, which a prompt's many
    // query tiles read instead of converting every block again for each tile
    const float* staged = nullptr;
    int64_t staged_blocks = 0;
};

// One (layer, KV head) of a sequence.
struct HeadCache {
    std::vector<int32_t> blocks;  // block table
    std::vector<int64_t> pos;     // absolute position of each held slot, ascending
    std::vector<float> scores;    // [slot][group] accumulated probabilities (when enabled)
    std::vector<float> degree;    // Chelsea: original tokens each slot stands for (empty: all 1)
    // added to the slot's logits: Chelsea's log(degree); -inf marks a hole, a token evicted by a
    // decode step but not yet compacted away (empty: no Chelsea, no holes)
    std::vector<float> bias;
    int64_t holes = 0;
    // MiniKV's 2-bit store: full 2-bit blocks of tokens older than every slot above
    std::vector<int32_t> qblocks;
    std::vector<int64_t> qpos;
    // [qslot][group] accumulated probabilities of the 2-bit tokens (when slot scores are kept): a
    // flush moves the slots' scores here, so a decode step can evict whole quantized chunks
    std::vector<float> qscores;
    // the prompt's pinned tail (PolicyCommon::tail): slots [pin_begin, pin_begin + pin_count) of
    // the full-precision blocks are never flushed into the 2-bit store
    int64_t pin_begin = 0;
    int64_t pin_count = 0;
    // a method's own per-head state (ClusterKV's cluster index and working set; null otherwise)
    std::shared_ptr<HeadState> state;
    StepTokens step;  // the step's exact tokens while its prompt attention runs (none otherwise)
    // slots of the full-precision blocks (the residual, when there is a 2-bit store)
    int64_t size() const { return static_cast<int64_t>(pos.size()); }
    bool hole(int64_t slot) const { return holes && bias[static_cast<size_t>(slot)] == kHole; }
    // every token held: 2-bit and full precision, holes not counted
    int64_t held() const { return static_cast<int64_t>(pos.size() + qpos.size()) - holes; }
    static constexpr float kHole = -std::numeric_limits<float>::infinity();
};

class Sequence {
public:
    Sequence(int64_t id, std::shared_ptr<Pool> pool);
    ~Sequence();
    Sequence(const Sequence&) = delete;
    Sequence& operator=(const Sequence&) = delete;

    int64_t id() const { return id_; }
    Pool& pool() { return *pool_; }
    const std::shared_ptr<Pool>& pool_ptr() const { return pool_; }
    HeadCache& head(int layer, int kv_head) { return heads_[static_cast<size_t>(layer) * pool_->config().kv_heads + kv_head]; }
    int64_t& seen(int layer) { return seen_[static_cast<size_t>(layer)]; }
    int64_t blocks_held() const;
    int64_t qblocks_held() const;
    int64_t bytes_held() const;

    // Make room for n more slots in this head (acquires blocks from the pool).
    void reserve(HeadCache& hc, int64_t n);
    // Return the blocks past the head's held slots (after eviction, merging or truncation).
    void trim_blocks(HeadCache& hc);
    // Return every block to the pool and forget all tokens.
    void reset();
    // Forget the tokens at position >= tokens (their blocks go back to the pool).
    void truncate(int64_t tokens);

    std::mutex mu;  // one inference at a time per sequence

    // A prompt prefilled in several steps (chunked prefill, continuous batching): its length in
    // tokens, 0 when the prompt comes in one step. While the tokens seen are below it, a step is a
    // chunk of the prompt: it attends and adds its scores, and the method's prompt hooks run once,
    // on the last chunk, over the whole prompt, as if it had come in one step.
    int64_t prompt_end = 0;

    // A scoring pass (Policy::has_scoring_pass, KVzip): while on, a step attends what is held
    // plus itself, each held slot's score per query head becomes the largest probability a query
    // of the step gives it, and the step's tokens are dropped again (its positions reused).
    bool scoring = false;
    int64_t score_lo = 0, score_hi = 0;  // the positions a scoring step scores: [lo, hi)

    // time spent in the method's own work (selection, eviction, merging, the 2-bit flush), in the
    // per-head score pass, in the step's cache writes and in its attention, in prefill and in
    // decode steps (ns, summed over layers)
    int64_t policy_ns[2] = {0, 0};
    int64_t scores_ns[2] = {0, 0};
    int64_t append_ns[2] = {0, 0};
    int64_t attend_ns[2] = {0, 0};
    // the sparse prefill (PoolConfig::sparse): key blocks its prompts attended and the causal
    // blocks dense prompts attend (summed over layers and query heads), and the time its
    // estimate took (part of the prompt's attention time)
    int64_t sparse_blocks[2] = {0, 0};
    int64_t sparse_ns = 0;

private:
    int64_t id_;
    std::shared_ptr<Pool> pool_;
    std::vector<HeadCache> heads_;
    std::vector<int64_t> seen_;
};

// Process-wide registry of pools and sequences, addressed by handles (never reused).
class Registry {
public:
    static Registry& get();
    int64_t create_pool(const PoolConfig& cfg);
    void free_pool(int64_t id);
    std::shared_ptr<Pool> pool(int64_t id);
    int64_t create_sequence(int64_t pool_id);
    void free_sequence(int64_t id);
    std::shared_ptr<Sequence> sequence(int64_t id);
    int64_t sequences_of(const Pool* pool);
    // An error the op met inside an inference, kept for each sequence of that step until the
    // caller takes it (the op does not throw: OpenVINO drops a custom op's exception when it
    // infers on one thread, and its executor is then out of step).
    void record_step_error(const std::vector<int64_t>& handles, const std::string& message);
    std::string take_step_error(int64_t handle);

private:
    std::mutex mu_;
    std::mutex errors_mu_;
    std::vector<std::pair<int64_t, std::string>> errors_;
    int64_t next_ = 1;
    std::vector<std::pair<int64_t, std::shared_ptr<Pool>>> pools_;
    std::vector<std::pair<int64_t, std::shared_ptr<Sequence>>> seqs_;
};

}  // namespace ovkc
