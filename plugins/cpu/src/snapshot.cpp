// Snapshots of a sequence's cache, for conversations kept on disk (ov_kvcrush/op/snapshot.py):
// per (layer, KV head), its slots' positions and raw blocks, its 2-bit blocks and their
// positions, its scores, Chelsea's degrees and biases, the pinned tail, and the layer's tokens
// seen. Written back byte for byte into an empty sequence of a pool configured the same way, the
// restored cache is the saved one bit for bit: its next step computes what the saved one would
// have. Inside a chunked prompt it holds the chunks so far, unselected (a held prompt: its
// restore continues a prompt after ovkc_seq_set_prompt). A head with state beside its slots
// (ClusterKV's clusters, made at its prompt's end) has no snapshot: refused.
#include <algorithm>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "c_api.hpp"
#include "paged_cache.hpp"

using ovkc::Error;
using ovkc::HeadCache;
using ovkc::Registry;
using ovkc_c::guarded;
using ovkc_c::head_of;

namespace {
// The counts a head's snapshot holds, in this order (sizes[] of the calls below).
enum Field { kSlots, kBlocks, kQSlots, kQBlocks, kScores, kDegree, kBias, kQScores, kHoles, kPinBegin, kPinCount, kSeen, kFields };

void check_whole(ovkc::Sequence& s) {
    if (s.scoring) throw Error("the sequence is in a scoring pass: snapshot it once the pass has ended");
}

void sizes_of(ovkc::Sequence& s, int layer, const HeadCache& hc, int64_t* sizes) {
    if (hc.state)
        throw Error("the method keeps state beside the cache's slots (ClusterKV's clusters), which a snapshot does "
                    "not hold");
    sizes[kSlots] = hc.size();
    sizes[kBlocks] = static_cast<int64_t>(hc.blocks.size());
    sizes[kQSlots] = static_cast<int64_t>(hc.qpos.size());
    sizes[kQBlocks] = static_cast<int64_t>(hc.qblocks.size());
    sizes[kScores] = static_cast<int64_t>(hc.scores.size());
    sizes[kDegree] = static_cast<int64_t>(hc.degree.size());
    sizes[kBias] = static_cast<int64_t>(hc.bias.size());
    sizes[kQScores] = static_cast<int64_t>(hc.qscores.size());
    sizes[kHoles] = hc.holes;
    sizes[kPinBegin] = hc.pin_begin;
    sizes[kPinCount] = hc.pin_count;
    sizes[kSeen] = s.seen(layer);
}

// A snapshot's counts that this pool's empty head can take, or an Error naming the count.
void check_sizes(const ovkc::PoolConfig& cfg, const int64_t* z) {
    const int64_t bs = cfg.block_size, G = cfg.group();
    auto need = [](bool ok, const std::string& what) {
        if (!ok) throw Error("the snapshot does not fit this pool: " + what);
    };
    for (int f = 0; f < kFields; ++f) need(z[f] >= 0, "a negative count");
    need(z[kBlocks] >= (z[kSlots] + bs - 1) / bs, "fewer blocks than its slots fill");
    need(z[kQSlots] == z[kQBlocks] * bs, "2-bit slots that are not whole blocks");
    need(z[kScores] == (cfg.keeps_scores() ? z[kSlots] * G : 0), "scores per slot (the pools differ in keeping them)");
    need(z[kDegree] == 0 || z[kDegree] == z[kSlots], "degrees per slot");
    need(z[kBias] == 0 || z[kBias] == z[kSlots], "biases per slot");
    need(z[kQScores] == 0 || z[kQScores] == z[kQSlots] * G, "2-bit scores per slot");
    need(z[kHoles] <= z[kBias], "holes without biases");
    need(z[kPinBegin] + z[kPinCount] <= z[kSlots], "a pinned tail past its slots");
}
}  // namespace

OVKC_API int64_t ovkc_snapshot_fields() { return kFields; }

// The counts of one head's snapshot (Field order) into sizes[kFields].
OVKC_API int64_t ovkc_seq_snapshot_sizes(int64_t seq, int32_t layer, int32_t kv_head, int64_t* sizes) {
    return guarded([&]() -> int64_t {
        auto s = Registry::get().sequence(seq);
        std::lock_guard<std::mutex> lock(s->mu);
        check_whole(*s);
        sizes_of(*s, layer, head_of(*s, layer, kv_head), sizes);
        return 0;
    });
}

