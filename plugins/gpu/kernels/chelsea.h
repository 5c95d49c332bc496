// Chelsea's merge of one cache row (one sequence's KV head in one layer) on the device, by one
// sub-group: ov_kvcrush/methods/chelsea.py's chelsea_compress step for step, as the CPU op's
// plugins/cpu/src/chelsea.cpp ports it (compress, merge_down, merge_pass). Shared by the hosts'
// kernel (chelsea.cl: a prompt merged after it was attended) and the GPU plugin's merge layer
// (plugin_layers.cl: a decode step merged after its token is stored, before it is attended).
//
// The row's n slots: the first `sinks` and last `recent` never merge; with protect, the middle
// slots of the `protect` highest scores (the prompt window's, summed over the query group; ties
// to the earlier) are kept out too. The others are merged in passes: in each, the merging slots'
// middle is cut into chunks, each A slot (even offset) linked to the most key-similar B slot
// (odd offset) of its chunk (cosine; the earlier on ties), the strongest links (the earlier on
// ties) chosen, and each chosen A folded into its B with the slots' degrees as weights. The
// merged keys and values are written back in place; then the kept slots move down in order, with
// their degrees and scores. The row holds `target` slots after it.
//
// Compile-time constants: paged_store.cl's (SG, KV_PRECISION, BLOCK_SIZE, HEAD_DIM).
#ifndef OVKC_CHELSEA_H
#define OVKC_CHELSEA_H

#include "paged_store.h"

// A row's `merge` (ov_kvcrush/gpu/plugin_layers.py: MERGE_FIELDS): the slots held before the
// merge, the step's among them (0: the row does not merge now), the slots after it, the words in
// `index` where the row's degrees and scores start (-1: none: every degree 1, no protect), the
// slots those hold, the word in `scratch` where its working words start (merge_scratch_words), and
// the method's settings (chelsea.py: op_fields).
#define MERGE_WIDTH 14
#define M_HELD 0
#define M_TARGET 1
#define M_DEGREES 2
#define M_SCORES 3
#define M_CAPACITY 4
#define M_SCRATCH 5
#define M_SINKS 6
#define M_RECENT 7
#define M_CHUNK 8
#define M_PROTECT 9
#define M_RATIO 10
#define M_DECAY 11
#define M_DECAY_STEPS 12
#define M_VALUE_AWARE 13

// the dims a lane holds of a vector spread over the sub-group (lane l: l, l + SG, ...)
#define PER_LANE ((HEAD_DIM + SG - 1) / SG)

#if KV_PRECISION == 0
typedef uint kv_elem;
#elif KV_PRECISION == 1
typedef ushort kv_elem;
#else
typedef uchar kv_elem;
#endif

inline __global uchar* slot_block(__global uchar* pool, __global const int* table, int j) {
    return pool + (ulong)table[j / BLOCK_SIZE] * BLOCK_BYTES;
}

// chelsea.py's pass_cap: the links one pass may merge under the paper's schedule (ratio 0: any)
inline int pass_cap(int middle, int passes, __global const int* m) {
    if (!m[M_RATIO]) return middle;
    const long r = m[M_RATIO] - (long)m[M_DECAY] * min(m[M_DECAY_STEPS], passes);
    return max(1, (int)(r * middle / 10000));
}

// 1 / max(|x|, 1e-12) of slot j's key (value: `value`), summed over d in order (normalize_rows)
inline float inverse_norm(__global uchar* pool, __global const int* table, int j, bool value) {
    __global const uchar* b = slot_block(pool, table, j);
    float ss = 0.0f;
    for (int d = 0; d < HEAD_DIM; ++d) {
        const float x = value ? load_value(b, j % BLOCK_SIZE, d) : load_key(b, d, j % BLOCK_SIZE);
        ss += x * x;
    }
    return 1.0f / fmax(sqrt(ss), 1e-12f);
}

// The cosine of slots a and b's keys (value: values) from their inverse norms, the normalized
// products summed over d in order (chelsea.cpp's similarities)
inline float cosine(__global uchar* pool, __global const int* table, int a, float ia, int b, float ib, bool value) {
    __global const uchar* ba = slot_block(pool, table, a);
    __global const uchar* bb = slot_block(pool, table, b);
    float s = 0.0f;
    for (int d = 0; d < HEAD_DIM; ++d) {
        const float xa = value ? load_value(ba, a % BLOCK_SIZE, d) : load_key(ba, d, a % BLOCK_SIZE);
        const float xb = value ? load_value(bb, b % BLOCK_SIZE, d) : load_key(bb, d, b % BLOCK_SIZE);
        s = fma(xa * ia, xb * ib, s);
    }
    return s;
}

