// MiniKV's 2-/4-bit store (ov_kvcrush/methods/quant.py; plugins/cpu/src/kernels_quant.cpp) for
// Intel GPUs: quantize blocks into the CPU op's 2-bit block layout, dequantize them, and the
// decode logits and values over them. Codes, scales and zeros equal the reference's exactly
// (built with -cl-fp32-correctly-rounded-divide-sqrt: a code is round((x - zero) / scale)).
//
// The block (its layout, one group's quantization, one element read back) is quant_block.h's;
// here its tokens are BLOCK_SIZE (T).
//
// Compile-time constants (-D): SG, BLOCK_SIZE, HEAD_DIM, QGROUP (a multiple of 16),
// KEY_BITS, VALUE_BITS (2 or 4), GROUP (query heads per KV head).

#include "quant_block.h"

#define T BLOCK_SIZE
#define D HEAD_DIM

// Keys of blocks src [nblocks][T][D] into pool blocks ids[b]: one work-item per (channel, token
// group, block). Global size (D, T / QGROUP, nblocks).
__kernel void quantize_keys(__global const float* src, __global const int* ids, __global uchar* pool) {
    const int c = get_global_id(0), tg = get_global_id(1), b = get_global_id(2);
    __global const float* x = src + (long)b * T * D + tg * QGROUP * D + c;
    float group[QGROUP];
    for (int i = 0; i < QGROUP; ++i) group[i] = x[i * D];
    store_key_group(group, pool + (ulong)ids[b] * QBLOCK_BYTES, tg, c);
}

// Values of blocks src [nblocks][T][D]: one work-item per (channel group, token, block). Global
// size (D / QGROUP, T, nblocks).
__kernel void quantize_values(__global const float* src, __global const int* ids, __global uchar* pool) {
    const int cg = get_global_id(0), t = get_global_id(1), b = get_global_id(2);
    __global const float* x = src + (long)b * T * D + t * D + cg * QGROUP;
    float group[QGROUP];
    for (int i = 0; i < QGROUP; ++i) group[i] = x[i];
    store_value_group(group, pool + (ulong)ids[b] * QBLOCK_BYTES, t, cg);
}

// k, v [nblocks][T][D] = the tokens of pool blocks ids[b]. Global size (D, T, nblocks).
__kernel void dequantize_blocks(__global const uchar* pool, __global const int* ids, __global float* k,
                                __global float* v) {
    const int c = get_global_id(0), t = get_global_id(1), b = get_global_id(2);
    __global const uchar* blk = pool + (ulong)ids[b] * QBLOCK_BYTES;
    const long at = (long)b * T * D + t * D + c;
    k[at] = quant_key(blk, t, c);
    v[at] = quant_value(blk, t, c);
}

// Decode logits over each KV head's 2-bit slots: logits[h][j] = scale * q[h] . key(j), j <
// qlengths[h / GROUP] (the 2-bit slots come first in a head's logits; its full-precision slots
// follow, paged_logits writing them from that offset). Global size (slots rounded up to SG, query
// heads), local (SG, 1).
__attribute__((intel_reqd_sub_group_size(SG)))
__kernel void quant_logits(__global const uchar* pool, __global const int* tables, int table_stride,
                           __global const int* qlengths, __global const float* q, float scale,
                           __global float* logits, int logit_stride) {
    const int j = get_global_id(0);
    const int h = get_global_id(1);
    const int lane = get_sub_group_local_id();
    const int kv = h / GROUP;
    float qreg[D / SG];
    for (int i = 0; i < D / SG; ++i) qreg[i] = q[h * D + i * SG + lane];
    const bool live = j < qlengths[kv];
    __global const uchar* blk = pool + (ulong)(live ? tables[kv * table_stride + j / T] : 0) * QBLOCK_BYTES;
    float acc = 0.0f;
    for (int c = 0; c < D; ++c) {
        const float qc = intel_sub_group_shuffle(qreg[c / SG], c % SG);
        if (live) acc = fma(qc, quant_key(blk, j % T, c), acc);
    }
    if (live) logits[h * logit_stride + j] = acc * scale;
}

// out[h][c] = sum over the 2-bit slots j of probs[h][j] * value(j)[c] (written, not added: the
// full-precision slots' paged_values adds to it). Global size (D, query heads), local (SG, 1).
__attribute__((intel_reqd_sub_group_size(SG)))
__kernel void quant_values(__global const uchar* pool, __global const int* tables, int table_stride,
                           __global const int* qlengths, __global const float* probs, int logit_stride,
                           __global float* out) {
    const int c = get_global_id(0);
    const int h = get_global_id(1);
    const int kv = h / GROUP;
    const int n = qlengths[kv];
    __global const float* p = probs + h * logit_stride;
    float acc = 0.0f;
    for (int b = 0; b * T < n; ++b) {
        __global const uchar* blk = pool + (ulong)tables[kv * table_stride + b] * QBLOCK_BYTES;
        for (int t = 0; t < min(T, n - b * T); ++t) acc = fma(p[b * T + t], quant_value(blk, t, c), acc);
    }
    out[h * D + c] = acc;
}
