// bf16 prefill on AMX tiles: 16 query rows of one head against 64 staged tokens per step (the
// staging of kernels_bf16.cpp already holds keys and values in the pair layout AMX's B tiles
// take). QK^T and P·V run as tile dot products with fp32 sums; the online softmax between them
// runs on AVX-512, the same arithmetic as attend_bf16 (kernels.hpp: attend_amx).
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>

#include <tbb/parallel_for.h>

#include "kernels_detail.hpp"

#if OVKC_BF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#    define OVKC_AMX 1
#    include <sys/syscall.h>
#    include <unistd.h>
#else
#    define OVKC_AMX 0
#endif

namespace ovkc {

using namespace detail;

#if OVKC_AMX
namespace {
constexpr int kStep = 64;  // tokens per softmax update: four 16-token key groups, two 32-token P tiles

// Linux hands out the AMX tile state only to processes that ask for it (once per process).
// OV_KVCRUSH_AMX=0 keeps the AVX512-BF16 kernel (to compare the two).
bool tiles_permitted() {
    static const bool ok = [] {
        const char* env = std::getenv("OV_KVCRUSH_AMX");
        if (env && std::strcmp(env, "0") == 0) return false;
        constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
        return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
    }();
    return ok;
}

struct alignas(64) TileConfig {
    uint8_t palette = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// Every tile 16 rows x 64 bytes: A (16 x 32 bf16), B (16 pair rows x 16 x 2 bf16), C (16 x 16 fp32).
// Configured on every call: the thread's tiles are shared with OpenVINO's own AMX kernels.
void configure_tiles() {
    TileConfig c;
    for (int t = 0; t < 8; ++t) {
        c.colsb[t] = 64;
        c.rows[t] = 16;
    }
    _tile_loadconfig(&c);
}

// S [16][kStep] = A K^T for `groups` (1-4) 16-token key groups: C tiles 0-3 the groups, A (tile
// 4) one 32-dim slice of the 16 query rows (bf16, row-major, D per row), B (tile 5) the same
// slice of a group's staged keys (`kg`: the first group). Tile numbers are immediates, hence
// the unrolled groups.
void qk_tiles(const uint16_t* a, const uint16_t* kg, int D, int groups, float* S) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int k = 0; k < D / 32; ++k) {
        _tile_loadd(4, a + k * 32, D * 2);
        const uint16_t* b = kg + static_cast<size_t>(k) * 16 * 32;
        _tile_loadd(5, b, 64);
        _tile_dpbf16ps(0, 4, 5);
        if (groups > 1) {
            _tile_loadd(5, b + static_cast<size_t>(D) * 16, 64);
            _tile_dpbf16ps(1, 4, 5);
        }
        if (groups > 2) {
            _tile_loadd(5, b + static_cast<size_t>(D) * 32, 64);
            _tile_dpbf16ps(2, 4, 5);
        }
        if (groups > 3) {
            _tile_loadd(5, b + static_cast<size_t>(D) * 48, 64);
            _tile_dpbf16ps(3, 4, 5);
        }
    }
    _tile_stored(0, S, kStep * 4);
    if (groups > 1) _tile_stored(1, S + 16, kStep * 4);
    if (groups > 2) _tile_stored(2, S + 32, kStep * 4);
    if (groups > 3) _tile_stored(3, S + 48, kStep * 4);
}

// A step's online softmax (attend_amx): each row's logits S over the step's ntok tokens masked
// (past its position, or before its window), folded into its running max m and sum l, its
// output O rescaled, and its probabilities written to P in bf16 (rows past n, or with nothing
// causal here: zeros).
void softmax_step(const HeadCache& hc, int64_t slot0, int ntok, int n, const int64_t* qpos, int64_t window, int D,
                  float* S, uint16_t* P, float* O, float* m, float* l) {
    const int64_t last_pos = hc.pos[static_cast<size_t>(slot0 + ntok - 1)];
    for (int r = 0; r < kAmxRows; ++r) {
        float* s = S + r * kStep;
        uint16_t* p = P + r * kStep;
        if (r >= n) {
            std::fill(p, p + kStep, uint16_t(0));
            continue;
        }
        for (int j = ntok; j < kStep; ++j) s[j] = kNegInf;
        const int64_t lo = window > 0 ? qpos[r] - window : std::numeric_limits<int64_t>::min();
        if (last_pos > qpos[r] || hc.pos[static_cast<size_t>(slot0)] <= lo)
            for (int j = 0; j < ntok; ++j) {
                const int64_t pos = hc.pos[static_cast<size_t>(slot0 + j)];
                if (pos > qpos[r] || pos <= lo) s[j] = kNegInf;
            }
        const float mx = row_max(s, kStep);
        if (mx == kNegInf) {  // nothing causal for this row here
            std::fill(p, p + kStep, uint16_t(0));
            continue;
        }
        const float m_new = std::max(m[r], mx);
        const float alpha = m[r] == kNegInf ? 0.0f : std::exp(m[r] - m_new);
        l[r] = l[r] * alpha + exp_sum(s, kStep, m_new);
        m[r] = m_new;
        if (alpha != 1.0f)
            for (int d = 0; d < D; ++d) O[r * D + d] *= alpha;
        for (int j = 0; j < kStep; j += 32) {
            const __m512bh pb = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(s + j + 16), _mm512_loadu_ps(s + j));
            _mm512_store_si512(p + j, (__m512i)pb);
        }
    }
}

