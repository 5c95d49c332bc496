// The u8 store's codes (8 bits per key or value element, each slot's min and scale beside them,
// as OpenVINO's CPU plugin stores its cache): quantizing a token, converting a block's window to
// floats, and (on AVX2) attending a block's codes in place, its slots' min and scale applied
// around the products.
#include <algorithm>
#include <cmath>

#include "kernels_detail.hpp"

namespace ovkc {
namespace detail {

// ---- the u8 store ------------------------------------------------------------------------------
void quantize_u8(const float* x, int n, uint8_t* codes, int64_t stride, float& lo, float& scale) {
    float mn = x[0], mx = x[0];
    for (int i = 1; i < n; ++i) {
        mn = std::min(mn, x[i]);
        mx = std::max(mx, x[i]);
    }
    lo = mn;
    scale = (mx - mn) / 255.0f;
    const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
    for (int i = 0; i < n; ++i) {
        const float c = std::nearbyint((x[i] - mn) * inv);
        codes[static_cast<int64_t>(i) * stride] = static_cast<uint8_t>(std::clamp(c, 0.0f, 255.0f));
    }
}

void dequantize_u8(const uint8_t* base, int bs, int D, int j0, int j1, float* kt, float* v) {
    const size_t kv_elems = static_cast<size_t>(bs) * D;
    const float* p = u8_params(base, bs, D);
    const float *kmin = p, *kscale = p + bs, *vmin = p + 2 * bs, *vscale = p + 3 * bs;
    // the window's columns, padded to whole vectors (the attention reads 16 columns at a time)
    const int w1 = std::min(j0 + (j1 - j0 + 15) / 16 * 16, bs);
#if OVKC_AVX512
    auto codes16 = [](const uint8_t* c) {
        return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c))));
    };
    if ((w1 - j0) % 16 == 0) {  // whole vectors of columns (always, unless the block ends first)
        for (int j = j0; j < w1; j += 16) {
            const __m512 lo = _mm512_loadu_ps(kmin + j), sc = _mm512_loadu_ps(kscale + j);
            for (int d = 0; d < D; ++d)
                _mm512_storeu_ps(kt + static_cast<size_t>(d) * bs + j,
                                 _mm512_fmadd_ps(codes16(base + static_cast<size_t>(d) * bs + j), sc, lo));
        }
    } else
#elif OVKC_AVX2
    if ((w1 - j0) % 8 == 0) {
        for (int j = j0; j < w1; j += 8) {
            const __m256 lo = _mm256_loadu_ps(kmin + j), sc = _mm256_loadu_ps(kscale + j);
            for (int d = 0; d < D; ++d)
                _mm256_storeu_ps(kt + static_cast<size_t>(d) * bs + j,
                                 _mm256_fmadd_ps(codes8(base + static_cast<size_t>(d) * bs + j), sc, lo));
        }
    } else
#endif
    {
        for (int d = 0; d < D; ++d) {
            const uint8_t* c = base + static_cast<size_t>(d) * bs;
            float* out = kt + static_cast<size_t>(d) * bs;
            for (int j = j0; j < w1; ++j) out[j] = kmin[j] + static_cast<float>(c[j]) * kscale[j];
        }
    }
    for (int j = j0; j < j1; ++j) {
        const uint8_t* c = base + kv_elems + static_cast<size_t>(j) * D;
        float* out = v + static_cast<size_t>(j) * D;
        const float lo = vmin[j], sc = vscale[j];
#if OVKC_AVX512
        const __m512 lov = _mm512_set1_ps(lo), scv = _mm512_set1_ps(sc);
        for (int d = 0; d < D; d += 16) _mm512_storeu_ps(out + d, _mm512_fmadd_ps(codes16(c + d), scv, lov));
#elif OVKC_AVX2
        const __m256 lov = _mm256_set1_ps(lo), scv = _mm256_set1_ps(sc);
        for (int d = 0; d < D; d += 8) _mm256_storeu_ps(out + d, _mm256_fmadd_ps(codes8(c + d), scv, lov));
#else
        for (int d = 0; d < D; ++d) out[d] = lo + static_cast<float>(c[d]) * sc;
#endif
    }
}

