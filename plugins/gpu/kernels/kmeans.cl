// ClusterKV's clustering of a run of slots (ov_kvcrush/methods/clusterkv.py: cluster_tokens and
// kmeans_cosine; plugins/cpu/src/kmeans.cpp) for Intel GPUs, in one launch per layer: one
// work-group per KV head reads the run's keys from the pool, draws the seeded initial picks,
// runs cosine k-means to convergence or the cap, and adds its clusters to the head's cluster
// index in place (centroids, sizes, offsets, the slots sorted by label), so that nothing crosses
// to the host and no step waits for it.
//
// The index lies in an arena of int32 words, part after part, each part's heads one after
// another (ov_kvcrush/gpu/clusterkv.py: IndexRun): centroids [room][HEAD_DIM] floats, sizes
// [room], offsets [room + 1], sorted slots [slot room]. Where a clustering outgrows its run, the
// host takes a larger one and this launch first moves the index held into it.
//
// Compile-time constants (-D): KV_PRECISION, BLOCK_SIZE, HEAD_DIM (the pool's), LANES (the
// work-group's size, a power of two). Global (LANES, kv_heads), local (LANES, 1).

#include "paged_block.h"

#define D HEAD_DIM

// Where one index lies: each part's first word (head 0) and the words from one head to the next.
typedef struct {
    int at[4];
    int stride[4];
} IndexRun;

// SplitMix64's output function (methods/clusterkv.py: _splitmix64).
inline ulong splitmix64(ulong z) {
    z += 0x9E3779B97F4A7C15UL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9UL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBUL;
    return z ^ (z >> 31);
}

// The held index of head r moved from run `from` to run `to` (its first `clusters` clusters and
// `slots` sorted slots; nothing where the run is the same).
inline void move_index(__global int* words, IndexRun from, IndexRun to, int r, int clusters, int slots) {
    if (from.at[0] == to.at[0]) return;
    const int lane = get_local_id(0);
    const int counts[4] = {clusters * D, clusters, clusters + 1, slots};
    for (int p = 0; p < 4; ++p) {
        __global const int* src = words + from.at[p] + (long)r * from.stride[p];
        __global int* dst = words + to.at[p] + (long)r * to.stride[p];
        for (int j = lane; j < counts[p]; j += LANES) dst[j] = src[j];
    }
}

// xn[i] = key i / max(|key i|, 1e-12) (F.normalize) for the run's n slots; labels to -1.
inline void normalize_keys(__global const uchar* pool, __global const int* table, int first, int n,
                           __global float* xn, __global int* labels) {
    for (int i = get_local_id(0); i < n; i += LANES) {
        float sq = 0.0f;
        for (int d = 0; d < D; ++d) {
            const float x = slot_key(pool, table, first + i, d);
            sq = fma(x, x, sq);
        }
        const float norm = fmax(sqrt(sq), 1e-12f);
        for (int d = 0; d < D; ++d) xn[(long)i * D + d] = slot_key(pool, table, first + i, d) / norm;
        labels[i] = -1;
    }
}

// The initial directions: xn of the first k of the head's seeded order (init_order: item i's key
// splitmix64(splitmix64(seed * 2^32 + r) + i), ascending, ties to the lower item), drawn as k
// rounds of the least (key, item) above the last one drawn.
inline void draw_picks(__global const float* xn, int n, int k, uint seed, int r, __global float* directions,
                       __local ulong* keys, __local int* items) {
    const int lane = get_local_id(0);
    const ulong base = splitmix64(((ulong)seed << 32) + (ulong)r);
    ulong last_key = 0;
    int last_item = -1;
    for (int c = 0; c < k; ++c) {
        ulong best_key = ULONG_MAX;
        int best = -1;
        for (int i = lane; i < n; i += LANES) {
            const ulong key = splitmix64(base + (ulong)i);
            const bool above = last_item < 0 || key > last_key || (key == last_key && i > last_item);
            if (above && (best < 0 || key < best_key || (key == best_key && i < best))) {
                best_key = key;
                best = i;
            }
        }
        keys[lane] = best_key;
        items[lane] = best;
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int span = LANES / 2; span > 0; span /= 2) {
            if (lane < span) {
                const ulong ok = keys[lane + span];
                const int oi = items[lane + span];
                if (oi >= 0 && (items[lane] < 0 || ok < keys[lane] || (ok == keys[lane] && oi < items[lane]))) {
                    keys[lane] = ok;
                    items[lane] = oi;
                }
            }
            barrier(CLK_LOCAL_MEM_FENCE);
        }
        last_key = keys[0];
        last_item = items[0];
        for (int d = lane; d < D; d += LANES) directions[(long)c * D + d] = xn[(long)last_item * D + d];
        barrier(CLK_LOCAL_MEM_FENCE | CLK_GLOBAL_MEM_FENCE);
    }
}

