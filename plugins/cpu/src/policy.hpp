// The compression method a KV pool runs: a Policy, made by name from a table that each method's
// source file fills (one file per method, named like its reference module in ov_kvcrush/methods/).
//
// The op calls the policy's hooks around its attention (attention_op.cpp, through
// run_before_attention / run_after_attention below, which add the 2-bit store's flush):
//   before_attention  once the step's tokens are appended (ClusterKV clusters pending tokens,
//                     Chelsea merges when a decode step brings a head to budget + g);
//   recalls/attend_recalled  a decode step that attends a recalled subset instead of the head
//                     (ClusterKV);
//   after_attention   once the attention and the per-head scores are done (prefill selection,
//                     decode-time budget enforcement);
//   finish_scoring_pass  after a scoring pass (KVzip: the steps attend, score and are dropped;
//                     no other hook runs during them).
// A policy is shared read-only by every sequence of its pool: per-sequence state lives in the
// sequence's HeadCache (slots, scores, degrees, and a method's own HeadState).
//
// Adding a method: a source file that defines a Policy subclass and a factory that reads exactly
// the fields its Python config's op_fields() sends, registered with OVKC_REGISTER_POLICY; see
// docs/architecture.md. No file here names a method.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kernels.hpp"
#include "paged_cache.hpp"
#include "spec.hpp"

namespace ovkc {

// What every policy has: its name, the tokens each layer keeps per KV head (0: unbounded, e.g. a
// dense layer), and the store its tokens live in (MiniKV's 2-bit blocks under any method).
struct PolicyCommon {
    std::string name;
    std::vector<int64_t> budgets;
    bool quant = false;    // the 2-bit store
    int64_t group = 0;     // its quantization group (tokens per key group, channels per value group)
    int64_t residual = 0;  // tokens kept in full precision before a flush into 2-bit blocks
    int64_t tail = 0;      // the prompt's last tokens kept in full precision for good (pinned)
    int64_t key_bits = 2;    // the store's code widths (2 or 4)
    int64_t value_bits = 2;
};

// Named counters a method contributes to a sequence's statistics (summed over layers and heads).
using Counters = std::vector<std::pair<std::string, double>>;

class Policy {
public:
    explicit Policy(PolicyCommon common) : common_(std::move(common)) {}
    virtual ~Policy() = default;

    const std::string& name() const { return common_.name; }
    int64_t budget(int layer) const {
        return layer < static_cast<int>(common_.budgets.size()) ? common_.budgets[static_cast<size_t>(layer)] : 0;
    }
    bool quant() const { return common_.quant; }
    int64_t quant_group() const { return common_.group; }
    int64_t quant_residual() const { return common_.residual; }
    int64_t quant_tail() const { return common_.tail; }
    int quant_key_bits() const { return static_cast<int>(common_.key_bits); }
    int quant_value_bits() const { return static_cast<int>(common_.value_bits); }

    // Throw (naming the field) when a bounded layer's budget is below `floor`; `what` names the
    // floor in the message ("sinks + recent"). Every method that keeps sinks and windows calls it.
    void require_budgets_at_least(int64_t floor, const std::string& what) const;

    // Slots carry G floats each (hc.scores), moved with their tokens by every cache edit.
    virtual bool keeps_slot_scores() const { return false; }
    // This step's attention probabilities are added to the slot scores.
    virtual bool scores_step(bool /*prefill*/) const { return false; }
    // The first query row of the step whose probabilities count (SnapKV's prefill: its window).
    virtual int64_t score_rows_from(bool /*prefill*/, int64_t /*L*/) const { return 0; }
    // Whether a pool may also ask for the attention scores of every step (PoolConfig::scores):
    // not when the slot scores hold something else, or a decode step attends a subset.
    virtual bool allows_score_output() const { return true; }

