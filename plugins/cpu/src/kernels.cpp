#include "kernels.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#    include <immintrin.h>
#    define OVKC_AVX512 1
#else
#    define OVKC_AVX512 0
#endif
#if OVKC_AVX512 && defined(__AVX512BF16__)
#    define OVKC_BF16 1
#else
#    define OVKC_BF16 0
#endif

namespace ovkc {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ---- half precision -------------------------------------------------------------------------
inline uint16_t to_half(float f) {
#if OVKC_AVX512
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
        const uint32_t mant = (absx & 0x7fffffu) | 0x800000u;
        const int shift = 126 - static_cast<int>(absx >> 23);
        uint32_t h = mant >> (shift + 1);
        const uint32_t rem = mant & ((1u << (shift + 1)) - 1u);
        const uint32_t half = 1u << shift;
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
#if OVKC_AVX512
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

void half_to_float(const uint16_t* src, float* dst, int64_t n) {
    int64_t i = 0;
#if OVKC_AVX512
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
#endif
    for (; i < n; ++i) dst[i] = from_half(src[i]);
}

void float_to_half(const float* src, uint16_t* dst, int64_t n) {
    int64_t i = 0;
#if OVKC_AVX512
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                            _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    for (; i < n; ++i) dst[i] = to_half(src[i]);
}

// ---- float views of a block -------------------------------------------------------------------
struct Scratch {
    std::vector<float> k, v, s, q;
};
thread_local Scratch tls;

// Keys (transposed, [D][bs]) and values ([bs][D]) of a block as floats: the block itself for
// f32, a converted copy in thread-local scratch for f16.
void block_floats(const PoolConfig& cfg, const Pool& pool, int32_t block, int j0, int j1, const float*& kt,
                  const float*& v) {
    const int bs = cfg.block_size, D = cfg.head_dim;
    const size_t kv_elems = static_cast<size_t>(bs) * D;
    uint8_t* base = pool.block(block);
    if (cfg.precision == Precision::f32) {
        kt = reinterpret_cast<const float*>(base);
        v = kt + kv_elems;
        return;
    }
    if (tls.k.size() < kv_elems + 16) {  // + 16: a window's last padded vector may run past row D - 1
        tls.k.resize(kv_elems + 16);
        tls.v.resize(kv_elems);
    }
    const auto* h = reinterpret_cast<const uint16_t*>(base);
    if (j0 == 0 && j1 == bs) {
        half_to_float(h, tls.k.data(), static_cast<int64_t>(kv_elems));
    } else {  // only the window's columns (padded to whole vectors) of each channel
        const int w = std::min((j1 - j0 + 15) / 16 * 16, bs - j0);
        for (int d = 0; d < D; ++d) half_to_float(h + d * bs + j0, tls.k.data() + d * bs + j0, w);
    }
    half_to_float(h + kv_elems + static_cast<size_t>(j0) * D, tls.v.data() + static_cast<size_t>(j0) * D,
                  static_cast<int64_t>(j1 - j0) * D);
    kt = tls.k.data();
    v = tls.v.data();
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

// S[r][c..) = q[r] . K[:, c..) for R rows and `cols` columns (a multiple of 16).
template <int R>
void qk_rows(const float* const* q, const float* kt, int D, int bs, int cols, float* S) {
    int c = 0;
    for (; c + 32 <= cols; c += 32) {
        __m512 acc[R][2];
        for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
        for (int d = 0; d < D; ++d) {
            const __m512 k0 = _mm512_loadu_ps(kt + static_cast<size_t>(d) * bs + c);
            const __m512 k1 = _mm512_loadu_ps(kt + static_cast<size_t>(d) * bs + c + 16);
            for (int r = 0; r < R; ++r) {
                const __m512 qb = _mm512_set1_ps(q[r][d]);
                acc[r][0] = _mm512_fmadd_ps(qb, k0, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(qb, k1, acc[r][1]);
            }
        }
        for (int r = 0; r < R; ++r) {
            _mm512_storeu_ps(S + r * bs + c, acc[r][0]);
            _mm512_storeu_ps(S + r * bs + c + 16, acc[r][1]);
        }
    }
    for (; c < cols; c += 16) {
        __m512 acc[R];
        for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
        for (int d = 0; d < D; ++d) {
            const __m512 k0 = _mm512_loadu_ps(kt + static_cast<size_t>(d) * bs + c);
            for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r][d]), k0, acc[r]);
        }
        for (int r = 0; r < R; ++r) _mm512_storeu_ps(S + r * bs + c, acc[r]);
    }
}

// out[r][c..c+16*NV) += sum_j P[r][j] * V[j][c..) for RR rows.
template <int RR, int NV>
void pv_rows(const float* P, int bs, const float* v, int ntok, int D, int c, float* const* out) {
    __m512 acc[RR][NV];
    for (int r = 0; r < RR; ++r)
        for (int u = 0; u < NV; ++u) acc[r][u] = _mm512_loadu_ps(out[r] + c + 16 * u);
    for (int j = 0; j < ntok; ++j) {
        __m512 vv[NV];
        for (int u = 0; u < NV; ++u) vv[u] = _mm512_loadu_ps(v + static_cast<size_t>(j) * D + c + 16 * u);
        for (int r = 0; r < RR; ++r) {
            const __m512 p = _mm512_set1_ps(P[r * bs + j]);
            for (int u = 0; u < NV; ++u) acc[r][u] = _mm512_fmadd_ps(p, vv[u], acc[r][u]);
        }
    }
    for (int r = 0; r < RR; ++r)
        for (int u = 0; u < NV; ++u) _mm512_storeu_ps(out[r] + c + 16 * u, acc[r][u]);
}

template <int RR>
void pv_group(const float* P, int bs, const float* v, int ntok, int D, float* const* out) {
    int c = 0;
    for (; c + 64 <= D; c += 64) pv_rows<RR, 4>(P, bs, v, ntok, D, c, out);
    for (; c < D; c += 16) pv_rows<RR, 1>(P, bs, v, ntok, D, c, out);
}
#endif

void qk(int R, const float* const* q, const float* kt, int D, int bs, int cols, float* S) {
#if OVKC_AVX512
    switch (R) {
        case 1: return qk_rows<1>(q, kt, D, bs, cols, S);
        case 2: return qk_rows<2>(q, kt, D, bs, cols, S);
        case 3: return qk_rows<3>(q, kt, D, bs, cols, S);
        case 4: return qk_rows<4>(q, kt, D, bs, cols, S);
        case 5: return qk_rows<5>(q, kt, D, bs, cols, S);
        case 6: return qk_rows<6>(q, kt, D, bs, cols, S);
        case 7: return qk_rows<7>(q, kt, D, bs, cols, S);
        default: return qk_rows<8>(q, kt, D, bs, cols, S);
    }
#else
    for (int r = 0; r < R; ++r) {
        float* s = S + r * bs;
        for (int j = 0; j < cols; ++j) s[j] = 0.0f;
        for (int d = 0; d < D; ++d) {
            const float qd = q[r][d];
            const float* krow = kt + static_cast<size_t>(d) * bs;
            for (int j = 0; j < cols; ++j) s[j] += qd * krow[j];
        }
    }
#endif
}

void pv(int R, const float* P, int bs, const float* v, int ntok, int D, float* const* out) {
#if OVKC_AVX512
    int r = 0;
    for (; r + 4 <= R; r += 4) pv_group<4>(P + r * bs, bs, v, ntok, D, out + r);
    switch (R - r) {
        case 1: pv_group<1>(P + r * bs, bs, v, ntok, D, out + r); break;
        case 2: pv_group<2>(P + r * bs, bs, v, ntok, D, out + r); break;
        case 3: pv_group<3>(P + r * bs, bs, v, ntok, D, out + r); break;
        default: break;
    }
#else
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < ntok; ++j) {
            const float p = P[r * bs + j];
            if (p == 0.0f) continue;
            const float* vr = v + static_cast<size_t>(j) * D;
            for (int d = 0; d < D; ++d) out[r][d] += p * vr[d];
        }
#endif
}

