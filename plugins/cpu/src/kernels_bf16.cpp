// bf16 prefill (AVX512-BF16 dot products, or the operands widened to f32 FMAs; fp32 accumulation):
// a head staged once per step in bf16 pair layouts, then attended tile by tile (kernels.hpp:
// stage_bf16, attend_bf16, Bf16Products).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels_detail.hpp"

namespace ovkc {

using namespace detail;


bool has_bf16() { return OVKC_BF16; }

#if OVKC_BF16
namespace {
// seconds for `steps` x 16 independent instructions of `op` (accumulators kept in registers)
template <typename Op>
double time_instructions(int steps, Op op) {
    __m512 acc[16];
    for (auto& a : acc) a = _mm512_setzero_ps();
    // the empty asm statements pin the loop between the two clock readings (its inputs are
    // constants and its result unused: a compiler could otherwise move or drop it)
    const auto t0 = std::chrono::steady_clock::now();
    for (auto& a : acc) asm volatile("" : "+v"(a));
    for (int n = 0; n < steps; ++n) {
#    pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) acc[i] = op(acc[i]);
    }
    for (auto& a : acc) asm volatile("" : "+v"(a));
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// the best of `rounds` trials each, dot products and FMAs alternating (a load that comes and goes
// meets both alike); multiply-adds per second: 32 per dot product, 16 per FMA
Bf16Rates measure_rates(int rounds) {
    const __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80), b = (__m512bh)_mm512_set1_epi32(0x3c003c00);
    const __m512 x = _mm512_set1_ps(1.0f), y = _mm512_set1_ps(1e-9f);
    constexpr int kSteps = 20000;
    const auto dots = [&] {
        return time_instructions(kSteps, [&](__m512 acc) { return _mm512_dpbf16_ps(acc, a, b); });
    };
    const auto fmas = [&] {
        return time_instructions(kSteps, [&](__m512 acc) { return _mm512_fmadd_ps(acc, x, y); });
    };
    dots();  // untimed: a core may run its first 512-bit instructions at a lower rate
    double dot = 1e9, fma = 1e9;
    for (int rep = 0; rep < std::max(rounds, 1); ++rep) {
        dot = std::min(dot, dots());
        fma = std::min(fma, fmas());
    }
    const double instructions = 16.0 * kSteps;
    return {32.0 * instructions / dot, 16.0 * instructions / fma};
}
}  // namespace
#endif

Bf16Rates measure_bf16_rates(int rounds) {
#if OVKC_BF16
    return measure_rates(rounds);
#else
    (void)rounds;
    return {};
#endif
}

Bf16Products choose_bf16_products(const Bf16Rates& rates) {
    return rates.dot > 0.0 && rates.fma >= 1.2 * rates.dot ? Bf16Products::widened : Bf16Products::dot;
}

namespace {
std::atomic<int> g_bf16_products{-1};  // -1: not chosen yet
}  // namespace

Bf16Products bf16_products() {
    int p = g_bf16_products.load(std::memory_order_relaxed);
    if (p < 0) {
        const char* env = std::getenv("OVKC_BF16_PRODUCTS");
        if (env && std::strcmp(env, "dot") == 0)
            p = 0;
        else if (env && std::strcmp(env, "widened") == 0)
            p = 1;
        else
            p = choose_bf16_products(measure_bf16_rates(kBf16ChoiceRounds)) == Bf16Products::widened ? 1 : 0;
        int unset = -1;  // the first thread to choose wins; the others read its choice
        if (!g_bf16_products.compare_exchange_strong(unset, p)) p = unset;
    }
    return p == 1 ? Bf16Products::widened : Bf16Products::dot;
}

void set_bf16_products(Bf16Products products) {
    g_bf16_products.store(products == Bf16Products::widened ? 1 : 0);
}

// token j of a block (keys transposed [D][bs], values [bs][D]) at staged slot t, one value at a time
void stage_token_bf16(const float* kt, const float* v, int bs, int D, int j, int64_t t, Bf16Head& out) {
    uint16_t* kd = out.k.data() + static_cast<size_t>(t / 16) * D * 16 + (t % 16) * 2;
    for (int d = 0; d < D; ++d) kd[(d / 2) * 32 + (d % 2)] = to_bf16(kt[static_cast<size_t>(d) * bs + j]);
    uint16_t* vd = out.v.data() + static_cast<size_t>(t / 2) * D * 2 + (t % 2);
    for (int d = 0; d < D; ++d) vd[d * 2] = to_bf16(v[static_cast<size_t>(j) * D + d]);
}

#if OVKC_BF16
namespace {
// 16 floats of a and 16 of b rounded to bf16 and interleaved, a0 b0 a1 b1 ... a15 b15: one row of
// a staged head's pairs (two key dimensions of 16 tokens, or 16 value dimensions of two tokens)
inline __m512i interleave_bf16(__m512 a, __m512 b) {
    static const __m512i order = [] {
        alignas(64) uint16_t idx[32];
        for (int i = 0; i < 32; ++i) idx[i] = static_cast<uint16_t>(i % 2 ? 16 + i / 2 : i / 2);
        return _mm512_load_si512(idx);
    }();
    const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(a)),
                                          (__m256i)_mm512_cvtneps_pbh(b), 1);
    return _mm512_permutexvar_epi16(order, ab);
}

