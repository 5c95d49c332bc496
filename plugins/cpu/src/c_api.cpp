// C API of the KV cache, for Python (ctypes) in the same process as the OpenVINO runtime that
// loaded this library: create/free pools and sequences, reset a sequence, read statistics.
//
// Every function returns 0 (or a handle > 0) on success and -1 on error; ovkc_last_error() then
// gives the message. No exception crosses this boundary.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <numeric>
#include <string>
#include <vector>

#include "c_api.hpp"
#include "clusterkv.hpp"
#include "kernels.hpp"
#include "paged_cache.hpp"
#include "kvcrush.hpp"
#include "policy.hpp"
#include "selection.hpp"

using ovkc::Registry;
using ovkc_c::guarded;
using ovkc_c::head_of;
using ovkc_c::g_error;

OVKC_API const char* ovkc_last_error() { return g_error.c_str(); }

OVKC_API const char* ovkc_kernel_isa() { return ovkc::kernel_isa(); }

// How the bf16 prompt kernel multiplies (kernels.hpp: Bf16Products): 0 dot products, 1 widened
// to f32 FMAs; the setter (tests, A/B runs) returns the previous choice.
OVKC_API int32_t ovkc_bf16_products() { return ovkc::bf16_products() == ovkc::Bf16Products::widened ? 1 : 0; }
OVKC_API int32_t ovkc_set_bf16_products(int32_t widened) {
    const int32_t before = ovkc_bf16_products();
    ovkc::set_bf16_products(widened ? ovkc::Bf16Products::widened : ovkc::Bf16Products::dot);
    return before;
}

// The rates of this core's bf16 dot products and f32 FMAs (multiply-adds per second, the best of
// `rounds` trials, or of the library's own count where rounds <= 0: kernels.hpp,
// measure_bf16_rates) and the choice they make (0 dot products, 1 widened; -1 without
// AVX512-BF16, nothing to choose). Chooses nothing for the process.
OVKC_API int32_t ovkc_measure_bf16_products(int32_t rounds, double* dot, double* fma) {
    if (!ovkc::has_bf16()) return -1;
    const ovkc::Bf16Rates rates = ovkc::measure_bf16_rates(rounds > 0 ? rounds : ovkc::kBf16ChoiceRounds);
    if (dot) *dot = rates.dot;
    if (fma) *fma = rates.fma;
    return ovkc::choose_bf16_products(rates) == ovkc::Bf16Products::widened ? 1 : 0;
}

// The error the op raised in the last inference that stepped sequence ``handle`` (taken: it is
// cleared), copied into ``buf`` (at most ``len`` bytes, NUL-terminated); returns its length, 0 for none.
OVKC_API int64_t ovkc_take_step_error(int64_t handle, char* buf, int64_t len) {
    return guarded([&]() -> int64_t {
        const std::string message = Registry::get().take_step_error(handle);
        if (buf && len > 0) {
            const size_t n = std::min(message.size(), static_cast<size_t>(len - 1));
            std::memcpy(buf, message.data(), n);
            buf[n] = '\0';
        }
        return static_cast<int64_t>(message.size());
    });
}

