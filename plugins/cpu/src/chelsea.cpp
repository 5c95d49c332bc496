// Chelsea (ov_kvcrush/methods/chelsea.py): chunked soft matching and degree-weighted merging.
//
// When a head holds budget + merge_interval tokens it is merged back to the budget: the first
// `sinks` and last `recent` tokens stay; the middle is cut into chunks; in each chunk the even
// offsets (set A) link to their most similar odd offset (set B, cosine of keys, the earlier B on
// ties); the strongest links (the earlier link on ties) merge their A token into their B token,
// keys and values averaged with the tokens' degrees as weights; passes repeat until the target is
// met. Each slot carries its degree and log(degree), which the attention kernels add to its
// logits. Outlier heads are never merged. Every merged head of a layer removes the same count.
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels.hpp"
#include "policy.hpp"

namespace ovkc {

namespace {

// One head's tokens as floats, in slot order.
struct Tokens {
    std::vector<float> k, v, w;
    std::vector<int64_t> pos;
    int64_t n = 0;
};

// One matching pass over the slots [lo, hi) of t, merging at most `want` links. Returns the merges.
int64_t merge_pass(Tokens& t, int64_t lo, int64_t hi, int64_t want, int64_t chunk, int D) {
    const int64_t m = hi - lo;
    std::vector<float> kn(static_cast<size_t>(m) * D);
    normalize_rows(t.k.data() + lo * D, m, D, kn.data());
    // links in order: chunk by chunk, A tokens ascending
    std::vector<int64_t> la, lb;
    std::vector<float> ls;
    const float kNegInf = -std::numeric_limits<float>::infinity();
    for (int64_t c0 = 0; c0 < m; c0 += chunk) {
        const int64_t c1 = std::min(c0 + chunk, m);
        for (int64_t a = c0; a < c1; a += 2) {
            float best = kNegInf;
            int64_t bi = -1;
            const float* ka = kn.data() + a * D;
            for (int64_t b = c0 + 1; b < c1; b += 2) {
                const float* kb = kn.data() + b * D;
                float sim = 0.0f;
                for (int d = 0; d < D; ++d) sim += ka[d] * kb[d];
                if (bi < 0 || sim > best) {
                    best = sim;
                    bi = b;
                }
            }
            la.push_back(a);
            lb.push_back(bi);
            ls.push_back(bi < 0 ? kNegInf : best);
        }
    }
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
        ++out;
    }
    for (int64_t i = hi; i < t.n; ++i, ++out) {
        std::copy_n(t.k.begin() + i * D, D, t.k.begin() + out * D);
        std::copy_n(t.v.begin() + i * D, D, t.v.begin() + out * D);
        t.w[static_cast<size_t>(out)] = t.w[static_cast<size_t>(i)];
        t.pos[static_cast<size_t>(out)] = t.pos[static_cast<size_t>(i)];
    }
    t.n = out;
    return count;
}

}  // namespace

int64_t chelsea_compress(Sequence& seq, HeadCache& hc, int64_t target) {
    const PoolConfig& cfg = seq.pool().config();
    const MethodParams& p = *cfg.method;
    const int D = cfg.head_dim;
    Tokens t;
    t.n = hc.size();
    t.k.resize(static_cast<size_t>(t.n) * D);
    t.v.resize(static_cast<size_t>(t.n) * D);
    for (int64_t i = 0; i < t.n; ++i)
        load_token(cfg, seq.pool(), hc, i, t.k.data() + i * D, t.v.data() + i * D);
    t.w = hc.degree;
    t.pos = hc.pos;
    int64_t passes = 0;
    while (t.n > target) {
        const int64_t merged = merge_pass(t, p.sinks, t.n - p.recent, t.n - target, p.chunk, D);
        if (!merged) break;  // cannot happen with target >= sinks + recent + 1; never loop forever
        ++passes;
    }
    // write back from the first sink-free slot; blocks past the end go back to the pool
    for (int64_t i = p.sinks; i < t.n; ++i) store_token(cfg, seq.pool(), hc, i, t.k.data() + i * D, t.v.data() + i * D);
    t.pos.resize(static_cast<size_t>(t.n));
    t.w.resize(static_cast<size_t>(t.n));
    hc.pos = std::move(t.pos);
    hc.degree = std::move(t.w);
    hc.bias.resize(hc.degree.size());
    for (size_t i = 0; i < hc.degree.size(); ++i) hc.bias[i] = std::log(hc.degree[i]);
    seq.trim_blocks(hc);
    return passes;
}

void chelsea_step(Sequence& seq, int layer, bool prefill) {
    const PoolConfig& cfg = seq.pool().config();
    const MethodParams& p = *cfg.method;
    const int64_t budget = p.budget(layer);
    if (p.method != Method::chelsea || budget == 0) return;
    // heads merge independently (each its own slots; the pool's free list is locked), in parallel
    tbb::parallel_for(0, cfg.kv_heads, [&](int g) {
        if (p.outlier(layer, g)) return;  // kept whole, no degrees
        HeadCache& hc = seq.head(layer, g);
        if (prefill && hc.degree.empty()) {
            hc.degree.assign(static_cast<size_t>(hc.size()), 1.0f);
            hc.bias.assign(static_cast<size_t>(hc.size()), 0.0f);
        }
        if (hc.size() >= budget + p.merge_interval) chelsea_compress(seq, hc, budget);
    });
}

}  // namespace ovkc
