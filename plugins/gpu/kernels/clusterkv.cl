// ClusterKV's clustering and recall (ov_kvcrush/methods/clusterkv.py; plugins/cpu/src/
// clusterkv.cpp, kmeans.cpp) for Intel GPUs: cosine k-means over each KV head's keys (rows), the
// cluster index, and each decode step's ranking of the centroids and the recalled slots.
//
// Compile-time constants (-D): SG, HEAD_DIM (a multiple of SG), GROUP (query heads per KV head).

#include "clusterkv.h"

#define D HEAD_DIM

// xn[r][i] = x[r][i] / max(|x[r][i]|, 1e-12) (F.normalize). One sub-group per vector: global
// (SG, n, rows), local (SG, 1, 1).
__attribute__((intel_reqd_sub_group_size(SG)))
__kernel void normalize_rows(__global const float* x, __global float* xn) {
    const long at = ((long)get_global_id(2) * get_global_size(1) + get_global_id(1)) * D;
    const int lane = get_sub_group_local_id();
    float sq = 0.0f;
    for (int d = lane; d < D; d += SG) sq = fma(x[at + d], x[at + d], sq);
    const float norm = fmax(sqrt(sub_group_reduce_add(sq)), 1e-12f);
    for (int d = lane; d < D; d += SG) xn[at + d] = x[at + d] / norm;
}

// directions[r][c] = xn[r][picks[r][c]]: the seeded initial picks. Global (D, k, rows).
__kernel void gather_picks(__global const float* xn, int n, __global const int* picks, __global float* directions) {
    const int d = get_global_id(0), c = get_global_id(1), r = get_global_id(2);
    const int k = get_global_size(1);
    directions[((long)r * k + c) * D + d] = xn[((long)r * n + picks[r * k + c]) * D + d];
}

// labels[r][i] = the direction of largest cosine with xn[r][i], the first on ties; `changed` is
// set when any label moved. Global (n, rows).
__kernel void assign_nearest(__global const float* xn, __global const float* directions, int k,
                             __global int* labels, __global int* changed) {
    const int i = get_global_id(0), r = get_global_id(1);
    const int n = get_global_size(0);
    __global const float* x = xn + ((long)r * n + i) * D;
    int best = 0;
    float top = -INFINITY;
    for (int c = 0; c < k; ++c) {
        __global const float* mu = directions + ((long)r * k + c) * D;
        float s = 0.0f;
        for (int d = 0; d < D; ++d) s = fma(x[d], mu[d], s);
        if (s > top) {
            top = s;
            best = c;
        }
    }
    if (labels[(long)r * n + i] != best) {
        labels[(long)r * n + i] = best;
        *changed = 1;
    }
}

// Each direction moves to its members' normalised sum, members added in token order (an empty
// cluster keeps its direction); `means` (when set) gets the members' plain mean of x and `sizes`
// the member counts. Global (k, rows).
__kernel void update_directions(__global const float* xn, __global const float* x, int n,
                                __global const int* labels, __global float* directions, __global float* means,
                                __global int* sizes, int final_step) {
    const int c = get_global_id(0), r = get_global_id(1);
    const int k = get_global_size(0);
    float acc[D];
    for (int d = 0; d < D; ++d) acc[d] = 0.0f;
    int count = 0;
    __global const float* src = final_step ? x : xn;
    for (int i = 0; i < n; ++i) {
        if (labels[(long)r * n + i] != c) continue;
        ++count;
        for (int d = 0; d < D; ++d) acc[d] += src[((long)r * n + i) * D + d];
    }
    __global float* out = (final_step ? means : directions) + ((long)r * k + c) * D;
    if (final_step) {
        sizes[r * k + c] = count;
        for (int d = 0; d < D; ++d) out[d] = acc[d] / (float)max(count, 1);
        return;
    }
    float sq = 0.0f;
    for (int d = 0; d < D; ++d) sq = fma(acc[d], acc[d], sq);
    const float norm = sqrt(sq);
    if (norm > 0.0f)
        for (int d = 0; d < D; ++d) out[d] = acc[d] / fmax(norm, 1e-30f);
}

// scores[kv][c] = sum over the KV head's query group of q[h] . centroid[kv][c]. Global (C, kv).
__kernel void centroid_scores(__global const float* q, __global const float* centroids, int C,
                              __global float* scores) {
    const int c = get_global_id(0), kv = get_global_id(1);
    scores[kv * C + c] = centroid_score(q + kv * GROUP * D, D, centroids + ((long)kv * C + c) * D);
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
__kernel void recall_slots(__global const int* order, __global const int* sizes, __global const int* offsets,
                           __global const int* sorted_tokens, int C, int N, int budget, __global int* slots,
                           __global int* counts) {
    const int kv = get_global_id(1);
    const int taken = recall_clusters(order + kv * C, sizes + kv * C, offsets + kv * (C + 1),
                                      sorted_tokens + (long)kv * N, C, budget, slots + (long)kv * budget);
    if (get_sub_group_local_id() == 0) counts[kv] = taken;
}

// dst[r][at + i] = src[r][i] + add for i < count: the cluster index grown on the device (the
// clustered slots sorted by label, old clusters' then a new clustering's, whose order counts
// from its first slot `add`). Global (count, rows).
__kernel void append_rows(__global const int* src, int src_stride, int count, int add, __global int* dst,
                          int dst_stride, int at) {
    const int i = get_global_id(0), r = get_global_id(1);
    if (i < count) dst[(long)r * dst_stride + at + i] = src[(long)r * src_stride + i] + add;
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
