// Chelsea (ov_kvcrush/methods/chelsea.py): chunked soft matching and degree-weighted merging.
//
// When a head holds budget + merge_interval tokens it is merged back to the budget: the first
// `sinks` and last `recent` tokens stay; the middle is cut into chunks; in each chunk the even
// offsets (set A) link to their most similar odd offset (set B, cosine of keys, the earlier B on
// ties); the strongest links (the earlier link on ties) merge their A token into their B token,
// keys and values averaged with the tokens' degrees as weights; passes repeat until the target is
// met. Each slot carries its degree and log(degree), which the attention kernels add to its
// logits. Outlier heads are never merged. Every merged head of a layer removes the same count.
// With `protect` (beyond the paper), each head's `protect` middle tokens with the highest window
// scores (the slot scores: the prompt's last 32 queries, pooled over 31) are left out of the
// merging and put back in position order (chelsea.py: chelsea_compress with protect).
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <limits>

#if defined(__AVX512F__)
#    include <immintrin.h>
#endif

#include "importance.hpp"
#include "kernels.hpp"
#include "policy.hpp"
#include "selection.hpp"

namespace ovkc {

namespace {

// One head's tokens as floats, in slot order.
struct Tokens {
    std::vector<float> k, v, w;
    std::vector<float> sc;  // G slot scores per token (empty without protect)
    std::vector<int64_t> pos;
    int64_t n = 0;
    int G = 0;              // slot scores per token carried (0: none)
    int64_t first_changed;  // slots before it hold what the store holds
};

// Token i of `from` appended to `to` (keys, values, degree, position, scores).
void push_token(Tokens& to, const Tokens& from, int64_t i, int D) {
    to.k.insert(to.k.end(), from.k.begin() + i * D, from.k.begin() + (i + 1) * D);
    to.v.insert(to.v.end(), from.v.begin() + i * D, from.v.begin() + (i + 1) * D);
    to.w.push_back(from.w[static_cast<size_t>(i)]);
    to.pos.push_back(from.pos[static_cast<size_t>(i)]);
    to.sc.insert(to.sc.end(), from.sc.begin() + i * from.G, from.sc.begin() + (i + 1) * from.G);
    ++to.n;
}

// sim[j] = sum over d of a[d] * bt[d][j] (bt: [D][nb], nb a multiple of 16), each lane summing
// over d in order. Up to 8 registers of 16 B tokens advance together: one FMA chain per register
// would wait on its own latency.
#if defined(__AVX512F__)
template <int T>
void similarity_tiles(const float* a, const float* bt, int64_t nb, int D, float* sim) {
    __m512 acc[T];
    for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
    for (int d = 0; d < D; ++d) {
        const __m512 x = _mm512_set1_ps(a[d]);
        const float* row = bt + static_cast<size_t>(d) * nb;
        for (int t = 0; t < T; ++t) acc[t] = _mm512_fmadd_ps(x, _mm512_loadu_ps(row + 16 * t), acc[t]);
    }
    for (int t = 0; t < T; ++t) _mm512_storeu_ps(sim + 16 * t, acc[t]);
}
#endif

void similarities(const float* a, const float* bt, int64_t nb, int D, float* sim) {
#if defined(__AVX512F__)
    for (int64_t j0 = 0; j0 < nb; j0 += 128) {
        const float* b = bt + j0;
        float* out = sim + j0;
        switch (std::min<int64_t>(8, (nb - j0) / 16)) {
            case 8: similarity_tiles<8>(a, b, nb, D, out); break;
            case 7: similarity_tiles<7>(a, b, nb, D, out); break;
            case 6: similarity_tiles<6>(a, b, nb, D, out); break;
            case 5: similarity_tiles<5>(a, b, nb, D, out); break;
            case 4: similarity_tiles<4>(a, b, nb, D, out); break;
            case 3: similarity_tiles<3>(a, b, nb, D, out); break;
            case 2: similarity_tiles<2>(a, b, nb, D, out); break;
            default: similarity_tiles<1>(a, b, nb, D, out); break;
        }
    }
#else
    std::fill(sim, sim + nb, 0.0f);
    for (int d = 0; d < D; ++d)
        for (int64_t j = 0; j < nb; ++j) sim[j] += a[d] * bt[static_cast<size_t>(d) * nb + j];
#endif
}

// One matching pass over the slots [lo, hi) of t, merging at most `want` links. Returns the merges.
// value_aware: a link's strength is the lower of its keys' and values' cosine (chelsea.py).
int64_t merge_pass(Tokens& t, int64_t lo, int64_t hi, int64_t want, int64_t chunk, int D, bool value_aware) {
    const int64_t m = hi - lo;
    std::vector<float> kn(static_cast<size_t>(m) * D), vn;
    normalize_rows(t.k.data() + lo * D, m, D, kn.data());
    if (value_aware) {
        vn.resize(static_cast<size_t>(m) * D);
        normalize_rows(t.v.data() + lo * D, m, D, vn.data());
    }
    // links in order: chunk by chunk, A tokens ascending. A chunk's B keys are transposed
    // ([D][nb]) so that one A token's similarities to every B token are nb-wide FMAs, each lane
    // summing over d in order. Chunks are independent: they run in parallel (nested in the heads'
    // loop, so an idle core takes chunks of another head).
    const float kNegInf = -std::numeric_limits<float>::infinity();
    const int64_t chunks = (m + chunk - 1) / chunk;
    const int64_t links = (m + 1) / 2;  // A tokens: the even offsets (chunks are even-sized)
    std::vector<int64_t> la(static_cast<size_t>(links)), lb(static_cast<size_t>(links));
    std::vector<float> ls(static_cast<size_t>(links));
    tbb::parallel_for(int64_t(0), chunks, [&](int64_t ci) {
        const int64_t c0 = ci * chunk, c1 = std::min(c0 + chunk, m);
        const int64_t nb = (c1 - c0) / 2;  // B tokens: odd offsets
        const int64_t nbp = (nb + 15) / 16 * 16;  // rows padded with zeros to whole vectors
        std::vector<float> bt(static_cast<size_t>(nbp) * D, 0.0f), sim(static_cast<size_t>(nbp));
        for (int64_t j = 0; j < nb; ++j)
            for (int d = 0; d < D; ++d) bt[static_cast<size_t>(d * nbp + j)] = kn[static_cast<size_t>((c0 + 1 + 2 * j) * D + d)];
        for (int64_t a = c0, l = c0 / 2; a < c1; a += 2, ++l) {  // link l is A token 2l
            la[static_cast<size_t>(l)] = a;
            if (nb == 0) {
                lb[static_cast<size_t>(l)] = -1;
                ls[static_cast<size_t>(l)] = kNegInf;
                continue;
            }
            similarities(kn.data() + a * D, bt.data(), nbp, D, sim.data());
            int64_t bj = 0;  // the first maximum: the earlier B on ties
            for (int64_t j = 1; j < nb; ++j)
                if (sim[static_cast<size_t>(j)] > sim[static_cast<size_t>(bj)]) bj = j;
            lb[static_cast<size_t>(l)] = c0 + 1 + 2 * bj;
            float s = sim[static_cast<size_t>(bj)];
            if (value_aware) {
                float vc = 0.0f;
                const float* va = vn.data() + a * D;
                const float* vb = vn.data() + (c0 + 1 + 2 * bj) * D;
                for (int d = 0; d < D; ++d) vc += va[d] * vb[d];
                s = std::min(s, vc);
            }
            ls[static_cast<size_t>(l)] = s;
        }
    });
    int64_t usable = 0;
    for (int64_t i = 0; i < static_cast<int64_t>(lb.size()); ++i) usable += lb[static_cast<size_t>(i)] >= 0;
    const int64_t count = std::min(want, usable);
    if (count == 0) return 0;
    const auto chosen = topk_indices(ls.data(), static_cast<int64_t>(ls.size()), count);
    // degree-weighted sums: every middle token becomes k * w; each chosen A adds its sum to its B
    std::vector<float> nk(static_cast<size_t>(m) * D), nv(static_cast<size_t>(m) * D), nw(static_cast<size_t>(m));
    for (int64_t i = 0; i < m; ++i) {
        const float w = t.w[static_cast<size_t>(lo + i)];
        nw[static_cast<size_t>(i)] = w;
        for (int d = 0; d < D; ++d) {
            nk[static_cast<size_t>(i * D + d)] = t.k[static_cast<size_t>((lo + i) * D + d)] * w;
            nv[static_cast<size_t>(i * D + d)] = t.v[static_cast<size_t>((lo + i) * D + d)] * w;
        }
    }
    // an A token (even offset) is never a B token (odd offset): the sums read below are never
    // among those written, so they are the pre-merge ones, as the reference gathers them
    std::vector<char> alive(static_cast<size_t>(m), 1);
    for (int64_t j : chosen) {
        const int64_t a = la[static_cast<size_t>(j)], b = lb[static_cast<size_t>(j)];
        t.first_changed = std::min(t.first_changed, lo + std::min(a, b));
        for (int d = 0; d < D; ++d) {
            nk[static_cast<size_t>(b * D + d)] += nk[static_cast<size_t>(a * D + d)];
            nv[static_cast<size_t>(b * D + d)] += nv[static_cast<size_t>(a * D + d)];
        }
        nw[static_cast<size_t>(b)] += nw[static_cast<size_t>(a)];
        alive[static_cast<size_t>(a)] = 0;
    }
    // compact: kept middle tokens (divided by their new degree), then the recent ones move down
    int64_t out = lo;
    for (int64_t i = 0; i < m; ++i) {
        if (!alive[static_cast<size_t>(i)]) continue;
        const float w = nw[static_cast<size_t>(i)];
        for (int d = 0; d < D; ++d) {
            t.k[static_cast<size_t>(out * D + d)] = nk[static_cast<size_t>(i * D + d)] / w;
            t.v[static_cast<size_t>(out * D + d)] = nv[static_cast<size_t>(i * D + d)] / w;
        }
        t.w[static_cast<size_t>(out)] = w;
        t.pos[static_cast<size_t>(out)] = t.pos[static_cast<size_t>(lo + i)];
        std::copy_n(t.sc.begin() + (lo + i) * t.G, t.G, t.sc.begin() + out * t.G);  // a B keeps its own
        ++out;
    }
    for (int64_t i = hi; i < t.n; ++i, ++out) {
        std::copy_n(t.k.begin() + i * D, D, t.k.begin() + out * D);
        std::copy_n(t.v.begin() + i * D, D, t.v.begin() + out * D);
        t.w[static_cast<size_t>(out)] = t.w[static_cast<size_t>(i)];
        t.pos[static_cast<size_t>(out)] = t.pos[static_cast<size_t>(i)];
        std::copy_n(t.sc.begin() + i * t.G, t.G, t.sc.begin() + out * t.G);
    }
    t.n = out;
    return count;
}

}  // namespace

namespace {

class ChelseaPolicy : public Policy {
public:
    ChelseaPolicy(Spec& spec, const ModelShape& shape, PolicyCommon common);
    // the prompt attends whole, then is merged; a decode step merges before it attends
    void before_attention(Sequence& seq, int layer, bool prefill, int64_t /*L*/) const override {
        if (!prefill) merge_layer(seq, layer, false);
    }
    void after_attention(Sequence& seq, int layer, bool prefill, int64_t /*L*/) const override {
        if (prefill) merge_layer(seq, layer, true);
    }
    // protect: the prompt's window scores rank the tokens kept out of merging
    bool keeps_slot_scores() const override { return protect > 0; }
    bool scores_step(bool prefill) const override { return protect > 0 && prefill; }
    int64_t score_rows_from(bool prefill, int64_t L) const override {
        return prefill ? std::max<int64_t>(0, L - kProtectWindow) : 0;
    }
    bool allows_score_output() const override { return protect == 0; }

private:
    static constexpr int64_t kProtectWindow = 32, kProtectPool = 31;  // chelsea.py: PROTECT_*
    // merge a head down to `target` tokens (returns the matching passes)
    int64_t compress(Sequence& seq, HeadCache& hc, int64_t target) const;
    // merge passes over t's middle until it holds `target` tokens
    int64_t merge_down(Tokens& t, int64_t target, int D) const;
    void merge_layer(Sequence& seq, int layer, bool prefill) const;
    bool outlier(int layer, int kv_head) const {
        for (size_t i = 0; i + 1 < outliers.size(); i += 2)
            if (outliers[i] == layer && outliers[i + 1] == kv_head) return true;
        return false;
    }
    int64_t sinks = 0, recent = 0, chunk = 0, merge_interval = 0;
    // the paper's merge-ratio schedule in 1/10000 units (chelsea.py: pass_cap); ratio_e4 0: no cap
    int64_t ratio_e4 = 0, decay_e4 = 0, decay_steps = 0;
    bool value_aware = false;  // link_score key_value
    int64_t protect = 0;       // middle tokens per head kept out of merging
    int64_t pass_cap(int64_t middle, int64_t passes) const {
        if (!ratio_e4) return middle;
        return std::max<int64_t>(1, (ratio_e4 - decay_e4 * std::min(decay_steps, passes)) * middle / 10000);
    }
    std::vector<int64_t> outliers;  // flattened (layer, kv_head) pairs
};

ChelseaPolicy::ChelseaPolicy(Spec& spec, const ModelShape& shape, PolicyCommon common) : Policy(std::move(common)) {
    const int64_t kMax = int64_t(1) << 20;
    sinks = spec.integer("sinks", 0, kMax);
    recent = spec.integer("recent", 0, kMax);
    chunk = spec.integer("chunk", 2, 1 << 16);
    if (chunk % 2) throw Error(Spec::invalid("chunk", std::to_string(chunk), "an even integer in [2, 65536]"));
    merge_interval = spec.integer("merge_interval", 1, 1 << 16);
    ratio_e4 = spec.integer("ratio_e4", 0, 5000);
    decay_e4 = spec.integer("decay_e4", 0, 5000);
    decay_steps = spec.integer("decay_steps", 0, 1 << 10);
    value_aware = spec.choice("link_score", {"key", "key_value"}) == "key_value";
    protect = spec.integer("protect", 0, kMax);
    outliers = spec.integers("outliers", 0, 1 << 16);
    if (outliers.size() % 2) throw Error(Spec::invalid("outliers", std::to_string(outliers.size()) + " numbers", "(layer, kv_head) pairs"));
    for (size_t i = 0; i < outliers.size(); i += 2)
        if (outliers[i] >= shape.layers || outliers[i + 1] >= shape.kv_heads)
            throw Error(Spec::invalid("outliers", std::to_string(outliers[i]) + "," + std::to_string(outliers[i + 1]),
                                      "layer < " + std::to_string(shape.layers) + " and kv_head < " + std::to_string(shape.kv_heads)));
    if (quant()) throw Error(Spec::invalid("quant", "1", "0 for chelsea (the torch engine runs it over the 2-bit store)"));
    require_budgets_at_least(sinks + recent + 1, "sinks + recent + 1");
}

int64_t ChelseaPolicy::merge_down(Tokens& t, int64_t target, int D) const {
    int64_t passes = 0;
    while (t.n > target) {
        const int64_t lo = sinks, hi = t.n - recent;
        const int64_t merged =
            merge_pass(t, lo, hi, std::min(t.n - target, pass_cap(hi - lo, passes)), chunk, D, value_aware);
        if (!merged) break;  // cannot happen with target >= sinks + recent + 1; never loop forever
        ++passes;
    }
    return passes;
}

int64_t ChelseaPolicy::compress(Sequence& seq, HeadCache& hc, int64_t target) const {
    const PoolConfig& cfg = seq.pool().config();
    const int D = cfg.head_dim;
    Tokens t;
    t.n = hc.size();
    t.first_changed = t.n;
    t.k.resize(static_cast<size_t>(t.n) * D);
    t.v.resize(static_cast<size_t>(t.n) * D);
    load_tokens(cfg, seq.pool(), hc, 0, t.n, t.k.data(), t.v.data());
    t.w = hc.degree;
    t.pos = hc.pos;
    if (protect > 0) {
        t.G = cfg.group();
        t.sc = hc.scores;
    }
    const int64_t lo = sinks, hi = t.n - recent;
    const int64_t p = std::min({protect, target - sinks - recent - 1, hi - lo});
    int64_t passes = 0;
    if (p <= 0) {
        passes = merge_down(t, target, D);
    } else {
        // the p best window scores of the middle (group sums, ties to the earlier) stay out
        std::vector<float> sums(static_cast<size_t>(hi - lo));
        group_sums(t.sc.data() + lo * t.G, hi - lo, t.G, sums.data());
        std::vector<char> kept_out(static_cast<size_t>(t.n), 0);
        for (int64_t i : topk_indices(sums.data(), hi - lo, p)) kept_out[static_cast<size_t>(lo + i)] = 1;
        Tokens rest, out;
        rest.G = out.G = t.G;
        for (int64_t i = 0; i < t.n; ++i)
            if (!kept_out[static_cast<size_t>(i)]) push_token(rest, t, i, D);
        rest.first_changed = rest.n;
        passes = merge_down(rest, target - p, D);
        // both back in position order; a slot is unchanged up to the first moved or merged one
        out.first_changed = -1;
        for (int64_t i = 0, r = 0; i < t.n; ++i) {
            if (!kept_out[static_cast<size_t>(i)] && (r >= rest.n || rest.pos[static_cast<size_t>(r)] != t.pos[static_cast<size_t>(i)]))
                continue;  // merged away
            const bool from_rest = !kept_out[static_cast<size_t>(i)];
            if (from_rest) {
                if (out.first_changed < 0 && r >= rest.first_changed) out.first_changed = out.n;
                push_token(out, rest, r++, D);
            } else {
                push_token(out, t, i, D);
            }
            if (out.first_changed < 0 && out.pos.back() != t.pos[static_cast<size_t>(out.n - 1)]) out.first_changed = out.n - 1;
        }
        if (out.first_changed < 0) out.first_changed = out.n;
        t = std::move(out);
    }
    // write back from the first slot a merge changed; blocks past the end go back to the pool
    const int64_t from = std::min(t.first_changed, t.n);
    store_tokens(cfg, seq.pool(), hc, from, t.n, t.k.data() + from * D, t.v.data() + from * D);
    t.pos.resize(static_cast<size_t>(t.n));
    t.w.resize(static_cast<size_t>(t.n));
    hc.pos = std::move(t.pos);
    hc.degree = std::move(t.w);
    if (protect > 0) {
        t.sc.resize(static_cast<size_t>(t.n * t.G));
        hc.scores = std::move(t.sc);
    }
    hc.bias.resize(hc.degree.size());
    for (size_t i = 0; i < hc.degree.size(); ++i) hc.bias[i] = std::log(hc.degree[i]);
    seq.trim_blocks(hc);
    return passes;
}

void ChelseaPolicy::merge_layer(Sequence& seq, int layer, bool prefill) const {
    const PoolConfig& cfg = seq.pool().config();
    const int64_t budget = this->budget(layer);
    if (budget == 0) return;  // a local layer (its window) or no budget
    const int global = cfg.global_index(layer);  // outlier pairs name global layers, as the reference
    // outlier heads count against the budget (the reference's merged_budget): the merged heads
    // share what the method's heads' whole budget leaves after the outliers' tokens
    const int64_t outlier_count = static_cast<int64_t>(outliers.size() / 2);
    const int64_t heads = static_cast<int64_t>(cfg.global_index(cfg.layers)) * cfg.kv_heads;
    const int64_t target = outlier_count == 0 || outlier_count >= heads
                               ? budget
                               : std::max<int64_t>(sinks + recent + 1,
                                                   (budget * heads - outlier_count * seq.seen(layer)) / (heads - outlier_count));
    if (prefill && protect > 0) pool_layer_scores(seq, layer, kProtectPool, false);  // the prompt's window scores
    // heads merge independently (each its own slots; the pool's free list is locked), in parallel
    tbb::parallel_for(0, cfg.kv_heads, [&](int g) {
        if (outlier(global, g)) return;  // kept whole, no degrees
        HeadCache& hc = seq.head(layer, g);
        if (prefill && hc.degree.empty()) {
            hc.degree.assign(static_cast<size_t>(hc.size()), 1.0f);
            hc.bias.assign(static_cast<size_t>(hc.size()), 0.0f);
        }
        if (hc.size() >= target + merge_interval) compress(seq, hc, target);
    });
}

std::unique_ptr<Policy> make_chelsea(Spec& spec, const ModelShape& shape, PolicyCommon common) {
    return std::make_unique<ChelseaPolicy>(spec, shape, std::move(common));
}

}  // namespace

OVKC_REGISTER_POLICY("chelsea", make_chelsea);

}  // namespace ovkc