// a block's ntok tokens (keys transposed [D][bs], values [bs][D]) at staged slots slot0.. (a
// multiple of 16): keys 16 tokens by two dimensions at a time, values two tokens by 16
// dimensions; a group's missing tokens and an odd last token's partner stage as zeros
void stage_block_bf16(const float* kt, const float* v, int bs, int D, int ntok, int64_t slot0, Bf16Head& out) {
    for (int j0 = 0; j0 < ntok; j0 += 16) {
        const __mmask16 live = ntok - j0 >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (ntok - j0)) - 1);
        uint16_t* kg = out.k.data() + static_cast<size_t>((slot0 + j0) / 16) * D * 16;
        for (int d = 0; d < D; d += 2) {
            const __m512 a = _mm512_maskz_loadu_ps(live, kt + static_cast<size_t>(d) * bs + j0);
            const __m512 b = _mm512_maskz_loadu_ps(live, kt + static_cast<size_t>(d + 1) * bs + j0);
            _mm512_storeu_si512(kg + (d / 2) * 32, interleave_bf16(a, b));
        }
    }
    for (int j = 0; j < ntok; j += 2) {
        uint16_t* vd = out.v.data() + static_cast<size_t>((slot0 + j) / 2) * D * 2;
        const float* v0 = v + static_cast<size_t>(j) * D;
        for (int d = 0; d < D; d += 16) {
            const __m512 b = j + 1 < ntok ? _mm512_loadu_ps(v0 + D + d) : _mm512_setzero_ps();
            _mm512_storeu_si512(vd + d * 2, interleave_bf16(_mm512_loadu_ps(v0 + d), b));
        }
    }
}
}  // namespace
#endif

void stage_bf16(const PoolConfig& cfg, const Pool& pool, const HeadCache& hc, Bf16Head& out) {
    const int D = cfg.head_dim, bs = cfg.block_size;
    const int64_t n = hc.size();
    const int64_t groups = (n + 63) / 64 * 4, pairs = groups * 8;  // whole 64-token steps (zeros past n)
    out.n = n;
    out.k.assign(static_cast<size_t>(groups) * D * 16, 0);
    out.v.assign(static_cast<size_t>(pairs) * D * 2, 0);
    for (int64_t slot0 = 0; slot0 < n; slot0 += bs) {
        const int ntok = static_cast<int>(std::min<int64_t>(bs, n - slot0));
        const float *kt, *v;
        head_block_floats(cfg, pool, hc, slot0 / bs, 0, ntok, kt, v);
#if OVKC_BF16
        stage_block_bf16(kt, v, bs, D, ntok, slot0, out);
#else
        for (int j = 0; j < ntok; ++j) stage_token_bf16(kt, v, bs, D, j, slot0 + j, out);
#endif
    }
}