// ---- the u8 store read in place (kCodeKernels) -------------------------------------------------
// A decode reads every held block once per step: converting each to floats first (dequantize_u8)
// cost more than the attention over it. The slot's min and scale come out of the products:
// q.(min + scale * code) = min * sum(q) + scale * (q.code), and each p * (min + scale * code)
// sums to (sum of p * min) + (p * scale).code.

// Whether block `block_index` of hc is read as codes: the u8 store where no step's tokens must be
// read exactly (a decode; a prompt attends its own tokens as given) and no staged copy stands in.
bool reads_codes(const PoolConfig& cfg, const HeadCache& hc, int64_t block_index) {
    return kCodeKernels && cfg.precision == Precision::u8 && !hc.step.k && block_index >= hc.step.staged_blocks;
}

// A block a decode is about to read, fetched ahead: the pool's blocks lie anywhere (no
// prefetcher's stream leads from one to the next) and the slots' mins and scales past the codes
// (else each block waits on memory for them, twice).
void prefetch_block(const PoolConfig& cfg, const Pool& pool, int32_t block) {
    const char* p = reinterpret_cast<const char*>(pool.block(block));
    const size_t bytes = 2 * static_cast<size_t>(cfg.block_size) * cfg.head_dim * cfg.elem_bytes() + cfg.param_bytes();
    for (size_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b);
}

// The logits of columns [j0, j0 + cols) of a u8 block (qsum[r]: the sum of row r's scaled query).
void code_logits(const RowSet& rows, const float* const* q, const float* qsum, const uint8_t* base, int D, int bs,
                 int j0, int cols, float* S) {
#if OVKC_AVX2
    qk_codes(rows.n, q, base + j0, D, bs, cols, S);
    // the padding's columns read past the block's keys into its own later bytes: masked after
    const float* kmin = u8_params(base, bs, D) + j0;
    const float* kscale = kmin + bs;
    for (int r = 0; r < rows.n; ++r) {
        float* s = S + r * bs;
        const __m256 qs = _mm256_set1_ps(qsum[r]);
        for (int j = 0; j < cols; j += 8)
            _mm256_storeu_ps(s + j, _mm256_fmadd_ps(_mm256_loadu_ps(kscale + j), _mm256_loadu_ps(s + j),
                                                    _mm256_mul_ps(_mm256_loadu_ps(kmin + j), qs)));
    }
    if (rows.softcap > 0.0f) cap_logits(S, rows.n, cols, bs, rows.softcap);
#else
    (void)rows, (void)q, (void)qsum, (void)base, (void)D, (void)bs, (void)j0, (void)cols, (void)S;
#endif
}

// out[r] += P[r][0..ntok) . the values of slots [j0, j0 + ntok) of a u8 block (P scaled in place).
void code_values(int R, float* P, int bs, const uint8_t* base, int D, int j0, int ntok, float* const* out) {
#if OVKC_AVX2
    const float* vmin = u8_params(base, bs, D) + 2 * bs + j0;
    const float* vscale = vmin + bs;
    for (int r = 0; r < R; ++r) {
        float* p = P + r * bs;
        __m256 sum = _mm256_setzero_ps();
        int j = 0;
        for (; j + 8 <= ntok; j += 8) {
            const __m256 pj = _mm256_loadu_ps(p + j);
            sum = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vmin + j), sum);
            _mm256_storeu_ps(p + j, _mm256_mul_ps(pj, _mm256_loadu_ps(vscale + j)));
        }
        float shift = hsum256(sum);
        for (; j < ntok; ++j) {
            shift += p[j] * vmin[j];
            p[j] *= vscale[j];
        }
        const __m256 sh = _mm256_set1_ps(shift);
        for (int d = 0; d < D; d += 8) _mm256_storeu_ps(out[r] + d, _mm256_add_ps(_mm256_loadu_ps(out[r] + d), sh));
    }
    pv_codes(R, P, bs, base + (static_cast<size_t>(bs) + j0) * D, ntok, D, out);
#else
    (void)R, (void)P, (void)bs, (void)base, (void)D, (void)j0, (void)ntok, (void)out;
#endif
}

}  // namespace detail
}  // namespace ovkc
