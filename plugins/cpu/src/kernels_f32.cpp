// The f32 arithmetic of a block's query rows, on AVX-512, on AVX2 + FMA where the CPU has no
// AVX-512, or in scalar C++: q.k of up to kMaxRows rows over a block's transposed keys, p.v into
// the rows' outputs, the softmax's row maxima and exponentials, Gemma 2's soft-capping. Every
// kernel that attends or scores rows in f32 (kernels.cpp, kernels_quant.cpp) takes them from here.
#include <algorithm>
#include <cmath>

#include "kernels_detail.hpp"

namespace ovkc {
namespace detail {

#if OVKC_AVX512
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
#elif OVKC_AVX2
// On 8 lanes and 16 vector registers, as a GEMM micro-kernel: a tile of R rows by NV vectors of
// columns keeps its R * NV sums in registers, loading NV vectors of keys (or values) and R
// broadcasts per step: 6 x 2 (12 sums, 8 loads per 12 FMAs) for up to 6 rows, 2 x 4 for the
// rest. The unrolling is spelled out: without it GCC keeps the sums in memory.
#define OVKC_UNROLL _Pragma("GCC unroll 8")

// Where a tile's key or value vectors come from: floats in place, or the u8 store's codes as
// floats (their slots' min and scale applied around the products, in qk_codes and pv_codes' callers)
struct FloatRow {
    const float* p;
    __m256 operator()(size_t i) const { return _mm256_loadu_ps(p + i); }
};
struct CodeRow {
    const uint8_t* p;
    __m256 operator()(size_t i) const { return codes8(p + i); }
};

// S[r][c .. c + 8 NV) = q[r] . K[:, c ..) for R rows
template <int R, int NV, class Keys>
inline void qk_tile(const float* const* q, Keys kt, int D, int bs, int c, float* S) {
    __m256 acc[R][NV];
    OVKC_UNROLL for (int r = 0; r < R; ++r) OVKC_UNROLL for (int u = 0; u < NV; ++u) acc[r][u] = _mm256_setzero_ps();
    for (int d = 0; d < D; ++d) {
        const size_t row = static_cast<size_t>(d) * bs + c;
        __m256 k[NV];
        OVKC_UNROLL for (int u = 0; u < NV; ++u) k[u] = kt(row + 8 * u);
        OVKC_UNROLL for (int r = 0; r < R; ++r) {
            const __m256 qb = _mm256_broadcast_ss(q[r] + d);
            OVKC_UNROLL for (int u = 0; u < NV; ++u) acc[r][u] = _mm256_fmadd_ps(qb, k[u], acc[r][u]);
        }
    }
    OVKC_UNROLL for (int r = 0; r < R; ++r) OVKC_UNROLL for (int u = 0; u < NV; ++u)
        _mm256_storeu_ps(S + r * bs + c + 8 * u, acc[r][u]);
}

// out[r][c .. c + 8 NV) += sum_j P[r][j] * V[j][c ..) for R rows
template <int R, int NV, class Values>
inline void pv_tile(const float* P, int bs, Values v, int ntok, int D, int c, float* const* out) {
    __m256 acc[R][NV];
    OVKC_UNROLL for (int r = 0; r < R; ++r) OVKC_UNROLL for (int u = 0; u < NV; ++u)
        acc[r][u] = _mm256_loadu_ps(out[r] + c + 8 * u);
    for (int j = 0; j < ntok; ++j) {
        const size_t row = static_cast<size_t>(j) * D + c;
        __m256 vv[NV];
        OVKC_UNROLL for (int u = 0; u < NV; ++u) vv[u] = v(row + 8 * u);
        OVKC_UNROLL for (int r = 0; r < R; ++r) {
            const __m256 p = _mm256_broadcast_ss(P + r * bs + j);
            OVKC_UNROLL for (int u = 0; u < NV; ++u) acc[r][u] = _mm256_fmadd_ps(p, vv[u], acc[r][u]);
        }
    }
    OVKC_UNROLL for (int r = 0; r < R; ++r) OVKC_UNROLL for (int u = 0; u < NV; ++u)
        _mm256_storeu_ps(out[r] + c + 8 * u, acc[r][u]);
}

// R rows (at most 6) over `cols` columns (a multiple of 16): the widest tile that fits
template <int R, class Keys>
void qk_rows(const float* const* q, Keys kt, int D, int bs, int cols, float* S) {
    constexpr int NV = R <= 2 ? 4 : 2;
    int c = 0;
    for (; c + 8 * NV <= cols; c += 8 * NV) qk_tile<R, NV>(q, kt, D, bs, c, S);
    for (; c < cols; c += 16) qk_tile<R, 2>(q, kt, D, bs, c, S);
}

// R rows (at most 6) over D channels (a multiple of 8)
template <int R, class Values>
void pv_group(const float* P, int bs, Values v, int ntok, int D, float* const* out) {
    constexpr int NV = R <= 2 ? 4 : 2;
    int c = 0;
    for (; c + 8 * NV <= D; c += 8 * NV) pv_tile<R, NV>(P, bs, v, ntok, D, c, out);
    for (; c + 16 <= D; c += 16) pv_tile<R, 2>(P, bs, v, ntok, D, c, out);
    for (; c < D; c += 8) pv_tile<R, 1>(P, bs, v, ntok, D, c, out);
}
#undef OVKC_UNROLL

// any number of rows: tiles of 6, then the rest
template <class Keys>
void qk_any(int R, const float* const* q, Keys kt, int D, int bs, int cols, float* S) {
    int r = 0;
    for (; r + 6 <= R; r += 6) qk_rows<6>(q + r, kt, D, bs, cols, S + r * bs);
    switch (R - r) {
        case 1: qk_rows<1>(q + r, kt, D, bs, cols, S + r * bs); break;
        case 2: qk_rows<2>(q + r, kt, D, bs, cols, S + r * bs); break;
        case 3: qk_rows<3>(q + r, kt, D, bs, cols, S + r * bs); break;
        case 4: qk_rows<4>(q + r, kt, D, bs, cols, S + r * bs); break;
        case 5: qk_rows<5>(q + r, kt, D, bs, cols, S + r * bs); break;
        default: break;
    }
}

template <class Values>
void pv_any(int R, const float* P, int bs, Values v, int ntok, int D, float* const* out) {
    int r = 0;
    for (; r + 6 <= R; r += 6) pv_group<6>(P + r * bs, bs, v, ntok, D, out + r);
    switch (R - r) {
        case 1: pv_group<1>(P + r * bs, bs, v, ntok, D, out + r); break;
        case 2: pv_group<2>(P + r * bs, bs, v, ntok, D, out + r); break;
        case 3: pv_group<3>(P + r * bs, bs, v, ntok, D, out + r); break;
        case 4: pv_group<4>(P + r * bs, bs, v, ntok, D, out + r); break;
        case 5: pv_group<5>(P + r * bs, bs, v, ntok, D, out + r); break;
        default: break;
    }
}

void qk_codes(int R, const float* const* q, const uint8_t* kt, int D, int bs, int cols, float* S) {
    qk_any(R, q, CodeRow{kt}, D, bs, cols, S);
}

void pv_codes(int R, const float* P, int bs, const uint8_t* v, int ntok, int D, float* const* out) {
    pv_any(R, P, bs, CodeRow{v}, ntok, D, out);
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
#elif OVKC_AVX2
    qk_any(R, q, FloatRow{kt}, D, bs, cols, S);
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
#elif OVKC_AVX2
    pv_any(R, P, bs, FloatRow{v}, ntok, D, out);
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

void row_logits(const RowSet& rows, const float* const* q, const float* kt, int D, int bs, int cols, float* S) {
    qk(rows.n, q, kt, D, bs, cols, S);
    if (rows.softcap > 0.0f) cap_logits(S, rows.n, cols, bs, rows.softcap);
}

// tanh(x) = 1 - 2 / (exp(2x) + 1): exact at both saturations (exp gives 0 below -104 and is
// clamped at 88), within a few units of f32's last place near 0 once multiplied back by cap.
void cap_logits(float* S, int R, int cols, int bs, float cap) {
    [[maybe_unused]] const float two_over_cap = 2.0f / cap;  // (the scalar build uses std::tanh)
    for (int r = 0; r < R; ++r) {
        float* s = S + static_cast<size_t>(r) * bs;
        int j = 0;
#if OVKC_AVX512
        const __m512 k = _mm512_set1_ps(two_over_cap), one = _mm512_set1_ps(1.0f), two = _mm512_set1_ps(2.0f),
                     c = _mm512_set1_ps(cap);
        for (; j + 16 <= cols; j += 16) {
            const __m512 e = exp512(_mm512_mul_ps(_mm512_loadu_ps(s + j), k));
            const __m512 t = _mm512_sub_ps(one, _mm512_div_ps(two, _mm512_add_ps(e, one)));
            _mm512_storeu_ps(s + j, _mm512_mul_ps(c, t));
        }
#elif OVKC_AVX2
        const __m256 k = _mm256_set1_ps(two_over_cap), one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f),
                     c = _mm256_set1_ps(cap);
        for (; j + 8 <= cols; j += 8) {
            const __m256 e = exp256(_mm256_mul_ps(_mm256_loadu_ps(s + j), k));
            const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(e, one)));
            _mm256_storeu_ps(s + j, _mm256_mul_ps(c, t));
        }
#endif
        for (; j < cols; ++j) s[j] = cap * std::tanh(s[j] / cap);
    }
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
#elif OVKC_AVX2
    __m256 sum = _mm256_setzero_ps();
    const __m256 mm = _mm256_set1_ps(m);
    for (int j = 0; j < cols; j += 8) {
        const __m256 e = exp256_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j), mm));
        _mm256_storeu_ps(s + j, e);
        sum = _mm256_add_ps(sum, e);
    }
    return hsum256(sum);
#else
    float sum = 0.0f;
    for (int j = 0; j < cols; ++j) {
        s[j] = s[j] == kNegInf ? 0.0f : std::exp(s[j] - m);
        sum += s[j];
    }
    return sum;
#endif
}


float row_max(const float* s, int cols) {
#if OVKC_AVX512
    __m512 m = _mm512_set1_ps(kNegInf);
    for (int j = 0; j < cols; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + j));
    return _mm512_reduce_max_ps(m);
#elif OVKC_AVX2
    __m256 m = _mm256_set1_ps(kNegInf);
    for (int j = 0; j < cols; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + j));
    return hmax256(m);
#else
    float m = kNegInf;
    for (int j = 0; j < cols; ++j) m = std::max(m, s[j]);
    return m;
#endif
}

}  // namespace detail
}  // namespace ovkc
