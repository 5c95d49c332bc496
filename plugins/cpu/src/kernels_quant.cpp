// MiniKV's 2-bit (or 4-bit) blocks: quantize, dequantize, and attend them with the dequantization
// inside the dot products (kernels.hpp: quantize_block, dequantize_token, attend_quant).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels_detail.hpp"

namespace ovkc {

using namespace detail;

// ---- 2-/4-bit blocks ----------------------------------------------------------------------------
namespace {
// The six arrays of a quantized block (key codes, key scales, key zeros, value codes, value
// scales, value zeros), typed; const or writable as the block is.
template <typename Byte>
struct QArrays {
    using U32 = std::conditional_t<std::is_const_v<Byte>, const uint32_t, uint32_t>;
    using U16 = std::conditional_t<std::is_const_v<Byte>, const uint16_t, uint16_t>;
    U32* kc;
    U16 *ks, *kz;
    U32* vc;
    U16 *vs, *vz;
};

// Where the arrays lie in a block, and the code widths: kb/vb bits, kp/vp codes per word.
struct QLayout {
    int T, D, g, kb, vb, kp, vp;
    size_t kc, ks, kz, vc, vs, vz;
    template <typename Byte>
    QArrays<Byte> arrays(Byte* blk) const {
        using A = QArrays<Byte>;
        return {reinterpret_cast<typename A::U32*>(blk + kc), reinterpret_cast<typename A::U16*>(blk + ks),
                reinterpret_cast<typename A::U16*>(blk + kz), reinterpret_cast<typename A::U32*>(blk + vc),
                reinterpret_cast<typename A::U16*>(blk + vs), reinterpret_cast<typename A::U16*>(blk + vz)};
    }
    explicit QLayout(const PoolConfig& cfg)
        : T(cfg.block_size),
          D(cfg.head_dim),
          g(cfg.quant_group()),
          kb(cfg.quant_key_bits()),
          vb(cfg.quant_value_bits()),
          kp(32 / kb),
          vp(32 / vb) {
        kc = 0;
        ks = kc + static_cast<size_t>(D) * (T / kp) * 4;
        kz = ks + static_cast<size_t>(T / g) * D * 2;
        vc = kz + static_cast<size_t>(T / g) * D * 2;
        vs = vc + static_cast<size_t>(T) * (D / vp) * 4;
        vz = vs + static_cast<size_t>(T) * (D / g) * 2;
    }
    // the code of item i (token or channel) in a row of packed words
    static uint32_t code(const uint32_t* words, int i, int bits) {
        const int per = 32 / bits;
        return (words[i / per] >> (bits * (i % per))) & ((1u << bits) - 1u);
    }
};

// One group's (scale, zero) and codes, exactly as quant.quantize_groups: zero = fp16(min), scale =
// fp16((max - min(zero, min)) / levels), code = round_half_even((x - zero) / scale) clamped.
void quantize_group(const float* x, int n, int stride, int bits, uint16_t& scale_out, uint16_t& zero_out,
                    uint8_t* codes) {
    const float levels = static_cast<float>((1 << bits) - 1);
    float lo = x[0], hi = x[0];
    for (int i = 1; i < n; ++i) {
        lo = std::min(lo, x[i * stride]);
        hi = std::max(hi, x[i * stride]);
    }
    const uint16_t zero = to_half(lo);
    const float zf = from_half(zero);
    const uint16_t scale = to_half((hi - std::min(zf, lo)) / levels);
    const float sf = from_half(scale);
    for (int i = 0; i < n; ++i) {
        float c = 0.0f;
        if (sf > 0.0f) c = std::min(levels, std::max(0.0f, std::nearbyint((x[i * stride] - zf) / sf)));
        codes[i] = static_cast<uint8_t>(c);
    }
    scale_out = scale;
    zero_out = zero;
}

#if OVKC_AVX512
// The 16 codes of items 16j .. 16j + 15 of a row of packed words, as floats: one word at 2 bits,
// two at 4.
inline __m512 codes16(const uint32_t* words, int j, int bits) {
    if (bits == 2) {
        const __m512i shifts = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        const __m512i c = _mm512_and_si512(
            _mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(words[j])), shifts), _mm512_set1_epi32(3));
        return _mm512_cvtepi32_ps(c);
    }
    const __m512i shifts = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
    const __m512i w = _mm512_inserti64x4(_mm512_set1_epi32(static_cast<int>(words[2 * j])),
                                         _mm256_set1_epi32(static_cast<int>(words[2 * j + 1])), 1);
    return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(w, shifts), _mm512_set1_epi32(15)));
}
#endif
}  // namespace

