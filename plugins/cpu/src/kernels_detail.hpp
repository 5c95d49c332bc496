// What the kernel files share (kernels.cpp, kernels_f32.cpp, kernels_u8.cpp, kernels_bf16.cpp,
// kernels_quant.cpp, and the sparse prefill's estimate in sparse_prefill.cpp): the vector-unit
// switches, f16 conversion, the u8 store's codes, thread-local scratch, a block's float view and
// the online-softmax step. Internal to the kernels; the interface is kernels.hpp.
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#    include <immintrin.h>
#    define OVKC_AVX512 1
#else
#    define OVKC_AVX512 0
#endif
// AVX2 with FMA (and F16C), where AVX-512 is not there: most x86 servers' and clients' vector
// unit (Intel's without AVX-512, AMD's before Zen 4, and virtual machines that hide AVX-512).
// The hot kernels have an 8-lane path there; the rest is scalar C++ the compiler vectorises.
#if !OVKC_AVX512 && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#    include <immintrin.h>
#    define OVKC_AVX2 1
#else
#    define OVKC_AVX2 0
#endif
#if OVKC_AVX512 && defined(__AVX512BF16__)
#    define OVKC_BF16 1
#else
#    define OVKC_BF16 0
#endif


#include "kernels.hpp"

namespace ovkc {
namespace detail {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ---- half precision -------------------------------------------------------------------------
inline uint16_t to_half(float f) {
#if OVKC_AVX512 || OVKC_AVX2
    return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
#else
    uint32_t x;
    std::memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t absx = x & 0x7fffffffu;
    if (absx >= 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u | (absx > 0x7f800000u ? 0x200u : 0u));
    if (absx >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
    if (absx < 0x38800000u) {                                                // subnormal half or zero
        if (absx < 0x33000000u) return static_cast<uint16_t>(sign);
        // x = mant * 2^(e - 150) = (mant >> shift) half subnormal units of 2^-24, rounded to even
        const uint32_t mant = (absx & 0x7fffffu) | 0x800000u;
        const int shift = 126 - static_cast<int>(absx >> 23);
        uint32_t h = mant >> shift;
        const uint32_t rem = mant & ((1u << shift) - 1u);
        const uint32_t half = 1u << (shift - 1);
        if (rem > half || (rem == half && (h & 1u))) ++h;
        return static_cast<uint16_t>(sign | h);
    }
    uint32_t h = ((absx - 0x38000000u) >> 13);
    const uint32_t rem = absx & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
#endif
}

inline float from_half(uint16_t h) {
#if OVKC_AVX512 || OVKC_AVX2
    return _cvtsh_ss(h);
#else
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    uint32_t x;
    if (exp == 0) {
        if (mant == 0) {
            x = sign;
        } else {
            exp = 127 - 15 + 1;
            while (!(mant & 0x400u)) {
                mant <<= 1;
                --exp;
            }
            x = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        x = sign | 0x7f800000u | (mant << 13);
    } else {
        x = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    std::memcpy(&f, &x, 4);
    return f;
#endif
}

// bf16, rounded to nearest even
inline uint16_t to_bf16(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    x += 0x7fffu + ((x >> 16) & 1u);
    return static_cast<uint16_t>(x >> 16);
}

// ---- exp --------------------------------------------------------------------------------------
#if OVKC_AVX512
// Cephes expf on 16 lanes (about 1 ulp), down into the denormal range as libm's expf (scalef
// rounds 2^n scaling to a denormal): the per-head scores then rank tokens with almost no
// attention the way the torch reference does; lanes below -104 (and -inf) give exactly 0.
inline __m512 exp512(__m512 x) {
    const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-104.0f), _CMP_GE_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(88.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 r2 = _mm512_mul_ps(r, r);
    __m512 y = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    y = _mm512_scalef_ps(y, n);
    return _mm512_maskz_mov_ps(live, y);
}
#endif

#if OVKC_AVX2
// exp512's Cephes expf on 8 lanes, the same arithmetic step for step, for x already clamped:
// n = round(x / ln 2) and the polynomial of r = x - n ln 2 (e^x = 2^n times what it returns).
inline __m256 exp256_reduced(__m256 x, __m256i& n) {
    const __m256 nf = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(nf, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(nf, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    const __m256 r2 = _mm256_mul_ps(r, r);
    n = _mm256_cvtps_epi32(nf);
    return _mm256_fmadd_ps(p, r2, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
}

// 2^n as a float, for n in [-126, 127]
inline __m256 pow2_256(__m256i n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
}

// e^x: AVX2 has no scalef, so 2^n is applied in two halves (each a normal power of two down to
// n = -150), which reaches the denormals with the one rounding scalef does. Lanes below -104
// (and -inf) give exactly 0.
inline __m256 exp256(__m256 x) {
    const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-104.0f), _CMP_GE_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-104.0f)), _mm256_set1_ps(88.0f));
    __m256i n;
    const __m256 y = exp256_reduced(x, n);
    const __m256i n1 = _mm256_srai_epi32(n, 1), n2 = _mm256_sub_epi32(n, n1);
    return _mm256_and_ps(_mm256_mul_ps(_mm256_mul_ps(y, pow2_256(n1)), pow2_256(n2)), live);
}

// exp256 where x <= 0 (a softmax's s - max): lanes below -87 (and -inf) give 0, so every 2^n
// is a normal power of two and applied in one multiply. Against exp256 this drops only the
// denormals (below 2^-126 = 1.2e-38): nothing beside the row's largest term, e^0 = 1.
inline __m256 exp256_nonpositive(__m256 x) {
    const __m256 live = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
    __m256i n;
    const __m256 y = exp256_reduced(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), n);
    return _mm256_and_ps(_mm256_mul_ps(y, pow2_256(n)), live);
}

inline float hsum256(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

inline float hmax256(__m256 v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

// 8 u8 codes as floats
inline __m256 codes8(const uint8_t* c) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c))));
}
#endif