// s[0..cols) = exp(s - m) in place; returns the sum. Lanes at -inf give 0.
float exp_sum(float* s, int cols, float m) {
#if OVKC_AVX512
    __m512 sum = _mm512_setzero_ps();
    const __m512 mm = _mm512_set1_ps(m);
    for (int j = 0; j < cols; j += 16) {
        const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(s + j), mm));
        _mm512_storeu_ps(s + j, e);
        sum = _mm512_add_ps(sum, e);
    }
    return _mm512_reduce_add_ps(sum);
#else
    float sum = 0.0f;
    for (int j = 0; j < cols; ++j) {
        s[j] = s[j] == kNegInf ? 0.0f : std::exp(s[j] - m);
        sum += s[j];
    }
    return sum;
#endif
}

// Mask the slots that are not held or are after each row's position (logits already scaled).
void mask_logits(const HeadCache& hc, const RowSet& rows, int64_t slot0, int ntok, int bs, float* S) {
    const int cols = (ntok + 15) / 16 * 16;
    const int64_t last_pos = hc.pos[static_cast<size_t>(slot0 + ntok - 1)];
    for (int r = 0; r < rows.n; ++r) {
        float* s = S + r * bs;
        if (last_pos <= rows.qpos[r]) {  // every held slot is visible: only the padding goes
            for (int j = ntok; j < cols; ++j) s[j] = kNegInf;
            continue;
        }
        for (int j = 0; j < cols; ++j)
            if (j >= ntok || hc.pos[static_cast<size_t>(slot0 + j)] > rows.qpos[r]) s[j] = kNegInf;
    }
}