// Each vector's label: the direction of largest cosine, the first on ties; *moved set when one
// moved.
inline void assign_nearest(__global const float* xn, int n, __global const float* directions, int k,
                           __global int* labels, __local int* moved) {
    for (int i = get_local_id(0); i < n; i += LANES) {
        int best = 0;
        float top = -INFINITY;
        for (int c = 0; c < k; ++c) {
            float s = 0.0f;
            for (int d = 0; d < D; ++d) s = fma(xn[(long)i * D + d], directions[(long)c * D + d], s);
            if (s > top) {
                top = s;
                best = c;
            }
        }
        if (labels[i] != best) {
            labels[i] = best;
            *moved = 1;
        }
    }
}

// Each direction moved to its members' normalised sum, added in token order (an empty cluster
// keeps its direction); sums [k][D] is scratch. A lane per dimension scans the tokens once, so a
// step costs n * D additions, not k times that.
inline void move_directions(__global const float* xn, int n, __global const int* labels, int k,
                            __global float* sums, __global float* directions) {
    for (int d = get_local_id(0); d < D; d += LANES) {
        for (int c = 0; c < k; ++c) sums[c * D + d] = 0.0f;
        for (int i = 0; i < n; ++i) sums[labels[i] * D + d] += xn[(long)i * D + d];
    }
    barrier(CLK_GLOBAL_MEM_FENCE);
    for (int e = get_local_id(0); e < k * D; e += LANES) {
        const int c = e / D;
        float sq = 0.0f;
        for (int d = 0; d < D; ++d) sq = fma(sums[c * D + d], sums[c * D + d], sq);
        const float norm = sqrt(sq);
        if (norm > 0.0f) directions[e] = sums[e] / fmax(norm, 1e-30f);
    }
    barrier(CLK_GLOBAL_MEM_FENCE);
}

// The new clusters into the index: centroids (the members' plain mean of the keys), sizes,
// offsets from the slots held on, and the run's slots sorted by label (ties by slot).
inline void add_clusters(__global const uchar* pool, __global const int* table, int first, int n,
                         __global const int* labels, int k, __global float* centroids, __global int* sizes,
                         __global int* offsets, __global int* sorted, int held_slots) {
    const int lane = get_local_id(0);
    for (int d = lane; d < D; d += LANES) {
        for (int c = 0; c < k; ++c) centroids[c * D + d] = 0.0f;
        if (d == 0)
            for (int c = 0; c < k; ++c) sizes[c] = 0;
        for (int i = 0; i < n; ++i) {
            centroids[labels[i] * D + d] += slot_key(pool, table, first + i, d);
            if (d == 0) ++sizes[labels[i]];
        }
    }
    barrier(CLK_GLOBAL_MEM_FENCE);
    for (int e = lane; e < k * D; e += LANES) centroids[e] /= (float)max(sizes[e / D], 1);
    barrier(CLK_GLOBAL_MEM_FENCE);
    if (lane == 0) {
        int at = held_slots;
        offsets[0] = at;
        for (int c = 0; c < k; ++c) offsets[c + 1] = at += sizes[c];
    }
    barrier(CLK_GLOBAL_MEM_FENCE);
    for (int c = lane; c < k; c += LANES) {
        int at = offsets[c] - held_slots;
        for (int i = 0; i < n; ++i)
            if (labels[i] == c) sorted[at++] = first + i;
    }
}

// A run's parts' first words and head strides, as scalar arguments (every host passes scalars).
#define RUN_ARGS(p) int p##_c, int p##_s, int p##_o, int p##_t, int p##_cs, int p##_ss, int p##_os, int p##_ts
#define RUN(p) {{p##_c, p##_s, p##_o, p##_t}, {p##_cs, p##_ss, p##_os, p##_ts}}

// KV head r's slots [first, first + n) (its block table `table`) clustered into k clusters added
// to its index (held: `clusters` clusters over `slots` slots, in run `from`; written in run `to`):
// the work-group's lanes; xn [n + 2k][D] floats and labels [n] its scratch; *iterations its
// iteration count. keys, items and moved: the kernel's local memory.
inline void cluster_head(__global const uchar* pool, __global const int* table, int first, int n, int k, uint seed,
                         int max_iters, __global float* xn, __global int* head_labels, __global int* index,
                         IndexRun from, IndexRun to, int clusters, int slots, int r, __local ulong* keys,
                         __local int* items, __local int* moved, __global int* iterations) {
    const int lane = get_local_id(0);
    __global float* directions = xn + (long)n * D;
    __global float* sums = directions + (long)k * D;
    move_index(index, from, to, r, clusters, slots);
    normalize_keys(pool, table, first, n, xn, head_labels);  // (the moved words are not read below)
    barrier(CLK_GLOBAL_MEM_FENCE);
    draw_picks(xn, n, k, seed, r, directions, keys, items);
    int it = 0;
    while (it < max_iters) {
        ++it;
        if (lane == 0) *moved = 0;
        barrier(CLK_LOCAL_MEM_FENCE);
        assign_nearest(xn, n, directions, k, head_labels, moved);
        barrier(CLK_LOCAL_MEM_FENCE | CLK_GLOBAL_MEM_FENCE);
        if (!*moved) break;
        move_directions(xn, n, head_labels, k, sums, directions);
    }
    __global float* words = (__global float*)index;
    add_clusters(pool, table, first, n, head_labels, k, words + to.at[0] + (long)r * to.stride[0] + (long)clusters * D,
                 index + to.at[1] + (long)r * to.stride[1] + clusters, index + to.at[2] + (long)r * to.stride[2] + clusters,
                 index + to.at[3] + (long)r * to.stride[3] + slots, slots);
    if (lane == 0) *iterations = it;
}

