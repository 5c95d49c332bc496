// ClusterKV's recall (ov_kvcrush/methods/clusterkv.py; plugins/cpu/src/clusterkv.cpp) for Intel
// GPUs: each decode step's ranking of the centroids and the recalled slots, over the cluster
// index where kmeans.cl put it in an arena of int32 words (each part's first word and the words
// from one KV head to the next passed as *_at and *_stride; ov_kvcrush/gpu/clusterkv.py:
// IndexRun), and the list of slots the step attends.
//
// Compile-time constants (-D): SG, HEAD_DIM (a multiple of SG), GROUP (query heads per KV head).

#include "clusterkv.h"

#define D HEAD_DIM

// scores[kv][c] = sum over the KV head's query group of q[h] . centroid[kv][c]. Global (C, kv).
__kernel void centroid_scores(__global const float* q, __global const float* index, int c_at, int c_stride, int C,
                              __global float* scores) {
    const int c = get_global_id(0), kv = get_global_id(1);
    scores[kv * C + c] = centroid_score(q + kv * GROUP * D, D, index + c_at + (long)kv * c_stride + (long)c * D);
}

// order[kv][rank] = c: the clusters by score, best first, ties to the lower cluster id (the
// rank of c counts the clusters above it). Global (C, kv).
__kernel void rank_order(__global const float* scores, int C, __global int* order) {
    const int c = get_global_id(0), kv = get_global_id(1);
    order[kv * C + cluster_rank(scores + kv * C, C, c)] = c;
}

// The recalled slots of each KV head: whole clusters in ranked order until `budget` slots, the
// last one trimmed to its earliest; counts[kv] gets how many (min(budget, clustered)). One
// sub-group per head copies each cluster's slots: global (SG, kv), local (SG, 1).
__attribute__((intel_reqd_sub_group_size(SG)))
__kernel void recall_slots(__global const int* order, __global const int* index, int s_at, int s_stride, int o_at,
                           int o_stride, int t_at, int t_stride, int C, int budget, __global int* slots,
                           __global int* counts) {
    const int kv = get_global_id(1);
    const int taken = recall_clusters(order + kv * C, index + s_at + kv * s_stride, index + o_at + kv * o_stride,
                                      index + t_at + (long)kv * t_stride, C, budget, slots + (long)kv * budget);
    if (get_sub_group_local_id() == 0) counts[kv] = taken;
}

// The slots a decode step attends per KV head: the sinks [0, sinks), the recalled slots
// (counts[kv] of recalled[kv]), then the pending tokens [pending, held); lengths[kv] their count.
// map [kv][map_stride]. Global (map_stride, kv).
__kernel void attended_slots(__global const int* recalled, int recall_stride, __global const int* counts, int sinks,
                             int pending, int held, __global int* map, int map_stride, __global int* lengths) {
    const int j = get_global_id(0), kv = get_global_id(1);
    const int r = counts[kv];
    const int n = sinks + r + (held - pending);
    if (j == 0) lengths[kv] = n;
    if (j < n) map[(long)kv * map_stride + j] = attended_slot(j, sinks, r, pending, recalled + (long)kv * recall_stride);
}