// Chelsea: add each slot's log(degree) to its (scaled) logits.
void add_bias(const HeadCache& hc, int R, int64_t slot0, int ntok, int bs, float* S) {
    const float* b = hc.bias.data() + slot0;
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < ntok; ++j) S[r * bs + j] += b[j];
}

float row_max(const float* s, int cols) {
#if OVKC_AVX512
    __m512 m = _mm512_set1_ps(kNegInf);
    for (int j = 0; j < cols; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + j));
    return _mm512_reduce_max_ps(m);
#else
    float m = kNegInf;
    for (int j = 0; j < cols; ++j) m = std::max(m, s[j]);
    return m;
#endif
}

// Query rows multiplied by the logit scale, in thread-local scratch (the kernels then produce
// scaled logits directly).
void scaled_queries(const RowSet& rows, int D, float scale, std::vector<float>& buf, const float* out[kMaxRows]) {
    if (buf.size() < static_cast<size_t>(kMaxRows) * D) buf.resize(static_cast<size_t>(kMaxRows) * D);
    for (int r = 0; r < rows.n; ++r) {
        float* dst = buf.data() + static_cast<size_t>(r) * D;
        for (int d = 0; d < D; ++d) dst[d] = rows.q[r][d] * scale;
        out[r] = dst;
    }
}

// One online-softmax step of row r over the next `cols` scaled logits in s (masked ones -inf):
// rescales the row's running output and sum to the new maximum and turns s into exp(s - m).
// Returns false, leaving s as it is, when none of these keys is visible to the row.
bool softmax_step(RowSet& rows, int r, float* s, int cols, int D) {
    const float mx = row_max(s, cols);
    if (mx == kNegInf) return false;
    const float m_new = std::max(rows.m[r], mx);
    const float alpha = rows.m[r] == kNegInf ? 0.0f : std::exp(rows.m[r] - m_new);
    const float sum = exp_sum(s, cols, m_new);
    rows.l[r] = rows.l[r] * alpha + sum;
    if (alpha != 1.0f)
        for (int d = 0; d < D; ++d) rows.out[r][d] *= alpha;
    rows.m[r] = m_new;
    return true;
}

}  // namespace

void RowSet::start() {
    for (int r = 0; r < kMaxRows; ++r) {
        m[r] = kNegInf;
        l[r] = 0.0f;
    }
}

void attend_range(const PoolConfig& cfg, const Pool& pool, const HeadCache& hc, RowSet& rows, float scale,
                  int64_t slot_begin, int64_t slot_end) {
    const int bs = cfg.block_size;
    const int D = cfg.head_dim;
    int64_t max_q = rows.qpos[0];
    for (int r = 1; r < rows.n; ++r) max_q = std::max(max_q, rows.qpos[r]);
    if (tls.s.size() < static_cast<size_t>(kMaxRows) * bs) tls.s.resize(static_cast<size_t>(kMaxRows) * bs);
    float* S = tls.s.data();
    const float* q[kMaxRows];
    scaled_queries(rows, D, scale, tls.q, q);
    slot_end = std::min(slot_end, hc.size());
    for (int64_t slot0 = slot_begin / bs * bs; slot0 < slot_end; slot0 += bs) {
        // the range's part of this block: slots [w0, w0 + ntok), handled as a window starting at
        // its first slot (a recalled cluster may start and end mid-block: no work on the rest)
        const int j0 = static_cast<int>(std::max<int64_t>(slot_begin - slot0, 0));
        const int64_t w0 = slot0 + j0;
        if (hc.pos[static_cast<size_t>(w0)] > max_q) break;  // positions ascend: nothing further is causal
        const int ntok = static_cast<int>(std::min<int64_t>(bs, slot_end - slot0)) - j0;
        const float *kt, *v;
        block_floats(cfg, pool, hc.blocks[static_cast<size_t>(slot0 / bs)], j0, j0 + ntok, kt, v);
        const int cols = (ntok + 15) / 16 * 16;
        qk(rows.n, q, kt + j0, D, bs, cols, S);
        if (!hc.bias.empty()) add_bias(hc, rows.n, w0, ntok, bs, S);
        mask_logits(hc, rows, w0, ntok, bs, S);
        for (int r = 0; r < rows.n; ++r) {
            float* s = S + r * bs;
            if (rows.logits[r]) std::copy(s, s + ntok, rows.logits[r] + w0);
            if (!softmax_step(rows, r, s, cols, D)) std::fill(s, s + cols, 0.0f);  // nothing causal here
        }
        pv(rows.n, S, bs, v + static_cast<size_t>(j0) * D, ntok, D, rows.out);
    }
}

