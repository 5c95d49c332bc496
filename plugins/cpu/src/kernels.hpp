// Attention kernels over one (layer, KV head) of the paged cache.
//
// A RowSet is up to kMaxRows query rows that attend the same KV head: in prefill, consecutive
// positions of one query head (the keys of a block are loaded once for all of them); in decode,
// the query heads of one GQA group. Keys are stored transposed per block ([head_dim][block]) so
// the q.k products vectorise across tokens, values row-major so p.v vectorises across channels.
// Softmax is computed online (flash-attention style) block by block, so no [rows x tokens] logit
// matrix is ever materialised.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "paged_cache.hpp"

namespace ovkc {

// Query rows a task attends together: AVX-512's kernels hold 8 rows' sums in registers; AVX2's
// tiles hold 6, so there a task takes two tiles' worth (every key block read once per 12 rows).
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr int kMaxRows = 12;
#else
constexpr int kMaxRows = 8;
#endif

// Slots of a head as ascending, disjoint [begin, end) ranges.
using SlotRanges = std::vector<std::pair<int64_t, int64_t>>;

// How the model turns q.k into the logit its softmax takes: times `scale`, then (Gemma 2)
// softcap * tanh(s / softcap) when softcap > 0. The op's two attributes of the same names.
struct LogitMap {
    float scale = 1.0f;
    float softcap = 0.0f;
};

struct RowSet {
    int n = 0;
    const float* q[kMaxRows] = {};  // query rows (head_dim floats, unscaled)
    int64_t qpos[kMaxRows] = {};    // absolute position: keys at a later position are masked
    // a sliding-window layer's span (0: none): keys at or before qpos - window are masked too
    int64_t window = 0;
    // the model's soft-capping of its attention logits (Gemma 2; 0: none): each scaled logit s
    // becomes softcap * tanh(s / softcap) before the softmax, as in prompt and decode alike
    float softcap = 0.0f;
    float* out[kMaxRows] = {};      // accumulator rows (head_dim floats), unnormalised until finish
    float m[kMaxRows] = {};         // running max of the scaled logits
    float l[kMaxRows] = {};         // running sum of exp(logit - m)
    int group_index[kMaxRows] = {}; // which query head of the KV group (for scores)
    float* logits[kMaxRows] = {};   // if set, attend_range stores the row's logits here, by slot

