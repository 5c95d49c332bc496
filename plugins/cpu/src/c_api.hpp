// What every C API file shares: the export macro, the calling thread's last error and the guard
// that turns an exception into it (no exception crosses the C boundary), and the checked lookup
// of one (layer, KV head) of a sequence.
#pragma once

#include <cstdint>
#include <exception>
#include <string>

#include "paged_cache.hpp"

#define OVKC_API extern "C" __attribute__((visibility("default")))

namespace ovkc_c {

inline thread_local std::string g_error;

template <class F>
int64_t guarded(F&& f) {
    try {
        return f();
    } catch (const std::exception& e) {
        g_error = e.what();
    } catch (...) {
        g_error = "unknown error";
    }
    return -1;
}

// One (layer, KV head) of a sequence, both indices checked.
inline ovkc::HeadCache& head_of(ovkc::Sequence& s, int32_t layer, int32_t kv_head) {
    const auto& cfg = s.pool().config();
    if (layer < 0 || layer >= cfg.layers)
        throw ovkc::Error("layer=" + std::to_string(layer) + " is invalid: allowed 0.." + std::to_string(cfg.layers - 1));
    if (kv_head < 0 || kv_head >= cfg.kv_heads)
        throw ovkc::Error("kv_head=" + std::to_string(kv_head) + " is invalid: allowed 0.." + std::to_string(cfg.kv_heads - 1));
    return s.head(layer, kv_head);
}

}  // namespace ovkc_c