// Slot j's key and value (the lane's dims) written in the store's precision, one sub-group.
inline void store_vectors(__global uchar* pool, __global const int* table, int j, const float* k, const float* v) {
    const int lane = get_sub_group_local_id();
    __global uchar* block = slot_block(pool, table, j);
    const int s = j % BLOCK_SIZE, vat = BLOCK_SIZE * HEAD_DIM + s * HEAD_DIM;
#if KV_PRECISION == 2
    float klo = INFINITY, khi = -INFINITY, vlo = INFINITY, vhi = -INFINITY;
    for (int i = 0; i < PER_LANE; ++i)
        if (lane + i * SG < HEAD_DIM) {
            klo = fmin(klo, k[i]);
            khi = fmax(khi, k[i]);
            vlo = fmin(vlo, v[i]);
            vhi = fmax(vhi, v[i]);
        }
    klo = sub_group_reduce_min(klo);
    vlo = sub_group_reduce_min(vlo);
    const float2 kp = (float2)(klo, (sub_group_reduce_max(khi) - klo) / 255.0f);
    const float2 vp = (float2)(vlo, (sub_group_reduce_max(vhi) - vlo) / 255.0f);
#endif
    for (int i = 0; i < PER_LANE; ++i) {
        const int d = lane + i * SG;
        if (d >= HEAD_DIM) break;
#if KV_PRECISION == 0
        ((__global float*)block)[d * BLOCK_SIZE + s] = k[i];
        ((__global float*)block)[vat + d] = v[i];
#elif KV_PRECISION == 1
        vstore_half_rte(k[i], d * BLOCK_SIZE + s, (__global half*)block);
        vstore_half_rte(v[i], vat + d, (__global half*)block);
#else
        block[d * BLOCK_SIZE + s] = u8_code(k[i], kp);
        block[vat + d] = u8_code(v[i], vp);
#endif
    }
#if KV_PRECISION == 2
    if (lane == 0) {
        __global float* p = (__global float*)(block + KV_BYTES);
        p[s] = kp.x;
        p[BLOCK_SIZE + s] = kp.y;
        p[2 * BLOCK_SIZE + s] = vp.x;
        p[3 * BLOCK_SIZE + s] = vp.y;
    }
#endif
}

// The merging slots (alive 1), in order, into `list`; returns their count. The whole sub-group.
inline int list_merging(__global const int* alive, int n, __global int* list) {
    const int lane = get_sub_group_local_id();
    int base = 0;
    for (int i0 = 0; i0 < n; i0 += SG) {
        const int i = i0 + lane;
        const int f = i < n && alive[i] == 1;
        const int at = base + sub_group_scan_exclusive_add(f);
        if (f) list[at] = i;
        base += sub_group_reduce_add(f);
    }
    barrier(CLK_GLOBAL_MEM_FENCE);
    return base;
}