void Slab::clear() {
    kt.clear();
    v.clear();
    kt.shrink_to_fit();
    v.shrink_to_fit();
    count = 0;
    max_token = -1;
}

void Slab::resize(int64_t n, int D) {
    const int64_t tiles = (n + kSlabTile - 1) / kSlabTile;
    kt.resize(static_cast<size_t>(tiles * D * kSlabTile), 0.0f);
    v.resize(static_cast<size_t>(n * D));
}

void Slab::put(int64_t j, const float* k, const float* val, int D) {
    float* tile = kt.data() + static_cast<size_t>(j / kSlabTile) * D * kSlabTile + j % kSlabTile;
    for (int d = 0; d < D; ++d) tile[static_cast<size_t>(d) * kSlabTile] = k[d];
    std::memcpy(v.data() + static_cast<size_t>(j) * D, val, sizeof(float) * D);
}

void attend_slab(const Slab& slab, int64_t n, int D, RowSet& rows, float scale, int64_t pos0) {
    constexpr int bs = kSlabTile;
    if (tls.s.size() < static_cast<size_t>(kMaxRows) * bs) tls.s.resize(static_cast<size_t>(kMaxRows) * bs);
    float* S = tls.s.data();
    const float* q[kMaxRows];
    scaled_queries(rows, D, scale, tls.q, q);
    n = std::min(n, slab.count);
    for (int64_t j0 = 0; j0 < n; j0 += bs) {
        const int ntok = static_cast<int>(std::min<int64_t>(bs, n - j0));
        qk(rows.n, q, slab.kt.data() + static_cast<size_t>(j0 / bs) * D * bs, D, bs, bs, S);
        for (int r = 0; r < rows.n; ++r) {
            float* s = S + r * bs;
            // padding, and (for consecutive positions from pos0) the keys after the row's own
            int visible = ntok;
            if (pos0 >= 0) visible = static_cast<int>(std::clamp<int64_t>(rows.qpos[r] - (pos0 + j0) + 1, 0, ntok));
            for (int j = visible; j < bs; ++j) s[j] = kNegInf;
            if (!softmax_step(rows, r, s, bs, D)) std::fill(s, s + bs, 0.0f);
        }
        pv(rows.n, S, bs, slab.v.data() + static_cast<size_t>(j0) * D, ntok, D, rows.out);
    }
}

float dot(const float* a, const float* b, int n) {
    int d = 0;
    float acc = 0.0f;
#if OVKC_AVX512
    __m512 v = _mm512_setzero_ps();
    for (; d + 16 <= n; d += 16) v = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), v);
    acc = _mm512_reduce_add_ps(v);
#endif
    for (; d < n; ++d) acc += a[d] * b[d];
    return acc;
}

void normalize_rows(const float* x, int64_t n, int D, float* out) {
    for (int64_t i = 0; i < n; ++i) {
        const float* xi = x + i * D;
        float ss = 0.0f;
        for (int d = 0; d < D; ++d) ss += xi[d] * xi[d];
        const float inv = 1.0f / std::max(std::sqrt(ss), 1e-12f);
        for (int d = 0; d < D; ++d) out[i * D + d] = xi[d] * inv;
    }
}

float merge_partials(const float* first, size_t stride, int n, int D, float* out) {
    float M = kNegInf;
    for (int c = 0; c < n; ++c) M = std::max(M, first[c * stride]);
    float lsum = 0.0f;
    for (int c = 0; c < n; ++c) {
        const float* pr = first + c * stride;
        if (pr[1] == 0.0f) continue;
        const float w = std::exp(pr[0] - M);
        lsum += pr[1] * w;
        for (int d = 0; d < D; ++d) out[d] += w * pr[2 + d];
    }
    const float inv = lsum > 0.0f ? 1.0f / lsum : 0.0f;
    for (int d = 0; d < D; ++d) out[d] *= inv;
    return M + std::log(lsum);
}

void finish_rows(RowSet& rows, int head_dim) {
    for (int r = 0; r < rows.n; ++r) {
        if (rows.l[r] <= 0.0f) continue;
        const float inv = 1.0f / rows.l[r];
        for (int d = 0; d < head_dim; ++d) rows.out[r][d] *= inv;
    }
}

