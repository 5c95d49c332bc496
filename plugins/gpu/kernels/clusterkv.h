// ClusterKV's decode-step recall (ov_kvcrush/methods/clusterkv.py: rank the centroids by the
// step's query, recall whole clusters up to the budget, attend the sinks, the recalled and the
// pending slots), one KV head's share each, shared by the hosts' kernels (clusterkv.cl) and the
// GPU plugin's recall layer (plugin_layers.cl). Compile-time constants: SG, HEAD_DIM, GROUP; ACT
// (the query's type: the plugin's activations; float otherwise).
#ifndef OVKC_CLUSTERKV_H
#define OVKC_CLUSTERKV_H

#ifndef ACT
#define ACT float
#define ACT_LOAD(p, i) ((p)[i])
#endif

// The sum over a KV head's query group of q[g] . mu: q its group's first query head, head_stride
// the elements from one query head to the next.
inline float centroid_score(__global const ACT* q, long head_stride, __global const float* mu) {
    float total = 0.0f;
    for (int g = 0; g < GROUP; ++g) {
        float s = 0.0f;
        for (int d = 0; d < HEAD_DIM; ++d) s = fma(ACT_LOAD(q, g * head_stride + d), mu[d], s);
        total += s;
    }
    return total;
}

// Cluster c's place among C scores s, best first: the clusters above it (ties to the lower id).
inline int cluster_rank(__global const float* s, int C, int c) {
    const float x = s[c];
    int rank = 0;
    for (int o = 0; o < C; ++o) rank += s[o] > x || (s[o] == x && o < c);
    return rank;
}

// One KV head's recalled slots (one sub-group): whole clusters in ranked `order` until `budget`
// slots, the last one trimmed to its earliest, into slots[0 ..]; returns how many. The head's
// rows of the index: cluster sizes [C], offsets [C + 1] into sorted_tokens (its slots by cluster).
inline int recall_clusters(__global const int* order, __global const int* sizes, __global const int* offsets,
                           __global const int* sorted_tokens, int C, int budget, __global int* slots) {
    const int lane = get_sub_group_local_id();
    int taken = 0;
    for (int rank = 0; rank < C && taken < budget; ++rank) {
        const int c = order[rank];
        const int size = min(sizes[c], budget - taken);
        for (int i = lane; i < size; i += SG) slots[taken + i] = sorted_tokens[offsets[c] + i];
        taken += size;
    }
    return taken;
}

// The j-th slot a decode step attends: the sinks [0, sinks), the `count` recalled slots, then the
// pending ones [pending, ..) (not clustered yet, the step's own token the last).
inline int attended_slot(int j, int sinks, int count, int pending, __global const int* recalled) {
    if (j < sinks) return j;
    if (j < sinks + count) return recalled[j - sinks];
    return pending + (j - sinks - count);
}

#endif  // OVKC_CLUSTERKV_H