void stage_bf16_ranges(const PoolConfig& cfg, const Pool& pool, const HeadCache& hc, const SlotRanges& ranges,
                       Bf16Head& out, HeadCache& view) {
    const int D = cfg.head_dim, bs = cfg.block_size;
    int64_t n = 0;
    for (const auto& r : ranges) n += std::max<int64_t>(0, r.second - r.first);
    const int64_t groups = (n + 63) / 64 * 4, pairs = groups * 8;
    out.n = n;
    out.k.assign(static_cast<size_t>(groups) * D * 16, 0);
    out.v.assign(static_cast<size_t>(pairs) * D * 2, 0);
    view.pos.clear();
    view.pos.reserve(static_cast<size_t>(n));
    int64_t t = 0;
    for (const auto& r : ranges) {
        for (int64_t slot0 = r.first / bs * bs; slot0 < r.second; slot0 += bs) {
            const int ntok = static_cast<int>(std::min<int64_t>(bs, hc.size() - slot0));
            const float *kt, *v;
            head_block_floats(cfg, pool, hc, slot0 / bs, 0, ntok, kt, v);
            const int j0 = static_cast<int>(std::max<int64_t>(0, r.first - slot0));
            const int j1 = static_cast<int>(std::min<int64_t>(ntok, r.second - slot0));
            for (int j = j0; j < j1; ++j, ++t) {
                view.pos.push_back(hc.pos[static_cast<size_t>(slot0 + j)]);
                stage_token_bf16(kt, v, bs, D, j, t, out);
            }
        }
    }
}