void accumulate_scores(const PoolConfig& cfg, const Pool& pool, HeadCache& hc, const RowSet& rows, const float* lse,
                       float scale, int64_t block_index) {
    const int bs = cfg.block_size;
    const int G = cfg.group();
    const int64_t slot0 = block_index * bs;
    if (slot0 >= hc.size()) return;
    const int ntok = static_cast<int>(std::min<int64_t>(bs, hc.size() - slot0));
    if (tls.s.size() < static_cast<size_t>(kMaxRows) * bs) tls.s.resize(static_cast<size_t>(kMaxRows) * bs);
    float* S = tls.s.data();
    const float* q[kMaxRows];
    scaled_queries(rows, cfg.head_dim, scale, tls.q, q);
    const float *kt, *v;
    block_floats(cfg, pool, hc.blocks[static_cast<size_t>(block_index)], 0, ntok, kt, v);
    const int cols = (ntok + 15) / 16 * 16;
    qk(rows.n, q, kt, cfg.head_dim, bs, cols, S);
    if (!hc.bias.empty()) add_bias(hc, rows.n, slot0, ntok, bs, S);
    mask_logits(hc, rows, slot0, ntok, bs, S);
    for (int r = 0; r < rows.n; ++r) {
        float* s = S + r * bs;
        exp_sum(s, cols, lse[r]);
        float* dst = hc.scores.data() + static_cast<size_t>(slot0) * G + rows.group_index[r];
        for (int j = 0; j < ntok; ++j) dst[static_cast<size_t>(j) * G] += s[j];
    }
}

void add_probabilities(HeadCache& hc, int group, int gi, float* logits, int64_t n, float lse) {
    const int64_t cols = (n + 15) / 16 * 16;
    for (int64_t j0 = 0; j0 < cols; j0 += 1024) exp_sum(logits + j0, static_cast<int>(std::min<int64_t>(1024, cols - j0)), lse);
    float* dst = hc.scores.data() + gi;
    for (int64_t j = 0; j < n; ++j) dst[j * group] += logits[j];
}

void store_token(const PoolConfig& cfg, const Pool& pool, const HeadCache& hc, int64_t slot, const float* k,
                 const float* v) {
    const int bs = cfg.block_size;
    const int D = cfg.head_dim;
    const size_t kv_elems = static_cast<size_t>(bs) * D;
    uint8_t* base = pool.block(hc.blocks[static_cast<size_t>(slot / bs)]);
    const int j = static_cast<int>(slot % bs);
    if (cfg.precision == Precision::f32) {
        auto* kt = reinterpret_cast<float*>(base);
        for (int d = 0; d < D; ++d) kt[static_cast<size_t>(d) * bs + j] = k[d];
        std::memcpy(kt + kv_elems + static_cast<size_t>(j) * D, v, sizeof(float) * D);
    } else {
        auto* kt = reinterpret_cast<uint16_t*>(base);
        for (int d = 0; d < D; ++d) kt[static_cast<size_t>(d) * bs + j] = to_half(k[d]);
        uint16_t* vr = kt + kv_elems + static_cast<size_t>(j) * D;
        for (int d = 0; d < D; ++d) vr[d] = to_half(v[d]);
    }
}

void load_tokens(const PoolConfig& cfg, const Pool& pool, const HeadCache& hc, int64_t begin, int64_t end, float* k,
                 float* v) {
    const int64_t bs = cfg.block_size;
    const int D = cfg.head_dim;
    for (int64_t slot0 = begin / bs * bs; slot0 < end; slot0 += bs) {
        const int64_t j0 = std::max<int64_t>(begin - slot0, 0), j1 = std::min<int64_t>(bs, end - slot0);
        const float *kt, *vb;
        block_floats(cfg, pool, hc.blocks[static_cast<size_t>(slot0 / bs)], static_cast<int>(j0), static_cast<int>(j1), kt, vb);
        float* kr = k + (slot0 + j0 - begin) * D;
        for (int64_t j = j0; j < j1; ++j, kr += D)
            for (int d = 0; d < D; ++d) kr[d] = kt[static_cast<size_t>(d) * bs + j];
        std::copy(vb + j0 * D, vb + j1 * D, v + (slot0 + j0 - begin) * D);
    }
}

void store_tokens(const PoolConfig& cfg, const Pool& pool, const HeadCache& hc, int64_t begin, int64_t end,
                  const float* k, const float* v) {
    const int64_t bs = cfg.block_size;
    const int D = cfg.head_dim;
    const size_t kv_elems = static_cast<size_t>(bs) * D;
    std::vector<float> row(static_cast<size_t>(bs));
    for (int64_t slot0 = begin / bs * bs; slot0 < end; slot0 += bs) {
        const int64_t j0 = std::max<int64_t>(begin - slot0, 0), j1 = std::min<int64_t>(bs, end - slot0);
        uint8_t* base = pool.block(hc.blocks[static_cast<size_t>(slot0 / bs)]);
        const float* kr = k + (slot0 - begin) * D;  // token j of this block: kr + j * D
        const float* vr = v + (slot0 - begin) * D;
        if (cfg.precision == Precision::f32) {
            auto* kt = reinterpret_cast<float*>(base);
            for (int d = 0; d < D; ++d)
                for (int64_t j = j0; j < j1; ++j) kt[static_cast<size_t>(d) * bs + j] = kr[j * D + d];
            std::copy(vr + j0 * D, vr + j1 * D, kt + kv_elems + j0 * D);
        } else {
            auto* kt = reinterpret_cast<uint16_t*>(base);
            for (int d = 0; d < D; ++d) {  // one channel's run of slots, converted together
                for (int64_t j = j0; j < j1; ++j) row[static_cast<size_t>(j - j0)] = kr[j * D + d];
                float_to_half(row.data(), kt + static_cast<size_t>(d) * bs + j0, j1 - j0);
            }
            float_to_half(vr + j0 * D, kt + kv_elems + j0 * D, (j1 - j0) * D);
        }
    }
}

