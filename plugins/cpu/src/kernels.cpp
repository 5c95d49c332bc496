// Attention kernels over the full-precision (f32/f16/u8) blocks of the paged cache (token loads
// and stores: kernels_store.cpp; the rows' f32 arithmetic: kernels_f32.cpp; the u8 store's codes:
// kernels_u8.cpp), and what the other kernel files share (kernels_detail.hpp).
#include "kernels.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels_detail.hpp"

namespace ovkc {

namespace detail {

void half_to_float(const uint16_t* src, float* dst, int64_t n) {
    int64_t i = 0;
#if OVKC_AVX512
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
#elif OVKC_AVX2
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
    for (; i < n; ++i) dst[i] = from_half(src[i]);
}

void float_to_half(const float* src, uint16_t* dst, int64_t n) {
    int64_t i = 0;
#if OVKC_AVX512
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                            _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif OVKC_AVX2
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
    for (; i < n; ++i) dst[i] = to_half(src[i]);
}

// ---- float views of a block -------------------------------------------------------------------
// Keys (transposed, [D][bs]) and values ([bs][D]) of a block as floats: the block itself for
// f32, a converted copy in thread-local scratch for f16 and u8.
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
    Scratch& tls = scratch();
    if (tls.k.size() < kv_elems + 16) {  // + 16: a window's last padded vector may run past row D - 1
        tls.k.resize(kv_elems + 16);
        tls.v.resize(kv_elems);
    }
    if (cfg.precision == Precision::u8) {
        dequantize_u8(base, bs, D, j0, j1, tls.k.data(), tls.v.data());
        kt = tls.k.data();
        v = tls.v.data();
        return;
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

void head_block_floats(const PoolConfig& cfg, const Pool& pool, const HeadCache& hc, int64_t block_index, int j0,
                       int j1, const float*& kt, const float*& v) {
    const StepTokens& step = hc.step;
    if (block_index < step.staged_blocks) {  // converted once for the step
        kt = step.staged + static_cast<size_t>(block_index) * 2 * cfg.block_size * cfg.head_dim;
        v = kt + static_cast<size_t>(cfg.block_size) * cfg.head_dim;
        return;
    }
    block_floats(cfg, pool, hc.blocks[static_cast<size_t>(block_index)], j0, j1, kt, v);
    if (!step.k || cfg.precision == Precision::f32) return;
    const int bs = cfg.block_size, D = cfg.head_dim;
    Scratch& tls = scratch();  // where block_floats converted the block: ours to overwrite
    const int64_t slot0 = block_index * bs;
    for (int j = j0; j < j1; ++j) {
        // by position, not slot: the step's token i is at position step.first + i wherever it sits
        const int64_t i = hc.pos[static_cast<size_t>(slot0 + j)] - step.first;
        if (i < 0 || i >= step.count) continue;
        const float* k = step.k + i * D;
        for (int d = 0; d < D; ++d) tls.k[static_cast<size_t>(d) * bs + j] = k[d];
        std::copy(step.v + i * D, step.v + (i + 1) * D, tls.v.data() + static_cast<size_t>(j) * D);
    }
}

// Mask the slots that are not held or are after each row's position (logits already scaled).
void mask_logits(const HeadCache& hc, const RowSet& rows, int64_t slot0, int ntok, int bs, float* S) {
    const int cols = (ntok + 15) / 16 * 16;
    const int64_t first_pos = hc.pos[static_cast<size_t>(slot0)];
    const int64_t last_pos = hc.pos[static_cast<size_t>(slot0 + ntok - 1)];
    for (int r = 0; r < rows.n; ++r) {
        float* s = S + r * bs;
        // a sliding window sees positions (qpos - window, qpos]
        const int64_t lo = rows.window > 0 ? rows.qpos[r] - rows.window : std::numeric_limits<int64_t>::min();
        if (last_pos <= rows.qpos[r] && first_pos > lo) {  // every held slot is visible: only the padding goes
            for (int j = ntok; j < cols; ++j) s[j] = kNegInf;
            continue;
        }
        for (int j = 0; j < cols; ++j) {
            if (j >= ntok) {
                s[j] = kNegInf;
                continue;
            }
            const int64_t p = hc.pos[static_cast<size_t>(slot0 + j)];
            if (p > rows.qpos[r] || p <= lo) s[j] = kNegInf;
        }
    }
}

// Chelsea: add each slot's log(degree) to its (scaled) logits.
void add_bias(const HeadCache& hc, int R, int64_t slot0, int ntok, int bs, float* S) {
    const float* b = hc.bias.data() + slot0;
    for (int r = 0; r < R; ++r)
        for (int j = 0; j < ntok; ++j) S[r * bs + j] += b[j];
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

}  // namespace detail

using namespace detail;

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
    Scratch& tls = scratch();
    if (tls.s.size() < static_cast<size_t>(kMaxRows) * bs) tls.s.resize(static_cast<size_t>(kMaxRows) * bs);
    float* S = tls.s.data();
    const float* q[kMaxRows];
    scaled_queries(rows, D, scale, tls.q, q);
    slot_end = std::min(slot_end, hc.size());
    slot_begin = std::max(slot_begin, first_visible_slot(hc, rows));
    float qsum[kMaxRows] = {};  // each scaled query's sum, for the u8 codes' mins
    // a step reads every block as codes or none (a staged copy covers every block of its head)
    if (reads_codes(cfg, hc, slot_begin / bs)) {
        for (int r = 0; r < rows.n; ++r)
            for (int d = 0; d < D; ++d) qsum[r] += q[r][d];
        if (slot_begin < slot_end) prefetch_block(cfg, pool, hc.blocks[static_cast<size_t>(slot_begin / bs)]);
    }
    for (int64_t slot0 = slot_begin / bs * bs; slot0 < slot_end; slot0 += bs) {
        // the range's part of this block: slots [w0, w0 + ntok), handled as a window starting at
        // its first slot (a recalled cluster may start and end mid-block: no work on the rest)
        const int j0 = static_cast<int>(std::max<int64_t>(slot_begin - slot0, 0));
        const int64_t w0 = slot0 + j0;
        if (hc.pos[static_cast<size_t>(w0)] > max_q) break;  // positions ascend: nothing further is causal
        const int ntok = static_cast<int>(std::min<int64_t>(bs, slot_end - slot0)) - j0;
        const int cols = (ntok + 15) / 16 * 16;
        const float *kt = nullptr, *v = nullptr;
        const uint8_t* codes = reads_codes(cfg, hc, slot0 / bs) ? pool.block(hc.blocks[static_cast<size_t>(slot0 / bs)]) : nullptr;
        if (codes && slot0 + bs < slot_end) prefetch_block(cfg, pool, hc.blocks[static_cast<size_t>(slot0 / bs + 1)]);
        if (codes) {
            code_logits(rows, q, qsum, codes, D, bs, j0, cols, S);
        } else {
            head_block_floats(cfg, pool, hc, slot0 / bs, j0, j0 + ntok, kt, v);
            row_logits(rows, q, kt + j0, D, bs, cols, S);
        }
        if (!hc.bias.empty()) add_bias(hc, rows.n, w0, ntok, bs, S);
        mask_logits(hc, rows, w0, ntok, bs, S);
        for (int r = 0; r < rows.n; ++r) {
            float* s = S + r * bs;
            if (rows.logits[r]) std::copy(s, s + ntok, rows.logits[r] + w0);
            if (!softmax_step(rows, r, s, cols, D)) std::fill(s, s + cols, 0.0f);  // nothing causal here
        }
        if (codes)
            code_values(rows.n, S, bs, codes, D, j0, ntok, rows.out);
        else
            pv(rows.n, S, bs, v + static_cast<size_t>(j0) * D, ntok, D, rows.out);
    }
}

void stage_f32(const PoolConfig& cfg, const Pool& pool, HeadCache& hc, std::vector<float>& buf) {
    const int64_t bs = cfg.block_size, D = cfg.head_dim, per_block = 2 * bs * D;
    const int64_t blocks = static_cast<int64_t>(hc.blocks.size());
    buf.assign(static_cast<size_t>(blocks * per_block), 0.0f);
    for (int64_t b = 0; b < blocks && b * bs < hc.size(); ++b) {
        const int ntok = static_cast<int>(std::min<int64_t>(bs, hc.size() - b * bs));
        const float *kt, *v;
        head_block_floats(cfg, pool, hc, b, 0, ntok, kt, v);
        float* dst = buf.data() + b * per_block;
        for (int64_t d = 0; d < D; ++d) std::copy(kt + d * bs, kt + d * bs + ntok, dst + d * bs);
        std::copy(v, v + ntok * D, dst + bs * D);
    }
    hc.step.staged = buf.data();
    hc.step.staged_blocks = blocks;
}

int64_t first_visible_slot(const HeadCache& hc, const int64_t* qpos, int n, int64_t window) {
    if (window <= 0 || n <= 0) return 0;
    int64_t min_q = qpos[0];
    for (int r = 1; r < n; ++r) min_q = std::min(min_q, qpos[r]);
    return std::upper_bound(hc.pos.begin(), hc.pos.end(), min_q - window) - hc.pos.begin();
}

int64_t first_visible_slot(const HeadCache& hc, const RowSet& rows) {
    return first_visible_slot(hc, rows.qpos, rows.n, rows.window);
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
    Scratch& tls = scratch();
    if (tls.s.size() < static_cast<size_t>(kMaxRows) * bs) tls.s.resize(static_cast<size_t>(kMaxRows) * bs);
    float* S = tls.s.data();
    const float* q[kMaxRows];
    scaled_queries(rows, D, scale, tls.q, q);
    n = std::min(n, slab.count);
    for (int64_t j0 = 0; j0 < n; j0 += bs) {
        const int ntok = static_cast<int>(std::min<int64_t>(bs, n - j0));
        row_logits(rows, q, slab.kt.data() + static_cast<size_t>(j0 / bs) * D * bs, D, bs, bs, S);
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
#elif OVKC_AVX2
    __m256 v = _mm256_setzero_ps();
    for (; d + 8 <= n; d += 8) v = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), v);
    acc = hsum256(v);
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
                       float scale, int64_t block_index, bool take_max, int64_t slot_lo, int64_t slot_hi) {
    const int bs = cfg.block_size;
    const int G = cfg.group();
    const int64_t slot0 = block_index * bs;
    if (slot0 >= hc.size()) return;
    const int ntok = static_cast<int>(std::min<int64_t>(bs, hc.size() - slot0));
    Scratch& tls = scratch();
    if (tls.s.size() < static_cast<size_t>(kMaxRows) * bs) tls.s.resize(static_cast<size_t>(kMaxRows) * bs);
    float* S = tls.s.data();
    const float* q[kMaxRows];
    scaled_queries(rows, cfg.head_dim, scale, tls.q, q);
    const float *kt, *v;
    head_block_floats(cfg, pool, hc, block_index, 0, ntok, kt, v);
    const int cols = (ntok + 15) / 16 * 16;
    row_logits(rows, q, kt, cfg.head_dim, bs, cols, S);
    if (!hc.bias.empty()) add_bias(hc, rows.n, slot0, ntok, bs, S);
    mask_logits(hc, rows, slot0, ntok, bs, S);
    for (int r = 0; r < rows.n; ++r) {
        float* s = S + r * bs;
        exp_sum(s, cols, lse[r]);
        float* dst = hc.scores.data() + static_cast<size_t>(slot0) * G + rows.group_index[r];
        if (take_max) {
            const int j0 = static_cast<int>(std::clamp<int64_t>(slot_lo - slot0, 0, ntok));
            const int j1 = static_cast<int>(std::clamp<int64_t>(slot_hi - slot0, 0, ntok));
            for (int j = j0; j < j1; ++j) dst[static_cast<size_t>(j) * G] = std::max(dst[static_cast<size_t>(j) * G], s[j]);
        } else {
            for (int j = 0; j < ntok; ++j) dst[static_cast<size_t>(j) * G] += s[j];
        }
    }
}

void add_probabilities(HeadCache& hc, int group, int gi, float* logits, float lse) {
    const int64_t nq = static_cast<int64_t>(hc.qpos.size()), n = hc.size();
    const int64_t cols = (nq + n + 15) / 16 * 16;
    for (int64_t j0 = 0; j0 < cols; j0 += 1024) exp_sum(logits + j0, static_cast<int>(std::min<int64_t>(1024, cols - j0)), lse);
    if (!hc.qscores.empty()) {
        float* qdst = hc.qscores.data() + gi;
        for (int64_t j = 0; j < nq; ++j) qdst[j * group] += logits[j];
    }
    float* dst = hc.scores.data() + gi;
    for (int64_t j = 0; j < n; ++j) dst[j * group] += logits[nq + j];
}

}  // namespace ovkc