#if OVKC_BF16
namespace {
// the even and the odd bf16 of 16 pairs as floats (exact): the low halves shifted up, the high
// halves with the low ones cleared
inline __m512 even_floats(__m512i pairs) { return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)); }
inline __m512 odd_floats(__m512i pairs) {
    return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// each of N vectors of 16 bf16 pairs as the floats of its even and of its odd members
template <int N>
inline void widen_pairs(const __m512i (&pairs)[N], __m512 (&even)[N], __m512 (&odd)[N]) {
    for (int u = 0; u < N; ++u) {
        even[u] = even_floats(pairs[u]);
        odd[u] = odd_floats(pairs[u]);
    }
}

// acc[u] += a[0] * even[u] + a[1] * odd[u]: one row's two products with N widened pair vectors
// (a: the row's two values of the pair, as floats, broadcast from memory)
template <int N>
inline void fma_pairs(__m512 (&acc)[N], const float* a, const __m512 (&even)[N], const __m512 (&odd)[N]) {
    const __m512 a0 = _mm512_set1_ps(a[0]), a1 = _mm512_set1_ps(a[1]);
    for (int u = 0; u < N; ++u) acc[u] = _mm512_fmadd_ps(a1, odd[u], _mm512_fmadd_ps(a0, even[u], acc[u]));
}

// A prompt tile's bf16 operands: the pairs the dot products take, and (widened products) the
// same values as floats, which the FMAs broadcast from memory
struct Bf16Operands {
    const uint32_t* pairs;  // [rows][n / 2]
    const float* floats;    // [rows][n], widened products only
    int stride;             // pairs per row
};

template <Bf16Products P, int R, int NG>
void qk_bf16(Bf16Operands q, int D, const uint16_t* kg, float* S, int stride) {
    // S[r][0..16NG) for NG consecutive 16-token groups; q: the scaled query rows, [R][D/2] bf16
    // pairs (one broadcast of a query pair, or of each of its two values, serves every group)
    __m512 acc[R][NG];
    for (int r = 0; r < R; ++r)
        for (int u = 0; u < NG; ++u) acc[r][u] = _mm512_setzero_ps();
    for (int d2 = 0; d2 < D / 2; ++d2) {
        __m512i kz[NG];
        for (int u = 0; u < NG; ++u) kz[u] = _mm512_loadu_si512(kg + (static_cast<size_t>(u) * D / 2 + d2) * 32);
        if constexpr (P == Bf16Products::dot) {
            for (int r = 0; r < R; ++r) {
                const __m512bh qz = (__m512bh)_mm512_set1_epi32(static_cast<int>(q.pairs[r * q.stride + d2]));
                for (int u = 0; u < NG; ++u) acc[r][u] = _mm512_dpbf16_ps(acc[r][u], (__m512bh)kz[u], qz);
            }
        } else {
            __m512 even[NG], odd[NG];
            widen_pairs(kz, even, odd);
            for (int r = 0; r < R; ++r) fma_pairs(acc[r], q.floats + r * 2 * q.stride + 2 * d2, even, odd);
        }
    }
    for (int r = 0; r < R; ++r)
        for (int u = 0; u < NG; ++u) _mm512_storeu_ps(S + r * stride + 16 * u, acc[r][u]);
}

template <Bf16Products P, int RR, int NV>
void pv_bf16(Bf16Operands p, int npairs, const uint16_t* vst, int D, int c, float* const* out) {
    // out[r][c..c+16NV) += sum over token pairs; p: [RR] rows of bf16 pairs of probabilities
    __m512 acc[RR][NV];
    for (int r = 0; r < RR; ++r)
        for (int u = 0; u < NV; ++u) acc[r][u] = _mm512_loadu_ps(out[r] + c + 16 * u);
    for (int jp = 0; jp < npairs; ++jp) {
        __m512i vz[NV];
        for (int u = 0; u < NV; ++u) vz[u] = _mm512_loadu_si512(vst + (static_cast<size_t>(jp) * D + c + 16 * u) * 2);
        if constexpr (P == Bf16Products::dot) {
            for (int r = 0; r < RR; ++r) {
                const __m512bh pz = (__m512bh)_mm512_set1_epi32(static_cast<int>(p.pairs[r * p.stride + jp]));
                for (int u = 0; u < NV; ++u) acc[r][u] = _mm512_dpbf16_ps(acc[r][u], (__m512bh)vz[u], pz);
            }
        } else {
            __m512 even[NV], odd[NV];  // the pair's first and second token
            widen_pairs(vz, even, odd);
            for (int r = 0; r < RR; ++r) fma_pairs(acc[r], p.floats + r * 2 * p.stride + 2 * jp, even, odd);
        }
    }
    for (int r = 0; r < RR; ++r)
        for (int u = 0; u < NV; ++u) _mm512_storeu_ps(out[r] + c + 16 * u, acc[r][u]);
}

template <Bf16Products P, int RR>
void pv_bf16_rows(Bf16Operands p, int npairs, const uint16_t* vst, int D, float* const* out) {
    int c = 0;
    for (; c + 64 <= D; c += 64) pv_bf16<P, RR, 4>(p, npairs, vst, D, c, out);
    for (; c < D; c += 16) pv_bf16<P, RR, 1>(p, npairs, vst, D, c, out);
}

// the rows of p from `first` on (their pairs and floats)
Bf16Operands from_row(Bf16Operands p, int first) {
    return {p.pairs + first * p.stride, p.floats ? p.floats + first * 2 * p.stride : nullptr, p.stride};
}

// out[r] += P[r] . V for R rows: four at a time, then the rest
template <Bf16Products P>
void pv_bf16_tile(int R, Bf16Operands p, int npairs, const uint16_t* vst, int D, float* const* out) {
    int r = 0;
    for (; r + 4 <= R; r += 4) pv_bf16_rows<P, 4>(from_row(p, r), npairs, vst, D, out + r);
    switch (R - r) {
        case 1: pv_bf16_rows<P, 1>(from_row(p, r), npairs, vst, D, out + r); break;
        case 2: pv_bf16_rows<P, 2>(from_row(p, r), npairs, vst, D, out + r); break;
        case 3: pv_bf16_rows<P, 3>(from_row(p, r), npairs, vst, D, out + r); break;
        default: break;
    }
}

template <Bf16Products P, int NG>
void qk_bf16_groups(int R, Bf16Operands q, int D, const uint16_t* kg, float* S, int stride) {
    switch (R) {
        case 1: return qk_bf16<P, 1, NG>(q, D, kg, S, stride);
        case 2: return qk_bf16<P, 2, NG>(q, D, kg, S, stride);
        case 3: return qk_bf16<P, 3, NG>(q, D, kg, S, stride);
        case 4: return qk_bf16<P, 4, NG>(q, D, kg, S, stride);
        case 5: return qk_bf16<P, 5, NG>(q, D, kg, S, stride);
        case 6: return qk_bf16<P, 6, NG>(q, D, kg, S, stride);
        case 7: return qk_bf16<P, 7, NG>(q, D, kg, S, stride);
        default: return qk_bf16<P, 8, NG>(q, D, kg, S, stride);
    }
}

// S[r][0..cols) for R rows over `cols` keys (a multiple of 16) from key group kg on: two groups
// at a time, then the odd one
template <Bf16Products P>
void qk_bf16_rows(int R, Bf16Operands q, int D, const uint16_t* kg, int cols, float* S, int stride) {
    int g = 0;
    for (; g + 2 <= cols / 16; g += 2)
        qk_bf16_groups<P, 2>(R, q, D, kg + static_cast<size_t>(g) * D * 16, S + g * 16, stride);
    if (g < cols / 16) qk_bf16_groups<P, 1>(R, q, D, kg + static_cast<size_t>(g) * D * 16, S + g * 16, stride);
}

// rows x `values` bf16 (as pairs, `stride` pairs a row) written as floats to `floats` (exact)
void widen_rows(const uint32_t* pairs, int rows, int stride, int values, float* floats) {
    for (int r = 0; r < rows; ++r) {
        const uint16_t* src = reinterpret_cast<const uint16_t*>(pairs + r * stride);
        float* dst = floats + r * 2 * stride;
        for (int i = 0; i < values; i += 16) {
            const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
            _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
        }
    }
}

// One online-softmax step of row r over its `cols` scaled logits s (a multiple of 16, at most
// kMaxGroups vectors), written straight as bf16 pairs of probabilities to pr (and, when `keep` is
// set, as floats there: exp(logit - the row's running max)): the logits stay in registers between
// the maximum, the exponentials and the conversion. Returns false, writing nothing, when no key
// here is visible to the row.
constexpr int kMaxGroups = 8;
bool softmax_to_bf16(RowSet& rows, int r, const float* s, int cols, int D, uint32_t* pr, float* keep) {
    const int nv = cols / 16;
    __m512 x[kMaxGroups];
    __m512 mx = _mm512_set1_ps(kNegInf);
    for (int u = 0; u < nv; ++u) {
        x[u] = _mm512_loadu_ps(s + 16 * u);
        mx = _mm512_max_ps(mx, x[u]);
    }
    const float top = _mm512_reduce_max_ps(mx);
    if (top == kNegInf) return false;
    const float m_new = std::max(rows.m[r], top);
    const float alpha = rows.m[r] == kNegInf ? 0.0f : std::exp(rows.m[r] - m_new);
    const __m512 mm = _mm512_set1_ps(m_new);
    __m512 sum = _mm512_setzero_ps();
    for (int u = 0; u < nv; ++u) {
        x[u] = exp512(_mm512_sub_ps(x[u], mm));
        sum = _mm512_add_ps(sum, x[u]);
        if (keep) _mm512_storeu_ps(keep + 16 * u, x[u]);
    }
    for (int u = 0; u < nv; u += 2) {
        const __m512 hi = u + 1 < nv ? x[u + 1] : _mm512_setzero_ps();
        _mm512_store_si512(pr + 8 * u, (__m512i)_mm512_cvtne2ps_pbh(hi, x[u]));
    }
    rows.l[r] = rows.l[r] * alpha + _mm512_reduce_add_ps(sum);
    if (alpha != 1.0f)
        for (int d = 0; d < D; d += 16)
            _mm512_storeu_ps(rows.out[r] + d, _mm512_mul_ps(_mm512_loadu_ps(rows.out[r] + d), _mm512_set1_ps(alpha)));
    rows.m[r] = m_new;
    return true;
}

// A row tile's probabilities kept for the column sums: per row, exp(logit - running max) of every
// slot from `first` on, and per row and span the running max they were taken against.
struct KeptProbabilities {
    std::vector<float> p, span_max;
    int64_t first = 0, width = 0, spans = 0;
};

KeptProbabilities& kept_probabilities() {
    thread_local KeptProbabilities tls;
    return tls;
}

// sums[slot] += each scored row's final probability of the slot: exp(logit - running max) times
// exp(running max - the row's log-sum-exp), span by span
void add_kept_probabilities(const KeptProbabilities& kept, const RowSet& rows, int first_row, int64_t n, int chunk,
                            float* sums) {
    for (int r = first_row; r < rows.n; ++r) {
        if (rows.l[r] <= 0.0f) continue;
        const float lse = rows.m[r] + std::log(rows.l[r]);
        const float* pr = kept.p.data() + static_cast<size_t>(r) * kept.width;
        for (int64_t c = 0; c < kept.spans; ++c) {
            const float mc = kept.span_max[static_cast<size_t>(r * kept.spans + c)];
            if (mc == kNegInf) continue;
            const float fs = std::exp(mc - lse);
            const __m512 f = _mm512_set1_ps(fs);
            const int64_t j0 = c * chunk, j1 = std::min<int64_t>(j0 + chunk, n - kept.first);
            int64_t j = j0;
            for (; j + 16 <= j1; j += 16) {
                float* dst = sums + kept.first + j;
                _mm512_storeu_ps(dst, _mm512_fmadd_ps(f, _mm512_loadu_ps(pr + j), _mm512_loadu_ps(dst)));
            }
            for (; j < j1; ++j) sums[kept.first + j] += fs * pr[j];
        }
    }
}
}  // namespace
#endif

