#include "attention_op.hpp"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <mutex>
#include <vector>

#include "attention_step.hpp"
#include "kernels.hpp"
#include "paged_cache.hpp"
#include "policy.hpp"

namespace ovkc {

namespace {
std::string shape_str(const ov::Shape& s) {
    std::string out = "[";
    for (size_t i = 0; i < s.size(); ++i) out += (i ? "," : "") + std::to_string(s[i]);
    return out + "]";
}

// The method's hooks of a step (before or after its attention), when the step runs them; their
// time goes to the sequence's policy time of the step's phase.
void run_hooks(StepContext& ctx, void (*hook)(Sequence&, int, bool, int64_t)) {
    if (!ctx.mode.hooks) return;
    const auto t0 = StepClock::now();
    try {
        hook(ctx.seq, ctx.mode.layer, ctx.mode.prefill, ctx.mode.hook_tokens);
    } catch (const Error& e) {
        OPENVINO_THROW("ov_kvcrush PagedAttention: ", e.what());
    }
    ctx.seq.policy_ns[ctx.mode.phase] += ns_since(t0);
}
}  // namespace

PagedAttention::PagedAttention(const ov::OutputVector& args, int64_t layer, float scale, std::string compute,
                               float softcap)
    : Op(args), m_layer(layer), m_scale(scale), m_compute(std::move(compute)), m_softcap(softcap) {
    constructor_validate_and_infer_types();
}

void PagedAttention::validate_and_infer_types() {
    NODE_VALIDATION_CHECK(this, get_input_size() == 4, "PagedAttention takes 4 inputs (q, k, v, sequence handles), got ",
                          get_input_size());
    const auto& q = get_input_partial_shape(0);
    NODE_VALIDATION_CHECK(this, q.rank().compatible(4), "query must be [B, Hq, L, D], got ", q);
    for (size_t i = 1; i < 3; ++i)
        NODE_VALIDATION_CHECK(this, get_input_partial_shape(i).rank().compatible(4), "key/value must be [B, Hkv, L, D]");
    // The CPU plugin runs i64 tensors as i32; handles stay far below 2^31.
    const auto& ht = get_input_element_type(3);
    NODE_VALIDATION_CHECK(this, ht.is_dynamic() || ht == ov::element::i64 || ht == ov::element::i32,
                          "sequence handles must be i64 (or i32), got ", ht);
    NODE_VALIDATION_CHECK(this, m_layer >= 0, "layer must be >= 0, got ", m_layer);
    NODE_VALIDATION_CHECK(this, m_compute == "f32" || m_compute == "bf16", "compute must be f32 or bf16, got ", m_compute);
    NODE_VALIDATION_CHECK(this, m_softcap >= 0.0f && std::isfinite(m_softcap),
                          "softcap must be 0 (none) or a positive finite cap, got ", m_softcap);
    set_output_type(0, get_input_element_type(0), q);
}

std::shared_ptr<ov::Node> PagedAttention::clone_with_new_inputs(const ov::OutputVector& new_args) const {
    return std::make_shared<PagedAttention>(new_args, m_layer, m_scale, m_compute, m_softcap);
}

bool PagedAttention::visit_attributes(ov::AttributeVisitor& visitor) {
    visitor.on_attribute("layer", m_layer);
    visitor.on_attribute("scale", m_scale);
    visitor.on_attribute("compute", m_compute);
    visitor.on_attribute("softcap", m_softcap);
    return true;
}

namespace {
// The sequence handles of a step, as far as its handles input can be read (none otherwise).
std::vector<int64_t> step_handles(const ov::TensorVector& inputs) {
    std::vector<int64_t> out;
    if (inputs.size() < 4) return out;
    const auto& ids = inputs[3];
    const auto ht = ids.get_element_type();
    for (size_t i = 0; i < ids.get_size(); ++i) {
        if (ht == ov::element::i64)
            out.push_back(ids.data<int64_t>()[i]);
        else if (ht == ov::element::i32)
            out.push_back(ids.data<int32_t>()[i]);
    }
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
    if (out.empty()) out.push_back(0);  // unreadable handles: kept under 0, which no sequence has
    return out;
}
// Runs of equal handles: each is one sequence's step (a batch row, or adjacent tokens of a
// one-row batch), attended like a batch row of its own; (first token or row, tokens). Steps of
// different sequences run side by side, so one sequence may have only one.
std::vector<std::pair<int64_t, int64_t>> sequence_runs(const std::vector<int64_t>& handles, bool per_token, int64_t B,
                                                       int64_t L) {
    std::vector<std::pair<int64_t, int64_t>> runs;
    if (per_token) {
        for (int64_t t = 0; t < L; ++t)
            if (t == 0 || handles[static_cast<size_t>(t)] != handles[static_cast<size_t>(t - 1)]) runs.emplace_back(t, 0);
        for (size_t r = 0; r < runs.size(); ++r)
            runs[r].second = (r + 1 < runs.size() ? runs[r + 1].first : L) - runs[r].first;
    } else {
        for (int64_t b = 0; b < B; ++b) runs.emplace_back(b, L);
    }
    for (size_t r = 0; r < runs.size(); ++r)
        for (size_t s = 0; s < r; ++s)
            OPENVINO_ASSERT(handles[static_cast<size_t>(runs[r].first)] != handles[static_cast<size_t>(runs[s].first)],
                            "ov_kvcrush PagedAttention: sequence ", handles[static_cast<size_t>(runs[r].first)],
                            per_token ? " has two separate runs of tokens in one step (a sequence's tokens must be adjacent)"
                                      : " is in two batch rows of one step (one row per sequence)");
    return runs;
}
}  // namespace

bool PagedAttention::evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const {
    try {
        return evaluate_step(outputs, inputs);
    } catch (const std::exception& e) {
        // Not thrown on: OpenVINO drops an exception from here when it infers on one thread
        // (INFERENCE_NUM_THREADS=1, one core), and its executor then runs a later request's
        // step twice or not at all. The error is kept for the step's sequences, the step ends
        // with a zero output, and the caller raises it (kvcache.infer_steps).
        Registry::get().record_step_error(step_handles(inputs), e.what());
        outputs[0].set_shape(inputs[0].get_shape());
        if (outputs[0].get_element_type() == ov::element::f32)
            std::fill_n(outputs[0].data<float>(), outputs[0].get_size(), 0.0f);
        return true;
    }
}

bool PagedAttention::evaluate_step(ov::TensorVector& outputs, const ov::TensorVector& inputs) const {
    const auto& q = inputs[0];
    const auto& k = inputs[1];
    const auto& v = inputs[2];
    const auto& ids = inputs[3];
    for (size_t i = 0; i < 3; ++i)
        OPENVINO_ASSERT(inputs[i].get_element_type() == ov::element::f32,
                        "ov_kvcrush PagedAttention: inputs must be f32, input ", i, " is ",
                        inputs[i].get_element_type());
    const ov::Shape qs = q.get_shape(), ks = k.get_shape(), vs = v.get_shape();
    OPENVINO_ASSERT(qs.size() == 4 && ks.size() == 4 && vs == ks && ks[0] == qs[0] && ks[2] == qs[2] && ks[3] == qs[3],
                    "ov_kvcrush PagedAttention: shapes q ", shape_str(qs), " k ", shape_str(ks), " v ", shape_str(vs),
                    " are not [B,Hq,L,D], [B,Hkv,L,D], [B,Hkv,L,D]");
    const int64_t B = qs[0], Hq = qs[1], L = qs[2], D = qs[3], Hkv = ks[1];
    const auto ht = ids.get_element_type();
    // one handle per batch row, or (one row) one per token: the row's tokens are then runs of
    // several sequences' tokens (a prompt chunk beside other sequences' decode tokens)
    const bool per_token = B == 1 && L > 1 && ids.get_size() == static_cast<size_t>(L);
    OPENVINO_ASSERT((ht == ov::element::i64 || ht == ov::element::i32) &&
                        (per_token || ids.get_size() == static_cast<size_t>(B)),
                    "ov_kvcrush PagedAttention: sequence handles must be i64 [", B, "] (or [", L,
                    "], one per token, in a one-row batch), got ", ht, " ", shape_str(ids.get_shape()));
    outputs[0].set_shape(qs);
    float* out = outputs[0].data<float>();
    if (B == 0 || L == 0) return true;
    const float* qd = q.data<float>();
    const float* kd = k.data<float>();
    const float* vd = v.data<float>();
    std::vector<int64_t> handles(ids.get_size());
    for (size_t i = 0; i < handles.size(); ++i)
        handles[i] = ht == ov::element::i64 ? ids.data<int64_t>()[i] : ids.data<int32_t>()[i];
    const auto runs = sequence_runs(handles, per_token, B, L);
    if (!per_token) {
        // decode rows run side by side (each sequence is locked by its own step; the pool by its
        // allocations): a step of many sequences would otherwise pay each row's task start-up in turn
        auto row = [&](int64_t b) {
            attend_sequence(handles[static_cast<size_t>(b)], qd + b * Hq * L * D, kd + b * Hkv * L * D,
                            vd + b * Hkv * L * D, out + b * Hq * L * D, Hq, Hkv, L, D);
        };
        if (L == 1 && B > 1)
            tbb::parallel_for(int64_t(0), B, row);
        else
            for (int64_t b = 0; b < B; ++b) row(b);
        return true;
    }
    if (runs.size() == 1) {
        attend_sequence(handles[0], qd, kd, vd, out, Hq, Hkv, L, D);
        return true;
    }
    // each run's rows are copied out of the [1, H, L, D] inputs into a [1, H, n, D] step and back;
    // the prompt chunks go one after the other, then the decode tokens side by side
    auto run = [&](size_t r) {
        const auto [first, n] = runs[r];
        std::vector<float> qr, kr, vr, orow(static_cast<size_t>(Hq * n * D), 0.0f);
        auto gather = [&](const float* src, int64_t H, std::vector<float>& dst) {
            dst.resize(static_cast<size_t>(H * n * D));
            for (int64_t h = 0; h < H; ++h)
                std::copy(src + (h * L + first) * D, src + (h * L + first + n) * D, dst.data() + h * n * D);
        };
        gather(qd, Hq, qr);
        gather(kd, Hkv, kr);
        gather(vd, Hkv, vr);
        attend_sequence(handles[static_cast<size_t>(first)], qr.data(), kr.data(), vr.data(), orow.data(), Hq, Hkv, n, D);
        for (int64_t h = 0; h < Hq; ++h)
            std::copy(orow.data() + h * n * D, orow.data() + (h + 1) * n * D, out + (h * L + first) * D);
    };
    std::vector<size_t> singles;
    for (size_t r = 0; r < runs.size(); ++r)
        if (runs[r].second > 1)
            run(r);
        else
            singles.push_back(r);
    tbb::parallel_for(size_t(0), singles.size(), [&](size_t i) { run(singles[i]); });
    return true;
}

void PagedAttention::attend_sequence(int64_t handle, const float* qb, const float* kd, const float* vd, float* ob,
                                     int64_t Hq, int64_t Hkv, int64_t L, int64_t D) const {
    const int layer = static_cast<int>(m_layer);
    std::shared_ptr<Sequence> seq;
    try {
        seq = Registry::get().sequence(handle);
    } catch (const Error& e) {
        OPENVINO_THROW("ov_kvcrush PagedAttention: ", e.what());
    }
    std::lock_guard<std::mutex> lock(seq->mu);
    const PoolConfig& cfg = seq->pool().config();
    OPENVINO_ASSERT(layer < cfg.layers && Hq == cfg.q_heads && Hkv == cfg.kv_heads && D == cfg.head_dim,
                    "ov_kvcrush PagedAttention: layer ", layer, " with q_heads=", Hq, " kv_heads=", Hkv,
                    " head_dim=", D, " does not match the KV pool (layers=", cfg.layers, " q_heads=", cfg.q_heads,
                    " kv_heads=", cfg.kv_heads, " head_dim=", cfg.head_dim, ")");
    const LogitMap logit{m_scale, m_softcap};
    StepContext ctx(*seq, cfg, decide_step(*seq, cfg, layer, L), qb, ob, Hq, Hkv, D, logit);
    const StepMode& mode = ctx.mode;
    const StepTokensCleared step_tokens_cleared(ctx);
    const auto t_append = StepClock::now();
    append_step(ctx, kd, vd);
    seq->append_ns[mode.phase] += ns_since(t_append);
    run_hooks(ctx, run_before_attention);

    std::fill(ob, ob + Hq * L * D, 0.0f);
    ctx.lse.assign(mode.scores ? static_cast<size_t>(Hq * L) : 0, 0.0f);
    score_slot_ranges(ctx);
    bool fused_scores = false;  // the attention added the step's probabilities itself
    const auto t_attend = StepClock::now();
    const int64_t others_before = seq->scores_ns[mode.phase] + seq->policy_ns[mode.phase];
    if (!mode.scoring && !mode.window && cfg.policy->recalls(*seq, layer, mode.prefill))
        // a recall method (ClusterKV): only the recalled working set (its selection time goes to policy_ns)
        cfg.policy->attend_recalled(*seq, layer, qb, L, mode.past, logit, ob);
    else if (!cfg.count_only)  // a byte probe's step attends nothing (the output stays zero)
        fused_scores = mode.prompt_attention ? attend_prompt(ctx, m_compute == "bf16" && has_bf16()) : attend_decode(ctx);
    // a fused score pass (or a recall method's selection) counts as its own, not as attention
    seq->attend_ns[mode.phase] += ns_since(t_attend) - (seq->scores_ns[mode.phase] + seq->policy_ns[mode.phase] - others_before);

    const auto t_scores = StepClock::now();
    if (mode.scores && !fused_scores) accumulate_step_scores(ctx);
    seq->scores_ns[mode.phase] += ns_since(t_scores);
    for (int64_t g = 0; g < Hkv; ++g) ctx.head(g).step.staged_blocks = 0;  // the hooks move blocks: read them
    if (mode.scoring) return drop_scoring_step(ctx);
    if (mode.window > 0) return keep_window_ring(ctx);
    run_hooks(ctx, run_after_attention);  // the method's eviction, the 2-bit store's flush
}

}  // namespace ovkc
