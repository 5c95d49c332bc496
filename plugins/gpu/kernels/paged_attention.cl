// Paged decode attention over the CPU op's block layout, for Intel GPUs (OpenCL C, Intel
// sub-groups). One query token per (layer, sequence); every KV head has its own block table and
// its own token count, since the methods evict per head.
//
// The block layout and its loads: paged_block.h.
//
// Three passes, as a decode step over a long cache needs every slot's logit before any
// probability: logits (one work-item per (query head, slot): consecutive slots read consecutive
// key addresses of the transposed keys), softmax (one sub-group per query head, writing the
// probabilities: the per-head scores the methods accumulate) and values (one work-item per
// (query head, dim): consecutive dims read consecutive value addresses).
//
// Compile-time constants (-D): SG (sub-group size: 8, 16 or 32), KV_PRECISION (0 f32, 1 f16,
// 2 u8), BLOCK_SIZE, HEAD_DIM (a multiple of SG), GROUP (query heads per KV head).

#include "paged_block.h"

// The j-th slot a head attends: slot j itself, or entry j of its row of `slot_map` when the
// step attends a list of slots (map_stride > 0; ClusterKV's sinks, recalled and pending slots).
#define SLOT(kv, j) (map_stride > 0 ? slot_map[(kv) * map_stride + (j)] : (j))

// logits[h][first[kv] + j] = scale * q[h] . key(SLOT(kv, j)) for j < lengths[kv], kv = h / GROUP (`first`:
// where a head's full-precision slots start in its logits, after its 2-bit slots, quant2.cl).
// Global size: (slots rounded up to SG, query heads); the query is held across the sub-group
// (lane l: dims l, l + SG, ...) and broadcast one dim at a time.
__attribute__((intel_reqd_sub_group_size(SG)))
__kernel void paged_logits(__global const uchar* pool, __global const int* tables, int table_stride,
                           __global const int* lengths, __global const int* first, __global const int* slot_map,
                           int map_stride, __global const float* q, float scale, __global float* logits,
                           int logit_stride) {
    const int j = get_global_id(0);
    const int h = get_global_id(1);
    const int lane = get_sub_group_local_id();
    const int kv = h / GROUP;
    float qreg[HEAD_DIM / SG];
    for (int i = 0; i < HEAD_DIM / SG; ++i) qreg[i] = q[h * HEAD_DIM + i * SG + lane];
    const bool live = j < lengths[kv];
    const int slot = live ? SLOT(kv, j) : 0;
    const int block_id = live ? tables[kv * table_stride + slot / BLOCK_SIZE] : 0;
    __global const uchar* block = pool + (ulong)block_id * BLOCK_BYTES;
    float acc = 0.0f;
    for (int d = 0; d < HEAD_DIM; ++d) {
        const float qd = intel_sub_group_shuffle(qreg[d / SG], d % SG);
        if (live) acc = fma(qd, load_key(block, d, slot % BLOCK_SIZE), acc);
    }
    if (live) logits[h * logit_stride + first[kv] + j] = acc * scale;
}

// probs[h][j] = softmax over j < lengths[h / GROUP] (every slot of the head) of logits[h]. One sub-group per query head:
// global size (SG, query heads), local (SG, 1).
__attribute__((intel_reqd_sub_group_size(SG)))
__kernel void paged_softmax(__global const float* logits, int logit_stride, __global const int* lengths,
                            __global float* probs) {
    const int h = get_global_id(1);
    const int lane = get_sub_group_local_id();
    const int n = lengths[h / GROUP];
    __global const float* s = logits + h * logit_stride;
    float mx = -INFINITY;
    for (int j = lane; j < n; j += SG) mx = fmax(mx, s[j]);
    mx = sub_group_reduce_max(mx);
    float sum = 0.0f;
    for (int j = lane; j < n; j += SG) sum += exp(s[j] - mx);
    sum = sub_group_reduce_add(sum);
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (int j = lane; j < n; j += SG) probs[h * logit_stride + j] = exp(s[j] - mx) * inv;
}

// out[h][d] (+)= sum over j < lengths[kv] of probs[h][first[kv] + j] * value(j)[d], kv = h /
// GROUP (added to what quant_values wrote when `accumulate`). Global size (HEAD_DIM, query
// heads), local (SG, 1).
__attribute__((intel_reqd_sub_group_size(SG)))
__kernel void paged_values(__global const uchar* pool, __global const int* tables, int table_stride,
                           __global const int* lengths, __global const int* first, __global const int* slot_map,
                           int map_stride, __global const float* probs, int logit_stride, int accumulate,
                           __global float* out) {
    const int d = get_global_id(0);
    const int h = get_global_id(1);
    const int kv = h / GROUP;
    const int n = lengths[kv];
    __global const float* p = probs + h * logit_stride + first[kv];
    float acc = 0.0f;
    if (map_stride > 0) {  // a slot list (ClusterKV's recalled slots): one slot at a time
        for (int j = 0; j < n; ++j) {
            const int slot = SLOT(kv, j);
            __global const uchar* block = pool + (ulong)tables[kv * table_stride + slot / BLOCK_SIZE] * BLOCK_BYTES;
            acc = fma(p[j], load_value(block, slot % BLOCK_SIZE, d), acc);
        }
    } else {
        for (int b = 0; b * BLOCK_SIZE < n; ++b) {
            __global const uchar* block = pool + (ulong)tables[kv * table_stride + b] * BLOCK_BYTES;
            const int end = min(BLOCK_SIZE, n - b * BLOCK_SIZE);
            for (int j = 0; j < end; ++j) acc = fma(p[b * BLOCK_SIZE + j], load_value(block, j, d), acc);
        }
    }
    out[h * HEAD_DIM + d] = accumulate ? out[h * HEAD_DIM + d] + acc : acc;
}