// One matching pass over the middle [lo, lo + mid) of the `count` merging slots listed (merge_pass):
// every A linked, `want` links at most chosen, each chosen A folded into its B. Returns the merges.
inline int merge_pass(__global uchar* pool, __global const int* table, __global const int* mv, __global int* alive,
                      __global const int* list, int lo, int mid, int want, __global float* wdeg, __global float* inv,
                      __global int* link_b, __global float* link_s, __global int* chosen) {
    const int lane = get_sub_group_local_id(), chunk = mv[M_CHUNK];
    const bool value_aware = mv[M_VALUE_AWARE];
    const int links = (mid + 1) / 2;  // the A slots: even offsets (chunks are even-sized)
    const int usable = links - (mid % chunk == 1);  // a last chunk of one slot has no B
    const int count = min(want, usable);
    if (count <= 0) return 0;
    for (int i = lane; i < mid; i += SG) inv[i] = inverse_norm(pool, table, list[lo + i], false);
    barrier(CLK_GLOBAL_MEM_FENCE);
    for (int l = lane; l < links; l += SG) {  // link l: A at offset 2l, its best B of the chunk
        const int a = 2 * l, c0 = a / chunk * chunk, nb = (min(c0 + chunk, mid) - c0) / 2;
        int best = -1;
        float s = -INFINITY;
        for (int j = 0; j < nb; ++j) {
            const int b = c0 + 1 + 2 * j;
            const float x = cosine(pool, table, list[lo + a], inv[a], list[lo + b], inv[b], false);
            if (best < 0 || x > s) {
                best = b;
                s = x;
            }
        }
        if (best >= 0 && value_aware) {
            const int sa = list[lo + a], sb = list[lo + best];
            const float ia = inverse_norm(pool, table, sa, true), ib = inverse_norm(pool, table, sb, true);
            s = fmin(s, cosine(pool, table, sa, ia, sb, ib, true));
        }
        link_b[l] = best;
        link_s[l] = s;
    }
    barrier(CLK_GLOBAL_MEM_FENCE);
    for (int l = lane; l < links; l += SG) {  // the `count` strongest, ties to the earlier link
        const float s = link_s[l];
        int rank = 0;
        for (int f = 0; f < links; ++f) rank += link_s[f] > s || (link_s[f] == s && f < l);
        chosen[l] = rank < count;
    }
    barrier(CLK_GLOBAL_MEM_FENCE);
    // every middle slot that stays: (its k * w plus each chosen A's, in order) / the summed degree
    for (int i = 0; i < mid; ++i) {
        const int slot = list[lo + i];
        if (i % 2 == 0 && chosen[i / 2]) {  // an A merged away
            if (lane == 0) alive[slot] = 0;
            continue;
        }
        const float w = wdeg[slot];
        float k[PER_LANE], v[PER_LANE], total = w;
        __global const uchar* b = slot_block(pool, table, slot);
        for (int q = 0; q < PER_LANE; ++q) {
            const int d = min(lane + q * SG, HEAD_DIM - 1);
            k[q] = load_key(b, d, slot % BLOCK_SIZE) * w;
            v[q] = load_value(b, slot % BLOCK_SIZE, d) * w;
        }
        if (i % 2) {
            const int c0 = i / chunk * chunk, c1 = min(c0 + chunk, mid);
            for (int a = c0; a < c1; a += 2) {
                if (!chosen[a / 2] || link_b[a / 2] != i) continue;
                const int sa = list[lo + a];
                const float wa = wdeg[sa];
                __global const uchar* ba = slot_block(pool, table, sa);
                for (int q = 0; q < PER_LANE; ++q) {
                    const int d = min(lane + q * SG, HEAD_DIM - 1);
                    const float ka = load_key(ba, d, sa % BLOCK_SIZE) * wa;
                    const float va = load_value(ba, sa % BLOCK_SIZE, d) * wa;
                    k[q] += ka;
                    v[q] += va;
                }
                total += wa;
            }
        }
        for (int q = 0; q < PER_LANE; ++q) {
            k[q] /= total;
            v[q] /= total;
        }
        store_vectors(pool, (__global const int*)table, slot, k, v);
        sub_group_barrier(CLK_GLOBAL_MEM_FENCE);
        if (lane == 0) wdeg[slot] = total;
    }
    barrier(CLK_GLOBAL_MEM_FENCE);
    return count;
}

// Slot `from`'s element e (its key's HEAD_DIM, its value's HEAD_DIM, then the u8 store's four
// parameters) as raw bits
inline uint slot_element(__global const uchar* pool, __global const int* table, int from, int e) {
    __global const uchar* b = pool + (ulong)table[from / BLOCK_SIZE] * BLOCK_BYTES;
    const int s = from % BLOCK_SIZE;
    if (e < HEAD_DIM) return ((__global const kv_elem*)b)[e * BLOCK_SIZE + s];
    if (e < 2 * HEAD_DIM) return ((__global const kv_elem*)b)[BLOCK_SIZE * HEAD_DIM + s * HEAD_DIM + e - HEAD_DIM];
    return ((__global const uint*)(b + KV_BYTES))[(e - 2 * HEAD_DIM) * BLOCK_SIZE + s];
}

inline void set_slot_element(__global uchar* pool, __global const int* table, int to, int e, uint x) {
    __global uchar* b = pool + (ulong)table[to / BLOCK_SIZE] * BLOCK_BYTES;
    const int s = to % BLOCK_SIZE;
    if (e < HEAD_DIM)
        ((__global kv_elem*)b)[e * BLOCK_SIZE + s] = (kv_elem)x;
    else if (e < 2 * HEAD_DIM)
        ((__global kv_elem*)b)[BLOCK_SIZE * HEAD_DIM + s * HEAD_DIM + e - HEAD_DIM] = (kv_elem)x;
    else
        ((__global uint*)(b + KV_BYTES))[(e - 2 * HEAD_DIM) * BLOCK_SIZE + s] = x;
}