    virtual void before_attention(Sequence& /*seq*/, int /*layer*/, bool /*prefill*/, int64_t /*L*/) const {}
    virtual bool recalls(Sequence& /*seq*/, int /*layer*/, bool /*prefill*/) const { return false; }
    // Attend the step's queries q [Hq][L][D] over the recalled subset into out [Hq][L][D].
    virtual void attend_recalled(Sequence& /*seq*/, int /*layer*/, const float* /*q*/, int64_t /*L*/,
                                 int64_t /*past*/, LogitMap /*logit*/, float* /*out*/) const {}
    // L: the step's tokens, the last L slots of every head of the layer.
    virtual void after_attention(Sequence& /*seq*/, int /*layer*/, bool /*prefill*/, int64_t /*L*/) const {}
    // The method's counters for the sequence, summed over its layers and heads.
    virtual Counters counters(Sequence& /*seq*/) const { return {}; }
    // A method that scores the cache with a second pass after a prompt (KVzip): while the
    // sequence's `scoring` is on, the op attends each step over what is held plus the step, keeps
    // each held slot's largest probability per query head in its scores, and drops the step; then
    // the engine calls this once, for the selection over every layer.
    virtual bool has_scoring_pass() const { return false; }
    // the positions below which a scoring step also attends (its sinks), beside its chunk
    virtual int64_t scoring_sinks() const { return 0; }
    virtual void finish_scoring_pass(Sequence& /*seq*/) const {}
    // Whether the 2-bit store waits for the method to flush (quant_flush) instead of flushing
    // after a prompt and before each decode step (a method that selects after a scoring pass).
    virtual bool defers_quant_flush() const { return false; }

private:
    PolicyCommon common_;
};

// A method's factory: reads its own fields from the spec (each exactly once, no defaults) and
// checks them against the model and the common fields.
using PolicyFactory = std::unique_ptr<Policy> (*)(Spec& spec, const ModelShape& shape, PolicyCommon common);

// Add a method to the table (each method file does, at load time); returns true.
bool register_policy(const char* name, PolicyFactory make);
// The policy a spec describes; every field read exactly once, else an error naming it.
std::shared_ptr<const Policy> make_policy(const std::string& spec, const ModelShape& shape);
// The names in the table, sorted.
std::vector<std::string> policy_names();

#define OVKC_CONCAT_(a, b) a##b
#define OVKC_CONCAT(a, b) OVKC_CONCAT_(a, b)
#define OVKC_REGISTER_POLICY(name, factory) \
    static const bool OVKC_CONCAT(ovkc_registered_, __LINE__) = ::ovkc::register_policy(name, factory)

// The op's calls: the policy's hooks plus the 2-bit store's flush (a decode step's tokens are
// flushed before it attends, the prompt's after its selection, as in the reference).
void run_before_attention(Sequence& seq, int layer, bool prefill, int64_t L);
void run_after_attention(Sequence& seq, int layer, bool prefill, int64_t L);
// Whether this step accumulates scores at all, and from which query row.
bool step_scores(const PoolConfig& cfg, bool prefill);
int64_t score_rows_from(const PoolConfig& cfg, bool prefill, int64_t L);
// How many of an n-token prompt's first tokens, fed as chunks (Sequence::prompt_end), leave the
// sequence as the same chunks of any longer prompt would: a copy taken there continues a later
// turn's longer prompt exactly as that prompt sent whole (in chunks cut there) runs. The rows a
// scoring window counts (SnapKV's last queries) and the sparse prefill's dense last rows depend
// on where the prompt ends; the last chunk keeps a token at least, for the method's selection.
int64_t held_prompt_tokens(const PoolConfig& cfg, int64_t n);

// ---- cache edits the methods share --------------------------------------------------------------

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

// quant_store.cpp: move every whole `residual` chunk of full-precision tokens into 2-bit blocks;
// at the prompt's end (`prompt`) the last `tail` slots of each head are pinned first
void quant_flush(Sequence& seq, int layer, bool prompt);

}  // namespace ovkc