OVKC_API int64_t ovkc_pool_create(int32_t layers, int32_t q_heads, int32_t kv_heads, int32_t head_dim,
                                  int32_t block_size, int32_t precision, int64_t max_blocks, int32_t scores,
                                  const char* method, const int64_t* windows, int32_t count_only,
                                  const double* sparse) {
    return guarded([&]() -> int64_t {
        if (precision < 0 || precision > 2)
            throw ovkc::Error("precision=" + std::to_string(precision) + " is invalid: allowed 0 (f32), 1 (f16), 2 (u8)");
        ovkc::PoolConfig cfg;
        cfg.layers = layers;
        cfg.q_heads = q_heads;
        cfg.kv_heads = kv_heads;
        cfg.head_dim = head_dim;
        cfg.block_size = block_size;
        cfg.precision = static_cast<ovkc::Precision>(precision);
        cfg.max_blocks = max_blocks;
        cfg.scores = scores != 0;
        cfg.count_only = count_only != 0;
        if (windows && layers > 0) cfg.windows.assign(windows, windows + layers);
        // sparse prefill: block size, stride, threshold, last dense tokens, dense layers (null: dense)
        if (sparse)
            cfg.sparse = {static_cast<int64_t>(sparse[0]), static_cast<int64_t>(sparse[1]), sparse[2],
                          static_cast<int64_t>(sparse[3]), static_cast<int64_t>(sparse[4])};
        cfg.validate();  // the shape first: the policy's fields are checked against it
        cfg.policy = ovkc::make_policy(method ? method : "", {layers, q_heads, kv_heads, head_dim, block_size});
        cfg.validate();
        return Registry::get().create_pool(cfg);
    });
}

OVKC_API int64_t ovkc_pool_free(int64_t pool) {
    return guarded([&]() -> int64_t {
        Registry::get().free_pool(pool);
        return 0;
    });
}

// out[0] blocks in use, [1] blocks allocated, [2] peak blocks in use, [3] bytes per block,
// [4] live sequences of this pool, [5] 2-bit blocks in use, [6] bytes per 2-bit block.
OVKC_API int64_t ovkc_pool_stats(int64_t pool, int64_t* out) {
    return guarded([&]() -> int64_t {
        auto p = Registry::get().pool(pool);
        out[0] = p->blocks_in_use();
        out[1] = p->blocks_allocated();
        out[2] = p->peak_blocks();
        out[3] = static_cast<int64_t>(p->config().block_bytes());
        out[4] = Registry::get().sequences_of(p.get());
        out[5] = p->qblocks_in_use();
        out[6] = static_cast<int64_t>(p->config().qblock_bytes());
        return 0;
    });
}

OVKC_API int64_t ovkc_seq_create(int64_t pool) {
    return guarded([&]() -> int64_t { return Registry::get().create_sequence(pool); });
}

OVKC_API int64_t ovkc_seq_free(int64_t seq) {
    return guarded([&]() -> int64_t {
        Registry::get().free_sequence(seq);
        return 0;
    });
}

OVKC_API int64_t ovkc_seq_reset(int64_t seq) {
    return guarded([&]() -> int64_t {
        auto s = Registry::get().sequence(seq);
        std::lock_guard<std::mutex> lock(s->mu);
        s->reset();
        return 0;
    });
}

OVKC_API int64_t ovkc_seq_truncate(int64_t seq, int64_t tokens) {
    return guarded([&]() -> int64_t {
        if (tokens < 0) throw ovkc::Error("tokens=" + std::to_string(tokens) + " is invalid: allowed >= 0");
        auto s = Registry::get().sequence(seq);
        std::lock_guard<std::mutex> lock(s->mu);
        s->truncate(tokens);
        return 0;
    });
}

namespace {
// Whether every layer the method runs on holds every token it has seen, unselected: no holes, no
// 2-bit blocks, no method state beside the slots (a prompt's earlier chunks, before its hooks).
bool holds_every_token(ovkc::Sequence& s) {
    const ovkc::PoolConfig& cfg = s.pool().config();
    for (int layer = 0; layer < cfg.layers; ++layer) {
        if (cfg.window(layer)) continue;  // a sliding-window layer's ring is not the method's
        for (int g = 0; g < cfg.kv_heads; ++g) {
            const ovkc::HeadCache& hc = s.head(layer, g);
            if (hc.size() != s.seen(layer) || hc.holes || !hc.qpos.empty() || hc.state) return false;
        }
    }
    return true;
}
}  // namespace

