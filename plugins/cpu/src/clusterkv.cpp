// ClusterKV (ov_kvcrush/methods/clusterkv.py): nothing is evicted; the full store stays in the
// pool (full precision, or MiniKV's 2-bit blocks) and each decode step attends only a working
// set per KV head: the sinks, the tokens of the clusters whose centroids score highest against
// the step's queries (whole clusters, the last one trimmed to its earliest tokens, exactly the
// budget), and the generated tokens not clustered yet.
//
// The working set lives in slabs (kernels.hpp): gathered f32 copies of a cluster's tokens. A
// cluster recalled within the last recall_cache_steps steps is still in its slab and is not
// gathered again (a cache hit, counted as the reference counts it); a slab whose full-precision
// tokens were flushed into the 2-bit store since it was loaded is gathered again, so the values
// attended are always the store's own, as in the reference.
#include "clusterkv.hpp"

#include <tbb/parallel_for.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>

#include "policy.hpp"

#if defined(__AVX512F__)
#    include <immintrin.h>
#endif

namespace ovkc {

namespace {

// Token t of a head's store as floats: the 2-bit blocks hold tokens [0, qpos.size()), the
// full-precision slots the rest (ClusterKV keeps every token, so the index is the position).
void load_any(const PoolConfig& cfg, const Pool& pool, const HeadCache& hc, int64_t t, float* k, float* v) {
    const int64_t nq = static_cast<int64_t>(hc.qpos.size());
    if (t < nq) {
        dequantize_token(cfg, pool.qblock(hc.qblocks[static_cast<size_t>(t / cfg.block_size)]),
                         static_cast<int>(t % cfg.block_size), k, v);
    } else {
        load_token(cfg, pool, hc, t - nq, k, v);
    }
}

}  // namespace

namespace {

// A segment of a head's working set: n tokens of a slab (2-bit store), or the slots [a, a + n)
// of the head (full precision); pos0: the slab's first position (-1: its own positions).
struct Seg {
    const Slab* slab;
    int64_t a;
    int64_t n;
    int64_t pos0;
};

// ClusterKV's fields (ClusterKVConfig.op_fields) and hooks.
class ClusterKVPolicy : public Policy {
public:
    ClusterKVPolicy(Spec& spec, const ModelShape& shape, PolicyCommon common);
    // the slot scores would miss what a decode step does not attend
    bool allows_score_output() const override { return false; }
    void before_attention(Sequence& seq, int layer, bool prefill, int64_t L) const override;
    bool recalls(Sequence& seq, int layer, bool prefill) const override;
    void attend_recalled(Sequence& seq, int layer, const float* q, int64_t L, int64_t past, LogitMap logit,
                         float* out) const override;
    void after_attention(Sequence& seq, int layer, bool prefill, int64_t L) const override;
    Counters counters(Sequence& seq) const override;

