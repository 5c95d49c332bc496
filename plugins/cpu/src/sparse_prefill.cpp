// The sparse prompt attention's block mask (sparse_prefill.hpp), in the reference's steps:
// strided keys, strided queries, antidiagonal probabilities summed into block mass, the
// selection, dense rows from the first scored one; and a step's mask from its context
// (sparse_prefill_mask, the stage attention_step.hpp lists).
#include "sparse_prefill.hpp"

#include <tbb/parallel_for.h>

#include <algorithm>
#include <numeric>
#include <string>

#include "attention_step.hpp"
#include "kernels_detail.hpp"

namespace ovkc {

namespace {
constexpr int kTile = 16;  // strided keys per tile (one vector of logits)
constexpr int kRows = 8;   // strided query rows per pass
size_t at(int64_t i) { return static_cast<size_t>(i); }

// A KV head's strided keys, tiled and transposed: [tile][stride * D][16], row b of the strided
// keys is keys b*stride + s (s = 0 .. stride-1, D each), zeros past the prompt. On the bf16 path
// (the step's prompt arithmetic) as bf16 pairs instead, [tile][stride * D / 2][16]: two
// consecutive values of one strided key a word, as the dot products take them.
struct StridedKeys {
    std::vector<float> f32;
    std::vector<uint32_t> bf16;
};

StridedKeys strided_keys(const float* k, int64_t L, int D, int64_t S, bool bf16) {
    const int64_t A = (L + S - 1) / S, tiles = (A + kTile - 1) / kTile, SD = S * D;
    StridedKeys out;
    std::vector<float>& kt = out.f32;
    kt.assign(at(tiles * SD * kTile), 0.0f);
    for (int64_t b = 0; b < A; ++b)
        for (int64_t s = 0; s < S && b * S + s < L; ++s) {
            const float* src = k + (b * S + s) * D;
            float* dst = kt.data() + at(((b / kTile) * SD + s * D) * kTile + b % kTile);
            for (int d = 0; d < D; ++d) dst[at(d) * kTile] = src[d];
        }
    if (!bf16) return out;
    out.bf16.resize(kt.size() / 2);
    for (int64_t t = 0; t < tiles; ++t)
        for (int64_t p = 0; p < SD / 2; ++p)
            for (int j = 0; j < kTile; ++j) {
                const float* even = kt.data() + at((t * SD + 2 * p) * kTile + j);
                out.bf16[at((t * SD / 2 + p) * kTile + j)] =
                    static_cast<uint32_t>(detail::to_bf16(even[0])) | (static_cast<uint32_t>(detail::to_bf16(even[kTile])) << 16);
            }
    out.f32.clear();
    out.f32.shrink_to_fit();
    return out;
}

// Up to kRows strided query rows [a0, a0 + n) of one head: row a is the queries at positions
// a*stride + stride-1-s for s = 0 .. stride-1; the step's [L][D] queries sit at positions
// [past, past + L), zeros elsewhere (before the step, past the prompt, rows >= n).
void strided_queries(const float* q, int64_t past, int64_t L, int D, int64_t S, int64_t a0, int n, float* out) {
    const int64_t SD = S * D;
    std::fill(out, out + kRows * SD, 0.0f);
    for (int r = 0; r < n; ++r)
        for (int64_t s = 0; s < S; ++s) {
            const int64_t t = (a0 + r) * S + S - 1 - s - past;
            if (t >= 0 && t < L) std::copy(q + t * D, q + (t + 1) * D, out + r * SD + s * D);
        }
}

// logits[r][0 .. tiles*16) = strided query row r . strided keys, kRows rows at once (each key
// vector loaded once for all rows; the rows' sums stay in registers)
void strided_logits(const float* qs, const float* kt, int64_t tiles, int64_t SD, float* logits, int64_t stride) {
    for (int64_t t = 0; t < tiles; ++t) {
        const float* kb = kt + at(t * SD * kTile);
#if OVKC_AVX512
        __m512 acc[kRows];
        for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
        for (int64_t d = 0; d < SD; ++d) {
            const __m512 kv = _mm512_loadu_ps(kb + d * kTile);
            for (int r = 0; r < kRows; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(qs[r * SD + d]), kv, acc[r]);
        }
        for (int r = 0; r < kRows; ++r) _mm512_storeu_ps(logits + r * stride + t * kTile, acc[r]);
#else
        float acc[kRows][kTile] = {};
        for (int64_t d = 0; d < SD; ++d)
            for (int r = 0; r < kRows; ++r)
                for (int j = 0; j < kTile; ++j) acc[r][j] += qs[r * SD + d] * kb[d * kTile + j];
        for (int r = 0; r < kRows; ++r) std::copy(acc[r], acc[r] + kTile, logits + r * stride + t * kTile);
#endif
    }
}

// The same with bf16 operands (pairs, as strided_keys packs them) and f32 sums: AVX512-BF16 dot
// products, two multiply-adds a lane an instruction.
void strided_logits_bf16(const uint32_t* qp, const uint32_t* kt, int64_t tiles, int64_t pairs, float* logits,
                         int64_t stride) {
#if OVKC_BF16
    for (int64_t t = 0; t < tiles; ++t) {
        const uint32_t* kb = kt + at(t * pairs * kTile);
        __m512 acc[kRows];
        for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
        for (int64_t p = 0; p < pairs; ++p) {
            const __m512bh kv = (__m512bh)_mm512_loadu_si512(kb + p * kTile);
            for (int r = 0; r < kRows; ++r)
                acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[r * pairs + p])), kv);
        }
        for (int r = 0; r < kRows; ++r) _mm512_storeu_ps(logits + r * stride + t * kTile, acc[r]);
    }