// The next steps prefill a prompt of `tokens` tokens in chunks (Sequence::prompt_end): from an
// empty sequence, or after the earlier chunks a held prompt restored (serving/kept.py: a
// snapshot taken inside a chunked prompt; every token it has seen still held, unselected), so the
// method selects once at the end as over the whole prompt. 0: prompts come whole (the default).
OVKC_API int64_t ovkc_seq_set_prompt(int64_t seq, int64_t tokens) {
    return guarded([&]() -> int64_t {
        if (tokens < 0) throw ovkc::Error("prompt tokens=" + std::to_string(tokens) + " is invalid: allowed >= 0");
        auto s = Registry::get().sequence(seq);
        std::lock_guard<std::mutex> lock(s->mu);
        const int64_t seen = s->seen(0);
        if (tokens && seen && tokens <= seen)
            throw ovkc::Error("prompt tokens=" + std::to_string(tokens) + " is invalid: allowed > the " +
                              std::to_string(seen) + " tokens the sequence holds");
        if (tokens && seen && !holds_every_token(*s))
            throw ovkc::Error("a chunked prompt continues only a sequence that holds every token it has seen, "
                              "unselected (a held prompt's earlier chunks); this one's method has selected (" +
                              std::to_string(seen) + " tokens seen)");
        s->prompt_end = tokens;
        return 0;
    });
}

// How many of a `tokens`-token prompt's first tokens a held prompt may keep for a later, longer
// prompt (held_prompt_tokens); 0: none.
OVKC_API int64_t ovkc_pool_held_prompt(int64_t pool, int64_t tokens) {
    return guarded([&]() -> int64_t {
        if (tokens < 0) throw ovkc::Error("prompt tokens=" + std::to_string(tokens) + " is invalid: allowed >= 0");
        return ovkc::held_prompt_tokens(Registry::get().pool(pool)->config(), tokens);
    });
}

// A scoring pass of a method that has one (KVzip). mode 1: the next steps attend and score what
// is held at positions [lo, hi) and are then dropped (starts the pass, or moves it on); mode 2:
// end it with the method's selection over every layer; mode 0: end it without (an interrupted
// pass: nothing changes but the scores).
OVKC_API int64_t ovkc_seq_scoring_pass(int64_t seq, int64_t mode, int64_t lo, int64_t hi) {
    return guarded([&]() -> int64_t {
        auto s = Registry::get().sequence(seq);
        std::lock_guard<std::mutex> lock(s->mu);
        const ovkc::Policy& policy = *s->pool().config().policy;
        if (!policy.has_scoring_pass())
            throw ovkc::Error("method " + policy.name() + " has no scoring pass (kvzip has)");
        if (mode < 0 || mode > 2) throw ovkc::Error("mode=" + std::to_string(mode) + " is invalid: allowed 0, 1, 2");
        if (mode == 1) {
            if (!s->seen(0)) throw ovkc::Error("a scoring pass needs a prefilled prompt (the sequence is empty)");
            if (lo < 0 || hi < lo)
                throw ovkc::Error("positions [" + std::to_string(lo) + ", " + std::to_string(hi) + ") are invalid: allowed 0 <= lo <= hi");
            s->scoring = true;
            s->score_lo = lo;
            s->score_hi = hi;
            return 0;
        }
        if (!s->scoring) throw ovkc::Error("no scoring pass is running");
        s->scoring = false;
        if (mode == 2) policy.finish_scoring_pass(*s);
        return 0;
    });
}