// One head's snapshot into buffers of the sizes above: positions [slots], blocks [blocks][block
// bytes], 2-bit positions [qslots], 2-bit blocks [qblocks][qblock bytes], scores, degrees,
// biases, 2-bit scores (floats). `expected` is sizes as the caller read them: the head must
// not have changed since.
OVKC_API int64_t ovkc_seq_snapshot_read(int64_t seq, int32_t layer, int32_t kv_head, const int64_t* expected,
                                        int64_t* pos, uint8_t* blocks, int64_t* qpos, uint8_t* qblocks, float* scores,
                                        float* degree, float* bias, float* qscores) {
    return guarded([&]() -> int64_t {
        auto s = Registry::get().sequence(seq);
        std::lock_guard<std::mutex> lock(s->mu);
        check_whole(*s);
        const HeadCache& hc = head_of(*s, layer, kv_head);
        int64_t z[kFields];
        sizes_of(*s, layer, hc, z);
        if (!std::equal(z, z + kFields, expected)) throw Error("the sequence changed while it was being read");
        const auto& cfg = s->pool().config();
        std::copy(hc.pos.begin(), hc.pos.end(), pos);
        for (size_t b = 0; b < hc.blocks.size(); ++b)
            std::memcpy(blocks + b * cfg.block_bytes(), s->pool().block(hc.blocks[b]), cfg.block_bytes());
        std::copy(hc.qpos.begin(), hc.qpos.end(), qpos);
        for (size_t b = 0; b < hc.qblocks.size(); ++b)
            std::memcpy(qblocks + b * cfg.qblock_bytes(), s->pool().qblock(hc.qblocks[b]), cfg.qblock_bytes());
        std::copy(hc.scores.begin(), hc.scores.end(), scores);
        std::copy(hc.degree.begin(), hc.degree.end(), degree);
        std::copy(hc.bias.begin(), hc.bias.end(), bias);
        std::copy(hc.qscores.begin(), hc.qscores.end(), qscores);
        return 0;
    });
}

// Write one head's snapshot (as read above) into an empty head of `seq`, taking its blocks from
// the sequence's pool (an exhausted pool is an Error, and the head stays empty).
OVKC_API int64_t ovkc_seq_snapshot_write(int64_t seq, int32_t layer, int32_t kv_head, const int64_t* z,
                                         const int64_t* pos, const uint8_t* blocks, const int64_t* qpos,
                                         const uint8_t* qblocks, const float* scores, const float* degree,
                                         const float* bias, const float* qscores) {
    return guarded([&]() -> int64_t {
        auto s = Registry::get().sequence(seq);
        std::lock_guard<std::mutex> lock(s->mu);
        HeadCache& hc = head_of(*s, layer, kv_head);
        if (!hc.blocks.empty() || !hc.qblocks.empty() || !hc.pos.empty() || hc.state)
            throw Error("a snapshot is written into an empty sequence (reset it first)");
        const auto& cfg = s->pool().config();
        check_sizes(cfg, z);
        auto& pool = s->pool();
        try {
            for (int64_t b = 0; b < z[kBlocks]; ++b) {
                hc.blocks.push_back(pool.acquire());
                std::memcpy(pool.block(hc.blocks.back()), blocks + b * cfg.block_bytes(), cfg.block_bytes());
            }
            for (int64_t b = 0; b < z[kQBlocks]; ++b) {
                hc.qblocks.push_back(pool.acquire_q());
                std::memcpy(pool.qblock(hc.qblocks.back()), qblocks + b * cfg.qblock_bytes(), cfg.qblock_bytes());
            }
        } catch (...) {
            for (int32_t b : hc.blocks) pool.release(b);
            for (int32_t b : hc.qblocks) pool.release_q(b);
            hc.blocks.clear();
            hc.qblocks.clear();
            throw;
        }
        hc.pos.assign(pos, pos + z[kSlots]);
        hc.qpos.assign(qpos, qpos + z[kQSlots]);
        hc.scores.assign(scores, scores + z[kScores]);
        hc.degree.assign(degree, degree + z[kDegree]);
        hc.bias.assign(bias, bias + z[kBias]);
        hc.qscores.assign(qscores, qscores + z[kQScores]);
        hc.holes = z[kHoles];
        hc.pin_begin = z[kPinBegin];
        hc.pin_count = z[kPinCount];
        s->seen(layer) = z[kSeen];
        return 0;
    });
}