#else
    (void)qp, (void)kt, (void)tiles, (void)pairs, (void)logits, (void)stride;
    throw Error("bf16 estimate is not compiled in (no AVX512-BF16 on the build machine)");
#endif
}

// One query block's estimated mass per key block (mass[0 .. i]): each of its strided rows'
// softmax, over the strided keys at or before it, of the antidiagonal sums times scale / stride.
// The step's queries are positions [past, past + L); the keys (kt) every position before its end.
// On the bf16 path the scaled queries are rounded to bf16 pairs and the keys are (kt.bf16).
void antidiagonal_mass(const SparsePrefill& cfg, const float* q, const StridedKeys& kt, int64_t past, int64_t L,
                       int D, float scale, int64_t i, std::vector<double>& mass) {
    const int64_t S = cfg.stride, P = cfg.block_size / S, A = (past + L + S - 1) / S, SD = S * D;
    const int64_t a_begin = std::max(i * P, past / S), a_end = std::min(A, (i + 1) * P);
    const int64_t tiles = (a_end + kTile - 1) / kTile, cols = tiles * kTile;
    const bool bf16 = !kt.bf16.empty();
    std::vector<float> qs(at(kRows * SD)), logits(at(kRows * cols));
    std::vector<uint32_t> qp(bf16 ? at(kRows * SD / 2) : 0);
    mass.assign(at(i + 1), 0.0);
    const float s = scale / static_cast<float>(S);
    for (int64_t a0 = a_begin; a0 < a_end; a0 += kRows) {
        const int n = static_cast<int>(std::min<int64_t>(kRows, a_end - a0));
        strided_queries(q, past, L, D, S, a0, n, qs.data());
        if (bf16) {
            for (size_t x = 0; x < qp.size(); ++x)
                qp[x] = static_cast<uint32_t>(detail::to_bf16(qs[2 * x] * s)) |
                        (static_cast<uint32_t>(detail::to_bf16(qs[2 * x + 1] * s)) << 16);
            strided_logits_bf16(qp.data(), kt.bf16.data(), tiles, SD / 2, logits.data(), cols);
        } else {
            strided_logits(qs.data(), kt.f32.data(), tiles, SD, logits.data(), cols);
        }
        for (int r = 0; r < n; ++r) {
            float* row = logits.data() + r * cols;
            const int64_t a = a0 + r;
            if (!bf16)
                for (int64_t b = 0; b <= a; ++b) row[b] *= s;
            std::fill(row + a + 1, row + cols, detail::kNegInf);
            const float m = detail::row_max(row, static_cast<int>(cols));
            const float inv = 1.0f / detail::exp_sum(row, static_cast<int>(cols), m);
            for (int64_t j = 0; j * P <= a; ++j) {  // key block j: strided keys [j*P, (j+1)*P), masked ones 0
                float part = 0.0f;
                for (int64_t b = j * P; b < (j + 1) * P && b < cols; ++b) part += row[b];
                mass[at(j)] += static_cast<double>(part * inv);
            }
        }
    }
}

