#include "attention_op.hpp"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <mutex>
#include <vector>

#include "kernels.hpp"
#include "paged_cache.hpp"
#include "policy.hpp"

namespace ovkc {

namespace {
// Decode splits each head's cache into chunks of this many blocks so that all cores share the
// work even when there are fewer KV heads than cores (the partial softmaxes are then combined).
constexpr int64_t kDecodeChunkBlocks = 8;

std::string shape_str(const ov::Shape& s) {
    std::string out = "[";
    for (size_t i = 0; i < s.size(); ++i) out += (i ? "," : "") + std::to_string(s[i]);
    return out + "]";
}
}  // namespace

PagedAttention::PagedAttention(const ov::OutputVector& args, int64_t layer, float scale, std::string compute)
    : Op(args), m_layer(layer), m_scale(scale), m_compute(std::move(compute)) {
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
    set_output_type(0, get_input_element_type(0), q);
}

std::shared_ptr<ov::Node> PagedAttention::clone_with_new_inputs(const ov::OutputVector& new_args) const {
    return std::make_shared<PagedAttention>(new_args, m_layer, m_scale, m_compute);
}

bool PagedAttention::visit_attributes(ov::AttributeVisitor& visitor) {
    visitor.on_attribute("layer", m_layer);
    visitor.on_attribute("scale", m_scale);
    visitor.on_attribute("compute", m_compute);
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
    // runs of equal handles: each is one sequence's step (a batch row, or adjacent tokens of a
    // one-row batch), attended like a batch row of its own. Steps of different sequences run side
    // by side, so one sequence may have only one.
    std::vector<std::pair<int64_t, int64_t>> runs;  // (first token or row, tokens)
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
    const int G = cfg.group();
    const int64_t past = seq->seen(layer);
    // a chunk of a prompt prefilled in parts: it attends and scores like the prompt's rows it
    // holds; the method's prompt hooks wait for the last chunk and then see the whole prompt
    const int64_t prompt_end = seq->prompt_end;
    const bool chunk = prompt_end > 0 && past < prompt_end;
    OPENVINO_ASSERT(!chunk || past + L <= prompt_end, "ov_kvcrush PagedAttention: a ", L, "-token step after ", past,
                    " tokens runs past the chunked prompt's ", prompt_end, " tokens");
    // a step of a scoring pass (KVzip): attend, keep each held slot's largest probability,
    // then drop the step's tokens; no hook runs
    const bool scoring = seq->scoring;
    OPENVINO_ASSERT(!scoring || (!chunk && past > 0), "ov_kvcrush PagedAttention: a scoring pass needs a prefilled, "
                    "whole prompt (", past, " tokens seen)");
    // a sliding-window layer (Gemma 3's local layers): attends its window, keeps it as a ring
    // of blocks, and the method never runs there
    const int64_t window = cfg.window(layer);
    const bool hooks = !scoring && !window && (!chunk || past + L == prompt_end);
    std::vector<int64_t> held_before(static_cast<size_t>(Hkv));
    const int64_t hook_tokens = chunk ? prompt_end : L;

    // 1. append the step's keys and values (and zeroed score slots) to every head
    for (int64_t g = 0; g < Hkv; ++g) {
        HeadCache& hc = seq->head(layer, static_cast<int>(g));
        try {
            if (L > 1) compact(*seq, hc);  // a chat turn's tokens attend a hole-free head (bf16 path)
            seq->reserve(hc, L);
        } catch (const Error& e) {
            OPENVINO_THROW("ov_kvcrush PagedAttention: ", e.what());
        }
        const int64_t base = hc.size();
        held_before[static_cast<size_t>(g)] = base;
        hc.pos.resize(static_cast<size_t>(base + L));
        if (cfg.keeps_scores()) hc.scores.resize(static_cast<size_t>(base + L) * G, 0.0f);
        if (!hc.degree.empty()) hc.degree.resize(static_cast<size_t>(base + L), 1.0f);
        if (!hc.bias.empty()) hc.bias.resize(static_cast<size_t>(base + L), 0.0f);
        const float* kh = kd + g * L * D;
        const float* vh = vd + g * L * D;
        for (int64_t i = 0; i < L; ++i) {
            hc.pos[static_cast<size_t>(base + i)] = past + i;
            store_token(cfg, seq->pool(), hc, base + i, kh + i * D, vh + i * D);
        }
    }
    seq->seen(layer) = past + L;
    const bool prefill = past == 0 || chunk;
    const bool scores = !cfg.count_only && !window && (scoring || step_scores(cfg, prefill));
    using Clock = std::chrono::steady_clock;
    auto since = [](Clock::time_point t0) {
        return static_cast<int64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count());
    };
    const int phase = prefill || scoring ? 0 : 1;
    auto t_policy = Clock::now();
    try {
        if (hooks) run_before_attention(*seq, layer, prefill, hook_tokens);
    } catch (const Error& e) {
        OPENVINO_THROW("ov_kvcrush PagedAttention: ", e.what());
    }
    seq->policy_ns[phase] += since(t_policy);