void move_slots(const PoolConfig& cfg, const Pool& pool, const HeadCache& hc, int64_t from, int64_t to, int64_t count) {
    const int64_t bs = cfg.block_size;
    const int D = cfg.head_dim;
    const size_t es = cfg.elem_bytes();
    const size_t kv_elems = static_cast<size_t>(bs) * D;
    while (count > 0) {
        const int64_t delta = from - to;
        if (to % bs == 0 && delta > 0 && delta < bs && count >= bs) {
            // a whole destination block fed by its own tail and the next block's head (a decode
            // step's eviction shifts every later block by one slot): one memmove of each of K^T
            // and V, then the `delta` slots that cross the block edge, instead of a memmove per
            // channel and block segment
            uint8_t* dst = pool.block(hc.blocks[static_cast<size_t>(to / bs)]);
            const uint8_t* next = pool.block(hc.blocks[static_cast<size_t>(to / bs + 1)]);
            const size_t tail = static_cast<size_t>(bs - delta);
            std::memmove(dst, dst + delta * es, (kv_elems - delta) * es);  // rows' last delta slots fixed below
            for (int d = 0; d < D; ++d)
                std::memcpy(dst + (static_cast<size_t>(d) * bs + tail) * es, next + static_cast<size_t>(d) * bs * es,
                            static_cast<size_t>(delta) * es);
            std::memmove(dst + kv_elems * es, dst + (kv_elems + delta * D) * es, tail * D * es);
            std::memcpy(dst + (kv_elems + tail * D) * es, next + kv_elems * es, static_cast<size_t>(delta) * D * es);
            from += bs;
            to += bs;
            count -= bs;
            continue;
        }
        const int64_t js = from % bs, jd = to % bs;
        const int64_t seg = std::min({count, bs - js, bs - jd});  // neither side crosses a block edge
        const uint8_t* src = pool.block(hc.blocks[static_cast<size_t>(from / bs)]);
        uint8_t* dst = pool.block(hc.blocks[static_cast<size_t>(to / bs)]);
        for (int d = 0; d < D; ++d)
            std::memmove(dst + (static_cast<size_t>(d) * bs + jd) * es, src + (static_cast<size_t>(d) * bs + js) * es,
                         static_cast<size_t>(seg) * es);
        std::memmove(dst + (kv_elems + jd * D) * es, src + (kv_elems + js * D) * es, static_cast<size_t>(seg) * D * es);
        from += seg;
        to += seg;
        count -= seg;
    }
}

void load_token(const PoolConfig& cfg, const Pool& pool, const HeadCache& hc, int64_t slot, float* k, float* v) {
    const int bs = cfg.block_size;
    const int D = cfg.head_dim;
    const size_t kv_elems = static_cast<size_t>(bs) * D;
    const uint8_t* base = pool.block(hc.blocks[static_cast<size_t>(slot / bs)]);
    const int j = static_cast<int>(slot % bs);
    if (cfg.precision == Precision::f32) {
        const auto* kt = reinterpret_cast<const float*>(base);
        for (int d = 0; d < D; ++d) k[d] = kt[static_cast<size_t>(d) * bs + j];
        std::memcpy(v, kt + kv_elems + static_cast<size_t>(j) * D, sizeof(float) * D);
    } else {
        const auto* kt = reinterpret_cast<const uint16_t*>(base);
        for (int d = 0; d < D; ++d) k[d] = from_half(kt[static_cast<size_t>(d) * bs + j]);
        for (int d = 0; d < D; ++d) v[d] = from_half(kt[kv_elems + static_cast<size_t>(j) * D + d]);
    }
}

namespace {
inline uint16_t to_bf16(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    x += 0x7fffu + ((x >> 16) & 1u);  // round to nearest even
    return static_cast<uint16_t>(x >> 16);
}
}  // namespace

bool has_bf16() { return OVKC_BF16; }