// A run's parts' first words and head strides, as scalar arguments (every host passes scalars).
#define RUN_ARGS(p) int p##_c, int p##_s, int p##_o, int p##_t, int p##_cs, int p##_ss, int p##_os, int p##_ts
#define RUN(p) {{p##_c, p##_s, p##_o, p##_t}, {p##_cs, p##_ss, p##_os, p##_ts}}

// Slots [first, first + n) of each KV head clustered into k clusters added to its index (held:
// `clusters` clusters over `slots` slots, in run `from`; written in run `to`). scratch: [kv][n +
// 2k][D] floats, labels [kv][n]; iterations[r] gets the head's iteration count.
__kernel void cluster_slots(__global const uchar* pool, __global const int* tables, int table_stride, int first,
                            int n, int k, uint seed, int max_iters, __global float* scratch, __global int* labels,
                            __global int* index, RUN_ARGS(from), RUN_ARGS(to), int clusters, int slots,
                            __global int* iterations) {
    __local ulong keys[LANES];
    __local int items[LANES];
    __local int moved;
    const int r = get_group_id(1);
    const IndexRun from = RUN(from), to = RUN(to);
    cluster_head(pool, tables + (long)r * table_stride, first, n, k, seed, max_iters,
                 scratch + (long)r * (n + 2 * k) * D, labels + (long)r * n, index, from, to, clusters, slots, r, keys,
                 items, &moved, iterations + r);
}

// A decode step's clusterings of the step's sequences in one launch (ov_kvcrush/gpu/clusterkv.py:
// launch_step_clusterings): each row of `work` (C_* ints), one a clustering sequence, says which
// sequence, its run of slots, its seed, its index's runs and where its scratch and labels lie;
// its KV heads' block tables are the step's (`tables`: the layer's rows from table_first, a row
// per (sequence, KV head)). iterations [sequences][kv]. Global (LANES, kv_heads, clusterings),
// local (LANES, 1, 1).
#define C_FIRST 0
#define C_N 1
#define C_K 2
#define C_SEED 3       // the seed's 32 bits
#define C_MAX_ITERS 4
#define C_CLUSTERS 5
#define C_SLOTS 6
#define C_FROM 7       // 8 ints: the held run's parts' first words, then their head strides
#define C_TO 15        // 8 ints: the run written
#define C_SCRATCH 23   // the sequence's scratch (floats) and labels: their first words
#define C_LABELS 24
#define C_SEQUENCE 25  // the sequence's place among the step's
#define C_FIELDS 26
__kernel void step_cluster_slots(__global const uchar* pool, __global const int* tables, int table_first,
                                 int table_stride, __global const int* work, __global float* scratch,
                                 __global int* labels, __global int* index, __global int* iterations) {
    __local ulong keys[LANES];
    __local int items[LANES];
    __local int moved;
    const int r = get_group_id(1), kv_heads = get_num_groups(1);
    __global const int* w = work + get_group_id(2) * C_FIELDS;
    const int n = w[C_N], k = w[C_K], s = w[C_SEQUENCE];
    IndexRun from, to;
    for (int p = 0; p < 4; ++p) {
        from.at[p] = w[C_FROM + p];
        from.stride[p] = w[C_FROM + 4 + p];
        to.at[p] = w[C_TO + p];
        to.stride[p] = w[C_TO + 4 + p];
    }
    __global const int* table = tables + (long)(table_first + s * kv_heads + r) * table_stride;
    cluster_head(pool, table, w[C_FIRST], n, k, (uint)w[C_SEED], w[C_MAX_ITERS],
                 scratch + w[C_SCRATCH] + (long)r * (n + 2 * k) * D, labels + w[C_LABELS] + (long)r * n, index, from,
                 to, w[C_CLUSTERS], w[C_SLOTS], r, keys, items, &moved, iterations + s * kv_heads + r);
}
