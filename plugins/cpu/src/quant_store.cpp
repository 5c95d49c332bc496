// MiniKV's 2-bit store (ov_kvcrush/methods/store.py, quant.py), under any method: the newest tokens stay
// in full-precision blocks (the residual); whenever `residual` tokens have gathered, they are
// quantized, block by block, into bit-packed 2-bit blocks (keys per channel, values per token,
// fp16 scales/zeros per group) and their full-precision blocks go back to the pool, their slot scores
// into the 2-bit tokens' own (qscores). MiniKV's and Knorm's selections over it are made once at
// prefill and frozen, since quantized key groups cannot lose members; the importance selections
// and KVCrush drop whole flushed chunks in decode steps instead (evict_quant_chunks). As in the reference, a
// decode step's tokens are flushed before that step attends, the prompt's after its selection.
// The prompt's last `tail` slots are pinned at its end and never flushed (store.py says why); the
// slots flushed are the others in slot order, as the reference flushes its residual.
#include <algorithm>

#include "kernels.hpp"
#include "policy.hpp"

namespace ovkc {

void quant_flush(Sequence& seq, int layer, bool prompt) {
    const PoolConfig& cfg = seq.pool().config();
    const Policy& p = *cfg.policy;
    if (!p.quant()) return;
    const int64_t residual = p.quant_residual();
    const int T = cfg.block_size, D = cfg.head_dim, G = cfg.group();
    std::vector<float> k, v;
    for (int g = 0; g < cfg.kv_heads; ++g) {
        compact(seq, seq.head(layer, g));  // (a frozen selection leaves no holes; never quantize one)
        HeadCache& hc = seq.head(layer, g);
        if (prompt) {  // the prompt's last slots stay in full precision for good (the question)
            hc.pin_count = std::min(p.quant_tail(), hc.size());
            hc.pin_begin = hc.size() - hc.pin_count;
        }
        // the slots that may be flushed: all but the pinned run, in slot order
        const int64_t movable = hc.size() - hc.pin_count;
        const int64_t chunk = movable / residual * residual;  // a multiple of the block size
        if (!chunk) continue;
        auto slot_of = [&](int64_t i) { return i < hc.pin_begin ? i : i + hc.pin_count; };
        // read the flushed tokens out, give their full-precision blocks back, then take the 2-bit
        // blocks: a 2-bit block never needs more bytes than the block it replaces, so a full pool
        // can always flush
        k.resize(static_cast<size_t>(chunk) * D);
        v.resize(static_cast<size_t>(chunk) * D);
        for (int64_t i = 0; i < chunk; ++i) {
            const int64_t slot = slot_of(i);
            load_token(cfg, seq.pool(), hc, slot, k.data() + static_cast<size_t>(i) * D,
                       v.data() + static_cast<size_t>(i) * D);
            hc.qpos.push_back(hc.pos[static_cast<size_t>(slot)]);
            if (!hc.scores.empty())  // the token's scores go with it (chunk eviction ranks by them)
                hc.qscores.insert(hc.qscores.end(), hc.scores.begin() + slot * G, hc.scores.begin() + (slot + 1) * G);
        }
        if (!hc.pin_count) {  // the flushed slots are the first blocks: given back without a copy
            const size_t nb = static_cast<size_t>(chunk / T);
            for (size_t b = 0; b < nb; ++b) seq.pool().release(hc.blocks[b]);
            hc.blocks.erase(hc.blocks.begin(), hc.blocks.begin() + static_cast<std::ptrdiff_t>(nb));
            hc.pos.erase(hc.pos.begin(), hc.pos.begin() + chunk);
            if (!hc.scores.empty()) hc.scores.erase(hc.scores.begin(), hc.scores.begin() + chunk * G);
        } else {
            std::vector<int64_t> keep;  // the rest, in slot order (the pinned run moves down)
            keep.reserve(static_cast<size_t>(hc.size() - chunk));
            for (int64_t i = chunk; i < movable; ++i) keep.push_back(slot_of(i));
            for (int64_t i = 0; i < hc.pin_count; ++i) keep.push_back(hc.pin_begin + i);
            std::sort(keep.begin(), keep.end());
            hc.pin_begin -= std::min(hc.pin_begin, chunk);  // the flushed slots before the run went first
            keep_slots(seq, hc, keep);  // its trim gives chunk / T blocks back
        }
        for (int64_t start = 0; start < chunk; start += T) {
            const int32_t qb = seq.pool().acquire_q();
            quantize_block(cfg, seq.pool().qblock(qb), k.data() + static_cast<size_t>(start) * D,
                           v.data() + static_cast<size_t>(start) * D);
            hc.qblocks.push_back(qb);
        }
    }
}

}  // namespace ovkc
