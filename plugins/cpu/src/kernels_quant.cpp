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
// dst[0..16) = zero + code * scale for items 16w .. 16w + 15 of a row of packed words.
void dequantize16(const uint32_t* words, int w, int bits, float scale, float zero, float* dst) {
#if OVKC_AVX512
    _mm512_storeu_ps(dst, _mm512_fmadd_ps(codes16(words, w, bits), _mm512_set1_ps(scale), _mm512_set1_ps(zero)));
#else
    for (int j = 0; j < 16; ++j) dst[j] = zero + static_cast<float>(QLayout::code(words, w * 16 + j, bits)) * scale;
#endif
}

// A 2-bit block as floats, as block_floats gives the others: keys transposed [D][T] (x = zero +
// code * scale, one scale/zero per channel and token group) and, when `v` is set, values [T][D]
// (one per token and channel group). `sc` holds the block's scales and zeros as floats (scratch,
// at least 2 * T * D / g floats).
void dequantize_qblock(const QLayout& L, const uint8_t* blk, float* kt, float* v, std::vector<float>& sc) {
    const auto a = L.arrays(blk);
    const int T = L.T, D = L.D, g = L.g;
    const int64_t kparams = static_cast<int64_t>(T / g) * D, vparams = static_cast<int64_t>(T) * (D / g);
    if (sc.size() < static_cast<size_t>(2 * std::max(kparams, vparams))) sc.resize(static_cast<size_t>(2 * std::max(kparams, vparams)));
    float *scale = sc.data(), *zero = sc.data() + std::max(kparams, vparams);
    half_to_float(a.ks, scale, kparams);
    half_to_float(a.kz, zero, kparams);
    for (int c = 0; c < D; ++c) {
        const uint32_t* words = a.kc + c * (T / L.kp);
        for (int w = 0; w < T / 16; ++w) {  // 16 tokens at a time, in one token group (g >= 16)
            const int tg = w * 16 / g;
            dequantize16(words, w, L.kb, scale[tg * D + c], zero[tg * D + c], kt + c * T + w * 16);
        }
    }
    if (!v) return;
    half_to_float(a.vs, scale, vparams);
    half_to_float(a.vz, zero, vparams);
    for (int t = 0; t < T; ++t) {
        const uint32_t* words = a.vc + t * (D / L.vp);
        for (int w = 0; w < D / 16; ++w) {  // 16 channels at a time, in one channel group
            const int64_t at = t * (D / g) + w * 16 / g;
            dequantize16(words, w, L.vb, scale[at], zero[at], v + t * D + w * 16);
        }
    }
}

// The scaled logits S [R][T] of the rows' (scaled) queries over 2-bit block qb of `hc`, its keys
// dequantized into `kt`. A token after a row's position (a multi-token step's own tokens,
// flushed before it attends) gets -inf.
void quant_logits(const QLayout& L, const Pool& pool, const HeadCache& hc, int64_t qb, const RowSet& rows,
                  const float* const* q, float* kt, float* v, std::vector<float>& sc, float* S) {
    const int T = L.T;
    dequantize_qblock(L, pool.qblock(hc.qblocks[static_cast<size_t>(qb)]), kt, v, sc);
    row_logits(rows, q, kt, L.D, T, T, S);
    const int64_t* pos = hc.qpos.data() + qb * T;
    for (int r = 0; r < rows.n; ++r)
        if (pos[T - 1] > rows.qpos[r])
            for (int j = 0; j < T; ++j)
                if (pos[j] > rows.qpos[r]) S[r * T + j] = -std::numeric_limits<float>::infinity();
}

// Scratch of a 2-bit block's keys and values as floats (per thread).
struct QScratch {
    std::vector<float> kt, v, sc;
    void size(int T, int D) {
        if (kt.size() < static_cast<size_t>(T) * D) {
            kt.resize(static_cast<size_t>(T) * D);
            v.resize(static_cast<size_t>(T) * D);
        }
    }
};
QScratch& qscratch() {
    thread_local QScratch tls;
    return tls;
}
}  // namespace

void attend_quant(const PoolConfig& cfg, const Pool& pool, const HeadCache& hc, RowSet& rows, float scale,
                  int64_t qb_begin, int64_t qb_end) {
    const QLayout L(cfg);
    const int T = L.T, D = L.D, R = rows.n;
    Scratch& tls = scratch();
    if (tls.s.size() < static_cast<size_t>(kMaxRows) * T) tls.s.resize(static_cast<size_t>(kMaxRows) * T);
    float* S = tls.s.data();
    const float* q[kMaxRows];
    scaled_queries(rows, D, scale, tls.q, q);
    QScratch& buf = qscratch();
    buf.size(T, D);
    qb_end = std::min<int64_t>(qb_end, static_cast<int64_t>(hc.qblocks.size()));
    for (int64_t qb = qb_begin; qb < qb_end; ++qb) {
        quant_logits(L, pool, hc, qb, rows, q, buf.kt.data(), buf.v.data(), buf.sc, S);
        for (int r = 0; r < R; ++r) {
            float* s = S + r * T;
            if (rows.logits[r]) std::copy(s, s + T, rows.logits[r] + qb * T);  // a decode step's scores
            if (!softmax_step(rows, r, s, T, D)) std::fill(s, s + T, 0.0f);
        }
        pv(R, S, T, buf.v.data(), T, D, rows.out);
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
    QScratch& buf = qscratch();
    buf.size(T, L.D);
    quant_logits(L, pool, hc, qb, rows, q, buf.kt.data(), nullptr, buf.sc, S);
    for (int r = 0; r < rows.n; ++r) {
        float* s = S + r * T;
        exp_sum(s, T, lse[r]);
        float* dst = hc.qscores.data() + static_cast<size_t>(qb * T) * G + rows.group_index[r];
        for (int j = 0; j < T; ++j) dst[static_cast<size_t>(j) * G] += s[j];
    }
}

const char* kernel_isa() {
    if (OVKC_BF16) return has_amx() ? "avx512+bf16+amx" : "avx512+bf16";
    return OVKC_AVX512 ? "avx512" : OVKC_AVX2 ? "avx2" : "scalar";
}

}  // namespace ovkc