    std::fill(ob, ob + Hq * L * D, 0.0f);
    // log-sum-exp of each (head, query) row, for the score pass
    std::vector<float> lse(scores ? static_cast<size_t>(Hq * L) : 0);
    bool fused_scores = false;  // a decode step adds its probabilities during the attention

    const Policy& policy = *cfg.policy;
    // a scoring step attends (and scores) its chunk's slots [slot_lo, slot_hi), the sinks
    // [0, slot_sinks) and itself
    std::vector<int64_t> slot_lo(static_cast<size_t>(Hkv), 0), slot_hi(static_cast<size_t>(Hkv), INT64_MAX);
    std::vector<int64_t> slot_sinks(static_cast<size_t>(Hkv), 0);
    // a sliding-window layer is not the method's: a scoring step attends its window as a
    // decode step would, scores nothing, and is dropped like on every layer
    const bool ranged = scoring && !window;
    if (ranged)
        for (int64_t g = 0; g < Hkv; ++g) {
            const auto& pos = seq->head(layer, static_cast<int>(g)).pos;
            const auto end = pos.begin() + held_before[static_cast<size_t>(g)];
            const size_t gi = static_cast<size_t>(g);
            slot_lo[gi] = std::lower_bound(pos.begin(), end, seq->score_lo) - pos.begin();
            slot_hi[gi] = std::lower_bound(pos.begin(), end, seq->score_hi) - pos.begin();
            slot_sinks[gi] = std::min(slot_lo[gi], std::lower_bound(pos.begin(), end, policy.scoring_sinks()) - pos.begin());
        }
    if (!scoring && !window && policy.recalls(*seq, layer, prefill)) {
        // 2c. a recall method (ClusterKV): attend only the recalled working set (its selection
        //     time goes to policy_ns)
        policy.attend_recalled(*seq, layer, qb, L, past, m_scale, ob);
    } else if (cfg.count_only) {
        // a byte probe's step: nothing is attended (the output stays zero)
    } else if (L == 1 && !chunk && !scoring) {
        // 2a. decode: rows = the query heads of a KV group; split the cache into chunks
        const int row_tiles = (G + kMaxRows - 1) / kMaxRows;
        // chunks of 2-bit blocks first (MiniKV's store), then of full-precision blocks
        std::vector<int64_t> chunks(static_cast<size_t>(Hkv)), qchunks(static_cast<size_t>(Hkv));
        int64_t max_chunks = 1;
        for (int64_t g = 0; g < Hkv; ++g) {
            const HeadCache& hc = seq->head(layer, static_cast<int>(g));
            const int64_t nb = static_cast<int64_t>(hc.blocks.size());
            const int64_t nqb = static_cast<int64_t>(hc.qblocks.size());
            qchunks[static_cast<size_t>(g)] = (nqb + kDecodeChunkBlocks - 1) / kDecodeChunkBlocks;
            chunks[static_cast<size_t>(g)] = qchunks[static_cast<size_t>(g)] +
                                             std::max<int64_t>(1, (nb + kDecodeChunkBlocks - 1) / kDecodeChunkBlocks);
            max_chunks = std::max(max_chunks, chunks[static_cast<size_t>(g)]);
        }
        const int64_t tasks = Hkv * row_tiles * max_chunks;
        // scores: the attention keeps each row's logits, turned into probabilities below; a row's
        // logits are its head's 2-bit slots, then its full-precision slots
        int64_t logit_stride = 0;
        if (scores)
            for (int64_t g = 0; g < Hkv; ++g) {
                const HeadCache& hc = seq->head(layer, static_cast<int>(g));
                logit_stride = std::max(logit_stride, (static_cast<int64_t>(hc.qpos.size()) + hc.size() + 15) / 16 * 16);
            }
        std::vector<float> logits(static_cast<size_t>(Hq * logit_stride), -std::numeric_limits<float>::infinity());
        // partial results: per task, per row: m, l, out[D]
        const size_t row_floats = static_cast<size_t>(D + 2);
        std::vector<float> part(static_cast<size_t>(tasks) * kMaxRows * row_floats);
        auto partial = [&](int64_t task, int64_t r) { return part.data() + (static_cast<size_t>(task) * kMaxRows + r) * row_floats; };
        tbb::parallel_for(tbb::blocked_range<int64_t>(0, tasks, 1), [&](const tbb::blocked_range<int64_t>& range) {
            for (int64_t t = range.begin(); t < range.end(); ++t) {
                const int64_t g = t / (row_tiles * max_chunks);
                const int64_t tile = (t / max_chunks) % row_tiles;
                const int64_t chunk = t % max_chunks;
                RowSet rows;
                rows.start();
                rows.window = window;
                rows.n = static_cast<int>(std::min<int64_t>(kMaxRows, G - tile * kMaxRows));
                const HeadCache& hc = seq->head(layer, static_cast<int>(g));
                const int64_t qc = qchunks[static_cast<size_t>(g)];
                // a full-precision chunk's logits go after the head's 2-bit slots
                const int64_t logit0 = chunk < qc ? 0 : static_cast<int64_t>(hc.qpos.size());
                for (int r = 0; r < rows.n; ++r) {
                    const int64_t h = g * G + tile * kMaxRows + r;
                    rows.q[r] = qb + h * D;
                    rows.qpos[r] = past;
                    rows.out[r] = partial(t, r) + 2;
                    if (scores) rows.logits[r] = logits.data() + h * logit_stride + logit0;
                    std::fill(rows.out[r], rows.out[r] + D, 0.0f);
                }
                if (chunk < chunks[static_cast<size_t>(g)]) {
                    if (chunk < qc) {
                        attend_quant(cfg, seq->pool(), hc, rows, m_scale, chunk * kDecodeChunkBlocks,
                                     (chunk + 1) * kDecodeChunkBlocks);
                    } else {
                        const int64_t span = kDecodeChunkBlocks * cfg.block_size;
                        attend_range(cfg, seq->pool(), hc, rows, m_scale, (chunk - qc) * span, (chunk - qc + 1) * span);
                    }
                }
                for (int r = 0; r < rows.n; ++r) {
                    partial(t, r)[0] = rows.m[r];
                    partial(t, r)[1] = rows.l[r];
                }
            }
        });
        // combine the chunks of each row
        for (int64_t h = 0; h < Hq; ++h) {
            const int64_t g = h / G, tile = (h % G) / kMaxRows, r = (h % G) % kMaxRows;
            const int64_t first = (g * row_tiles + tile) * max_chunks;  // this row's chunk tasks
            const float l = merge_partials(partial(first, r), kMaxRows * row_floats, static_cast<int>(max_chunks),
                                           static_cast<int>(D), ob + h * D);
            if (scores) lse[static_cast<size_t>(h)] = l;
        }
        if (scores) {
            const auto t_scores = Clock::now();
            tbb::parallel_for(int64_t(0), Hkv, [&](int64_t g) {
                HeadCache& hc = seq->head(layer, static_cast<int>(g));
                for (int gi = 0; gi < G; ++gi) {
                    const int64_t h = g * G + gi;
                    add_probabilities(hc, G, gi, logits.data() + h * logit_stride, lse[static_cast<size_t>(h)]);
                }
            });
            seq->scores_ns[phase] += since(t_scores);
            fused_scores = true;
        }
    } else {
        // 2b. prefill (or a chunk of a chat turn, or a scoring step): rows = kMaxRows consecutive
        //     queries of one head (kAmxRows on AMX tiles). A scoring step (KVzip's
        //     reconstruction) attends only the sinks, its chunk and itself: on the bf16 paths
        //     those slots are staged as one head (`views` holds their positions), in f32 the
        //     slot ranges are attended one after the other.
        using Ranges = std::vector<std::pair<int64_t, int64_t>>;
        std::vector<Ranges> ranges(static_cast<size_t>(Hkv));
        for (int64_t g = 0; g < Hkv; ++g) {
            const size_t gi = static_cast<size_t>(g);
            const int64_t n = seq->head(layer, static_cast<int>(g)).size();
            ranges[gi] = ranged ? Ranges{{0, slot_sinks[gi]}, {slot_lo[gi], slot_hi[gi]}, {held_before[gi], n}}
                                : Ranges{{0, n}};
        }
        // a scoring step over the 2-bit store attends, of its quantized tokens, the sinks only
        // (dequantized once per head, positions ascend so they come first)
        std::vector<Slab> qsinks(ranged && policy.quant() ? static_cast<size_t>(Hkv) : 0);
        for (size_t gi = 0; gi < qsinks.size(); ++gi) {
            const HeadCache& hc = seq->head(layer, static_cast<int>(gi));
            const auto sinks = std::lower_bound(hc.qpos.begin(), hc.qpos.end(), policy.scoring_sinks());
            load_quant_slab(cfg, seq->pool(), hc, sinks - hc.qpos.begin(), qsinks[gi]);
        }
        const int64_t tiles = (L + kMaxRows - 1) / kMaxRows;
        const bool bf16 = m_compute == "bf16" && has_bf16();
        std::vector<Bf16Head> staged(bf16 ? static_cast<size_t>(Hkv) : 0);
        std::vector<HeadCache> views(bf16 && ranged ? static_cast<size_t>(Hkv) : 0);
        if (bf16)
            tbb::parallel_for(int64_t(0), Hkv, [&](int64_t g) {
                const size_t gi = static_cast<size_t>(g);
                const HeadCache& hc = seq->head(layer, static_cast<int>(g));
                if (ranged)
                    stage_bf16_ranges(cfg, seq->pool(), hc, ranges[gi], staged[gi], views[gi]);
                else
                    stage_bf16(cfg, seq->pool(), hc, staged[gi]);
            });
        // the head whose positions the bf16 kernels mask by
        auto staged_head = [&](int64_t g) -> const HeadCache& {
            return ranged ? views[static_cast<size_t>(g)] : seq->head(layer, static_cast<int>(g));
        };
        bool amx = bf16 && amx_head_dim(static_cast<int>(D)) && has_amx();
        for (int64_t g = 0; amx && g < Hkv; ++g) {
            const HeadCache& hc = seq->head(layer, static_cast<int>(g));
            amx = hc.qblocks.empty() && hc.bias.empty();
        }
        if (amx) {
            const int64_t atiles = (L + kAmxRows - 1) / kAmxRows;
            tbb::parallel_for(tbb::blocked_range<int64_t>(0, Hq * atiles, 1), [&](const tbb::blocked_range<int64_t>& range) {
                for (int64_t t = range.begin(); t < range.end(); ++t) {
                    const int64_t h = t / atiles;
                    const int64_t tile = atiles - 1 - t % atiles;  // the largest tiles first
                    const int n = static_cast<int>(std::min<int64_t>(kAmxRows, L - tile * kAmxRows));
                    const float* qr[kAmxRows];
                    float* orow[kAmxRows];
                    int64_t qpos[kAmxRows];
                    float m[kAmxRows], l[kAmxRows];
                    for (int r = 0; r < n; ++r) {
                        const int64_t i = tile * kAmxRows + r;
                        qr[r] = qb + (h * L + i) * D;
                        orow[r] = ob + (h * L + i) * D;
                        qpos[r] = past + i;
                    }
                    attend_amx(cfg, staged_head(h / G), staged[static_cast<size_t>(h / G)], n, qr, qpos, orow, m_scale, m, l,
                               window);
                    if (scores)
                        for (int r = 0; r < n; ++r)
                            lse[static_cast<size_t>(h * L + tile * kAmxRows + r)] = m[r] + std::log(l[r]);
                }
            });
            if (ranged && scores) {  // a scoring step's maxima from the same bf16 logits, on tiles
                const auto t_scores = Clock::now();
                std::vector<HeadCache*> heads(static_cast<size_t>(Hkv));
                for (int64_t g = 0; g < Hkv; ++g) heads[static_cast<size_t>(g)] = &seq->head(layer, static_cast<int>(g));
                score_step_amx(cfg, heads, qb, L, m_scale, lse, staged, slot_sinks, slot_lo, slot_hi);
                seq->scores_ns[phase] += since(t_scores);
                fused_scores = true;
            }
        } else
        tbb::parallel_for(tbb::blocked_range<int64_t>(0, Hq * tiles, 1), [&](const tbb::blocked_range<int64_t>& range) {
            for (int64_t t = range.begin(); t < range.end(); ++t) {
                // consecutive tasks share a head (its keys stay in cache); within a head the
                // largest tiles (latest queries, most keys) come first for a better balance
                const int64_t h = t / tiles;
                const int64_t tile = tiles - 1 - t % tiles;
                const HeadCache& hc = seq->head(layer, static_cast<int>(h / G));
                RowSet rows;
                rows.start();
                rows.window = window;
                rows.n = static_cast<int>(std::min<int64_t>(kMaxRows, L - tile * kMaxRows));
                for (int r = 0; r < rows.n; ++r) {
                    const int64_t i = tile * kMaxRows + r;
                    rows.q[r] = qb + (h * L + i) * D;
                    rows.qpos[r] = past + i;
                    rows.out[r] = ob + (h * L + i) * D;
                }
                if (bf16 && hc.qblocks.empty() && hc.bias.empty()) {
                    attend_bf16(cfg, staged_head(h / G), staged[static_cast<size_t>(h / G)], rows, m_scale);
                } else {
                    if (ranged && !qsinks.empty())
                        attend_slab(qsinks[static_cast<size_t>(h / G)], INT64_MAX, static_cast<int>(D), rows, m_scale, -1);
                    else if (!hc.qblocks.empty())
                        attend_quant(cfg, seq->pool(), hc, rows, m_scale, 0, static_cast<int64_t>(hc.qblocks.size()));
                    for (const auto& [begin, end] : ranges[static_cast<size_t>(h / G)])
                        attend_range(cfg, seq->pool(), hc, rows, m_scale, begin, end);
                    finish_rows(rows, static_cast<int>(D));
                }
                if (scores)
                    for (int r = 0; r < rows.n; ++r)
                        lse[static_cast<size_t>(h * L + tile * kMaxRows + r)] = rows.m[r] + std::log(rows.l[r]);
            }
        });
    }