void stage_bf16(const PoolConfig& cfg, const Pool& pool, const HeadCache& hc, Bf16Head& out) {
    const int D = cfg.head_dim, bs = cfg.block_size;
    const int64_t n = hc.size();
    const int64_t groups = (n + 15) / 16, pairs = groups * 8;
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
    for (int64_t slot0 = 0; slot0 < st.n; slot0 += kChunk) {
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

// ---- 2-bit blocks ------------------------------------------------------------------------------
namespace {
// The six arrays of a 2-bit block (key codes, key scales, key zeros, value codes, value scales,
// value zeros), typed; const or writable as the block is.
template <typename Byte>
struct QArrays {
    using U32 = std::conditional_t<std::is_const_v<Byte>, const uint32_t, uint32_t>;
    using U16 = std::conditional_t<std::is_const_v<Byte>, const uint16_t, uint16_t>;
    U32* kc;
    U16 *ks, *kz;
    U32* vc;
    U16 *vs, *vz;
};

struct QLayout {
    int T, D, g;
    size_t kc, ks, kz, vc, vs, vz;
    template <typename Byte>
    QArrays<Byte> arrays(Byte* blk) const {
        using A = QArrays<Byte>;
        return {reinterpret_cast<typename A::U32*>(blk + kc), reinterpret_cast<typename A::U16*>(blk + ks),
                reinterpret_cast<typename A::U16*>(blk + kz), reinterpret_cast<typename A::U32*>(blk + vc),
                reinterpret_cast<typename A::U16*>(blk + vs), reinterpret_cast<typename A::U16*>(blk + vz)};
    }
    explicit QLayout(const PoolConfig& cfg)
        : T(cfg.block_size), D(cfg.head_dim), g(cfg.quant_group()) {
        kc = 0;
        ks = kc + static_cast<size_t>(D) * T / 4;
        kz = ks + static_cast<size_t>(T / g) * D * 2;
        vc = kz + static_cast<size_t>(T / g) * D * 2;
        vs = vc + static_cast<size_t>(T) * D / 4;
        vz = vs + static_cast<size_t>(T) * (D / g) * 2;
    }
};

// One group's (scale, zero) and codes, exactly as quant.quantize_groups: zero = fp16(min), scale =
// fp16((max - min(zero, min)) / 3), code = round_half_even((x - zero) / scale) clamped to 0..3.
void quantize_group(const float* x, int n, int stride, uint16_t& scale_out, uint16_t& zero_out, uint8_t* codes) {
    float lo = x[0], hi = x[0];
    for (int i = 1; i < n; ++i) {
        lo = std::min(lo, x[i * stride]);
        hi = std::max(hi, x[i * stride]);
    }
    const uint16_t zero = to_half(lo);
    const float zf = from_half(zero);
    const uint16_t scale = to_half((hi - std::min(zf, lo)) / 3.0f);
    const float sf = from_half(scale);
    for (int i = 0; i < n; ++i) {
        float c = 0.0f;
        if (sf > 0.0f) c = std::min(3.0f, std::max(0.0f, std::nearbyint((x[i * stride] - zf) / sf)));
        codes[i] = static_cast<uint8_t>(c);
    }
    scale_out = scale;
    zero_out = zero;
}

#if OVKC_AVX512
inline __m512 expand_codes(uint32_t word) {
    const __m512i shifts = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i c = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(word)), shifts),
                                       _mm512_set1_epi32(3));
    return _mm512_cvtepi32_ps(c);
}
#endif
}  // namespace

void quantize_block(const PoolConfig& cfg, uint8_t* dst, const float* k, const float* v) {
    const QLayout L(cfg);
    const auto [kc, ks, kz, vc, vs, vz] = L.arrays(dst);
    const int T = L.T, D = L.D, g = L.g;
    std::vector<uint8_t> codes(static_cast<size_t>(std::max(T, D)));
    std::fill(kc, kc + static_cast<size_t>(D) * T / 16, 0u);
    std::fill(vc, vc + static_cast<size_t>(T) * D / 16, 0u);
    for (int c = 0; c < D; ++c)
        for (int tg = 0; tg < T / g; ++tg) {
            quantize_group(k + static_cast<size_t>(tg) * g * D + c, g, D, ks[tg * D + c], kz[tg * D + c], codes.data());
            for (int i = 0; i < g; ++i) {
                const int t = tg * g + i;
                kc[c * (T / 16) + t / 16] |= static_cast<uint32_t>(codes[static_cast<size_t>(i)]) << (2 * (t % 16));
            }
        }
    for (int t = 0; t < T; ++t)
        for (int cg = 0; cg < D / g; ++cg) {
            quantize_group(v + static_cast<size_t>(t) * D + cg * g, g, 1, vs[t * (D / g) + cg], vz[t * (D / g) + cg],
                           codes.data());
            for (int i = 0; i < g; ++i) {
                const int c = cg * g + i;
                vc[t * (D / 16) + c / 16] |= static_cast<uint32_t>(codes[static_cast<size_t>(i)]) << (2 * (c % 16));
            }
        }
}