void attend_bf16(const PoolConfig& cfg, const HeadCache& hc, const Bf16Head& st, RowSet& rows, float scale,
                 ColumnSums* columns, const SlotRanges* keys) {
#if OVKC_BF16
    // keys per online-softmax update: eight 16-token key groups. A longer span spreads a row's
    // fixed cost of an update (its maximum, the rescaling of its output, the scalar exp) over
    // more keys; past the diagonal a row's logits are masked, and a span wholly past every row's
    // position is not computed.
    constexpr int kChunk = 16 * kMaxGroups;
    constexpr int kPairs = kChunk / 2;
    const int D = cfg.head_dim;
    int64_t max_q = rows.qpos[0];
    for (int r = 1; r < rows.n; ++r) max_q = std::max(max_q, rows.qpos[r]);
    uint32_t qp[kMaxRows * 256];
    for (int r = 0; r < rows.n; ++r)
        for (int d2 = 0; d2 < D / 2; ++d2)
            qp[r * (D / 2) + d2] = static_cast<uint32_t>(to_bf16(rows.q[r][2 * d2] * scale)) |
                                   (static_cast<uint32_t>(to_bf16(rows.q[r][2 * d2 + 1] * scale)) << 16);
    alignas(64) float S[kMaxRows * kChunk];
    alignas(64) uint32_t pp[kMaxRows * kPairs];
    // widened products: the query rows and each span's probabilities as floats too
    const bool widened = bf16_products() == Bf16Products::widened;
    alignas(64) float qw[kMaxRows * 512];  // as many values as qp holds in pairs
    if (widened) widen_rows(qp, rows.n, D / 2, D, qw);
    alignas(64) float pw[kMaxRows * kChunk];
    const Bf16Operands queries{qp, widened ? qw : nullptr, D / 2};
    const Bf16Operands probabilities{pp, widened ? pw : nullptr, kPairs};
    const int64_t first = first_visible_slot(hc, rows) / 16 * 16;
    KeptProbabilities* kept = nullptr;  // the rows' probabilities, for the column sums
    if (keys && columns) throw Error("attend_bf16: column sums need every key (no slot ranges)");
    if (columns && columns->first_row < rows.n) {
        kept = &kept_probabilities();
        kept->first = first;
        kept->width = (st.n - first + kChunk - 1) / kChunk * kChunk;
        kept->spans = kept->width / kChunk;
        kept->p.resize(static_cast<size_t>(rows.n * kept->width));
        kept->span_max.assign(static_cast<size_t>(rows.n * kept->spans), kNegInf);
    }
    const SlotRanges every{{first, st.n}};
    for (const auto& [begin, end] : keys ? *keys : every) {
        for (int64_t slot0 = std::max(begin, first); slot0 < std::min(end, st.n); slot0 += kChunk) {
            if (hc.pos[static_cast<size_t>(slot0)] > max_q) break;  // later spans keep span_max -inf
            const int ntok = static_cast<int>(std::min<int64_t>(kChunk, std::min(end, st.n) - slot0));
            const int cols = (ntok + 15) / 16 * 16;
            const int cols32 = (ntok + 31) / 32 * 32;  // the probabilities go to bf16 in pairs of 16-lane vectors
            const uint16_t* kg = st.k.data() + static_cast<size_t>(slot0 / 16) * D * 16;
            if (widened)
                qk_bf16_rows<Bf16Products::widened>(rows.n, queries, D, kg, cols, S, kChunk);
            else
                qk_bf16_rows<Bf16Products::dot>(rows.n, queries, D, kg, cols, S, kChunk);
            if (rows.softcap > 0.0f) cap_logits(S, rows.n, cols, kChunk, rows.softcap);
            mask_logits(hc, rows, slot0, ntok, kChunk, S);
            for (int r = 0; r < rows.n; ++r) {
                uint32_t* pr = pp + r * kPairs;
                const int64_t span = (slot0 - first) / kChunk;
                float* keep = kept ? kept->p.data() + static_cast<size_t>(r * kept->width + span * kChunk) : nullptr;
                if (softmax_to_bf16(rows, r, S + r * kChunk, cols, D, pr, keep)) {
                    if (kept) kept->span_max[static_cast<size_t>(r * kept->spans + span)] = rows.m[r];
                } else {  // nothing causal here: zero probabilities
                    std::fill(pr, pr + cols32 / 2, 0u);
                }
            }
            const int npairs = (ntok + 1) / 2;
            const uint16_t* vst = st.v.data() + static_cast<size_t>(slot0 / 2) * D * 2;
            if (widened) {
                widen_rows(pp, rows.n, kPairs, cols32, pw);
                pv_bf16_tile<Bf16Products::widened>(rows.n, probabilities, npairs, vst, D, rows.out);
            } else {
                pv_bf16_tile<Bf16Products::dot>(rows.n, probabilities, npairs, vst, D, rows.out);
            }
        }
    }
    finish_rows(rows, D);
    if (kept) add_kept_probabilities(*kept, rows, columns->first_row, st.n, kChunk, columns->sums);
#else
    (void)cfg;
    (void)hc;
    (void)st;
    (void)rows;
    (void)scale;
    (void)columns;
    (void)keys;
    throw Error("bf16 attention is not compiled in (no AVX512-BF16 on the build machine)");
#endif
}

}  // namespace ovkc
