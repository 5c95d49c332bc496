// Tokens in and out of the full-precision blocks (f32, f16 or u8; keys transposed per block): one
// token, a run of slots, and the compaction move the eviction methods use (kernels.hpp).
#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels_detail.hpp"

namespace ovkc {

using namespace detail;

namespace {
// One token into slot j of a u8 block: codes, then its min and scale for keys and for values.
void store_u8(uint8_t* base, int bs, int D, int j, const float* k, const float* v) {
    const size_t kv_elems = static_cast<size_t>(bs) * D;
    float* p = u8_params(base, bs, D);
    quantize_u8(k, D, base + j, bs, p[j], p[bs + j]);
    quantize_u8(v, D, base + kv_elems + static_cast<size_t>(j) * D, 1, p[2 * bs + j], p[3 * bs + j]);
}
}  // namespace

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
    } else if (cfg.precision == Precision::f16) {
        auto* kt = reinterpret_cast<uint16_t*>(base);
        for (int d = 0; d < D; ++d) kt[static_cast<size_t>(d) * bs + j] = to_half(k[d]);
        uint16_t* vr = kt + kv_elems + static_cast<size_t>(j) * D;
        for (int d = 0; d < D; ++d) vr[d] = to_half(v[d]);
    } else {
        store_u8(base, bs, D, j, k, v);
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
        if (cfg.precision == Precision::u8) {
            for (int64_t j = j0; j < j1; ++j) store_u8(base, static_cast<int>(bs), D, static_cast<int>(j), kr + j * D, vr + j * D);
        } else if (cfg.precision == Precision::f32) {
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
    const bool params = cfg.param_bytes() > 0;
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
            if (params) {  // the u8 scales: 4 rows of bs floats, shifted like the rows of K^T
                float* pd = reinterpret_cast<float*>(dst + 2 * kv_elems * es);
                const float* pn = reinterpret_cast<const float*>(next + 2 * kv_elems * es);
                std::memmove(pd, pd + delta, (4 * static_cast<size_t>(bs) - delta) * sizeof(float));
                for (int r = 0; r < 4; ++r) std::memcpy(pd + r * bs + tail, pn + r * bs, static_cast<size_t>(delta) * sizeof(float));
            }
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
        if (params) {
            float* pd = reinterpret_cast<float*>(dst + 2 * kv_elems * es);
            const float* ps = reinterpret_cast<const float*>(src + 2 * kv_elems * es);
            for (int r = 0; r < 4; ++r) std::memmove(pd + r * bs + jd, ps + r * bs + js, static_cast<size_t>(seg) * sizeof(float));
        }
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
    } else if (cfg.precision == Precision::u8) {
        const float* p = u8_params(base, bs, D);
        for (int d = 0; d < D; ++d) k[d] = p[j] + static_cast<float>(base[static_cast<size_t>(d) * bs + j]) * p[bs + j];
        const uint8_t* c = base + kv_elems + static_cast<size_t>(j) * D;
        for (int d = 0; d < D; ++d) v[d] = p[2 * bs + j] + static_cast<float>(c[d]) * p[3 * bs + j];
    } else {
        const auto* kt = reinterpret_cast<const uint16_t*>(base);
        for (int d = 0; d < D; ++d) k[d] = from_half(kt[static_cast<size_t>(d) * bs + j]);
        for (int d = 0; d < D; ++d) v[d] = from_half(kt[kv_elems + static_cast<size_t>(j) * D + d]);
    }
}

}  // namespace ovkc