void dequantize_token(const PoolConfig& cfg, const uint8_t* blk, int t, float* k, float* v) {
    const QLayout L(cfg);
    const auto [kc, ks, kz, vc, vs, vz] = L.arrays(blk);
    const int T = L.T, D = L.D, g = L.g, tg = t / g;
    for (int c = 0; c < D; ++c) {
        const float code = static_cast<float>((kc[c * (T / 16) + t / 16] >> (2 * (t % 16))) & 3u);
        k[c] = from_half(kz[tg * D + c]) + code * from_half(ks[tg * D + c]);
        const float vcode = static_cast<float>((vc[t * (D / 16) + c / 16] >> (2 * (c % 16))) & 3u);
        v[c] = from_half(vz[t * (D / g) + c / g]) + vcode * from_half(vs[t * (D / g) + c / g]);
    }
}

void attend_quant(const PoolConfig& cfg, const Pool& pool, const HeadCache& hc, RowSet& rows, float scale,
                  int64_t qb_begin, int64_t qb_end) {
    const QLayout L(cfg);
    const int T = L.T, D = L.D, g = L.g, R = rows.n;
    if (tls.s.size() < static_cast<size_t>(kMaxRows) * T) tls.s.resize(static_cast<size_t>(kMaxRows) * T);
    float* S = tls.s.data();
    const float* q[kMaxRows];
    scaled_queries(rows, D, scale, tls.q, q);
    std::vector<float>& qs = tls.k;  // q * key scale of the current token group, [R][D]
    if (qs.size() < static_cast<size_t>(kMaxRows) * D) qs.resize(static_cast<size_t>(kMaxRows) * D);
    std::vector<float> sf(static_cast<size_t>(D)), zf(static_cast<size_t>(D));
    qb_end = std::min<int64_t>(qb_end, static_cast<int64_t>(hc.qblocks.size()));
    for (int64_t qb = qb_begin; qb < qb_end; ++qb) {
        const uint8_t* blk = pool.qblock(hc.qblocks[static_cast<size_t>(qb)]);
        const auto [kc, ks, kz, vc, vs, vz] = L.arrays(blk);
        // logits: per key group, q.k = q.zero + sum_c (q_c * scale_c) * code_c
        for (int tg = 0; tg < T / g; ++tg) {
            half_to_float(ks + tg * D, sf.data(), D);
            half_to_float(kz + tg * D, zf.data(), D);
            float bias[kMaxRows];
            for (int r = 0; r < R; ++r) {
                float b = 0.0f;
                for (int c = 0; c < D; ++c) {
                    b += q[r][c] * zf[static_cast<size_t>(c)];
                    qs[static_cast<size_t>(r) * D + c] = q[r][c] * sf[static_cast<size_t>(c)];
                }
                bias[r] = b;
            }
            for (int w = tg * g / 16; w < (tg + 1) * g / 16; ++w) {
#if OVKC_AVX512
                __m512 acc[kMaxRows];
                for (int r = 0; r < R; ++r) acc[r] = _mm512_set1_ps(bias[r]);
                for (int c = 0; c < D; ++c) {
                    const __m512 codes = expand_codes(kc[c * (T / 16) + w]);
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
                                 static_cast<float>((kc[c * (T / 16) + w] >> (2 * j)) & 3u);
                        S[r * T + w * 16 + j] = a;
                    }
#endif
            }
        }
        // online softmax (every token of a 2-bit block is older than the step's queries)
        for (int r = 0; r < R; ++r)
            if (!softmax_step(rows, r, S + r * T, T, D)) std::fill(S + r * T, S + (r + 1) * T, 0.0f);
        // p.v: out += (p * scale) * codes + p * zero, per value group
        for (int t = 0; t < T; ++t) {
            const uint32_t* words = vc + t * (D / 16);
            for (int cg = 0; cg < D / g; ++cg) {
                const float vsc = from_half(vs[t * (D / g) + cg]), vzr = from_half(vz[t * (D / g) + cg]);
                for (int r = 0; r < R; ++r) {
                    const float p = S[r * T + t];
                    if (p == 0.0f) continue;
                    for (int w = cg * g / 16; w < (cg + 1) * g / 16; ++w) {
#if OVKC_AVX512
                        float* o = rows.out[r] + w * 16;
                        const __m512 base = _mm512_fmadd_ps(_mm512_set1_ps(p * vsc), expand_codes(words[w]),
                                                            _mm512_set1_ps(p * vzr));
                        _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), base));
#else
                        for (int j = 0; j < 16; ++j)
                            rows.out[r][w * 16 + j] += p * vsc * static_cast<float>((words[w] >> (2 * j)) & 3u) + p * vzr;
#endif
                    }
                }
            }
        }
    }
}

const char* kernel_isa() { return OVKC_BF16 ? "avx512+bf16" : OVKC_AVX512 ? "avx512" : "scalar"; }

}  // namespace ovkc
