// ov_kvcrush::PagedAttention: causal attention over the op's own paged KV cache.
//
// Inputs:  0 query [B, Hq, L, D] f32 (after RoPE), 1 key [B, Hkv, L, D] f32 (after RoPE, the
//          step's new tokens only), 2 value [B, Hkv, L, D] f32, 3 sequence handles [B] i64, or
//          [L] in a one-row batch: one handle per token ("ragged": adjacent tokens of one handle
//          are that sequence's step, so a prompt chunk and other sequences' decode tokens share
//          one inference, as in native continuous batching).
// Output:  0 attention [B, Hq, L, D] f32.
// Attributes: layer (which layer's cache of the sequence), scale (logit scale), compute ("f32",
// or "bf16": prefill dot products in bf16 with fp32 accumulation, as OpenVINO's SDPA does when
// the model runs with a bf16 inference precision; decode is always f32), softcap (Gemma 2's
// attention soft-capping, cap * tanh(s / cap) of each scaled logit; 0: none; AMX tiles take raw
// logits, so a capped bf16 prompt runs the AVX512-BF16 kernel).
//
// Each call appends the step's keys/values to the sequence's cache for this layer, then every
// query token attends every held token at or before its own position. A prompt may come in
// chunks (Sequence::prompt_end, set through the C API): the method's prompt selection then runs
// once, on the last chunk, over the whole prompt. Batch rows (or runs of
// per-token handles) are independent sequences (no padding). Replaces ScaledDotProductAttention together with the
// ReadValue/Concat/Assign state of optimum's stateful IR (see transformations/).
#pragma once

#include <openvino/op/op.hpp>
#include <string>

namespace ovkc {

class PagedAttention : public ov::op::Op {
public:
    OPENVINO_OP("PagedAttention", "ov_kvcrush");

    PagedAttention() = default;
    PagedAttention(const ov::OutputVector& args, int64_t layer, float scale, std::string compute = "f32",
                   float softcap = 0.0f);

    void validate_and_infer_types() override;
    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& new_args) const override;
    bool visit_attributes(ov::AttributeVisitor& visitor) override;
    // Runs the step (evaluate_step); an error is kept for the step's sequences
    // (Registry::record_step_error) and the output zeroed, never thrown: see the .cpp.
    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override;
    bool has_evaluate() const override { return true; }
    bool can_constant_fold(const ov::OutputVector&) const override { return false; }

private:
    bool evaluate_step(ov::TensorVector& outputs, const ov::TensorVector& inputs) const;
    // one sequence's step: q/out [Hq, L, D], k/v [Hkv, L, D], contiguous
    void attend_sequence(int64_t handle, const float* qb, const float* kd, const float* vd, float* ob, int64_t Hq,
                         int64_t Hkv, int64_t L, int64_t D) const;

    int64_t m_layer = 0;
    float m_scale = 1.0f;
    std::string m_compute = "f32";
    float m_softcap = 0.0f;
};

}  // namespace ovkc