// Key block 0 and i itself, then the others of 1 .. i-1 by descending mass (ties: the earlier
// block) while the kept mass is short of `threshold` of the row's total.
void select_blocks(const std::vector<double>& mass, int64_t i, double threshold, uint8_t* keep) {
    const double need = threshold * std::accumulate(mass.begin(), mass.begin() + i + 1, 0.0);
    keep[0] = keep[i] = 1;
    double kept = mass[0] + (i > 0 ? mass[at(i)] : 0.0);
    std::vector<int64_t> order(at(std::max<int64_t>(0, i - 1)));
    std::iota(order.begin(), order.end(), 1);
    std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return mass[at(x)] > mass[at(y)]; });
    for (int64_t j : order) {
        if (kept >= need) break;
        keep[j] = 1;
        kept += mass[at(j)];
    }
}
}  // namespace

void SparsePrefill::validate() const {
    auto fail = [](const char* field, const std::string& value, const char* allowed) {
        throw Error(std::string(field) + "=" + value + " is invalid: allowed " + allowed);
    };
    if (!on()) return;
    if (block_size < 16 || block_size > 1024 || block_size % 16)
        fail("xattention_block_size", std::to_string(block_size), "a multiple of 16 in 16..1024");
    if (stride < 1 || stride > 64 || block_size % stride)
        fail("xattention_stride", std::to_string(stride), "1..64, dividing the block size");
    if (!(threshold > 0.0 && threshold <= 1.0)) fail("xattention_threshold", std::to_string(threshold), "in (0, 1]");
    if (last_dense_tokens < 0) fail("num_last_dense_tokens_in_prefill", std::to_string(last_dense_tokens), ">= 0");
    if (dense_layers < 0) fail("dense_layers", std::to_string(dense_layers), ">= 0");
}

std::vector<std::pair<int64_t, int64_t>> BlockMask::key_ranges(int64_t h, int64_t i, int64_t n) const {
    std::vector<std::pair<int64_t, int64_t>> ranges;
    const uint8_t* k = row(h, i);
    for (int64_t j = 0; j <= i; ++j) {
        if (!k[j]) continue;
        const int64_t begin = j * block_size, end = std::min(n, (j + 1) * block_size);
        if (!ranges.empty() && ranges.back().second == begin)
            ranges.back().second = end;
        else
            ranges.emplace_back(begin, end);
    }
    return ranges;
}

int64_t BlockMask::kept() const { return std::accumulate(keep.begin(), keep.end(), int64_t(0)); }

int64_t BlockMask::causal() const {
    int64_t n = 0;
    for (int64_t i = first; i < blocks; ++i) n += i + 1;
    return heads * n;
}