void quantize_block(const PoolConfig& cfg, uint8_t* dst, const float* k, const float* v) {
    const QLayout L(cfg);
    const auto [kc, ks, kz, vc, vs, vz] = L.arrays(dst);
    const int T = L.T, D = L.D, g = L.g;
    std::vector<uint8_t> codes(static_cast<size_t>(std::max(T, D)));
    std::fill(kc, kc + static_cast<size_t>(D) * (T / L.kp), 0u);
    std::fill(vc, vc + static_cast<size_t>(T) * (D / L.vp), 0u);
    for (int c = 0; c < D; ++c)
        for (int tg = 0; tg < T / g; ++tg) {
            quantize_group(k + static_cast<size_t>(tg) * g * D + c, g, D, L.kb, ks[tg * D + c], kz[tg * D + c],
                           codes.data());
            for (int i = 0; i < g; ++i) {
                const int t = tg * g + i;
                kc[c * (T / L.kp) + t / L.kp] |= static_cast<uint32_t>(codes[static_cast<size_t>(i)])
                                                 << (L.kb * (t % L.kp));
            }
        }
    for (int t = 0; t < T; ++t)
        for (int cg = 0; cg < D / g; ++cg) {
            quantize_group(v + static_cast<size_t>(t) * D + cg * g, g, 1, L.vb, vs[t * (D / g) + cg],
                           vz[t * (D / g) + cg], codes.data());
            for (int i = 0; i < g; ++i) {
                const int c = cg * g + i;
                vc[t * (D / L.vp) + c / L.vp] |= static_cast<uint32_t>(codes[static_cast<size_t>(i)])
                                                 << (L.vb * (c % L.vp));
            }
        }
}

void dequantize_token(const PoolConfig& cfg, const uint8_t* blk, int t, float* k, float* v) {
    const QLayout L(cfg);
    const auto [kc, ks, kz, vc, vs, vz] = L.arrays(blk);
    const int T = L.T, D = L.D, g = L.g, tg = t / g;
    for (int c = 0; c < D; ++c) {
        const float code = static_cast<float>(QLayout::code(kc + c * (T / L.kp), t, L.kb));
        k[c] = from_half(kz[tg * D + c]) + code * from_half(ks[tg * D + c]);
        const float vcode = static_cast<float>(QLayout::code(vc + t * (D / L.vp), c, L.vb));
        v[c] = from_half(vz[t * (D / g) + c / g]) + vcode * from_half(vs[t * (D / g) + c / g]);
    }
}

void load_quant_slab(const PoolConfig& cfg, const Pool& pool, const HeadCache& hc, int64_t n, Slab& out) {
    const int D = cfg.head_dim, T = cfg.block_size;
    n = std::min<int64_t>(n, static_cast<int64_t>(hc.qblocks.size()) * T);
    out.clear();
    out.resize(n, D);
    std::vector<float> k(static_cast<size_t>(D)), v(static_cast<size_t>(D));
    for (int64_t j = 0; j < n; ++j) {
        dequantize_token(cfg, pool.qblock(hc.qblocks[static_cast<size_t>(j / T)]), static_cast<int>(j % T), k.data(),
                         v.data());
        out.put(j, k.data(), v.data(), D);
    }
    out.count = n;
}

namespace {
// The scaled logits S [R][T] of the rows' (scaled) queries q over the T tokens of 2-bit block qb of
// `hc`: per key group, q.k = q.zero + sum_c (q_c * scale_c) * code_c. A token after a row's
// position (a multi-token step's own tokens, flushed before it attends) gets -inf. `qs` (at least
// kMaxRows * D floats) and `sf`/`zf` (D floats each) are the caller's scratch.
void quant_logits(const QLayout& L, const Pool& pool, const HeadCache& hc, int64_t qb, const RowSet& rows,
                  const float* const* q, float* qs, float* sf, float* zf, float* S) {
    const int T = L.T, D = L.D, g = L.g, R = rows.n;
    const auto key = L.arrays(pool.qblock(hc.qblocks[static_cast<size_t>(qb)]));
    const auto kc = key.kc;
    for (int tg = 0; tg < T / g; ++tg) {
        half_to_float(key.ks + tg * D, sf, D);
        half_to_float(key.kz + tg * D, zf, D);
        float bias[kMaxRows];
        for (int r = 0; r < R; ++r) {
            float b = 0.0f;
            for (int c = 0; c < D; ++c) {
                b += q[r][c] * zf[c];
                qs[static_cast<size_t>(r) * D + c] = q[r][c] * sf[c];
            }
            bias[r] = b;
        }
        for (int w = tg * g / 16; w < (tg + 1) * g / 16; ++w) {  // 16 tokens at a time
#if OVKC_AVX512
            __m512 acc[kMaxRows];
            for (int r = 0; r < R; ++r) acc[r] = _mm512_set1_ps(bias[r]);
            for (int c = 0; c < D; ++c) {
                const __m512 codes = codes16(kc + c * (T / L.kp), w, L.kb);
                for (int r = 0; r < R; ++r)
                    acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(qs[static_cast<size_t>(r) * D + c]), codes, acc[r]);
            }
            for (int r = 0; r < R; ++r) _mm512_storeu_ps(S + r * T + w * 16, acc[r]);
#else
            for (int r = 0; r < R; ++r)
                for (int j = 0; j < 16; ++j) {
                    float a = bias[r];
                    for (int c = 0; c < D; ++c)
                        a += qs[static_cast<size_t>(r) * D + c] *
                             static_cast<float>(QLayout::code(kc + c * (T / L.kp), w * 16 + j, L.kb));
                    S[r * T + w * 16 + j] = a;
                }
#endif
        }
    }
    const int64_t* pos = hc.qpos.data() + qb * T;
    for (int r = 0; r < R; ++r)
        if (pos[T - 1] > rows.qpos[r])
            for (int j = 0; j < T; ++j)
                if (pos[j] > rows.qpos[r]) S[r * T + j] = -std::numeric_limits<float>::infinity();
}
}  // namespace

