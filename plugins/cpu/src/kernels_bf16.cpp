// bf16 prefill (AVX512-BF16 dot products, fp32 accumulation): a head staged once per step in bf16
// pair layouts, then attended tile by tile (kernels.hpp: stage_bf16, attend_bf16).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels_detail.hpp"

namespace ovkc {

using namespace detail;


bool has_bf16() { return OVKC_BF16; }

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
        block_floats(cfg, pool, hc.blocks[static_cast<size_t>(slot0 / bs)], 0, ntok, kt, v);
        for (int j = 0; j < ntok; ++j) {
            const int64_t t = slot0 + j;
            uint16_t* kd = out.k.data() + static_cast<size_t>(t / 16) * D * 16 + (t % 16) * 2;
            for (int d = 0; d < D; ++d) kd[(d / 2) * 32 + (d % 2)] = to_bf16(kt[static_cast<size_t>(d) * bs + j]);
            uint16_t* vd = out.v.data() + static_cast<size_t>(t / 2) * D * 2 + (t % 2);
            for (int d = 0; d < D; ++d) vd[d * 2] = to_bf16(v[static_cast<size_t>(j) * D + d]);
        }
    }
}

void stage_bf16_ranges(const PoolConfig& cfg, const Pool& pool, const HeadCache& hc,
                       const std::vector<std::pair<int64_t, int64_t>>& ranges, Bf16Head& out, HeadCache& view) {
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
            block_floats(cfg, pool, hc.blocks[static_cast<size_t>(slot0 / bs)], 0, ntok, kt, v);
            const int j0 = static_cast<int>(std::max<int64_t>(0, r.first - slot0));
            const int j1 = static_cast<int>(std::min<int64_t>(ntok, r.second - slot0));
            for (int j = j0; j < j1; ++j, ++t) {
                view.pos.push_back(hc.pos[static_cast<size_t>(slot0 + j)]);
                uint16_t* kd = out.k.data() + static_cast<size_t>(t / 16) * D * 16 + (t % 16) * 2;
                for (int d = 0; d < D; ++d) kd[(d / 2) * 32 + (d % 2)] = to_bf16(kt[static_cast<size_t>(d) * bs + j]);
                uint16_t* vd = out.v.data() + static_cast<size_t>(t / 2) * D * 2 + (t % 2);
                for (int d = 0; d < D; ++d) vd[d * 2] = to_bf16(v[static_cast<size_t>(j) * D + d]);
            }
        }
    }
}

#if OVKC_BF16
namespace {
template <int R>
void qk_bf16(const uint32_t* qp, int D, const uint16_t* kg, float* S, int stride) {
    // S[r][0..16) for one 16-token group; qp: [R][D/2] bf16 pairs of the scaled query rows
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int d2 = 0; d2 < D / 2; ++d2) {
        const __m512bh kz = (__m512bh)_mm512_loadu_si512(kg + static_cast<size_t>(d2) * 32);
        for (int r = 0; r < R; ++r)
            acc[r] = _mm512_dpbf16_ps(acc[r], kz, (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[r * (D / 2) + d2])));
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(S + r * stride, acc[r]);
}

template <int RR, int NV>
void pv_bf16(const uint32_t* pp, int npairs, const uint16_t* vst, int D, int c, float* const* out) {
    // out[r][c..c+16NV) += sum over token pairs; pp: [RR][16] bf16 pairs of probabilities
    __m512 acc[RR][NV];
    for (int r = 0; r < RR; ++r)
        for (int u = 0; u < NV; ++u) acc[r][u] = _mm512_loadu_ps(out[r] + c + 16 * u);
    for (int jp = 0; jp < npairs; ++jp) {
        __m512bh vz[NV];
        for (int u = 0; u < NV; ++u)
            vz[u] = (__m512bh)_mm512_loadu_si512(vst + (static_cast<size_t>(jp) * D + c + 16 * u) * 2);
        for (int r = 0; r < RR; ++r) {
            const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[r * 16 + jp]));
            for (int u = 0; u < NV; ++u) acc[r][u] = _mm512_dpbf16_ps(acc[r][u], vz[u], p);
        }
    }
    for (int r = 0; r < RR; ++r)
        for (int u = 0; u < NV; ++u) _mm512_storeu_ps(out[r] + c + 16 * u, acc[r][u]);
}