    int64_t sinks = 0, tokens_per_cluster = 0, n_clusters = 0, new_clusters = 0, cluster_every = 0, max_iters = 0,
            seed = 0, cache_steps = 0;

private:
    // Cluster tokens [from, to) of one head into k more clusters (ids counting on from ch.C).
    void cluster_range(Sequence& seq, int layer, int g, int64_t from, int64_t to, int64_t k, int64_t seen) const;
    // A decode step's recall on one head, and the working set it attends (segments).
    std::vector<Seg> recall(Sequence& seq, int layer, int g, const float* q, int64_t L) const;
    std::vector<Seg> working_set_in_slabs(const Pool& pool, HeadCache& hc, ClusterHead& ch,
                                          const std::vector<int32_t>& chosen, const std::vector<int64_t>& take,
                                          int64_t step) const;
    void attend_segments(Sequence& seq, int layer, const std::vector<std::vector<Seg>>& segs, const float* q, int64_t L,
                         int64_t past, LogitMap logit, float* out) const;
};

void ClusterKVPolicy::cluster_range(Sequence& seq, int layer, int g, int64_t from, int64_t to, int64_t k, int64_t seen) const {
    const PoolConfig& cfg = seq.pool().config();
    const ClusterKVPolicy& p = *this;
    const int D = cfg.head_dim;
    HeadCache& hc = seq.head(layer, g);
    ClusterHead& ch = *cluster_of(hc);
    const int64_t n = to - from;
    std::vector<float> x(static_cast<size_t>(n) * D), vals(static_cast<size_t>(n) * D);
    if (hc.qpos.empty())  // a full-precision store: slot == token, read block by block
        load_tokens(cfg, seq.pool(), hc, from, to, x.data(), vals.data());
    else
        for (int64_t i = 0; i < n; ++i) load_any(cfg, seq.pool(), hc, from + i, x.data() + i * D, vals.data() + i * D);
    // the reference seeds with seed + tokens seen before the clustering step, row = the KV head
    const KMeans km = kmeans_cosine(x.data(), n, D, k, p.max_iters, p.seed + seen, g);
    const int64_t base = ch.C;
    ch.C += km.k;
    ch.centroids.insert(ch.centroids.end(), km.centroids.begin(), km.centroids.end());
    for (int32_t lab : km.labels) ch.labels.push_back(static_cast<int32_t>(lab + base));
    // sizes, offsets and the label-sorted token order (a counting sort keeps tokens ascending)
    ch.sizes.assign(static_cast<size_t>(ch.C), 0);
    for (int32_t lab : ch.labels) ++ch.sizes[static_cast<size_t>(lab)];
    ch.offsets.assign(static_cast<size_t>(ch.C + 1), 0);
    for (int64_t c = 0; c < ch.C; ++c)
        ch.offsets[static_cast<size_t>(c + 1)] = ch.offsets[static_cast<size_t>(c)] + ch.sizes[static_cast<size_t>(c)];
    ch.sorted.assign(ch.labels.size(), 0);
    std::vector<int64_t> fill(ch.offsets.begin(), ch.offsets.end() - 1);
    for (size_t i = 0; i < ch.labels.size(); ++i)
        ch.sorted[static_cast<size_t>(fill[static_cast<size_t>(ch.labels[i])]++)] = ch.sinks + static_cast<int64_t>(i);
    ch.slabs.resize(static_cast<size_t>(ch.C));
    // A full-precision store is rewritten cluster by cluster (each cluster's tokens ascending in
    // consecutive slots), so that a recalled cluster is attended in place, a slot range of the
    // pool's blocks, with nothing gathered. Slots [from, to) hold tokens [from, to) until now.
    // (A 2-bit store keeps its order: its key groups are the reference's; recalls go to slabs.)
    if (!p.quant()) {
        std::vector<int64_t> start(static_cast<size_t>(km.k) + 1, 0);
        for (int32_t lab : km.labels) ++start[static_cast<size_t>(lab) + 1];
        for (int64_t c = 0; c < km.k; ++c) {
            start[static_cast<size_t>(c + 1)] += start[static_cast<size_t>(c)];
            ch.slot_begin.push_back(from + start[static_cast<size_t>(c)]);
        }
        std::vector<float> xs(x.size()), vs(vals.size());  // the tokens in slot order
        for (int64_t i = 0; i < n; ++i) {
            const int64_t j = start[static_cast<size_t>(km.labels[static_cast<size_t>(i)])]++;
            std::copy_n(x.data() + i * D, D, xs.data() + j * D);
            std::copy_n(vals.data() + i * D, D, vs.data() + j * D);
            hc.pos[static_cast<size_t>(from + j)] = from + i;
        }
        store_tokens(cfg, seq.pool(), hc, from, to, xs.data(), vs.data());
    }
    ch.pending_from = to;
    ch.pending_slab.clear();
    ++ch.clusterings;
    ch.iterations += km.iterations;
}

// Gather tokens[0..n) into slab rows [at, at + n).
void gather(const PoolConfig& cfg, const Pool& pool, const HeadCache& hc, Slab& slab, const int64_t* tokens,
            int64_t n, int64_t at) {
    const int D = cfg.head_dim;
    std::vector<float> k(static_cast<size_t>(D)), v(static_cast<size_t>(D));
    slab.resize(at + n, D);
    for (int64_t j = 0; j < n; ++j) {
        load_any(cfg, pool, hc, tokens[j], k.data(), v.data());
        slab.put(at + j, k.data(), v.data(), D);
    }
    slab.count = at + n;
    slab.max_token = std::max(slab.max_token, n ? tokens[n - 1] : slab.max_token);
    slab.q_at_load = static_cast<int64_t>(hc.qpos.size());
}

// Whether a slab's full-precision tokens went into the 2-bit store since it was loaded.
bool stale(const Slab& s, const HeadCache& hc) {
    return s.max_token >= s.q_at_load && static_cast<int64_t>(hc.qpos.size()) != s.q_at_load;
}

}  // namespace

bool ClusterKVPolicy::recalls(Sequence& seq, int layer, bool prefill) const {
    return !prefill && budget(layer) > 0 && cluster_of(seq.head(layer, 0));
}

void ClusterKVPolicy::after_attention(Sequence& seq, int layer, bool prefill, int64_t /*L*/) const {
    // the prompt's keys are clustered (before the 2-bit flush reads them away)
    const PoolConfig& cfg = seq.pool().config();
    const ClusterKVPolicy& p = *this;
    if (!prefill || p.budget(layer) == 0) return;
    tbb::parallel_for(0, cfg.kv_heads, [&](int g) {
        HeadCache& hc = seq.head(layer, g);
        hc.state = std::make_shared<ClusterHead>();
        ClusterHead& ch = *cluster_of(hc);
        const int64_t n = hc.held();
        ch.sinks = std::min<int64_t>(p.sinks, n);
        ch.pending_from = ch.sinks;
        if (n == ch.sinks) return;
        const int64_t c0 = p.n_clusters ? p.n_clusters : (n - ch.sinks + p.tokens_per_cluster - 1) / p.tokens_per_cluster;
        cluster_range(seq, layer, g, ch.sinks, n, c0, seq.seen(layer));
    });
}

void ClusterKVPolicy::before_attention(Sequence& seq, int layer, bool prefill, int64_t L) const {
    // cluster the pending tokens as the store was before this step (and its flush)
    const PoolConfig& cfg = seq.pool().config();
    const ClusterKVPolicy& p = *this;
    if (!recalls(seq, layer, prefill)) return;
    auto due = [&](int g) {  // the store before this step's tokens holds cluster_every pending ones
        const HeadCache& hc = seq.head(layer, g);
        return hc.held() - L - cluster_of(hc)->pending_from >= p.cluster_every;
    };
    bool any = false;  // most steps cluster nothing: no parallel dispatch for them
    for (int g = 0; g < cfg.kv_heads; ++g) any = any || due(g);
    if (!any) return;
    tbb::parallel_for(0, cfg.kv_heads, [&](int g) {
        if (!due(g)) return;
        HeadCache& hc = seq.head(layer, g);
        const int64_t before = hc.held() - L;
        cluster_range(seq, layer, g, cluster_of(hc)->pending_from, before, p.new_clusters, before);
    });
}

namespace {
// rank_clusters (the reference's): q . mu summed over the group's query heads and the step's
// tokens, computed as (sum of those queries) . mu: one dot product per cluster
std::vector<float> rank_clusters(const ClusterHead& ch, const float* q, int g, int G, int64_t L, int D) {
    std::vector<float> qsum(static_cast<size_t>(D), 0.0f), score(static_cast<size_t>(ch.C));
    for (int64_t r = 0; r < G * L; ++r) {
        const float* qr = q + (static_cast<int64_t>(g) * G * L + r) * D;
        for (int d = 0; d < D; ++d) qsum[static_cast<size_t>(d)] += qr[d];
    }
    for (int64_t c = 0; c < ch.C; ++c) score[static_cast<size_t>(c)] = dot(qsum.data(), ch.centroids.data() + c * D, D);
    return score;
}

// select_clusters (the reference's): whole clusters in rank order (score descending, the lower
// id on ties) up to the budget beside the sinks, the last one trimmed to its earliest tokens.
// Only the first ranks are needed: a min-heap of integer keys (the score mapped to an
// order-preserving integer, then the id) yields them in order. Returns (clusters, tokens of each).
std::pair<std::vector<int32_t>, std::vector<int64_t>> select_clusters(const ClusterHead& ch,
                                                                      const std::vector<float>& score, int64_t budget) {
    std::vector<uint64_t> heap(static_cast<size_t>(ch.C));
    for (int64_t c = 0; c < ch.C; ++c) {
        const float x = score[static_cast<size_t>(c)] + 0.0f;  // -0 ranks as +0
        uint32_t u;
        std::memcpy(&u, &x, 4);
        u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // ascending with the float
        heap[static_cast<size_t>(c)] = (static_cast<uint64_t>(~u) << 32) | static_cast<uint64_t>(c);
    }
    std::make_heap(heap.begin(), heap.end(), std::greater<uint64_t>());
    int64_t left = std::min<int64_t>(budget - ch.sinks, static_cast<int64_t>(ch.labels.size()));
    std::vector<int32_t> chosen;
    std::vector<int64_t> take;
    for (auto end = heap.end(); left > 0 && end != heap.begin(); --end) {
        std::pop_heap(heap.begin(), end, std::greater<uint64_t>());
        const auto c = static_cast<int32_t>(*(end - 1) & 0xffffffffu);
        const int64_t size = ch.sizes[static_cast<size_t>(c)];
        if (size == 0) continue;
        chosen.push_back(c);
        take.push_back(std::min(size, left));
        left -= take.back();
    }
    return {std::move(chosen), std::move(take)};
}

// account_cache (the reference's): clusters recalled in the last R steps are hits
void account_cache(ClusterHead& ch, const std::vector<int32_t>& chosen, int64_t R) {
    std::vector<char> cached(static_cast<size_t>(ch.C), 0);
    if (R)
        for (const auto& ids : ch.recent)
            for (int32_t c : ids) cached[static_cast<size_t>(c)] = 1;
    for (int32_t c : chosen) {
        ++ch.lookups;
        if (cached[static_cast<size_t>(c)]) ++ch.hits;
        else ch.tokens_loaded += ch.sizes[static_cast<size_t>(c)];
    }
    if (R) {
        ch.recent.push_back(chosen);
        while (static_cast<int64_t>(ch.recent.size()) > R) ch.recent.pop_front();
    }
}

// the working set over the full-precision store, which is cluster-contiguous: attended in place
std::vector<Seg> working_set_in_place(const ClusterHead& ch, const std::vector<int32_t>& chosen,
                                      const std::vector<int64_t>& take, int64_t n) {
    std::vector<Seg> sg;
    if (ch.sinks) sg.push_back({nullptr, 0, ch.sinks, -1});
    for (size_t j = 0; j < chosen.size(); ++j) sg.push_back({nullptr, ch.slot_begin[static_cast<size_t>(chosen[j])], take[j], -1});
    sg.push_back({nullptr, ch.pending_from, n - ch.pending_from, -1});
    return sg;
}
}  // namespace

// the working set over the 2-bit store: recalled clusters are dequantized into slabs, kept while
// recalled within the last R steps; the sinks and the pending tokens have slabs of their own
std::vector<Seg> ClusterKVPolicy::working_set_in_slabs(const Pool& pool, HeadCache& hc, ClusterHead& ch,
                                                       const std::vector<int32_t>& chosen,
                                                       const std::vector<int64_t>& take, int64_t step) const {
    const PoolConfig& cfg = pool.config();
    const int64_t n = hc.held(), R = cache_steps;
    std::vector<Seg> sg;
    for (auto& s : ch.slabs)  // slabs not recalled within the last R steps leave the working set
        if (s.count && s.last_step < step - R) s.clear();
    if (ch.sink_slab.count != ch.sinks || stale(ch.sink_slab, hc)) {
        std::vector<int64_t> toks(static_cast<size_t>(ch.sinks));
        std::iota(toks.begin(), toks.end(), 0);
        ch.sink_slab.clear();
        gather(cfg, pool, hc, ch.sink_slab, toks.data(), ch.sinks, 0);
        ch.ws_loads += ch.sinks;
    }
    if (ch.sinks) sg.push_back({&ch.sink_slab, 0, ch.sinks, -1});
    for (size_t j = 0; j < chosen.size(); ++j) {
        const int32_t c = chosen[j];
        Slab& s = ch.slabs[static_cast<size_t>(c)];
        const int64_t size = ch.sizes[static_cast<size_t>(c)];
        if (s.count != size || stale(s, hc)) {
            s.clear();
            gather(cfg, pool, hc, s, ch.sorted.data() + ch.offsets[static_cast<size_t>(c)], size, 0);
            ch.ws_loads += size;
        }
        s.last_step = step;
        sg.push_back({&s, 0, take[j], -1});
    }
    Slab& pend = ch.pending_slab;
    if (stale(pend, hc)) pend.clear();
    const int64_t have = ch.pending_from + pend.count;
    if (have < n) {
        std::vector<int64_t> toks(static_cast<size_t>(n - have));
        std::iota(toks.begin(), toks.end(), have);
        gather(cfg, pool, hc, pend, toks.data(), n - have, pend.count);
        ch.ws_loads += n - have;
    }
    sg.push_back({&pend, 0, pend.count, ch.pending_from});
    return sg;
}

// One head's recall for a decode step: rank, select, account, and the segments it attends.
std::vector<Seg> ClusterKVPolicy::recall(Sequence& seq, int layer, int g, const float* q, int64_t L) const {
    const PoolConfig& cfg = seq.pool().config();
    HeadCache& hc = seq.head(layer, g);
    ClusterHead& ch = *cluster_of(hc);
    const int64_t step = ch.steps++;
    const int64_t n = hc.held();
    auto [chosen, take] = select_clusters(ch, rank_clusters(ch, q, g, cfg.group(), L, cfg.head_dim), budget(layer));
    account_cache(ch, chosen, cache_steps);
    std::vector<Seg> sg = quant() ? working_set_in_slabs(seq.pool(), hc, ch, chosen, take, step)
                                  : working_set_in_place(ch, chosen, take, n);
    // what this step attends, for the stats API and the tests (listed on request)
    ch.last_chosen = std::move(chosen);
    ch.last_take = std::move(take);
    ch.last_n = n;
    return sg;
}

void ClusterKVPolicy::attend_recalled(Sequence& seq, int layer, const float* q, int64_t L, int64_t past,
                                      LogitMap logit, float* out) const {
    const auto t0 = std::chrono::steady_clock::now();
    const PoolConfig& cfg = seq.pool().config();
    const int Hkv = cfg.kv_heads;
    std::vector<std::vector<Seg>> segs(static_cast<size_t>(Hkv));
    // a few microseconds per head: serial (a parallel dispatch would cost as much as the work),
    // but for the 2-bit store, which may dequantize clusters into slabs
    auto select = [&](int g) { segs[static_cast<size_t>(g)] = recall(seq, layer, g, q, L); };
    if (quant())
        tbb::parallel_for(0, Hkv, select);
    else
        for (int g = 0; g < Hkv; ++g) select(g);
    seq.policy_ns[1] += static_cast<int64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
    attend_segments(seq, layer, segs, q, L, past, logit, out);
}

// One task per (KV head, tile of its G*L query rows, segment); the partial softmaxes merged.
void ClusterKVPolicy::attend_segments(Sequence& seq, int layer, const std::vector<std::vector<Seg>>& segs,
                                      const float* q, int64_t L, int64_t past, LogitMap logit, float* out) const {
    const PoolConfig& cfg = seq.pool().config();
    const int G = cfg.group(), D = cfg.head_dim, Hkv = cfg.kv_heads;
    const int64_t rows_per_head = G * L;
    const int64_t row_tiles = (rows_per_head + kMaxRows - 1) / kMaxRows;
    int64_t max_segs = 1;
    for (const auto& sg : segs) max_segs = std::max<int64_t>(max_segs, static_cast<int64_t>(sg.size()));
    const int64_t tasks = Hkv * row_tiles * max_segs;
    const size_t row_floats = static_cast<size_t>(D + 2);
    std::vector<float> part(static_cast<size_t>(tasks) * kMaxRows * row_floats);
    auto partial = [&](int64_t task, int64_t r) { return part.data() + (static_cast<size_t>(task) * kMaxRows + r) * row_floats; };
    tbb::parallel_for(int64_t(0), tasks, [&](int64_t t) {
        const int64_t g = t / (row_tiles * max_segs), tile = (t / max_segs) % row_tiles, sj = t % max_segs;
        RowSet rows;
        rows.start();
        rows.softcap = logit.softcap;
        rows.n = static_cast<int>(std::min<int64_t>(kMaxRows, rows_per_head - tile * kMaxRows));
        for (int r = 0; r < rows.n; ++r) {
            const int64_t ri = tile * kMaxRows + r, gi = ri / L, i = ri % L;
            rows.q[r] = q + ((g * G + gi) * L + i) * D;
            rows.qpos[r] = past + i;
            rows.out[r] = partial(t, r) + 2;
            std::fill(rows.out[r], rows.out[r] + D, 0.0f);
        }
        const auto& sg = segs[static_cast<size_t>(g)];
        if (sj < static_cast<int64_t>(sg.size())) {
            const Seg& e = sg[static_cast<size_t>(sj)];
            if (e.slab)
                attend_slab(*e.slab, e.n, D, rows, logit.scale, e.pos0);
            else if (e.n)
                attend_range(cfg, seq.pool(), seq.head(layer, static_cast<int>(g)), rows, logit.scale, e.a,
                             e.a + e.n);
        }
        for (int r = 0; r < rows.n; ++r) {
            partial(t, r)[0] = rows.m[r];
            partial(t, r)[1] = rows.l[r];
        }
    });
    for (int64_t g = 0; g < Hkv; ++g)
        for (int64_t ri = 0; ri < rows_per_head; ++ri) {
            const int64_t gi = ri / L, i = ri % L, tile = ri / kMaxRows, r = ri % kMaxRows;
            const int64_t first = (g * row_tiles + tile) * max_segs;
            merge_partials(partial(first, r), kMaxRows * row_floats, static_cast<int>(max_segs), D,
                           out + ((g * G + gi) * L + i) * D);
        }
}

Counters ClusterKVPolicy::counters(Sequence& seq) const {
    const PoolConfig& cfg = seq.pool().config();
    double clusters = 0, lookups = 0, hits = 0, gathered = 0, iterations = 0, ws = 0;
    for (int l = 0; l < cfg.layers; ++l)
        for (int g = 0; g < cfg.kv_heads; ++g) {
            const ClusterHead* ch = cluster_of(seq.head(l, g));
            if (!ch) continue;
            clusters += static_cast<double>(ch->C);
            lookups += static_cast<double>(ch->lookups);
            hits += static_cast<double>(ch->hits);
            gathered += static_cast<double>(ch->ws_loads);
            iterations += static_cast<double>(ch->iterations);
            ws += static_cast<double>(ch->working_set_bytes());
        }
    return {{"clusters", clusters},
            {"cluster_lookups", lookups},
            {"hit_rate", lookups ? hits / lookups : 0.0},
            {"tokens_gathered", gathered},
            {"kmeans_iterations", iterations},
            {"working_set_bytes", ws}};
}

ClusterKVPolicy::ClusterKVPolicy(Spec& spec, const ModelShape& /*shape*/, PolicyCommon common) : Policy(std::move(common)) {
    const int64_t kMax = int64_t(1) << 20;
    sinks = spec.integer("sinks", 0, kMax);
    tokens_per_cluster = spec.integer("tokens_per_cluster", 1, kMax);
    n_clusters = spec.integer("n_clusters", 0, kMax);  // 0: derived from tokens_per_cluster
    new_clusters = spec.integer("new_clusters", 1, kMax);
    cluster_every = spec.integer("cluster_every", 1, 1 << 16);
    max_iters = spec.integer("max_iters", 1, 10000);
    seed = spec.integer("seed", 0, (int64_t(1) << 31) - 1);
    cache_steps = spec.integer("cache_steps", 0, 1 << 16);
    require_budgets_at_least(sinks + 1, "sinks + 1");
    if (quant_tail())  // the clusters index the store's tokens in flush order: nothing may stay behind
        throw Error(Spec::invalid("tail", std::to_string(quant_tail()), "0 for clusterkv"));
}

namespace {
std::unique_ptr<Policy> make_clusterkv(Spec& spec, const ModelShape& shape, PolicyCommon common) {
    return std::make_unique<ClusterKVPolicy>(spec, shape, std::move(common));
}
}  // namespace

OVKC_REGISTER_POLICY("clusterkv", make_clusterkv);

size_t ClusterHead::working_set_bytes() const {
    size_t ws = sink_slab.bytes() + pending_slab.bytes();
    for (const auto& sl : slabs) ws += sl.bytes();
    return ws;
}

void ClusterHead::check_truncate(int64_t tokens) const {
    if (pending_from > tokens)
        throw Error("cannot truncate to " + std::to_string(tokens) +
                    " tokens: ClusterKV has clustered later tokens (reset and prefill again)");
}

std::vector<int64_t> recalled_tokens(const ClusterHead& ch) {
    std::vector<int64_t> out;
    if (ch.last_n < 0) return out;
    for (int64_t t = 0; t < ch.sinks; ++t) out.push_back(t);
    for (size_t j = 0; j < ch.last_chosen.size(); ++j) {
        const int64_t* st = ch.sorted.data() + ch.offsets[static_cast<size_t>(ch.last_chosen[j])];
        out.insert(out.end(), st, st + ch.last_take[j]);
    }
    for (int64_t t = ch.pending_from; t < ch.last_n; ++t) out.push_back(t);
    std::sort(out.begin(), out.end());
    return out;
}

}  // namespace ovkc
