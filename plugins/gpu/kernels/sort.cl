// A stable counting sort on small integer keys, for Intel GPUs (OpenCL C, Intel sub-groups).
//
// Compile-time constants (-D): SG (sub-group size), MAX_KEYS (the local histogram's size: every
// key is below it).

// order: the m items by key, ties by position (a stable counting sort, keys below MAX_KEYS), for
// each row of keys [rows][m]: KVCrush's bucketing order and its evictable tokens, ClusterKV's
// index (each head's tokens by label). One
// sub-group per row: global (SG, rows), local (SG, 1). The histogram and its running starts live
// in local memory; each chunk of SG tokens is placed in order, a lane's rank among the chunk's
// lanes of its key coming from the keys shuffled across the sub-group.
// Of the sub-group's lanes holding `key`, how many come before `lane` (returned) and after it.
inline int same_key_lanes(int key, int lane, int* after) {
    int before = 0;
    *after = 0;
    for (int l = 0; l < SG; ++l) {
        const int other = intel_sub_group_shuffle(key, l);
        before += other == key && l < lane;
        *after += other == key && l > lane;
    }
    return before;
}

__attribute__((intel_reqd_sub_group_size(SG)))
__kernel void bucket_order(__global const int* keys, int m, int key_range, __global int* order) {
    __local int start[MAX_KEYS];
    keys += (long)get_global_id(1) * m;
    order += (long)get_global_id(1) * m;
    const int lane = get_sub_group_local_id();
    for (int k = lane; k < key_range; k += SG) start[k] = 0;
    sub_group_barrier(CLK_LOCAL_MEM_FENCE);
    for (int c = 0; c < m; c += SG) {  // the histogram, one chunk at a time (one lane per key adds)
        const int e = c + lane;
        const int key = e < m ? keys[e] : -1;
        int after;
        const int before = same_key_lanes(key, lane, &after);
        if (key >= 0 && after == 0) start[key] += before + 1;
        sub_group_barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (lane == 0) {  // counts to starts
        int total = 0;
        for (int k = 0; k < key_range; ++k) {
            const int count = start[k];
            start[k] = total;
            total += count;
        }
    }
    sub_group_barrier(CLK_LOCAL_MEM_FENCE);
    for (int c = 0; c < m; c += SG) {  // place each chunk after every earlier token of its key
        const int e = c + lane;
        const int key = e < m ? keys[e] : -1;
        int after;
        const int before = same_key_lanes(key, lane, &after);
        const int at = key >= 0 ? start[key] + before : 0;
        sub_group_barrier(CLK_LOCAL_MEM_FENCE);
        if (key >= 0) {
            order[at] = e;
            if (after == 0) start[key] = at + 1;
        }
        sub_group_barrier(CLK_LOCAL_MEM_FENCE);
    }
}