    // 3. per-head scores: each task owns one block of one KV head, so no two tasks add to
    //    the same slot; it recomputes the probabilities of every query row of the group. The
    //    2-bit blocks come first (tasks [0, max_qblocks)), where their scores are kept.
    const auto t_scores = Clock::now();
    if (scores && !fused_scores) {
        // the 2-bit blocks of a head whose scores are kept (a scoring step scores none of them)
        auto scored_qblocks = [&](const HeadCache& hc) -> int64_t {
            return hc.qscores.empty() || scoring ? 0 : static_cast<int64_t>(hc.qblocks.size());
        };
        int64_t max_blocks = 0, max_qblocks = 0;
        for (int64_t g = 0; g < Hkv; ++g) {
            const HeadCache& hc = seq->head(layer, static_cast<int>(g));
            max_qblocks = std::max(max_qblocks, scored_qblocks(hc));
            max_blocks = std::max<int64_t>(max_blocks, hc.blocks.size());
        }
        const int64_t units = max_qblocks + max_blocks;
        // SnapKV's prefill scores only the last window of queries
        // (a chunk: the rows of the whole prompt's window that fall in this chunk)
        const int64_t from = scoring ? 0
                             : chunk ? std::clamp<int64_t>(score_rows_from(cfg, true, prompt_end) - past, 0, L)
                                     : score_rows_from(cfg, prefill, L);
        const int64_t Lw = L - from;
        const int64_t rows_total = G * Lw;
        tbb::parallel_for(tbb::blocked_range<int64_t>(0, Hkv * units, 1), [&](const tbb::blocked_range<int64_t>& range) {
            for (int64_t t = range.begin(); t < range.end(); ++t) {
                const int64_t g = t / units, unit = t % units;
                const bool quant_block = unit < max_qblocks;
                const int64_t blk = quant_block ? unit : unit - max_qblocks;
                HeadCache& hc = seq->head(layer, static_cast<int>(g));
                if (blk >= (quant_block ? scored_qblocks(hc) : static_cast<int64_t>(hc.blocks.size()))) continue;
                const int64_t lo = slot_lo[static_cast<size_t>(g)], hi = slot_hi[static_cast<size_t>(g)];
                if (scoring && ((blk + 1) * cfg.block_size <= lo || blk * cfg.block_size >= hi)) continue;
                for (int64_t r0 = 0; r0 < rows_total; r0 += kMaxRows) {
                    RowSet rows;
                    float row_lse[kMaxRows];
                    rows.n = static_cast<int>(std::min<int64_t>(kMaxRows, rows_total - r0));
                    for (int r = 0; r < rows.n; ++r) {
                        const int64_t gi = (r0 + r) / Lw, i = from + (r0 + r) % Lw, h = g * G + gi;
                        rows.q[r] = qb + (h * L + i) * D;
                        rows.qpos[r] = past + i;
                        rows.group_index[r] = static_cast<int>(gi);
                        row_lse[r] = lse[static_cast<size_t>(h * L + i)];
                    }
                    if (quant_block)
                        accumulate_quant_scores(cfg, seq->pool(), hc, rows, row_lse, m_scale, blk);
                    else
                        accumulate_scores(cfg, seq->pool(), hc, rows, row_lse, m_scale, blk, scoring, lo, hi);
                }
            }
        });
    }

