// The CPU op's full-precision block (plugins/cpu/src/paged_cache.hpp), shared by the kernels
// that read or write it (paged_attention.cl, prefill.cl, paged_store.cl).
//
// A block is BLOCK_SIZE tokens of one KV head: the keys transposed [HEAD_DIM][BLOCK_SIZE], then
// the values [BLOCK_SIZE][HEAD_DIM], then, for the u8 store, four rows of BLOCK_SIZE floats: key
// min, key scale, value min, value scale (x = min + code * scale). A pool is one buffer of equal
// blocks, block id * BLOCK_BYTES apart.
//
// Compile-time constants (-D): KV_PRECISION (0 f32, 1 f16, 2 u8), BLOCK_SIZE, HEAD_DIM; ACT_HALF
// (optional: the activations' type, below).
#ifndef OVKC_PAGED_BLOCK_H
#define OVKC_PAGED_BLOCK_H

#if KV_PRECISION == 0
#define ELEM_BYTES 4
#elif KV_PRECISION == 1
#define ELEM_BYTES 2
#else
#define ELEM_BYTES 1
#endif
#define KV_BYTES (2 * BLOCK_SIZE * HEAD_DIM * ELEM_BYTES)
#define PARAM_BYTES (KV_PRECISION == 2 ? 4 * 4 * BLOCK_SIZE : 0)
#define BLOCK_BYTES ((ulong)(KV_BYTES + PARAM_BYTES))

// Gemma 2's attention soft-capping of each scaled logit, cap * tanh(s / cap), before the softmax
// and wherever the methods' scores take logits (the CPU op's row_logits); SOFTCAP 0: none.
#ifndef SOFTCAP
#define SOFTCAP 0
#endif
#define CAP_LOGIT(s) ((float)(SOFTCAP) > 0.0f ? (float)(SOFTCAP) * tanh((s) / (float)(SOFTCAP)) : (s))

// The step's activations (queries, keys and values in, attention out): f32, or f16 where
// OpenVINO's GPU plugin runs the model in f16 (ACT_HALF 1: its layers' tensors are half, read and
// written through vload_half / vstore_half_rte, computed in float). The hosts' kernels take f32.
#if defined(ACT_HALF) && ACT_HALF
#define ACT half
#define ACT_LOAD(p, i) vload_half((i), (p))
#define ACT_STORE(x, i, p) vstore_half_rte((x), (i), (p))
#else
#define ACT float
#define ACT_LOAD(p, i) ((p)[i])
#define ACT_STORE(x, i, p) ((p)[i] = (x))
#endif

// key element d of slot j of a block
inline float load_key(__global const uchar* block, int d, int j) {
#if KV_PRECISION == 0
    return ((__global const float*)block)[d * BLOCK_SIZE + j];
#elif KV_PRECISION == 1
    return vload_half(d * BLOCK_SIZE + j, (__global const half*)block);
#else
    __global const float* p = (__global const float*)(block + KV_BYTES);
    return p[j] + (float)block[d * BLOCK_SIZE + j] * p[BLOCK_SIZE + j];
#endif
}

// value element d of slot j of a block
inline float load_value(__global const uchar* block, int j, int d) {
    const int at = BLOCK_SIZE * HEAD_DIM + j * HEAD_DIM + d;
#if KV_PRECISION == 0
    return ((__global const float*)block)[at];
#elif KV_PRECISION == 1
    return vload_half(at, (__global const half*)block);
#else
    __global const float* p = (__global const float*)(block + KV_BYTES);
    return p[2 * BLOCK_SIZE + j] + (float)block[at] * p[3 * BLOCK_SIZE + j];
#endif
}

// key element d of slot `slot` of a head whose block table is `table`
inline float slot_key(__global const uchar* pool, __global const int* table, int slot, int d) {
    return load_key(pool + (ulong)table[slot / BLOCK_SIZE] * BLOCK_BYTES, d, slot % BLOCK_SIZE);
}

#endif
