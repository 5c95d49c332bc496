// MiniKV's 2-/4-bit store (ov_kvcrush/methods/quant.py; plugins/cpu/src/kernels_quant.cpp) for
// Intel GPUs: quantize blocks into the CPU op's 2-bit block layout, dequantize them, and the
// decode logits and values over them. Codes, scales and zeros equal the reference's exactly
// (built with -cl-fp32-correctly-rounded-divide-sqrt: a code is round((x - zero) / scale)).
//
// A 2-bit block holds BLOCK_SIZE (T) tokens of one KV head: key codes [D][T / KP] u32 (KP codes
// per word, token t at bits KEY_BITS * (t % KP)), key scale and zero fp16 [T / QGROUP][D] (per
// channel, per group of QGROUP tokens), value codes [T][D / VP] u32, value scale and zero fp16
// [T][D / QGROUP] (per token, per group of QGROUP channels). A pool is one buffer of such blocks.
//
// Compile-time constants (-D): SG, BLOCK_SIZE, HEAD_DIM, QGROUP (a multiple of 16),
// KEY_BITS, VALUE_BITS (2 or 4), GROUP (query heads per KV head).

#define T BLOCK_SIZE
#define D HEAD_DIM
#define KP (32 / KEY_BITS)
#define VP (32 / VALUE_BITS)
#define KC_OFF 0
#define KS_OFF (KC_OFF + D * (T / KP) * 4)
#define KZ_OFF (KS_OFF + (T / QGROUP) * D * 2)
#define VC_OFF (KZ_OFF + (T / QGROUP) * D * 2)
#define VS_OFF (VC_OFF + T * (D / VP) * 4)
#define VZ_OFF (VS_OFF + T * (D / QGROUP) * 2)
#define QBLOCK_BYTES ((ulong)(VZ_OFF + T * (D / QGROUP) * 2))

// One group's zero = fp16(min), scale = fp16((max - min(zero, min)) / levels), stored at index
// `at` of the block's scale and zero arrays; returns them as floats.
inline float2 group_params(float lo, float hi, int bits, __global half* scales, __global half* zeros, int at) {
    vstore_half_rte(lo, at, zeros);
    const float zf = vload_half(at, zeros);
    vstore_half_rte((hi - fmin(zf, lo)) / (float)((1 << bits) - 1), at, scales);
    return (float2)(vload_half(at, scales), zf);
}

inline uint group_code(float x, float2 sz, int bits) {
    if (!(sz.x > 0.0f)) return 0;
    return (uint)clamp(rint((x - sz.y) / sz.x), 0.0f, (float)((1 << bits) - 1));
}

// Keys of blocks src [nblocks][T][D] into pool blocks ids[b]: one work-item per (channel, token
// group, block). Global size (D, T / QGROUP, nblocks).
__kernel void quantize_keys(__global const float* src, __global const int* ids, __global uchar* pool) {
    const int c = get_global_id(0), tg = get_global_id(1), b = get_global_id(2);
    __global const float* x = src + (long)b * T * D + tg * QGROUP * D + c;
    __global uchar* blk = pool + (ulong)ids[b] * QBLOCK_BYTES;
    float lo = x[0], hi = x[0];
    for (int i = 1; i < QGROUP; ++i) {
        lo = fmin(lo, x[i * D]);
        hi = fmax(hi, x[i * D]);
    }
    const float2 sz = group_params(lo, hi, KEY_BITS, (__global half*)(blk + KS_OFF), (__global half*)(blk + KZ_OFF),
                                   tg * D + c);
    __global uint* words = (__global uint*)(blk + KC_OFF) + c * (T / KP) + tg * QGROUP / KP;
    for (int w = 0; w < QGROUP / KP; ++w) {
        uint word = 0;
        for (int i = 0; i < KP; ++i) word |= group_code(x[(w * KP + i) * D], sz, KEY_BITS) << (KEY_BITS * i);
        words[w] = word;
    }
}

// Values of blocks src [nblocks][T][D]: one work-item per (channel group, token, block). Global
// size (D / QGROUP, T, nblocks).
__kernel void quantize_values(__global const float* src, __global const int* ids, __global uchar* pool) {
    const int cg = get_global_id(0), t = get_global_id(1), b = get_global_id(2);
    __global const float* x = src + (long)b * T * D + t * D + cg * QGROUP;
    __global uchar* blk = pool + (ulong)ids[b] * QBLOCK_BYTES;
    float lo = x[0], hi = x[0];
    for (int i = 1; i < QGROUP; ++i) {
        lo = fmin(lo, x[i]);
        hi = fmax(hi, x[i]);
    }
    const float2 sz = group_params(lo, hi, VALUE_BITS, (__global half*)(blk + VS_OFF), (__global half*)(blk + VZ_OFF),
                                   t * (D / QGROUP) + cg);
    __global uint* words = (__global uint*)(blk + VC_OFF) + t * (D / VP) + cg * QGROUP / VP;
    for (int w = 0; w < QGROUP / VP; ++w) {
        uint word = 0;
        for (int i = 0; i < VP; ++i) word |= group_code(x[w * VP + i], sz, VALUE_BITS) << (VALUE_BITS * i);
        words[w] = word;
    }
}

// key element c of token t of a 2-bit block
inline float quant_key(__global const uchar* blk, int t, int c) {
    const uint word = ((__global const uint*)(blk + KC_OFF))[c * (T / KP) + t / KP];
    const uint code = (word >> (KEY_BITS * (t % KP))) & ((1u << KEY_BITS) - 1u);
    const int at = (t / QGROUP) * D + c;
    return vload_half(at, (__global const half*)(blk + KZ_OFF)) + (float)code * vload_half(at, (__global const half*)(blk + KS_OFF));
}

// value element c of token t of a 2-bit block
inline float quant_value(__global const uchar* blk, int t, int c) {
    const uint word = ((__global const uint*)(blk + VC_OFF))[t * (D / VP) + c / VP];
    const uint code = (word >> (VALUE_BITS * (c % VP))) & ((1u << VALUE_BITS) - 1u);
    const int at = t * (D / QGROUP) + c / QGROUP;
    return vload_half(at, (__global const half*)(blk + VZ_OFF)) + (float)code * vload_half(at, (__global const half*)(blk + VS_OFF));
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