    void start();  // m = -inf, l = 0, out = 0
};

// Attend the slots [slot_begin, slot_end) of `hc` (any range: a partial first or last block is
// masked), updating each row's (m, l, out). Positions must ascend within the range where rows
// need the causal mask; stops at the first block wholly after every row's position.
void attend_range(const PoolConfig& cfg, const Pool& pool, const HeadCache& hc, RowSet& rows, float scale,
                  int64_t slot_begin, int64_t slot_end);

// The first slot any row of `rows` can see under its sliding window (0 without one): positions
// ascend, so every slot before it is before every row's window.
int64_t first_visible_slot(const HeadCache& hc, const RowSet& rows);
int64_t first_visible_slot(const HeadCache& hc, const int64_t* qpos, int n, int64_t window);

// Combine n partial results of one row, each (m, l, out[D]) at first + c * stride, into out
// (accumulated, then normalised); returns the row's log-sum-exp.
float merge_partials(const float* first, size_t stride, int n, int D, float* out);

// out /= l for every row (rows with l == 0 saw no key: out stays 0).
void finish_rows(RowSet& rows, int head_dim);

// Add each row's softmax probabilities exp(scale*q.k - lse[r]) of the slots in block `block_index`
// to hc.scores[slot * group + group_index[r]] (causal keys only); `take_max`: keep the larger of
// the two instead (a scoring pass: each slot's largest probability), for slots in [slot_lo, slot_hi).
void accumulate_scores(const PoolConfig& cfg, const Pool& pool, HeadCache& hc, const RowSet& rows,
                       const float* lse, float scale, int64_t block_index, bool take_max = false,
                       int64_t slot_lo = 0, int64_t slot_hi = INT64_MAX);

// The decode step's score pass, fused: attend_quant and attend_range left each row's logits
// (masked ones -inf) in `logits`: the head's 2-bit slots [0, nq), then its full-precision slots
// [nq, nq + n), padded with -inf to a multiple of 16. Once the row's log-sum-exp is known, add
// exp(logit - lse) to hc.scores[slot * group + gi] (and to hc.qscores, when it is kept). The keys
// are not read again.
void add_probabilities(HeadCache& hc, int group, int gi, float* logits, float lse);

// Write one token's key and value (head_dim floats each) into slot `slot` of `hc`.
void store_token(const PoolConfig& cfg, const Pool& pool, const HeadCache& hc, int64_t slot, const float* k,
                 const float* v);

// Slots [begin, end) of `hc` as token-major floats (k and v: (end - begin) * head_dim each), and
// back: block by block, whole channel runs converted at once (merging rewrites most of a head).
void load_tokens(const PoolConfig& cfg, const Pool& pool, const HeadCache& hc, int64_t begin, int64_t end, float* k,
                 float* v);
void store_tokens(const PoolConfig& cfg, const Pool& pool, const HeadCache& hc, int64_t begin, int64_t end,
                  const float* k, const float* v);

// The head's blocks as f32 blocks (keys [D][bs], values [bs][D] each) in `buf`, the step's own
// tokens (hc.step) exact, set as the step's staged copy (StepTokens::staged) that the kernels
// then read in place of converting a block again (a prompt of many query tiles over u8 or f16).
void stage_f32(const PoolConfig& cfg, const Pool& pool, HeadCache& hc, std::vector<float>& buf);

// Compaction after eviction: move `count` consecutive slots from `from` down to `to` (to < from), block segment by segment.
void move_slots(const PoolConfig& cfg, const Pool& pool, const HeadCache& hc, int64_t from, int64_t to, int64_t count);

// Read slot `slot` back as floats (tests and stats).
void load_token(const PoolConfig& cfg, const Pool& pool, const HeadCache& hc, int64_t slot, float* k, float* v);

// bf16 prefill (AVX512-BF16 dot products, fp32 accumulation), used when the model runs with a
// bf16 inference precision as OpenVINO's own SDPA then does: the head's keys/values are staged
// once per step in bf16 pair layouts (keys [token/16][d/2][16][2], values [token/2][d][2]).
struct Bf16Head {
    std::vector<uint16_t> k, v;
    int64_t n = 0;
};
bool has_bf16();
// How the bf16 prompt kernel multiplies its bf16 operands: AVX512-BF16 dot products (vdpbf16ps,
// 32 products an instruction), or each operand widened to f32 (a shift or a mask, exact) and
// multiplied in f32 FMAs (16 an instruction). The products are the same (a bf16 times a bf16 is
// exact in f32), summed in f32 in another order. Some CPUs retire a quarter as many dot products
// as FMAs (benchmarks/dot_peak.cpp), so widening does more multiply-adds per second there.
enum class Bf16Products { dot, widened };
// The process's choice: OVKC_BF16_PRODUCTS (dot or widened) if set, else what the library's
// user set (the Python side: a choice measured once per CPU and cached, op/bf16_choice.py), else
// measured here once (measure_bf16_rates, kBf16ChoiceRounds trials).
Bf16Products bf16_products();
void set_bf16_products(Bf16Products products);
// Multiply-adds per second of this core's bf16 dot products and of its f32 FMAs, each the best
// of `rounds` interleaved trials of about 0.1 ms: a trial another process preempted or slowed is
// never the best, so the rates (and the choice) hold on a busy machine. Zeros without AVX512-BF16.
struct Bf16Rates {
    double dot = 0.0, fma = 0.0;
};
// trials of each instruction a choice is measured from (about 5 ms in all)
constexpr int kBf16ChoiceRounds = 25;
Bf16Rates measure_bf16_rates(int rounds);
// Widened where the FMAs do at least 1.2x the dot products' multiply-adds (the margin pays for
// the widening and the extra broadcasts).
Bf16Products choose_bf16_products(const Bf16Rates& rates);
void stage_bf16(const PoolConfig& cfg, const Pool& pool, const HeadCache& hc, Bf16Head& out);
// The slots of `ranges` ([begin, end) pairs, ascending, disjoint) staged as one head: `view`
// gets their positions only (what attend_bf16 / attend_amx read of a head besides the staging).
void stage_bf16_ranges(const PoolConfig& cfg, const Pool& pool, const HeadCache& hc, const SlotRanges& ranges,
                       Bf16Head& out, HeadCache& view);
// A prompt's per-head scores summed inside the attention (H2O's column sums over every query):
// the final probability each row from `first_row` on gives each slot is added to sums[slot].
struct ColumnSums {
    float* sums = nullptr;
    int first_row = 0;
};
// Same contract as attend_range over all slots of the head, then finish_rows; with `columns`,
// also its column sums (the kernel keeps the rows' probabilities of each span of keys and the
// running max they were taken against, and rescales them once the rows' softmax is complete).
// With `keys`, only those slots (each range starting at a multiple of 16; a sparse prefill's
// kept blocks), and no column sums.
void attend_bf16(const PoolConfig& cfg, const HeadCache& hc, const Bf16Head& st, RowSet& rows, float scale,
                 ColumnSums* columns = nullptr, const SlotRanges* keys = nullptr);

// AMX tiles (kernels_amx.cpp): whether this build and this process can use them (the kernel
// asks the OS for the tile state once), and for which head sizes (a multiple of 32, at most 512).
bool has_amx();
bool amx_head_dim(int head_dim);
constexpr int kAmxRows = 16;  // query rows one AMX tile holds
// The bf16 prefill of up to kAmxRows query rows of one head over the staged head (stage_bf16):
// q[r] (unscaled), causal by qpos[r] (and within `window` of it, when > 0); out[r] normalised; m[r], l[r] the row's softmax max and
// sum (its log-sum-exp is m + log l; l = 0: the row saw no key and out is 0). Same arithmetic as
// attend_bf16: bf16 products, fp32 sums, probabilities rounded to bf16 for the values.
void attend_amx(const PoolConfig& cfg, const HeadCache& hc, const Bf16Head& st, int n, const float* const* q,
                const int64_t* qpos, float* const* out, float scale, float* m, float* l, int64_t window = 0);

// A scoring step's per-slot maxima on AMX tiles (KVzip): for the staged slots [s_begin, s_end)
// of one head, best[j] = max(best[j], max over the `rows` query rows of (q.k - lse[row])) for
// slot s_begin + j: the log of the largest probability a row gives the slot. `q`: the rows'
// scaled queries in bf16, row-major (the logits are the ones attend_amx computed for them);
// no causal mask (the scored slots are older than every row).
void max_log_probabilities_amx(const PoolConfig& cfg, const Bf16Head& st, const uint16_t* q, const float* lse, int64_t rows,
                               int64_t s_begin, int64_t s_end, float* best);

// A scoring step's per-head scores on AMX tiles, from the bf16 logits attend_amx used (`lse`
// per (query head, row) as the attention left it): for each KV head g of `heads`, the staged
// slots [sinks[g], sinks[g] + hi[g] - lo[g]) of staged[g] are its held slots [lo[g], hi[g]); each
// query head gi of the group keeps in scores[slot * G + gi] the larger of what is there and the
// largest probability any of the step's L queries (q [Hq][L][D], unscaled) gives the slot.
void score_step_amx(const PoolConfig& cfg, const std::vector<HeadCache*>& heads, const float* q, int64_t L, float scale,
                    const std::vector<float>& lse, const std::vector<Bf16Head>& staged, const std::vector<int64_t>& sinks,
                    const std::vector<int64_t>& lo, const std::vector<int64_t>& hi);

// ---- MiniKV's 2-bit blocks (layout: PoolConfig::qblock_bytes) --------------------------------
// Quantize block_size tokens (keys and values [bs][D] floats) into a 2-bit block: keys per
// channel in groups of `group` tokens, values per token in groups of `group` channels, fp16
// scale and zero (the group's minimum), codes round((x - zero) / scale) in 0..3, as
// ov_kvcrush/methods/quant.py computes them.
void quantize_block(const PoolConfig& cfg, uint8_t* dst, const float* k, const float* v);
// Token `t` of a 2-bit block, dequantized (zero + code * scale).
void dequantize_token(const PoolConfig& cfg, const uint8_t* blk, int t, float* k, float* v);
// Attend the 2-bit blocks [qb_begin, qb_end) of `hc` (all older than every row), dequantizing
// inside the dot products: q.k = q.zero + (q*scale).codes per key group, p.v likewise; updates
// each row's (m, l, out) like attend_range.
// A row with `logits` set also gets its scaled logits there, by 2-bit slot (qb * block_size + t).
// Tokens after a row's position are masked (a multi-token step flushes before it attends).
void attend_quant(const PoolConfig& cfg, const Pool& pool, const HeadCache& hc, RowSet& rows, float scale,
                  int64_t qb_begin, int64_t qb_end);
// Add the rows' probabilities (exp(logit - lse[r])) of the tokens of 2-bit block qb to hc.qscores,
// column rows.group_index[r]: a multi-token step's scores of the quantized tokens.
void accumulate_quant_scores(const PoolConfig& cfg, const Pool& pool, HeadCache& hc, const RowSet& rows,
                             const float* lse, float scale, int64_t qb);

// ---- ClusterKV's working set -----------------------------------------------------------------
// Tokens gathered out of the store as f32: keys transposed in tiles of kSlabTile tokens
// ([tile][D][kSlabTile], zero padded), values row-major [token][D]. A recalled cluster, the sinks
// and the pending tokens are one slab each.
constexpr int kSlabTile = 32;
struct Slab {
    std::vector<float> kt, v;
    int64_t count = 0;       // tokens loaded
    int64_t max_token = -1;  // the latest store index among them
    int64_t q_at_load = 0;   // tokens in the 2-bit store when they were loaded
    int64_t last_step = -1;  // decode step that last recalled it
    void clear();                     // drop the tokens and free the memory
    void resize(int64_t n, int D);    // room for n tokens
    void put(int64_t j, const float* k, const float* v, int D);  // token j of the slab
    size_t bytes() const { return (kt.capacity() + v.capacity()) * sizeof(float); }
};
// The first n tokens of a head's 2-bit blocks, dequantized into `out` (a scoring step's sinks).
void load_quant_slab(const PoolConfig& cfg, const Pool& pool, const HeadCache& hc, int64_t n, Slab& out);
// Attend the first n tokens of a slab, updating each row's (m, l, out) like attend_range.
// pos0 >= 0: the slab's tokens sit at consecutive positions from pos0 and are masked causally;
// pos0 < 0: every token is older than every row.
void attend_slab(const Slab& slab, int64_t n, int D, RowSet& rows, float scale, int64_t pos0);

// sum of a[d] * b[d] over d < n (16 lanes, then reduced): a short dot product not bound by the
// latency of one serial chain of adds.
float dot(const float* a, const float* b, int n);

// out[i] = x[i] / max(|x[i]|, 1e-12) for n rows of D floats (torch's F.normalize): the cosine
// similarities of ClusterKV's k-means and Chelsea's matching.
void normalize_rows(const float* x, int64_t n, int D, float* out);

// The name of the compiled kernel path ("avx512+bf16+amx", "avx512+bf16", "avx512", "avx2" or "scalar").
const char* kernel_isa();

}  // namespace ovkc