template <int RR>
void pv_bf16_rows(const uint32_t* pp, int npairs, const uint16_t* vst, int D, float* const* out) {
    int c = 0;
    for (; c + 64 <= D; c += 64) pv_bf16<RR, 4>(pp, npairs, vst, D, c, out);
    for (; c < D; c += 16) pv_bf16<RR, 1>(pp, npairs, vst, D, c, out);
}

void qk_bf16_rows(int R, const uint32_t* qp, int D, const uint16_t* kg, float* S, int stride) {
    switch (R) {
        case 1: return qk_bf16<1>(qp, D, kg, S, stride);
        case 2: return qk_bf16<2>(qp, D, kg, S, stride);
        case 3: return qk_bf16<3>(qp, D, kg, S, stride);
        case 4: return qk_bf16<4>(qp, D, kg, S, stride);
        case 5: return qk_bf16<5>(qp, D, kg, S, stride);
        case 6: return qk_bf16<6>(qp, D, kg, S, stride);
        case 7: return qk_bf16<7>(qp, D, kg, S, stride);
        default: return qk_bf16<8>(qp, D, kg, S, stride);
    }
}
}  // namespace
#endif

void attend_bf16(const PoolConfig& cfg, const HeadCache& hc, const Bf16Head& st, RowSet& rows, float scale) {
#if OVKC_BF16
    constexpr int kChunk = 32;  // tokens per softmax update: two 16-token key groups
    const int D = cfg.head_dim;
    int64_t max_q = rows.qpos[0];
    for (int r = 1; r < rows.n; ++r) max_q = std::max(max_q, rows.qpos[r]);
    uint32_t qp[kMaxRows * 256];
    for (int r = 0; r < rows.n; ++r)
        for (int d2 = 0; d2 < D / 2; ++d2)
            qp[r * (D / 2) + d2] = static_cast<uint32_t>(to_bf16(rows.q[r][2 * d2] * scale)) |
                                   (static_cast<uint32_t>(to_bf16(rows.q[r][2 * d2 + 1] * scale)) << 16);
    alignas(64) float S[kMaxRows * kChunk];
    alignas(64) uint32_t pp[kMaxRows * 16];
    for (int64_t slot0 = first_visible_slot(hc, rows) / kChunk * kChunk; slot0 < st.n; slot0 += kChunk) {
        if (hc.pos[static_cast<size_t>(slot0)] > max_q) break;
        const int ntok = static_cast<int>(std::min<int64_t>(kChunk, st.n - slot0));
        const int cols = (ntok + 15) / 16 * 16;
        for (int g = 0; g < cols / 16; ++g)
            qk_bf16_rows(rows.n, qp, D, st.k.data() + static_cast<size_t>(slot0 / 16 + g) * D * 16, S + g * 16, kChunk);
        mask_logits(hc, rows, slot0, ntok, kChunk, S);
        for (int r = 0; r < rows.n; ++r) {
            float* s = S + r * kChunk;
            if (!softmax_step(rows, r, s, cols, D)) {  // nothing causal for this row here: zero probabilities
                std::fill(pp + r * 16, pp + r * 16 + 16, 0u);
                continue;
            }
            std::fill(s + cols, s + kChunk, 0.0f);
            const __m512bh pb = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + 16), _mm512_loadu_ps(s));
            _mm512_store_si512(pp + r * 16, (__m512i)pb);
        }
        const int npairs = (ntok + 1) / 2;
        const uint16_t* vst = st.v.data() + static_cast<size_t>(slot0 / 2) * D * 2;
        int r = 0;
        for (; r + 4 <= rows.n; r += 4) pv_bf16_rows<4>(pp + r * 16, npairs, vst, D, rows.out + r);
        switch (rows.n - r) {
            case 1: pv_bf16_rows<1>(pp + r * 16, npairs, vst, D, rows.out + r); break;
            case 2: pv_bf16_rows<2>(pp + r * 16, npairs, vst, D, rows.out + r); break;
            case 3: pv_bf16_rows<3>(pp + r * 16, npairs, vst, D, rows.out + r); break;
            default: break;
        }
    }
    finish_rows(rows, D);
#else
    (void)cfg;
    (void)hc;
    (void)st;
    (void)rows;
    (void)scale;
    throw Error("bf16 attention is not compiled in (no AVX512-BF16 on the build machine)");
#endif
}

}  // namespace ovkc