// out[0] blocks held, out[1] tokens seen by layer 0, out[2] tokens held summed over all layers
// and KV heads, out[3] bytes of the blocks held (full precision and 2-bit), out[4] 2-bit blocks,
// out[5..8] ns in the method's own work (prefill, decode) and in the score pass (prefill, decode),
// out[9..12] ns in the steps' cache writes (prefill, decode) and in their attention (prefill, decode),
// out[13..15] the sparse prefill's key blocks attended, the causal blocks of dense prompts, and
// the ns its estimate took.
OVKC_API int64_t ovkc_seq_stats(int64_t seq, int64_t* out) {
    return guarded([&]() -> int64_t {
        auto s = Registry::get().sequence(seq);
        std::lock_guard<std::mutex> lock(s->mu);
        const auto& cfg = s->pool().config();
        out[0] = s->blocks_held();
        out[1] = s->seen(0);
        int64_t held = 0;
        for (int l = 0; l < cfg.layers; ++l)
            for (int g = 0; g < cfg.kv_heads; ++g) held += s->head(l, g).held();
        out[2] = held;
        out[3] = s->bytes_held();
        out[4] = s->qblocks_held();
        out[5] = s->policy_ns[0];
        out[6] = s->policy_ns[1];
        out[7] = s->scores_ns[0];
        out[8] = s->scores_ns[1];
        out[9] = s->append_ns[0];
        out[10] = s->append_ns[1];
        out[11] = s->attend_ns[0];
        out[12] = s->attend_ns[1];
        out[13] = s->sparse_blocks[0];
        out[14] = s->sparse_blocks[1];
        out[15] = s->sparse_ns;
        return 0;
    });
}

// Per (layer, KV head), out has layers * kv_heads entries: what = 0, the tokens held; what = 1,
// the holes (tokens a decode step evicted whose slots are compacted away once a block's worth
// has gathered: they still occupy their blocks).
OVKC_API int64_t ovkc_seq_head_tokens(int64_t seq, int32_t what, int64_t* out, int64_t capacity) {
    return guarded([&]() -> int64_t {
        auto s = Registry::get().sequence(seq);
        std::lock_guard<std::mutex> lock(s->mu);
        const auto& cfg = s->pool().config();
        const int64_t n = static_cast<int64_t>(cfg.layers) * cfg.kv_heads;
        if (capacity < n) throw ovkc::Error("capacity=" + std::to_string(capacity) + " is too small: need " + std::to_string(n));
        if (what != 0 && what != 1) throw ovkc::Error("what=" + std::to_string(what) + " is invalid: allowed 0 (tokens), 1 (holes)");
        for (int l = 0; l < cfg.layers; ++l)
            for (int g = 0; g < cfg.kv_heads; ++g) {
                const auto& h = s->head(l, g);
                out[l * cfg.kv_heads + g] = what ? h.holes : h.held();
            }
        return n;
    });
}

// One (layer, KV head) in full: positions [n], keys and values [n][head_dim] as floats, and the
// accumulated scores [n][group] (zeros when the pool does not collect scores). Any pointer may be
// null to skip it. Returns n, or -1 when capacity (slots) is too small.
OVKC_API int64_t ovkc_seq_read_head(int64_t seq, int32_t layer, int32_t kv_head, int64_t capacity, int64_t* positions,
                                    float* keys, float* values, float* scores) {
    return guarded([&]() -> int64_t {
        auto s = Registry::get().sequence(seq);
        std::lock_guard<std::mutex> lock(s->mu);
        const auto& cfg = s->pool().config();
        const auto& hc = head_of(*s, layer, kv_head);
        const int64_t nq = static_cast<int64_t>(hc.qpos.size());
        const int64_t n = hc.held();
        if (capacity < n) throw ovkc::Error("capacity=" + std::to_string(capacity) + " is too small: need " + std::to_string(n));
        const int D = cfg.head_dim, G = cfg.group();
        std::vector<float> kbuf(D), vbuf(D);
        int64_t i = 0;  // output row; holes (evicted, not yet compacted) are skipped
        for (int64_t at = 0; at < nq + hc.size(); ++at) {
            const bool q = at < nq;  // 2-bit tokens first (dequantized), then the full-precision slots
            const int64_t slot = at - nq;
            if (!q && hc.hole(slot)) continue;
            if (positions) positions[i] = q ? hc.qpos[static_cast<size_t>(at)] : hc.pos[static_cast<size_t>(slot)];
            if (keys || values) {
                if (q)
                    ovkc::dequantize_token(cfg, s->pool().qblock(hc.qblocks[static_cast<size_t>(at / cfg.block_size)]),
                                           static_cast<int>(at % cfg.block_size), kbuf.data(), vbuf.data());
                else
                    ovkc::load_token(cfg, s->pool(), hc, slot, kbuf.data(), vbuf.data());
                if (keys) std::memcpy(keys + i * D, kbuf.data(), sizeof(float) * D);
                if (values) std::memcpy(values + i * D, vbuf.data(), sizeof(float) * D);
            }
            if (scores)
                for (int g = 0; g < G; ++g)
                    scores[i * G + g] = !cfg.keeps_scores()  ? 0.0f
                                        : !q                 ? hc.scores[static_cast<size_t>(slot * G + g)]
                                        : hc.qscores.empty() ? 0.0f
                                                             : hc.qscores[static_cast<size_t>(at * G + g)];
            ++i;
        }
        return n;
    });
}

