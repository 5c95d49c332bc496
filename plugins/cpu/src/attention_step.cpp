// The stages of one sequence's step on one layer (attention_step.hpp); the op's driver,
// PagedAttention::attend_sequence, runs them in order.
#include "attention_step.hpp"

#include <openvino/core/except.hpp>
#include <tbb/blocked_range.h>
#include <tbb/enumerable_thread_specific.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "kernels.hpp"
#include "policy.hpp"
#include "sparse_prefill.hpp"

namespace ovkc {

namespace {
// Decode splits each head's cache into chunks of this many blocks so that all cores share the
// work even when there are fewer KV heads than cores (the partial softmaxes are then combined).
constexpr int64_t kDecodeChunkBlocks = 8;

size_t at(int64_t i) { return static_cast<size_t>(i); }
}  // namespace

StepMode decide_step(Sequence& seq, const PoolConfig& cfg, int layer, int64_t L) {
    StepMode m;
    m.layer = layer;
    m.L = L;
    m.past = seq.seen(layer);
    // a chunk of a prompt prefilled in parts: it attends and scores like the prompt's rows it
    // holds; the method's prompt hooks wait for the last chunk and then see the whole prompt
    m.prompt_end = seq.prompt_end;
    m.chunk = m.prompt_end > 0 && m.past < m.prompt_end;
    OPENVINO_ASSERT(!m.chunk || m.past + L <= m.prompt_end, "ov_kvcrush PagedAttention: a ", L, "-token step after ",
                    m.past, " tokens runs past the chunked prompt's ", m.prompt_end, " tokens");
    // a step of a scoring pass (KVzip): attend, keep each held slot's largest probability,
    // then drop the step's tokens; no hook runs
    m.scoring = seq.scoring;
    OPENVINO_ASSERT(!m.scoring || (!m.chunk && m.past > 0), "ov_kvcrush PagedAttention: a scoring pass needs a "
                    "prefilled, whole prompt (", m.past, " tokens seen)");
    // a sliding-window layer (Gemma 3's local layers): attends its window, keeps it as a ring
    // of blocks, and the method never runs there
    m.window = cfg.window(layer);
    m.hooks = !m.scoring && !m.window && (!m.chunk || m.past + L == m.prompt_end);
    m.hook_tokens = m.chunk ? m.prompt_end : L;
    m.prefill = m.past == 0 || m.chunk;
    m.scores = !cfg.count_only && !m.window && (m.scoring || step_scores(cfg, m.prefill));
    // a sliding-window layer is not the method's: a scoring step attends its window as a
    // decode step would, scores nothing, and is dropped like on every layer
    m.ranged = m.scoring && !m.window;
    m.prompt_attention = L > 1 || m.chunk || m.scoring;
    m.phase = m.prefill || m.scoring ? 0 : 1;
    return m;
}

// 1. the step's keys and values (and zeroed score slots) go into every head
void append_step(StepContext& ctx, const float* kd, const float* vd) {
    const PoolConfig& cfg = ctx.cfg;
    const int64_t L = ctx.mode.L, D = ctx.D, past = ctx.mode.past;
    ctx.held_before.assign(at(ctx.Hkv), 0);
    for (int64_t g = 0; g < ctx.Hkv; ++g) {
        HeadCache& hc = ctx.head(g);
        try {
            if (L > 1) compact(ctx.seq, hc);  // a chat turn's tokens attend a hole-free head (bf16 path)
            ctx.seq.reserve(hc, L);
        } catch (const Error& e) {
            OPENVINO_THROW("ov_kvcrush PagedAttention: ", e.what());
        }
        const int64_t base = hc.size();
        ctx.held_before[at(g)] = base;
        hc.pos.resize(at(base + L));
        if (cfg.keeps_scores()) hc.scores.resize(at(base + L) * ctx.G, 0.0f);
        if (!hc.degree.empty()) hc.degree.resize(at(base + L), 1.0f);
        if (!hc.bias.empty()) hc.bias.resize(at(base + L), 0.0f);
        const float* kh = kd + g * L * D;
        const float* vh = vd + g * L * D;
        for (int64_t i = 0; i < L; ++i) {
            hc.pos[at(base + i)] = past + i;
            store_token(cfg, ctx.seq.pool(), hc, base + i, kh + i * D, vh + i * D);
        }
        if (ctx.mode.prompt_attention) hc.step = StepTokens{kh, vh, past, L};
    }
    ctx.seq.seen(ctx.mode.layer) = past + L;
}

// a scoring step's slot ranges per KV head: its chunk's, the sinks' (the whole head otherwise)
void score_slot_ranges(StepContext& ctx) {
    ctx.slot_lo.assign(at(ctx.Hkv), 0);
    ctx.slot_hi.assign(at(ctx.Hkv), INT64_MAX);
    ctx.slot_sinks.assign(at(ctx.Hkv), 0);
    if (!ctx.mode.ranged) return;
    const int64_t sinks_end = ctx.cfg.policy->scoring_sinks();
    for (int64_t g = 0; g < ctx.Hkv; ++g) {
        const auto& pos = ctx.head(g).pos;
        const auto end = pos.begin() + ctx.held_before[at(g)];
        ctx.slot_lo[at(g)] = std::lower_bound(pos.begin(), end, ctx.seq.score_lo) - pos.begin();
        ctx.slot_hi[at(g)] = std::lower_bound(pos.begin(), end, ctx.seq.score_hi) - pos.begin();
        ctx.slot_sinks[at(g)] = std::min(ctx.slot_lo[at(g)], std::lower_bound(pos.begin(), end, sinks_end) - pos.begin());
    }
}

namespace {
// A decode step's work: per KV head, chunks of 2-bit blocks (MiniKV's store) then of
// full-precision blocks; each (head, row tile, chunk) is one task.
struct DecodeChunks {
    int row_tiles = 1;
    std::vector<int64_t> chunks, qchunks;
    int64_t max_chunks = 1;
    int64_t tasks() const { return static_cast<int64_t>(chunks.size()) * row_tiles * max_chunks; }
};

DecodeChunks decode_chunks(const StepContext& ctx) {
    DecodeChunks c;
    c.row_tiles = (ctx.G + kMaxRows - 1) / kMaxRows;
    c.chunks.assign(at(ctx.Hkv), 0);
    c.qchunks.assign(at(ctx.Hkv), 0);
    for (int64_t g = 0; g < ctx.Hkv; ++g) {
        const HeadCache& hc = ctx.head(g);
        const int64_t nb = static_cast<int64_t>(hc.blocks.size());
        const int64_t nqb = static_cast<int64_t>(hc.qblocks.size());
        c.qchunks[at(g)] = (nqb + kDecodeChunkBlocks - 1) / kDecodeChunkBlocks;
        c.chunks[at(g)] = c.qchunks[at(g)] + std::max<int64_t>(1, (nb + kDecodeChunkBlocks - 1) / kDecodeChunkBlocks);
        c.max_chunks = std::max(c.max_chunks, c.chunks[at(g)]);
    }
    return c;
}
}  // namespace

// 2a. decode: rows = the query heads of a KV group; each head's cache split into chunks whose
//     partial softmaxes are merged; with scores, each row's logits become probabilities here
bool attend_decode(StepContext& ctx) {
    const PoolConfig& cfg = ctx.cfg;
    const StepMode& m = ctx.mode;
    const int64_t D = ctx.D, G = ctx.G;
    const DecodeChunks c = decode_chunks(ctx);
    // scores: the attention keeps each row's logits, turned into probabilities below; a row's
    // logits are its head's 2-bit slots, then its full-precision slots
    int64_t logit_stride = 0;
    if (m.scores)
        for (int64_t g = 0; g < ctx.Hkv; ++g) {
            const HeadCache& hc = ctx.head(g);
            logit_stride = std::max(logit_stride, (static_cast<int64_t>(hc.qpos.size()) + hc.size() + 15) / 16 * 16);
        }
    std::vector<float> logits(at(ctx.Hq * logit_stride), -std::numeric_limits<float>::infinity());
    // partial results: per task, per row: m, l, out[D]
    const size_t row_floats = at(D + 2);
    std::vector<float> part(at(c.tasks()) * kMaxRows * row_floats);
    auto partial = [&](int64_t task, int64_t r) { return part.data() + (at(task) * kMaxRows + at(r)) * row_floats; };
    tbb::parallel_for(tbb::blocked_range<int64_t>(0, c.tasks(), 1), [&](const tbb::blocked_range<int64_t>& range) {
        for (int64_t t = range.begin(); t < range.end(); ++t) {
            const int64_t g = t / (c.row_tiles * c.max_chunks);
            const int64_t tile = (t / c.max_chunks) % c.row_tiles;
            const int64_t chunk = t % c.max_chunks;
            RowSet rows;
            rows.start();
            rows.window = m.window;
            rows.softcap = ctx.logit.softcap;
            rows.n = static_cast<int>(std::min<int64_t>(kMaxRows, G - tile * kMaxRows));
            const HeadCache& hc = ctx.head(g);
            const int64_t qc = c.qchunks[at(g)];
            // a full-precision chunk's logits go after the head's 2-bit slots
            const int64_t logit0 = chunk < qc ? 0 : static_cast<int64_t>(hc.qpos.size());
            for (int r = 0; r < rows.n; ++r) {
                const int64_t h = g * G + tile * kMaxRows + r;
                rows.q[r] = ctx.q + h * D;
                rows.qpos[r] = m.past;
                rows.out[r] = partial(t, r) + 2;
                if (m.scores) rows.logits[r] = logits.data() + h * logit_stride + logit0;
                std::fill(rows.out[r], rows.out[r] + D, 0.0f);
            }
            if (chunk < c.chunks[at(g)]) {
                if (chunk < qc) {
                    attend_quant(cfg, ctx.seq.pool(), hc, rows, ctx.logit.scale, chunk * kDecodeChunkBlocks,
                                 (chunk + 1) * kDecodeChunkBlocks);
                } else {
                    const int64_t span = kDecodeChunkBlocks * cfg.block_size;
                    attend_range(cfg, ctx.seq.pool(), hc, rows, ctx.logit.scale, (chunk - qc) * span, (chunk - qc + 1) * span);
                }
            }
            for (int r = 0; r < rows.n; ++r) {
                partial(t, r)[0] = rows.m[r];
                partial(t, r)[1] = rows.l[r];
            }
        }
    });
    // combine the chunks of each row
    for (int64_t h = 0; h < ctx.Hq; ++h) {
        const int64_t g = h / G, tile = (h % G) / kMaxRows, r = (h % G) % kMaxRows;
        const int64_t first = (g * c.row_tiles + tile) * c.max_chunks;  // this row's chunk tasks
        const float l = merge_partials(partial(first, r), kMaxRows * row_floats, static_cast<int>(c.max_chunks),
                                       static_cast<int>(D), ctx.out + h * D);
        if (m.scores) ctx.lse[at(h)] = l;
    }
    if (!m.scores) return false;
    const auto t_scores = StepClock::now();
    tbb::parallel_for(int64_t(0), ctx.Hkv, [&](int64_t g) {
        HeadCache& hc = ctx.head(g);
        for (int gi = 0; gi < G; ++gi) {
            const int64_t h = g * G + gi;
            add_probabilities(hc, static_cast<int>(G), gi, logits.data() + h * logit_stride, ctx.lse[at(h)]);
        }
    });
    ctx.seq.scores_ns[m.phase] += ns_since(t_scores);
    return true;
}

namespace {
// The first of the step's query rows whose probabilities the scores sum: SnapKV's prefill
// scores only the last window of queries (a chunk: the rows of the whole prompt's window that
// fall in this chunk); a scoring step scores every row.
int64_t first_scored_row(const StepContext& ctx) {
    const StepMode& m = ctx.mode;
    if (m.scoring) return 0;
    return m.chunk ? std::clamp<int64_t>(score_rows_from(ctx.cfg, true, m.prompt_end) - m.past, 0, m.L)
                   : score_rows_from(ctx.cfg, m.prefill, m.L);
}

// What a prompt step attends per KV head: the whole head, or a scoring step's sinks, chunk and
// itself (on the bf16 paths those slots are staged as one head: `views` holds their positions;
// in f32 the slot ranges are attended one after the other). A scoring step over the 2-bit store
// attends, of its quantized tokens, the sinks only (dequantized once per head: positions ascend,
// so they come first).
struct PromptHeads {
    std::vector<SlotRanges> ranges;
    std::vector<Slab> qsinks;
    std::vector<Bf16Head> staged;
    std::vector<HeadCache> views;
};

PromptHeads stage_prompt_heads(const StepContext& ctx, bool bf16) {
    const PoolConfig& cfg = ctx.cfg;
    const bool ranged = ctx.mode.ranged;
    PromptHeads p;
    p.ranges.resize(at(ctx.Hkv));
    for (int64_t g = 0; g < ctx.Hkv; ++g) {
        const size_t gi = at(g);
        const int64_t n = ctx.head(g).size();
        p.ranges[gi] = ranged ? SlotRanges{{0, ctx.slot_sinks[gi]}, {ctx.slot_lo[gi], ctx.slot_hi[gi]}, {ctx.held_before[gi], n}}
                              : SlotRanges{{0, n}};
    }
    p.qsinks.resize(ranged && cfg.policy->quant() ? at(ctx.Hkv) : 0);
    for (size_t gi = 0; gi < p.qsinks.size(); ++gi) {
        const HeadCache& hc = ctx.head(static_cast<int64_t>(gi));
        const auto sinks = std::lower_bound(hc.qpos.begin(), hc.qpos.end(), cfg.policy->scoring_sinks());
        load_quant_slab(cfg, ctx.seq.pool(), hc, sinks - hc.qpos.begin(), p.qsinks[gi]);
    }
    p.staged.resize(bf16 ? at(ctx.Hkv) : 0);
    p.views.resize(bf16 && ranged ? at(ctx.Hkv) : 0);
    if (bf16)
        tbb::parallel_for(int64_t(0), ctx.Hkv, [&](int64_t g) {
            const size_t gi = at(g);
            const HeadCache& hc = ctx.head(g);
            if (ranged)
                stage_bf16_ranges(cfg, ctx.seq.pool(), hc, p.ranges[gi], p.staged[gi], p.views[gi]);
            else
                stage_bf16(cfg, ctx.seq.pool(), hc, p.staged[gi]);
        });
    return p;
}

// the head whose positions the bf16 kernels mask by
const HeadCache& staged_head(const StepContext& ctx, const PromptHeads& p, int64_t g) {
    return ctx.mode.ranged ? p.views[at(g)] : ctx.head(g);
}

// 2b on AMX tiles: kAmxRows consecutive queries of one head per task; a scoring step's maxima
// come from the same bf16 logits
bool attend_prompt_amx(StepContext& ctx, const PromptHeads& p) {
    const StepMode& m = ctx.mode;
    const int64_t L = m.L, D = ctx.D, G = ctx.G;
    const int64_t atiles = (L + kAmxRows - 1) / kAmxRows;
    tbb::parallel_for(tbb::blocked_range<int64_t>(0, ctx.Hq * atiles, 1), [&](const tbb::blocked_range<int64_t>& range) {
        for (int64_t t = range.begin(); t < range.end(); ++t) {
            const int64_t h = t / atiles;
            const int64_t tile = atiles - 1 - t % atiles;  // the largest tiles first
            const int n = static_cast<int>(std::min<int64_t>(kAmxRows, L - tile * kAmxRows));
            const float* qr[kAmxRows];
            float* orow[kAmxRows];
            int64_t qpos[kAmxRows];
            float mx[kAmxRows], l[kAmxRows];
            for (int r = 0; r < n; ++r) {
                const int64_t i = tile * kAmxRows + r;
                qr[r] = ctx.q + (h * L + i) * D;
                orow[r] = ctx.out + (h * L + i) * D;
                qpos[r] = m.past + i;
            }
            attend_amx(ctx.cfg, staged_head(ctx, p, h / G), p.staged[at(h / G)], n, qr, qpos, orow, ctx.logit.scale, mx, l,
                       m.window);
            if (m.scores)
                for (int r = 0; r < n; ++r) ctx.lse[at(h * L + tile * kAmxRows + r)] = mx[r] + std::log(l[r]);
        }
    });
    if (!(m.ranged && m.scores)) return false;
    const auto t_scores = StepClock::now();
    std::vector<HeadCache*> heads(at(ctx.Hkv));
    for (int64_t g = 0; g < ctx.Hkv; ++g) heads[at(g)] = &ctx.head(g);
    score_step_amx(ctx.cfg, heads, ctx.q, L, ctx.logit.scale, ctx.lse, p.staged, ctx.slot_sinks, ctx.slot_lo, ctx.slot_hi);
    ctx.seq.scores_ns[m.phase] += ns_since(t_scores);
    return true;
}

// Per thread, per query head, the column sums of the probabilities its rows gave each slot (a
// prompt's scores summed inside the bf16 attention: the tasks of one head share its slots).
using ThreadColumns = tbb::enumerable_thread_specific<std::vector<float>>;

// each thread's sums into the heads' scores: slot j of KV head g, query head gi of its group
void add_thread_columns(StepContext& ctx, ThreadColumns& columns, int64_t width) {
    const auto t_scores = StepClock::now();
    for (const std::vector<float>& sums : columns)
        for (int64_t h = 0; h < ctx.Hq; ++h) {
            HeadCache& hc = ctx.head(h / ctx.G);
            const float* src = sums.data() + h * width;
            float* dst = hc.scores.data() + h % ctx.G;
            for (int64_t j = 0; j < hc.size(); ++j) dst[j * ctx.G] += src[j];
        }
    ctx.seq.scores_ns[ctx.mode.phase] += ns_since(t_scores);
}

// The key slots the rows at positions [first, last] of query head h attend under the sparse
// prefill's mask: their query block's kept key blocks, or nullptr where that block attends every
// causal one (the dense path, whose bf16 kernel also sums scores) or the rows straddle two blocks.
const SlotRanges* sparse_keys(const BlockMask& sparse, int64_t h, int64_t first, int64_t last, int64_t n,
                              SlotRanges& buf) {
    if (sparse.empty() || first / sparse.block_size != last / sparse.block_size) return nullptr;
    const int64_t i = first / sparse.block_size;
    buf = sparse.key_ranges(h, i, n);
    const bool dense = buf.size() == 1 && buf[0].first == 0 && buf[0].second == std::min(n, (i + 1) * sparse.block_size);
    return dense ? nullptr : &buf;
}

// 2b in rows: kMaxRows consecutive queries of one head per task (8 under a sparse mask whose
// blocks 12 does not divide), bf16 over a staged head or f32 over the blocks (the 2-bit store's
// first). The bf16 kernel also sums the probabilities the rows from `from` on give each slot (the
// step's scores, without a second pass over the keys; from = L: none). Under a sparse prefill's
// mask a tile attends its query block's kept key blocks only.
void attend_prompt_rows(StepContext& ctx, const PromptHeads& p, bool bf16, int64_t from, const BlockMask& sparse) {
    const StepMode& m = ctx.mode;
    const int64_t L = m.L, D = ctx.D, G = ctx.G;
    // a tile's rows stay inside one of the sparse mask's query blocks (its block size is a
    // multiple of 16, so of 8, not always of 12)
    const int64_t T = sparse.empty() || sparse.block_size % kMaxRows == 0 ? kMaxRows : 8;
    const int64_t tiles = (L + T - 1) / T;
    int64_t width = 0;  // the widest head, in slots
    for (int64_t g = 0; g < ctx.Hkv; ++g) width = std::max(width, ctx.head(g).size());
    ThreadColumns columns([&] { return std::vector<float>(static_cast<size_t>(ctx.Hq * width), 0.0f); });
    tbb::parallel_for(tbb::blocked_range<int64_t>(0, ctx.Hq * tiles, 1), [&](const tbb::blocked_range<int64_t>& range) {
        for (int64_t t = range.begin(); t < range.end(); ++t) {
            // consecutive tasks share a head (its keys stay in cache); within a head the
            // largest tiles (latest queries, most keys) come first for a better balance
            const int64_t h = t / tiles;
            const int64_t tile = tiles - 1 - t % tiles;
            const HeadCache& hc = ctx.head(h / G);
            RowSet rows;
            rows.start();
            rows.window = m.window;
            rows.softcap = ctx.logit.softcap;
            rows.n = static_cast<int>(std::min<int64_t>(T, L - tile * T));
            for (int r = 0; r < rows.n; ++r) {
                const int64_t i = tile * T + r;
                rows.q[r] = ctx.q + (h * L + i) * D;
                rows.qpos[r] = m.past + i;
                rows.out[r] = ctx.out + (h * L + i) * D;
            }
            SlotRanges sparse_buf;
            const int64_t pos0 = m.past + tile * T;
            const SlotRanges* keys = sparse_keys(sparse, h, pos0, pos0 + rows.n - 1, hc.size(), sparse_buf);
            if (bf16 && hc.qblocks.empty() && hc.bias.empty()) {
                ColumnSums sums;
                const bool scored = tile * T + rows.n > from;  // never under a sparse mask
                if (scored) {
                    sums.sums = columns.local().data() + h * width;
                    sums.first_row = static_cast<int>(std::max<int64_t>(0, from - tile * T));
                }
                attend_bf16(ctx.cfg, staged_head(ctx, p, h / G), p.staged[at(h / G)], rows, ctx.logit.scale,
                            scored ? &sums : nullptr, keys);
            } else {
                if (m.ranged && !p.qsinks.empty())
                    attend_slab(p.qsinks[at(h / G)], INT64_MAX, static_cast<int>(D), rows, ctx.logit.scale, -1);
                else if (!hc.qblocks.empty())
                    attend_quant(ctx.cfg, ctx.seq.pool(), hc, rows, ctx.logit.scale, 0, static_cast<int64_t>(hc.qblocks.size()));
                for (const auto& [begin, end] : keys ? *keys : p.ranges[at(h / G)])
                    attend_range(ctx.cfg, ctx.seq.pool(), hc, rows, ctx.logit.scale, begin, end);
                finish_rows(rows, static_cast<int>(D));
            }
            if (m.scores)
                for (int r = 0; r < rows.n; ++r)
                    ctx.lse[at(h * L + tile * T + r)] = rows.m[r] + std::log(rows.l[r]);
        }
    });
    if (from < L) add_thread_columns(ctx, columns, width);
}

// A prompt step of several query tiles over a store that is not f32 (u8, f16) on the f32 path:
// every head's blocks converted to f32 once (the step's tokens exact), for its tiles and its score
// pass (the bf16 path stages its own, stage_prompt_heads).
void stage_f32_heads(StepContext& ctx) {
    const PoolConfig& cfg = ctx.cfg;
    // (a scoring step attends a few ranges of a long head: converting all of it would cost more)
    if (cfg.precision == Precision::f32 || ctx.mode.L <= kMaxRows || ctx.mode.ranged) return;
    ctx.f32_heads.resize(at(ctx.Hkv));
    tbb::parallel_for(int64_t(0), ctx.Hkv, [&](int64_t g) { stage_f32(cfg, ctx.seq.pool(), ctx.head(g), ctx.f32_heads[at(g)]); });
}
}  // namespace

// 2b. a prompt (or a chunk of a chat turn, or a scoring step): tiles of consecutive queries of
//     one head; a scoring step (KVzip's reconstruction) attends only the sinks, its chunk and itself
bool attend_prompt(StepContext& ctx, bool bf16) {
    if (!bf16) stage_f32_heads(ctx);
    const PromptHeads p = stage_prompt_heads(ctx, bf16);
    const int64_t from = ctx.mode.scores && !ctx.mode.ranged ? first_scored_row(ctx) : ctx.mode.L;
    const BlockMask sparse = sparse_prefill_mask(ctx, from, bf16);
    // the AMX kernels take raw logits and every key: a soft-capped model's prompt, and a sparse
    // one, take the AVX512-BF16 rows
    bool amx = bf16 && ctx.logit.softcap == 0.0f && sparse.empty() && amx_head_dim(static_cast<int>(ctx.D)) && has_amx();
    for (int64_t g = 0; amx && g < ctx.Hkv; ++g) amx = ctx.head(g).qblocks.empty() && ctx.head(g).bias.empty();
    if (amx) return attend_prompt_amx(ctx, p);
    // a prompt's scores on the bf16 path come out of the attention itself when every head is
    // attended there (no 2-bit blocks, no merge bias; not a scoring step, which keeps maxima)
    bool fuse = bf16 && from < ctx.mode.L;
    for (int64_t g = 0; fuse && g < ctx.Hkv; ++g) fuse = ctx.head(g).qblocks.empty() && ctx.head(g).bias.empty();
    attend_prompt_rows(ctx, p, bf16, fuse ? from : ctx.mode.L, sparse);
    return fuse;
}

// 3. per-head scores: each task owns one block of one KV head, so no two tasks add to the same
//    slot; it recomputes the probabilities of every query row of the group. The 2-bit blocks
//    come first (tasks [0, max_qblocks)), where their scores are kept.
void accumulate_step_scores(StepContext& ctx) {
    const PoolConfig& cfg = ctx.cfg;
    const StepMode& m = ctx.mode;
    const int64_t L = m.L, D = ctx.D, G = ctx.G;
    // the 2-bit blocks of a head whose scores are kept (a scoring step scores none of them)
    auto scored_qblocks = [&](const HeadCache& hc) -> int64_t {
        return hc.qscores.empty() || m.scoring ? 0 : static_cast<int64_t>(hc.qblocks.size());
    };
    int64_t max_blocks = 0, max_qblocks = 0;
    for (int64_t g = 0; g < ctx.Hkv; ++g) {
        const HeadCache& hc = ctx.head(g);
        max_qblocks = std::max(max_qblocks, scored_qblocks(hc));
        max_blocks = std::max<int64_t>(max_blocks, hc.blocks.size());
    }
    const int64_t units = max_qblocks + max_blocks;
    const int64_t from = first_scored_row(ctx);
    const int64_t Lw = L - from;
    const int64_t rows_total = G * Lw;
    tbb::parallel_for(tbb::blocked_range<int64_t>(0, ctx.Hkv * units, 1), [&](const tbb::blocked_range<int64_t>& range) {
        for (int64_t t = range.begin(); t < range.end(); ++t) {
            const int64_t g = t / units, unit = t % units;
            const bool quant_block = unit < max_qblocks;
            const int64_t blk = quant_block ? unit : unit - max_qblocks;
            HeadCache& hc = ctx.head(g);
            if (blk >= (quant_block ? scored_qblocks(hc) : static_cast<int64_t>(hc.blocks.size()))) continue;
            const int64_t lo = ctx.slot_lo[at(g)], hi = ctx.slot_hi[at(g)];
            if (m.scoring && ((blk + 1) * cfg.block_size <= lo || blk * cfg.block_size >= hi)) continue;
            for (int64_t r0 = 0; r0 < rows_total; r0 += kMaxRows) {
                RowSet rows;
                rows.softcap = ctx.logit.softcap;
                float row_lse[kMaxRows];
                rows.n = static_cast<int>(std::min<int64_t>(kMaxRows, rows_total - r0));
                for (int r = 0; r < rows.n; ++r) {
                    const int64_t gi = (r0 + r) / Lw, i = from + (r0 + r) % Lw, h = g * G + gi;
                    rows.q[r] = ctx.q + (h * L + i) * D;
                    rows.qpos[r] = m.past + i;
                    rows.group_index[r] = static_cast<int>(gi);
                    row_lse[r] = ctx.lse[at(h * L + i)];
                }
                if (quant_block)
                    accumulate_quant_scores(cfg, ctx.seq.pool(), hc, rows, row_lse, ctx.logit.scale, blk);
                else
                    accumulate_scores(cfg, ctx.seq.pool(), hc, rows, row_lse, ctx.logit.scale, blk, m.scoring, lo, hi);
            }
        }
    });
}

// a scoring step's tokens go again: every head holds what it held before the step
void drop_scoring_step(StepContext& ctx) {
    for (int64_t g = 0; g < ctx.Hkv; ++g) {
        HeadCache& hc = ctx.head(g);
        const int64_t base = ctx.held_before[at(g)];
        hc.pos.resize(at(base));
        if (!hc.scores.empty()) hc.scores.resize(at(base) * ctx.G);
        if (!hc.degree.empty()) hc.degree.resize(at(base));
        if (!hc.bias.empty()) hc.bias.resize(at(base));
        ctx.seq.trim_blocks(hc);
    }
    ctx.seq.seen(ctx.mode.layer) = ctx.mode.past;
}

// a sliding-window layer's ring: whole blocks before the next query's window go back
void keep_window_ring(StepContext& ctx) {
    const int64_t bs = ctx.cfg.block_size;
    const int64_t next_first = ctx.mode.past + ctx.mode.L - ctx.mode.window + 1;
    for (int64_t g = 0; g < ctx.Hkv; ++g) {
        HeadCache& hc = ctx.head(g);
        const int64_t first = std::lower_bound(hc.pos.begin(), hc.pos.end(), next_first) - hc.pos.begin();
        if (first < bs) continue;
        std::vector<int64_t> keep(at(hc.size() - first / bs * bs));
        for (size_t j = 0; j < keep.size(); ++j) keep[j] = first / bs * bs + static_cast<int64_t>(j);
        keep_blocks(ctx.seq, hc, keep);
    }
}

}  // namespace ovkc
