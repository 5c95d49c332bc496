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

#include "paged_attention.h"

// logits[h][first[kv] + j] = scale * q[h] . key(SLOT(kv, j)) for j < lengths[kv], kv = h / GROUP (`first`:
// where a head's full-precision slots start in its logits, after its 2-bit slots, quant2.cl).
// Global size: (slots rounded up to SG, query heads); the query is held across the sub-group
// (lane l: dims l, l + SG, ...) and broadcast one dim at a time.
__attribute__((intel_reqd_sub_group_size(SG)))
__kernel void paged_logits(__global const uchar* pool, __global const int* tables, int table_stride,
                           __global const int* lengths, __global const int* first, __global const int* slot_map,
                           int map_stride, __global const float* q, float scale, __global float* logits,
                           int logit_stride) {
    const int h = get_global_id(1);
    logits_item(get_global_id(0), h, pool, tables, table_stride, lengths, first[h / GROUP], slot_map, map_stride, q,
                scale, logits, logit_stride);
}

// probs[h][j] = softmax over j < lengths[h / GROUP] (every slot of the head) of logits[h]. One sub-group per query head:
// global size (SG, query heads), local (SG, 1).
__attribute__((intel_reqd_sub_group_size(SG)))
__kernel void paged_softmax(__global const float* logits, int logit_stride, __global const int* lengths,
                            __global float* probs) {
    softmax_head(get_global_id(1), logits, logit_stride, lengths, probs);
}

// out[h][d] (+)= sum over j < lengths[kv] of probs[h][first[kv] + j] * value(j)[d], kv = h /
// GROUP (added to what quant_values wrote when `accumulate`). Global size (HEAD_DIM, query
// heads), local (SG, 1).
__attribute__((intel_reqd_sub_group_size(SG)))
__kernel void paged_values(__global const uchar* pool, __global const int* tables, int table_stride,
                           __global const int* lengths, __global const int* first, __global const int* slot_map,
                           int map_stride, __global const float* probs, int logit_stride, int accumulate,
                           __global float* out) {
    const int h = get_global_id(1);
    values_item(get_global_id(0), h, pool, tables, table_stride, lengths, first[h / GROUP], slot_map, map_stride,
                probs, logit_stride, accumulate, out);
}