// The method's own counters for the sequence (summed over layers and heads), as
// "name=value;name=value" into buf (NUL-terminated). Returns the length; -1 when capacity is too small.
OVKC_API int64_t ovkc_seq_method_counters(int64_t seq, char* buf, int64_t capacity) {
    return guarded([&]() -> int64_t {
        auto s = Registry::get().sequence(seq);
        std::lock_guard<std::mutex> lock(s->mu);
        std::string text;
        for (const auto& [name, value] : s->pool().config().policy->counters(*s)) {
            char num[64];
            std::snprintf(num, sizeof num, "%.17g", value);
            text += (text.empty() ? "" : ";") + name + "=" + num;
        }
        if (capacity < static_cast<int64_t>(text.size()) + 1)
            throw ovkc::Error("capacity=" + std::to_string(capacity) + " is too small: need " + std::to_string(text.size() + 1));
        std::memcpy(buf, text.c_str(), text.size() + 1);
        return static_cast<int64_t>(text.size());
    });
}

// The names of the methods the op runs (its policy table), comma-separated, into buf.
OVKC_API int64_t ovkc_policy_names(char* buf, int64_t capacity) {
    return guarded([&]() -> int64_t {
        std::string text;
        for (const auto& n : ovkc::policy_names()) text += (text.empty() ? "" : ",") + n;
        if (capacity < static_cast<int64_t>(text.size()) + 1)
            throw ovkc::Error("capacity=" + std::to_string(capacity) + " is too small: need " + std::to_string(text.size() + 1));
        std::memcpy(buf, text.c_str(), text.size() + 1);
        return static_cast<int64_t>(text.size());
    });
}

// ---- the selection functions alone, for the shared test vectors ------------------------------

// Importance keep_indices over scores[n]; out receives min(budget, n) ascending indices.
OVKC_API int64_t ovkc_keep_indices(const float* scores, int64_t n, int64_t budget, int64_t sinks, int64_t recent,
                                   int64_t* out) {
    return guarded([&]() -> int64_t {
        if (budget < sinks + recent && budget < n)
            throw ovkc::Error("budget=" + std::to_string(budget) + " is invalid: allowed at least sinks + recent");
        const auto keep = ovkc::keep_indices(scores, n, budget, sinks, recent);
        std::copy(keep.begin(), keep.end(), out);
        return static_cast<int64_t>(keep.size());
    });
}

// SnapKV pooling of scores[n] in place.
OVKC_API int64_t ovkc_pool_scores(float* scores, int64_t n, int64_t kernel, int32_t avg) {
    return guarded([&]() -> int64_t {
        ovkc::pool_scores(scores, n, 1, kernel, avg != 0);
        return 0;
    });
}