#if OVKC_AVX2
// q.k and p.v (kernels_f32.cpp's) with the u8 store's codes as the keys (transposed, row stride
// bs) or the values (row stride D): their slots' min and scale are applied by the callers
void qk_codes(int R, const float* const* q, const uint8_t* kt, int D, int bs, int cols, float* S);
void pv_codes(int R, const float* P, int bs, const uint8_t* v, int ntok, int D, float* const* out);
#endif
// whether attention reads the u8 store's codes in place (AVX2), not a converted copy of the block
constexpr bool kCodeKernels = OVKC_AVX2;

void half_to_float(const uint16_t* src, float* dst, int64_t n);
// u8 store: a block's slot parameters lie after its codes (keys [D][bs], then values [bs][D]):
// four rows of bs floats, the keys' mins, the keys' scales, the values' mins, the values' scales
inline float* u8_params(uint8_t* base, int bs, int D) {
    return reinterpret_cast<float*>(base + 2 * static_cast<size_t>(bs) * D);
}
inline const float* u8_params(const uint8_t* base, int bs, int D) {
    return reinterpret_cast<const float*>(base + 2 * static_cast<size_t>(bs) * D);
}
// u8 store: n values (strided in `codes`) as codes with their min and scale (x = min + code * scale)
void quantize_u8(const float* x, int n, uint8_t* codes, int64_t stride, float& lo, float& scale);
// u8 store: columns [j0, j1) of a block's keys (transposed) and values as floats
void dequantize_u8(const uint8_t* base, int bs, int D, int j0, int j1, float* kt, float* v);
// u8 store read in place (kernels_u8.cpp): whether block `block_index` of hc is read as codes (a
// decode on AVX2; a prompt attends its own tokens exactly); the logits of its columns [j0, j0 +
// cols) (qsum[r]: the sum of row r's scaled query); out[r] += P[r][0..ntok) . its values from slot
// j0 (P scaled in place); and a block fetched ahead of its reading
bool reads_codes(const PoolConfig& cfg, const HeadCache& hc, int64_t block_index);
void code_logits(const RowSet& rows, const float* const* q, const float* qsum, const uint8_t* base, int D, int bs,
                 int j0, int cols, float* S);
void code_values(int R, float* P, int bs, const uint8_t* base, int D, int j0, int ntok, float* const* out);
void prefetch_block(const PoolConfig& cfg, const Pool& pool, int32_t block);
void float_to_half(const float* src, uint16_t* dst, int64_t n);

// Per-thread buffers (a converted block, logits, scaled queries).
struct Scratch {
    std::vector<float> k, v, s, q;
};
inline Scratch& scratch() {
    thread_local Scratch tls;
    return tls;
}

// Keys (transposed, [D][bs]) and values ([bs][D]) of a block as floats: the block itself for
// f32, a converted copy in thread-local scratch for f16 (columns [j0, j1) only).
void block_floats(const PoolConfig& cfg, const Pool& pool, int32_t block, int j0, int j1, const float*& kt,
                  const float*& v);
// block_floats of the head's block `block_index`, the step's own tokens (hc.step) exact: a prompt
// attends what it was given, not the store's rounding of it (every store but f32, which is exact);
// the step's staged copy of the block when there is one (StepTokens::staged)
void head_block_floats(const PoolConfig& cfg, const Pool& pool, const HeadCache& hc, int64_t block_index, int j0,
                       int j1, const float*& kt, const float*& v);
// S[r][0..cols) = q[r] . kt[:, 0..cols) for R query rows (keys transposed, row stride bs; cols a
// multiple of 16), and out[r] += P[r][0..ntok) . v (values [ntok][D]): every block's attention.
void qk(int R, const float* const* q, const float* kt, int D, int bs, int cols, float* S);
// A block's logits as the model computes them: qk of the rows' (scaled) queries, then the rows'
// soft-capping (RowSet::softcap) when the model has one. Every kernel that attends or scores
// rows with f32 products takes its logits from here.
void row_logits(const RowSet& rows, const float* const* q, const float* kt, int D, int bs, int cols, float* S);
// s = cap * tanh(s / cap) for rows [0, R) of S (row stride bs), their first `cols` logits.
void cap_logits(float* S, int R, int cols, int bs, float cap);
void pv(int R, const float* P, int bs, const float* v, int ntok, int D, float* const* out);
// Mask the slots that are not held or are after each row's position (logits already scaled).
void mask_logits(const HeadCache& hc, const RowSet& rows, int64_t slot0, int ntok, int bs, float* S);
// Query rows multiplied by the logit scale, in `buf` (the kernels then produce scaled logits).
void scaled_queries(const RowSet& rows, int D, float scale, std::vector<float>& buf, const float* out[kMaxRows]);
// The largest of cols (a multiple of 16) scaled logits; s[0..cols) = exp(s - m) in place, returning
// their sum (lanes at -inf give 0).
float row_max(const float* s, int cols);
float exp_sum(float* s, int cols, float m);
// One online-softmax step of row r over the next `cols` scaled logits in s (masked ones -inf);
// false when none of these keys is visible to the row.
bool softmax_step(RowSet& rows, int r, float* s, int cols, int D);

}  // namespace detail
}  // namespace ovkc
