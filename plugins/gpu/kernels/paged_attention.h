// The bodies of paged decode attention's three passes (one work-item's or sub-group's share
// each), shared by the hosts' kernels (paged_attention.cl) and the GPU plugin's layers
// (plugin_layers.cl). Compile-time constants: as paged_attention.cl.
#ifndef OVKC_PAGED_ATTENTION_H
#define OVKC_PAGED_ATTENTION_H

#include "paged_block.h"


// The j-th slot a head attends: slot j itself, or entry j of its row of `slot_map` when the
// step attends a list of slots (map_stride > 0; ClusterKV's sinks, recalled and pending slots).
#define SLOT(kv, j) (map_stride > 0 ? slot_map[(kv) * map_stride + (j)] : (j))

// One (slot j, query head h) of paged_logits; `first_kv`: first[kv] of the kernel.
inline void logits_item(int j, int h, __global const uchar* pool, __global const int* tables, int table_stride,
                        __global const int* lengths, int first_kv, __global const int* slot_map, int map_stride,
                        __global const float* q, float scale, __global float* logits, int logit_stride) {
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
    if (live) logits[h * logit_stride + first_kv + j] = CAP_LOGIT(acc * scale);
}


// Query head h of paged_softmax, one sub-group.
inline void softmax_head(int h, __global const float* logits, int logit_stride, __global const int* lengths,
                         __global float* probs) {
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


// One (dim d, query head h) of paged_values; `first_kv`: first[kv].
inline void values_item(int d, int h, __global const uchar* pool, __global const int* tables, int table_stride,
                        __global const int* lengths, int first_kv, __global const int* slot_map, int map_stride,
                        __global const float* probs, int logit_stride, int accumulate, __global float* out) {
    const int kv = h / GROUP;
    const int n = lengths[kv];
    __global const float* p = probs + h * logit_stride + first_kv;
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

#endif  // OVKC_PAGED_ATTENTION_H