// KVCrush's choice from per-query-head scores [H][n] under a method spec (its budgets entry is
// ignored: budget is given); block > 0 selects whole blocks of that size. Returns the count.
OVKC_API int64_t ovkc_kvcrush_select(const float* scores, int32_t H, int64_t n, int64_t budget, int64_t sinks,
                                     int64_t recent, int64_t reps, int64_t block, const char* spec, int64_t* out) {
    return guarded([&]() -> int64_t {
        const auto policy = ovkc::make_policy(spec ? spec : "", {1, H, 1, 16, 16});
        const auto* kvcrush = dynamic_cast<const ovkc::KVCrushPolicy*>(policy.get());
        if (!kvcrush) throw ovkc::Error("kvcrush_select needs a kvcrush spec, got method " + policy->name());
        const auto& p = kvcrush->kv;
        const auto keep = block > 0 ? ovkc::kvcrush_select_blocks(scores, H, n, block, budget, sinks, recent, reps, p)
                                    : ovkc::kvcrush_select(scores, H, n, budget, sinks, recent, reps, p);
        std::copy(keep.begin(), keep.end(), out);
        return static_cast<int64_t>(keep.size());
    });
}

// kvcrush_select's steps (token-wise), each unpacked for a comparison with the reference's:
// bits[n][H] (every token's signature), anchor_bits[A][H] (A <= 16), evictable[m],
// distances[m][A], order[m], reps[r], keep[k]; counts = {m, A, r, k}. Returns k.
OVKC_API int64_t ovkc_kvcrush_trace(const float* scores, int32_t H, int64_t n, int64_t budget, int64_t sinks,
                                    int64_t recent, int64_t reps, const char* spec, uint8_t* bits,
                                    uint8_t* anchor_bits, int64_t* evictable, int64_t* distances, int64_t* order,
                                    int64_t* reps_out, int64_t* keep_out, int64_t* counts) {
    return guarded([&]() -> int64_t {
        const auto policy = ovkc::make_policy(spec ? spec : "", {1, H, 1, 16, 16});
        const auto* kvcrush = dynamic_cast<const ovkc::KVCrushPolicy*>(policy.get());
        if (!kvcrush) throw ovkc::Error("kvcrush_trace needs a kvcrush spec, got method " + policy->name());
        if (budget >= n) throw ovkc::Error("kvcrush_trace needs budget < n: nothing is selected otherwise");
        ovkc::KVCrushTrace t;
        const auto keep = ovkc::kvcrush_select(scores, H, n, budget, sinks, recent, reps, kvcrush->kv, &t);
        auto unpack = [&](const uint64_t* words, uint8_t* out) {
            for (int h = 0; h < H; ++h) out[h] = (words[h / 64] >> (h % 64)) & 1;
        };
        for (int64_t i = 0; i < n; ++i) unpack(t.signatures.of(i), bits + i * H);
        for (size_t a = 0; a < t.anchors.size(); ++a) unpack(t.anchors[a].data(), anchor_bits + a * H);
        std::copy(t.evictable.begin(), t.evictable.end(), evictable);
        std::copy(t.distances.begin(), t.distances.end(), distances);
        std::copy(t.order.begin(), t.order.end(), order);
        std::copy(t.representatives.begin(), t.representatives.end(), reps_out);
        std::copy(keep.begin(), keep.end(), keep_out);
        const int64_t c[4] = {static_cast<int64_t>(t.evictable.size()), static_cast<int64_t>(t.anchors.size()),
                              static_cast<int64_t>(t.representatives.size()), static_cast<int64_t>(keep.size())};
        std::copy(c, c + 4, counts);
        return c[3];
    });
}

// ---- ClusterKV ----------------------------------------------------------------------------------

// Counters of one (layer, KV head): out[11] = clusters, decode steps, clusterings, k-means
// iterations, cluster lookups, cache hits, tokens loaded (the reference's accounting), tokens
// gathered into the working set, first pending token, sinks, working-set bytes. Returns 0, or 1
// when the head has no cluster state (other methods, dense layers, before the prompt).
OVKC_API int64_t ovkc_cluster_stats(int64_t seq, int32_t layer, int32_t kv_head, int64_t* out) {
    return guarded([&]() -> int64_t {
        auto s = Registry::get().sequence(seq);
        std::lock_guard<std::mutex> lock(s->mu);
        const auto& hc = head_of(*s, layer, kv_head);
        std::fill(out, out + 11, 0);
        const ovkc::ClusterHead* ch = ovkc::cluster_of(hc);
        if (!ch) return 1;
        const auto& c = *ch;
        const size_t ws = c.working_set_bytes();
        const int64_t vals[11] = {c.C,           c.steps,     c.clusterings, c.iterations,
                                  c.lookups,     c.hits,      c.tokens_loaded, c.ws_loads,
                                  c.pending_from, c.sinks,    static_cast<int64_t>(ws)};
        std::copy(vals, vals + 11, out);
        return 0;
    });
}

