// MiniKV's 2-bit store (ov_kvcrush/methods/store.py, quant.py), under any method: the newest tokens stay
// in full-precision blocks (the residual); whenever `residual` tokens have gathered, they are
// quantized, block by block, into bit-packed 2-bit blocks (keys per channel, values per token,
// fp16 scales/zeros per group) and their full-precision blocks go back to the pool. The selection
// above it (MiniKV's heavy hitters, or any importance/KVCrush selection with quant) is made once
// at prefill and frozen, since quantized key groups cannot lose members. As in the reference, a
// decode step's tokens are flushed before that step attends, the prompt's after its selection.
#include <algorithm>

#include "kernels.hpp"
#include "policy.hpp"

namespace ovkc {

void quant_flush(Sequence& seq, int layer) {
    const PoolConfig& cfg = seq.pool().config();
    const Policy& p = *cfg.policy;
    if (!p.quant()) return;
    const int64_t residual = p.quant_residual();
    const int T = cfg.block_size, D = cfg.head_dim, G = cfg.group();
    std::vector<float> k(static_cast<size_t>(T) * D), v(static_cast<size_t>(T) * D);
    for (int g = 0; g < cfg.kv_heads; ++g) {
        compact(seq, seq.head(layer, g));  // (a frozen selection leaves no holes; never quantize one)
        HeadCache& hc = seq.head(layer, g);
        const int64_t chunk = hc.size() / residual * residual;  // a multiple of the block size
        if (!chunk) continue;
        for (int64_t start = 0; start < chunk; start += T) {
            for (int t = 0; t < T; ++t)
                load_token(cfg, seq.pool(), hc, start + t, k.data() + static_cast<size_t>(t) * D,
                           v.data() + static_cast<size_t>(t) * D);
            const int32_t qb = seq.pool().acquire_q();
            quantize_block(cfg, seq.pool().qblock(qb), k.data(), v.data());
            hc.qblocks.push_back(qb);
        }
        hc.qpos.insert(hc.qpos.end(), hc.pos.begin(), hc.pos.begin() + chunk);
        const size_t nb = static_cast<size_t>(chunk / T);
        for (size_t b = 0; b < nb; ++b) seq.pool().release(hc.blocks[b]);
        hc.blocks.erase(hc.blocks.begin(), hc.blocks.begin() + static_cast<std::ptrdiff_t>(nb));
        hc.pos.erase(hc.pos.begin(), hc.pos.begin() + chunk);
        if (!hc.scores.empty())
            hc.scores.erase(hc.scores.begin(), hc.scores.begin() + chunk * G);
    }
}

}  // namespace ovkc