BlockMask prefill_block_mask(const SparsePrefill& cfg, const float* q, const std::vector<const float*>& keys,
                             int64_t Hq, int64_t past, int64_t L, int D, float scale, int64_t first_dense, bool bf16) {
    BlockMask mask;
    mask.block_size = cfg.block_size;
    mask.first = past / cfg.block_size;
    mask.blocks = (past + L + cfg.block_size - 1) / cfg.block_size;
    mask.heads = Hq;
    const int64_t nb = mask.blocks, rows = nb - mask.first;
    mask.keep.assign(at(Hq * rows * nb), 0);
    const int64_t Hkv = static_cast<int64_t>(keys.size()), G = Hq / Hkv;
    std::vector<StridedKeys> kt(at(Hkv));
    tbb::parallel_for(int64_t(0), Hkv, [&](int64_t g) { kt[at(g)] = strided_keys(keys[at(g)], past + L, D, cfg.stride, bf16); });
    const int64_t dense_block = first_dense / cfg.block_size;  // this block and later ones attend densely
    tbb::parallel_for(int64_t(0), Hq * rows, [&](int64_t t) {
        const int64_t h = t / rows, i = nb - 1 - t % rows;  // the latest blocks (most keys) first
        uint8_t* keep = mask.keep.data() + at((h * rows + i - mask.first) * nb);
        if (i >= dense_block) {
            std::fill(keep, keep + i + 1, uint8_t(1));
            return;
        }
        std::vector<double> mass;
        antidiagonal_mass(cfg, q + h * L * D, kt[at(h / G)], past, L, D, scale, i, mass);
        select_blocks(mass, i, cfg.threshold, keep);
    });
    return mask;
}

// The pool's sparse prefill mask for this step (empty: dense). A prompt step (whole, or a chunk
// of one) of a global layer past the first `dense_layers` is sparse while its heads hold every
// position before it in order (no eviction yet): slots are then positions. A chat turn is not a
// prompt step (the sequence held tokens before it): dense. The estimate reads the step's exact
// keys and the earlier ones as stored. Rows from `scored_from` on (the method ranks by their
// probabilities) and the prompt's last rows attend densely.
BlockMask sparse_prefill_mask(StepContext& ctx, int64_t scored_from, bool bf16) {
    const SparsePrefill& sp = ctx.cfg.sparse;
    const StepMode& m = ctx.mode;
    const int64_t n = m.past + m.L, D = ctx.D;
    if (!sp.on() || ctx.cfg.count_only || !m.prefill || m.scoring || m.window || n <= sp.block_size ||
        ctx.cfg.global_index(m.layer) < sp.dense_layers)
        return {};
    for (int64_t g = 0; g < ctx.Hkv; ++g) {
        const HeadCache& hc = ctx.head(g);
        if (!hc.qblocks.empty() || !hc.bias.empty() || hc.size() != n || hc.pos.front() != 0 || hc.pos.back() != n - 1)
            return {};
    }
    const auto t0 = StepClock::now();
    std::vector<std::vector<float>> earlier(at(m.past > 0 ? ctx.Hkv : 0));
    std::vector<const float*> keys(at(ctx.Hkv));
    for (int64_t g = 0; g < ctx.Hkv; ++g) {
        const HeadCache& hc = ctx.head(g);
        keys[at(g)] = hc.step.k;
        if (m.past == 0) continue;
        std::vector<float>& k = earlier[at(g)];
        std::vector<float> v(at(m.past * D));
        k.resize(at(n * D));
        load_tokens(ctx.cfg, ctx.seq.pool(), hc, 0, m.past, k.data(), v.data());
        std::copy(hc.step.k, hc.step.k + m.L * D, k.begin() + m.past * D);
        keys[at(g)] = k.data();
    }
    const int64_t prompt = m.chunk ? m.prompt_end : n;
    const int64_t first_dense = std::max<int64_t>(0, std::min(m.past + scored_from, prompt - sp.last_dense_tokens));
    BlockMask mask = prefill_block_mask(sp, ctx.q, keys, ctx.Hq, m.past, m.L, static_cast<int>(D), ctx.logit.scale,
                                        first_dense, bf16);
    ctx.seq.sparse_blocks[0] += mask.kept();
    ctx.seq.sparse_blocks[1] += mask.causal();
    ctx.seq.sparse_ns += ns_since(t0);
    return mask;
}

}  // namespace ovkc