// The tokens the last decode step attended (ascending), or the labels of the clustered tokens
// (what == 1: label of token sinks + i). Returns the count; -1 when capacity is too small.
OVKC_API int64_t ovkc_cluster_read(int64_t seq, int32_t layer, int32_t kv_head, int32_t what, int64_t capacity,
                                   int64_t* out) {
    return guarded([&]() -> int64_t {
        auto s = Registry::get().sequence(seq);
        std::lock_guard<std::mutex> lock(s->mu);
        const auto& hc = head_of(*s, layer, kv_head);
        if (what != 0 && what != 1) throw ovkc::Error("what=" + std::to_string(what) + " is invalid: allowed 0, 1");
        const ovkc::ClusterHead* ch = ovkc::cluster_of(hc);
        if (!ch) return 0;
        std::vector<int64_t> v;
        if (what == 0) {
            v = ovkc::recalled_tokens(*ch);
        } else {
            v.assign(ch->labels.begin(), ch->labels.end());
        }
        if (capacity < static_cast<int64_t>(v.size()))
            throw ovkc::Error("capacity=" + std::to_string(capacity) + " is too small: need " + std::to_string(v.size()));
        std::copy(v.begin(), v.end(), out);
        return static_cast<int64_t>(v.size());
    });
}

// kmeans_cosine of x [n][D] (one batch row `row`): labels [n], centroids [min(k,n)][D], sizes
// [min(k,n)], and the rows whose similarities were computed over all iterations (bounded = 0:
// every row every iteration). Returns the iterations run.
OVKC_API int64_t ovkc_kmeans(const float* x, int64_t n, int32_t D, int64_t k, int64_t max_iters, int64_t seed,
                             int64_t row, int32_t bounded, int32_t* labels, float* centroids, int64_t* sizes,
                             int64_t* rows_assigned) {
    return guarded([&]() -> int64_t {
        if (D < 1 || k < 1 || max_iters < 1 || seed < 0 || row < 0)
            throw ovkc::Error("kmeans: D, k and max_iters must be >= 1, seed and row >= 0");
        const auto km = ovkc::kmeans_cosine(x, n, D, k, max_iters, seed, row, bounded != 0);
        std::copy(km.labels.begin(), km.labels.end(), labels);
        std::copy(km.centroids.begin(), km.centroids.end(), centroids);
        std::copy(km.sizes.begin(), km.sizes.end(), sizes);
        *rows_assigned = km.rows_assigned;
        return km.iterations;
    });
}

// ---- Chelsea --------------------------------------------------------------------------------------

// Degree (original tokens merged into it) of each full-precision slot of one head, in slot order
// (1 where the head merges nothing). Returns the count; -1 when capacity is too small.
OVKC_API int64_t ovkc_seq_read_degrees(int64_t seq, int32_t layer, int32_t kv_head, int64_t capacity, float* out) {
    return guarded([&]() -> int64_t {
        auto s = Registry::get().sequence(seq);
        std::lock_guard<std::mutex> lock(s->mu);
        const auto& hc = head_of(*s, layer, kv_head);
        const int64_t n = hc.size();
        if (capacity < n) throw ovkc::Error("capacity=" + std::to_string(capacity) + " is too small: need " + std::to_string(n));
        for (int64_t i = 0; i < n; ++i) out[i] = hc.degree.empty() ? 1.0f : hc.degree[static_cast<size_t>(i)];
        return n;
    });
}