void attend_quant(const PoolConfig& cfg, const Pool& pool, const HeadCache& hc, RowSet& rows, float scale,
                  int64_t qb_begin, int64_t qb_end) {
    const QLayout L(cfg);
    const int T = L.T, D = L.D, g = L.g, R = rows.n;
    Scratch& tls = scratch();
    if (tls.s.size() < static_cast<size_t>(kMaxRows) * T) tls.s.resize(static_cast<size_t>(kMaxRows) * T);
    float* S = tls.s.data();
    const float* q[kMaxRows];
    scaled_queries(rows, D, scale, tls.q, q);
    std::vector<float>& qs = tls.k;  // q * key scale of the current token group, [R][D]
    if (qs.size() < static_cast<size_t>(kMaxRows) * D) qs.resize(static_cast<size_t>(kMaxRows) * D);
    std::vector<float> sf(static_cast<size_t>(D)), zf(static_cast<size_t>(D));
    qb_end = std::min<int64_t>(qb_end, static_cast<int64_t>(hc.qblocks.size()));
    for (int64_t qb = qb_begin; qb < qb_end; ++qb) {
        const auto value = L.arrays(pool.qblock(hc.qblocks[static_cast<size_t>(qb)]));
        const auto vc = value.vc;
        const auto vs = value.vs;
        const auto vz = value.vz;
        quant_logits(L, pool, hc, qb, rows, q, qs.data(), sf.data(), zf.data(), S);
        for (int r = 0; r < R; ++r)  // a decode step's scores: its logits by 2-bit slot
            if (rows.logits[r]) std::copy(S + r * T, S + (r + 1) * T, rows.logits[r] + qb * T);
        // online softmax
        for (int r = 0; r < R; ++r)
            if (!softmax_step(rows, r, S + r * T, T, D)) std::fill(S + r * T, S + (r + 1) * T, 0.0f);
        // p.v: out += (p * scale) * codes + p * zero, per value group
        for (int t = 0; t < T; ++t) {
            const uint32_t* words = vc + t * (D / L.vp);
            for (int cg = 0; cg < D / g; ++cg) {
                const float vsc = from_half(vs[t * (D / g) + cg]), vzr = from_half(vz[t * (D / g) + cg]);
                for (int r = 0; r < R; ++r) {
                    const float p = S[r * T + t];
                    if (p == 0.0f) continue;
                    for (int w = cg * g / 16; w < (cg + 1) * g / 16; ++w) {  // 16 channels at a time
#if OVKC_AVX512
                        float* o = rows.out[r] + w * 16;
                        const __m512 base = _mm512_fmadd_ps(_mm512_set1_ps(p * vsc), codes16(words, w, L.vb),
                                                            _mm512_set1_ps(p * vzr));
                        _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), base));
#else
                        for (int j = 0; j < 16; ++j)
                            rows.out[r][w * 16 + j] +=
                                p * vsc * static_cast<float>(QLayout::code(words, w * 16 + j, L.vb)) + p * vzr;
#endif
                    }
                }
            }
        }
    }
}

void accumulate_quant_scores(const PoolConfig& cfg, const Pool& pool, HeadCache& hc, const RowSet& rows,
                             const float* lse, float scale, int64_t qb) {
    const QLayout L(cfg);
    const int T = L.T, G = cfg.group();
    Scratch& tls = scratch();
    if (tls.s.size() < static_cast<size_t>(kMaxRows) * T) tls.s.resize(static_cast<size_t>(kMaxRows) * T);
    float* S = tls.s.data();
    const float* q[kMaxRows];
    scaled_queries(rows, L.D, scale, tls.q, q);
    if (tls.k.size() < static_cast<size_t>(kMaxRows) * L.D) tls.k.resize(static_cast<size_t>(kMaxRows) * L.D);
    std::vector<float> sf(static_cast<size_t>(L.D)), zf(static_cast<size_t>(L.D));
    quant_logits(L, pool, hc, qb, rows, q, tls.k.data(), sf.data(), zf.data(), S);
    for (int r = 0; r < rows.n; ++r) {
        float* s = S + r * T;
        exp_sum(s, T, lse[r]);
        float* dst = hc.qscores.data() + static_cast<size_t>(qb * T) * G + rows.group_index[r];
        for (int j = 0; j < T; ++j) dst[static_cast<size_t>(j) * G] += s[j];
    }
}

const char* kernel_isa() {
    if (OVKC_BF16) return has_amx() ? "avx512+bf16+amx" : "avx512+bf16";
    return OVKC_AVX512 ? "avx512" : "scalar";
}

}  // namespace ovkc