// O += P V over a step's kStep tokens (attend_amx), four 16-dim blocks at a time: C tiles 0-3,
// A (tile 4) 32 tokens of P, B (tile 5) the same tokens' values vs (token pairs x 16 dims x 2);
// T holds the four C tiles between.
void pv_tiles(const uint16_t* P, const uint16_t* vs, int D, int n, float* T, float* O) {
    const int dblocks = D / 16;
    for (int c0 = 0; c0 < dblocks; c0 += 4) {
        const int nb = std::min(4, dblocks - c0);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int h = 0; h < 2; ++h) {
            _tile_loadd(4, P + h * 32, kStep * 2);
            const uint16_t* b = vs + static_cast<size_t>(h) * 16 * D * 2 + static_cast<size_t>(c0) * 32;
            _tile_loadd(5, b, D * 4);
            _tile_dpbf16ps(0, 4, 5);
            if (nb > 1) {
                _tile_loadd(5, b + 32, D * 4);
                _tile_dpbf16ps(1, 4, 5);
            }
            if (nb > 2) {
                _tile_loadd(5, b + 64, D * 4);
                _tile_dpbf16ps(2, 4, 5);
            }
            if (nb > 3) {
                _tile_loadd(5, b + 96, D * 4);
                _tile_dpbf16ps(3, 4, 5);
            }
        }
        _tile_stored(0, T, kStep * 4);
        _tile_stored(1, T + 16, kStep * 4);
        _tile_stored(2, T + 32, kStep * 4);
        _tile_stored(3, T + 48, kStep * 4);
        for (int r = 0; r < n; ++r)
            for (int u = 0; u < nb * 16; u += 16)
                _mm512_storeu_ps(O + r * D + c0 * 16 + u,
                                 _mm512_add_ps(_mm512_loadu_ps(O + r * D + c0 * 16 + u), _mm512_loadu_ps(T + r * kStep + u)));
    }
}
}  // namespace
#endif

bool has_amx() {
#if OVKC_AMX
    return tiles_permitted();
#else
    return false;
#endif
}

bool amx_head_dim(int head_dim) { return head_dim % 32 == 0 && head_dim <= 512; }

void attend_amx(const PoolConfig& cfg, const HeadCache& hc, const Bf16Head& st, int n, const float* const* q,
                const int64_t* qpos, float* const* out, float scale, float* m, float* l, int64_t window) {
#if OVKC_AMX
    const int D = cfg.head_dim;
    alignas(64) uint16_t qb[kAmxRows * 512];  // scaled queries, bf16, row-major (rows past n: 0)
    alignas(64) float O[kAmxRows * 512];      // unnormalised outputs
    alignas(64) float S[kAmxRows * kStep];    // logits, then probabilities
    alignas(64) uint16_t P[kAmxRows * kStep];  // probabilities in bf16 (A tiles of the P.V product)
    alignas(64) float T[kAmxRows * kStep];    // four P.V C tiles of 16 dims
    int64_t max_q = qpos[0];
    for (int r = 0; r < kAmxRows; ++r) {
        for (int d = 0; d < D; ++d) qb[r * D + d] = r < n ? to_bf16(q[r][d] * scale) : 0;
        if (r < n) max_q = std::max(max_q, qpos[r]);
        m[r] = kNegInf;
        l[r] = 0.0f;
    }
    std::fill(O, O + kAmxRows * D, 0.0f);
    configure_tiles();
    for (int64_t slot0 = first_visible_slot(hc, qpos, n, window) / kStep * kStep; slot0 < st.n; slot0 += kStep) {
        if (hc.pos[static_cast<size_t>(slot0)] > max_q) break;
        const int ntok = static_cast<int>(std::min<int64_t>(kStep, st.n - slot0));
        // S = Q K^T over the step's four 16-token key groups
        qk_tiles(qb, st.k.data() + static_cast<size_t>(slot0 / 16) * D * 16, D, 4, S);
        softmax_step(hc, slot0, ntok, n, qpos, window, D, S, P, O, m, l);
        pv_tiles(P, st.v.data() + static_cast<size_t>(slot0 / 2) * D * 2, D, n, T, O);
    }
    _tile_release();
    for (int r = 0; r < n; ++r) {
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        for (int d = 0; d < D; ++d) out[r][d] = O[r * D + d] * inv;
    }
#else
    (void)cfg;
    (void)hc;
    (void)st;
    (void)n;
    (void)q;
    (void)qpos;
    (void)out;
    (void)scale;
    (void)m;
    (void)l;
    (void)window;
    throw Error("AMX attention is not compiled in (no AMX-BF16 on the build machine)");
#endif
}

