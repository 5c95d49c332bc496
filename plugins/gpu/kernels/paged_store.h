// The store's bodies (a token's u8 parameters and codes, one token's store), shared by the
// hosts' kernels (paged_store.cl) and the GPU plugin's store layer (plugin_layers.cl).
// Compile-time constants: as paged_store.cl.
#ifndef OVKC_PAGED_STORE_H
#define OVKC_PAGED_STORE_H

#include "paged_block.h"

// One vector's u8 min and scale over HEAD_DIM values, held across a sub-group (lane l: dims l,
// l + SG, ...): scale = (max - min) / 255.
inline float2 u8_params(__global const ACT* x) {
    const int lane = get_sub_group_local_id();
    float lo = INFINITY, hi = -INFINITY;
    for (int d = lane; d < HEAD_DIM; d += SG) {
        lo = fmin(lo, ACT_LOAD(x, d));
        hi = fmax(hi, ACT_LOAD(x, d));
    }
    lo = sub_group_reduce_min(lo);
    hi = sub_group_reduce_max(hi);
    return (float2)(lo, (hi - lo) / 255.0f);
}

inline uchar u8_code(float x, float2 p) {
    const float inv = p.y > 0.0f ? 1.0f / p.y : 0.0f;
    return (uchar)clamp(rint((x - p.x) * inv), 0.0f, 255.0f);
}

// Token t of KV head kv (of `tokens`: k, v [kv_heads, tokens, HEAD_DIM]) into `slot` of the head's
// block table `table`, one sub-group.
inline void store_token(int t, int kv, int tokens, __global uchar* pool, __global const int* table, int slot,
                        __global const ACT* k, __global const ACT* v) {
    const int lane = get_sub_group_local_id();
    __global uchar* block = pool + (ulong)table[slot / BLOCK_SIZE] * BLOCK_BYTES;
    const int j = slot % BLOCK_SIZE;
    __global const ACT* kx = k + ((long)kv * tokens + t) * HEAD_DIM;
    __global const ACT* vx = v + ((long)kv * tokens + t) * HEAD_DIM;
    const int vat = BLOCK_SIZE * HEAD_DIM + j * HEAD_DIM;
#if KV_PRECISION == 0
    __global float* f = (__global float*)block;
    for (int d = lane; d < HEAD_DIM; d += SG) {
        f[d * BLOCK_SIZE + j] = ACT_LOAD(kx, d);
        f[vat + d] = ACT_LOAD(vx, d);
    }
#elif KV_PRECISION == 1
    __global half* f = (__global half*)block;
    for (int d = lane; d < HEAD_DIM; d += SG) {
        vstore_half_rte(ACT_LOAD(kx, d), d * BLOCK_SIZE + j, f);
        vstore_half_rte(ACT_LOAD(vx, d), vat + d, f);
    }
#else
    const float2 kp = u8_params(kx), vp = u8_params(vx);
    for (int d = lane; d < HEAD_DIM; d += SG) {
        block[d * BLOCK_SIZE + j] = u8_code(ACT_LOAD(kx, d), kp);
        block[vat + d] = u8_code(ACT_LOAD(vx, d), vp);
    }
    if (lane == 0) {
        __global float* p = (__global float*)(block + KV_BYTES);
        p[j] = kp.x;
        p[BLOCK_SIZE + j] = kp.y;
        p[2 * BLOCK_SIZE + j] = vp.x;
        p[3 * BLOCK_SIZE + j] = vp.y;
    }
#endif
}

#endif  // OVKC_PAGED_STORE_H