    seq->scores_ns[phase] += since(t_scores);
    if (scoring) {  // the scoring step's tokens go again
        for (int64_t g = 0; g < Hkv; ++g) {
            HeadCache& hc = seq->head(layer, static_cast<int>(g));
            const int64_t base = held_before[static_cast<size_t>(g)];
            hc.pos.resize(static_cast<size_t>(base));
            if (!hc.scores.empty()) hc.scores.resize(static_cast<size_t>(base) * G);
            if (!hc.degree.empty()) hc.degree.resize(static_cast<size_t>(base));
            if (!hc.bias.empty()) hc.bias.resize(static_cast<size_t>(base));
            seq->trim_blocks(hc);
        }
        seq->seen(layer) = past;
        return;
    }
    if (window > 0) {  // the ring: whole blocks before the next query's window go back
        const int64_t bs = cfg.block_size;
        for (int64_t g = 0; g < Hkv; ++g) {
            HeadCache& hc = seq->head(layer, static_cast<int>(g));
            const int64_t first = std::lower_bound(hc.pos.begin(), hc.pos.end(), past + L - window + 1) - hc.pos.begin();
            if (first < bs) continue;
            std::vector<int64_t> keep(static_cast<size_t>(hc.size() - first / bs * bs));
            for (size_t j = 0; j < keep.size(); ++j) keep[j] = first / bs * bs + static_cast<int64_t>(j);
            keep_blocks(*seq, hc, keep);
        }
        return;
    }
    // 4. the method's eviction (prefill selection, decode budget) and the 2-bit store's flush
    t_policy = Clock::now();
    try {
        if (hooks) run_after_attention(*seq, layer, prefill, hook_tokens);
    } catch (const Error& e) {
        OPENVINO_THROW("ov_kvcrush PagedAttention: ", e.what());
    }
    seq->policy_ns[phase] += since(t_policy);
}

}  // namespace ovkc