void max_log_probabilities_amx(const PoolConfig& cfg, const Bf16Head& st, const uint16_t* q, const float* lse, int64_t rows,
                               int64_t s_begin, int64_t s_end, float* best) {
#if OVKC_AMX
    const int D = cfg.head_dim;
    const int64_t groups = static_cast<int64_t>(st.k.size()) / (static_cast<int64_t>(D) * 16);  // staged (zero padded)
    alignas(64) uint16_t A[kAmxRows * 512];  // 16 query rows (rows past the last: 0)
    alignas(64) float S[kAmxRows * kStep];
    configure_tiles();
    for (int64_t g0 = s_begin / 16; g0 * 16 < s_end && g0 < groups; g0 += 4) {
        const int nb = static_cast<int>(std::min<int64_t>(4, groups - g0));
        const uint16_t* kg = st.k.data() + static_cast<size_t>(g0) * D * 16;
        const int64_t lo = std::max<int64_t>(s_begin, g0 * 16), hi = std::min<int64_t>(s_end, (g0 + nb) * 16);
        for (int64_t r0 = 0; r0 < rows; r0 += kAmxRows) {
            const int n = static_cast<int>(std::min<int64_t>(kAmxRows, rows - r0));
            std::memcpy(A, q + r0 * D, sizeof(uint16_t) * static_cast<size_t>(n) * D);
            if (n < kAmxRows) std::fill(A + n * D, A + kAmxRows * D, uint16_t(0));
            qk_tiles(A, kg, D, nb, S);
            const int cols = static_cast<int>(hi - lo);
            for (int r = 0; r < n; ++r) {
                const __m512 shift = _mm512_set1_ps(lse[r0 + r]);
                const float* srow = S + r * kStep + (lo - g0 * 16);
                float* out = best + (lo - s_begin);
                for (int j = 0; j < cols; j += 16) {
                    const __mmask16 mask = cols - j >= 16 ? __mmask16(0xffff) : __mmask16((1u << (cols - j)) - 1);
                    const __m512 x = _mm512_sub_ps(_mm512_maskz_loadu_ps(mask, srow + j), shift);
                    _mm512_mask_storeu_ps(out + j, mask, _mm512_max_ps(_mm512_maskz_loadu_ps(mask, out + j), x));
                }
            }
        }
    }
    _tile_release();
#else
    (void)cfg;
    (void)st;
    (void)q;
    (void)lse;
    (void)rows;
    (void)s_begin;
    (void)s_end;
    (void)best;
    throw Error("AMX attention is not compiled in (no AMX-BF16 on the build machine)");
#endif
}

void score_step_amx(const PoolConfig& cfg, const std::vector<HeadCache*>& heads, const float* q, int64_t L, float scale,
                    const std::vector<float>& lse, const std::vector<Bf16Head>& staged, const std::vector<int64_t>& sinks,
                    const std::vector<int64_t>& lo, const std::vector<int64_t>& hi) {
    constexpr int64_t kWindow = 64;
    const int D = cfg.head_dim, G = cfg.group();
    const int64_t Hkv = static_cast<int64_t>(heads.size());
    // the step's scaled queries in bf16, once (attend_amx rounds them the same way)
    std::vector<uint16_t> qbf(static_cast<size_t>(Hkv * G * L * D));
    tbb::parallel_for(int64_t(0), Hkv * G, [&](int64_t h) {
        for (int64_t i = 0; i < L * D; ++i) qbf[static_cast<size_t>(h * L * D + i)] = to_bf16(q[h * L * D + i] * scale);
    });
    // tasks: one 64-slot window of one KV head's scored slots (no two tasks share a slot)
    std::vector<int64_t> first(static_cast<size_t>(Hkv)), windows(static_cast<size_t>(Hkv));
    int64_t max_windows = 0;
    for (int64_t g = 0; g < Hkv; ++g) {
        const size_t gi = static_cast<size_t>(g);
        const int64_t a = sinks[gi], b = a + std::max<int64_t>(0, hi[gi] - lo[gi]);
        first[gi] = a / kWindow * kWindow;
        windows[gi] = b > a ? (b - first[gi] + kWindow - 1) / kWindow : 0;
        max_windows = std::max(max_windows, windows[gi]);
    }
    tbb::parallel_for(int64_t(0), Hkv * max_windows, [&](int64_t t) {
        const int64_t g = t / max_windows, w = t % max_windows;
        const size_t gi = static_cast<size_t>(g);
        if (w >= windows[gi]) return;
        const int64_t a = sinks[gi], b = a + hi[gi] - lo[gi];
        const int64_t s0 = std::max(a, first[gi] + w * kWindow), s1 = std::min(b, first[gi] + (w + 1) * kWindow);
        float best[kWindow];
        HeadCache& hc = *heads[gi];
        for (int j = 0; j < G; ++j) {
            const int64_t h = g * G + j;
            std::fill(best, best + kWindow, kNegInf);
            max_log_probabilities_amx(cfg, staged[gi], qbf.data() + h * L * D, lse.data() + h * L, L, s0, s1, best);
            for (int64_t s = s0; s < s1; ++s) {
                float& score = hc.scores[static_cast<size_t>((lo[gi] + s - a) * G + j)];
                score = std::max(score, std::exp(best[s - s0]));
            }
        }
    });
}

}  // namespace ovkc
