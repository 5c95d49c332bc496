// MiniKV's 2-/4-bit block (the CPU op's layout, plugins/cpu/src/paged_cache.hpp: qblock_bytes),
// shared by the hosts' kernels (quant2.cl) and the GPU plugin's layers (plugin_layers.cl): the
// offsets, one group's quantization, and one element read back.
//
// A 2-bit block holds QUANT_TOKENS (QB_T) tokens of one KV head: key codes [D][T / KP] u32 (KP
// codes per word, token t at bits KEY_BITS * (t % KP)), key scale and zero fp16 [T / QGROUP][D]
// (per channel, per group of QGROUP tokens), value codes [T][D / VP] u32, value scale and zero
// fp16 [T][D / QGROUP] (per token, per group of QGROUP channels). A pool is one buffer of such
// blocks. Codes equal the reference's (ov_kvcrush/methods/quant.py) when built with
// -cl-fp32-correctly-rounded-divide-sqrt: a code is round((x - zero) / scale).
//
// Compile-time constants (-D): HEAD_DIM, QGROUP (a multiple of 16), KEY_BITS, VALUE_BITS (2 or
// 4), QUANT_TOKENS (the 2-bit block's tokens; quant2.cl's BLOCK_SIZE where not given).
#ifndef OVKC_QUANT_BLOCK_H
#define OVKC_QUANT_BLOCK_H

#ifndef QUANT_TOKENS
#define QUANT_TOKENS BLOCK_SIZE
#endif
#define QB_T QUANT_TOKENS
#define QB_D HEAD_DIM
#define QB_KP (32 / KEY_BITS)
#define QB_VP (32 / VALUE_BITS)
#define KC_OFF 0
#define KS_OFF (KC_OFF + QB_D * (QB_T / QB_KP) * 4)
#define KZ_OFF (KS_OFF + (QB_T / QGROUP) * QB_D * 2)
#define VC_OFF (KZ_OFF + (QB_T / QGROUP) * QB_D * 2)
#define VS_OFF (VC_OFF + QB_T * (QB_D / QB_VP) * 4)
#define VZ_OFF (VS_OFF + QB_T * (QB_D / QGROUP) * 2)
#define QBLOCK_BYTES ((ulong)(VZ_OFF + QB_T * (QB_D / QGROUP) * 2))

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

// One group of QGROUP values x at `bits` bits: its zero and scale at index `at` of `zeros` and
// `scales`, its codes packed 32 / bits a word into `words`.
inline void store_group(const float* x, int bits, __global half* scales, __global half* zeros, int at,
                        __global uint* words) {
    float lo = x[0], hi = x[0];
    for (int i = 1; i < QGROUP; ++i) {
        lo = fmin(lo, x[i]);
        hi = fmax(hi, x[i]);
    }
    const float2 sz = group_params(lo, hi, bits, scales, zeros, at);
    const int per_word = 32 / bits;
    for (int w = 0; w < QGROUP / per_word; ++w) {
        uint word = 0;
        for (int i = 0; i < per_word; ++i) word |= group_code(x[w * per_word + i], sz, bits) << (bits * i);
        words[w] = word;
    }
}

// Key channel c of the block's token group tg, x[i] the key of token tg * QGROUP + i.
inline void store_key_group(const float* x, __global uchar* blk, int tg, int c) {
    store_group(x, KEY_BITS, (__global half*)(blk + KS_OFF), (__global half*)(blk + KZ_OFF), tg * QB_D + c,
                (__global uint*)(blk + KC_OFF) + c * (QB_T / QB_KP) + tg * QGROUP / QB_KP);
}

// Token t's value channel group cg of the block, x[i] its channel cg * QGROUP + i.
inline void store_value_group(const float* x, __global uchar* blk, int t, int cg) {
    store_group(x, VALUE_BITS, (__global half*)(blk + VS_OFF), (__global half*)(blk + VZ_OFF),
                t * (QB_D / QGROUP) + cg, (__global uint*)(blk + VC_OFF) + t * (QB_D / QB_VP) + cg * QGROUP / QB_VP);
}

// key element c of token t of a 2-bit block
inline float quant_key(__global const uchar* blk, int t, int c) {
    const uint word = ((__global const uint*)(blk + KC_OFF))[c * (QB_T / QB_KP) + t / QB_KP];
    const uint code = (word >> (KEY_BITS * (t % QB_KP))) & ((1u << KEY_BITS) - 1u);
    const int at = (t / QGROUP) * QB_D + c;
    return vload_half(at, (__global const half*)(blk + KZ_OFF)) + (float)code * vload_half(at, (__global const half*)(blk + KS_OFF));
}

// value element c of token t of a 2-bit block
inline float quant_value(__global const uchar* blk, int t, int c) {
    const uint word = ((__global const uint*)(blk + VC_OFF))[t * (QB_D / QB_VP) + c / QB_VP];
    const uint code = (word >> (VALUE_BITS * (c % QB_VP))) & ((1u << VALUE_BITS) - 1u);
    const int at = t * (QB_D / QGROUP) + c / QGROUP;
    return vload_half(at, (__global const half*)(blk + VZ_OFF)) + (float)code * vload_half(at, (__global const half*)(blk + VS_OFF));
}

#endif  // OVKC_QUANT_BLOCK_H