// The kept slots (alive) moved down in order, their degrees and scores into `degrees`, `scores`
// (where given) and past them 1 and 0 up to `capacity`. A lane a slot, SG slots at a time; each
// element is read by every lane before any writes it (a slot moves to one before it, maybe one
// another lane of its group reads).
inline void compact(__global uchar* pool, __global const int* table, int n, __global const int* alive,
                    __global const float* wdeg, __global const float* sums, __global float* degrees,
                    __global float* scores, int capacity) {
    const int lane = get_sub_group_local_id();
    const int elements = 2 * HEAD_DIM + (KV_PRECISION == 2 ? 4 : 0);
    int base = 0;
    for (int i0 = 0; i0 < n; i0 += SG) {
        const int i = i0 + lane;
        const int keep = i < n && alive[i];
        const int to = base + sub_group_scan_exclusive_add(keep);
        const bool moves = keep && to != i;
        for (int e = 0; e < elements; ++e) {
            const uint x = moves ? slot_element(pool, table, i, e) : 0;
            sub_group_barrier(CLK_GLOBAL_MEM_FENCE);
            if (moves) set_slot_element(pool, table, to, e, x);
        }
        if (keep && degrees) degrees[to] = wdeg[i];
        if (keep && scores) scores[to] = sums[i];
        base += sub_group_reduce_add(keep);
        sub_group_barrier(CLK_GLOBAL_MEM_FENCE);
    }
    for (int i = base + lane; i < capacity; i += SG) {
        if (degrees) degrees[i] = 1.0f;
        if (scores) scores[i] = 0.0f;
    }
}

// The words a row of n slots works in (chelsea.py: merge_scratch_words): alive, the list, the
// degrees, the protect sums and the inverse norms by slot, then the links (b, strength, chosen).
#define MERGE_SCRATCH_WORDS(n) (7 * (n) + 8)

// Merge the row of `table` (mv: its MERGE_WIDTH fields, M_HELD > 0) down to M_TARGET slots:
// `degrees_in` its degrees (null: every one 1), `scores_in` its protect scores, the sum of
// `score_rows` rows `score_stride` apart (null: none); into `degrees` and `scores` (may be the
// inputs) up to M_CAPACITY. With M_TARGET at least M_HELD, nothing merges: the row's degrees and
// scores are only written. The whole sub-group (the work-group).
inline void merge_row(__global uchar* pool, __global const int* table, __global const int* mv,
                      __global const float* degrees_in, __global const float* scores_in, int score_rows,
                      long score_stride, __global float* degrees, __global float* scores, __global int* scratch) {
    const int lane = get_sub_group_local_id();
    const int n = mv[M_HELD], target = mv[M_TARGET], sinks = mv[M_SINKS], recent = mv[M_RECENT];
    __global int* alive = scratch;
    __global int* list = alive + n;
    __global float* wdeg = (__global float*)(list + n);
    __global float* sums = wdeg + n;
    __global float* inv = sums + n;
    __global int* link_b = (__global int*)(inv + n);
    __global float* link_s = (__global float*)(link_b + n / 2 + 1);
    __global int* chosen = (__global int*)(link_s + n / 2 + 1);
    for (int i = lane; i < n; i += SG) {
        alive[i] = 1;
        wdeg[i] = degrees_in ? degrees_in[i] : 1.0f;
        float s = 0.0f;
        if (scores_in) {  // the group's rows summed in order (selection.cpp: group_sums)
            s = scores_in[i];
            for (int g = 1; g < score_rows; ++g) s += scores_in[g * score_stride + i];
        }
        sums[i] = s;
    }
    barrier(CLK_GLOBAL_MEM_FENCE);
    if (n > target) {
        const int lo = sinks, hi = n - recent;
        const int p = scores_in ? max(0, min(min(mv[M_PROTECT], target - sinks - recent - 1), hi - lo)) : 0;
        for (int i = lo + lane; p && i < hi; i += SG) {  // the p best window scores stay out (ties: the earlier)
            const float s = sums[i];
            int rank = 0;
            for (int j = lo; j < hi; ++j) rank += sums[j] > s || (sums[j] == s && j < i);
            if (rank < p) alive[i] = 2;
        }
        barrier(CLK_GLOBAL_MEM_FENCE);
        for (int left = n - p, passes = 0; left > target - p; ++passes) {  // merge_down
            const int count = list_merging(alive, n, list), mid = count - sinks - recent;
            const int want = min(count - (target - p), pass_cap(mid, passes, mv));
            const int merged = merge_pass(pool, table, mv, alive, list, sinks, mid, want, wdeg, inv, link_b,
                                          link_s, chosen);
            if (!merged) break;  // not with target >= sinks + recent + 1: never loop forever
            left = count - merged;
        }
    }
    compact(pool, table, n, alive, wdeg, sums, degrees, scores, mv[M_CAPACITY]);
}

#endif  // OVKC_CHELSEA_H
