// KVCrush's selection (ov_kvcrush/methods/kvcrush.py; plugins/cpu/src/kvcrush.cpp) for Intel GPUs
// (OpenCL C), every step of the reference in one work-group a row (kvcrush_select; a decode step's
// selections anew of its sequences, step_kvcrush_drop). Every result (a head's decision, a packed
// signature, a Hamming distance, the bucketing order, a representative, the kept slots) is an
// integer and equals the reference's exactly.
//
// Scores are [H][n] (per query head, per token or per block for the block-wise form); the middle
// units are [sinks, sinks + mid). Signatures are packed as the reference packs them: head h is bit
// h % 32 of word h / 32, W = ceil(H / 32) words per unit.
//
// Compile-time constants (-D): SG (sub-group size).

// How many of s[0 .. mid) rank above s[i] (greater, or equal and earlier), counted up to `keep`.
inline int middle_rank(__global const float* s, int mid, int i, int keep) {
    const float x = s[i];
    int rank = 0;
    for (int j = 0; j < mid && rank < keep; ++j) rank += s[j] > x || (s[j] == x && j < i);
    return rank;
}

// Is middle item i among row h's `keep` highest, ties to the earlier item (the rank of score i is
// the count of scores above it, or equal and earlier): Quest's top pages (gpu/quest_cache.py).
// Global size (mid, rows). decisions [rows][mid].
__kernel void head_decisions_topk(__global const float* scores, int n, int lo, int mid, int keep,
                                  __global uchar* decisions) {
    const int i = get_global_id(0);
    const int h = get_global_id(1);
    if (i >= mid) return;
    decisions[(long)h * mid + i] = middle_rank(scores + (long)h * n + lo, mid, i, keep) < keep;
}

// An evictable unit's key under `nearest` with several anchors: (the nearest anchor's index, its
// distance), the lowest anchor on ties, as one integer.
inline int nearest_key(__global const int* d, int A, int H) {
    int best = 0;
    for (int a = 1; a < A; ++a)
        if (d[a] < d[best]) best = a;
    return best * (H + 1) + d[best];
}

// One unit per bucket: the m ordered units cut into `buckets` contiguous near-equal ranges
// [j * m / buckets, (j + 1) * m / buckets); bucket j's first unit, or (first == 0) its highest
// `score`, the first on ties. members[i] = evictable[order[i]].
inline int representative(__global const int* evictable, __global const int* order, int m, int buckets,
                          __global const float* score, int first, int j) {
    const int s = (int)((long)j * m / buckets), e = (int)((long)(j + 1) * m / buckets);
    int best = s;
    if (!first)
        for (int i = s + 1; i < e; ++i)
            if (score[evictable[order[i]]] > score[evictable[order[best]]]) best = i;
    return evictable[order[best]];
}

// ---- The whole selection of a row in one launch (kvcrush_select): every step of the reference, in
// its order, taken by the lanes of one work-group, each step's results in the row's scratch
// (global memory) behind a barrier. A decode step's selection anew (a block's worth of tokens
// come, or a token past the budget) is then one command a layer. The steps that order (the top-k
// ranks, the stable orders by flag and by bucket, the kept units listed) sort keys that carry the
// unit's index below its value (sort_keys: a bitonic network over the row's scratch), so their
// ties fall to the earlier unit as the reference's do, and a selection of any size is n log^2 n
// work in one launch (ranks counted unit by unit would be quadratic).
//
// `fields` (S_*, packed by gpu/kvcrush.py's SelectFields) says the sizes and where each step's
// results lie in a row's scratch (word offsets; scores as float bits). Row r (work-group (0, r))
// reads query heads r * S_HEADS .. of `scores` [Hq][score_stride], its anchors
// anchors[r][A][W], and lists its kept slots in kept[r][0 .. kept_count), ascending.
#define S_N 0             // slots held
#define S_BLOCK 1         // tokens a unit (1: token by token)
#define S_UNITS 2         // units selected over: the whole blocks (slots past them are kept)
#define S_SINKS 3         // in units, as the rest
#define S_RECENT 4
#define S_BUDGET 5        // units kept: the important ones and a representative a bucket
#define S_REPS 6          // buckets
#define S_HEADS 7         // query heads a row
#define S_TOPK 8          // the signature: 1 top-k, 0 threshold
#define S_NEAREST 9
#define S_FIRST 10        // the representative: 1 a bucket's first, 0 its highest score
#define S_A 11            // anchors
#define S_MEAN 12         // bit a: anchor a is the evictable units' majority
#define S_ROW_WORDS 13    // scratch words a row
#define S_SUMS 14         // [heads][units] the units' scores (floats)
#define S_COMBINED 15     // [units] summed over heads (floats)
#define S_MEANS 16        // [heads] the threshold signature's means (floats)
#define S_FLAGS 17        // [units] 1: important
#define S_BY_FLAG 18      // [units] evictable, then important, each in position order
#define S_SIGS 19         // [units][W]
#define S_ANCHOR_BITS 20  // [A][W]
#define S_DIST 21         // [m][A]
#define S_KEYS 22         // [m] the bucketing order between its sorts
#define S_ORDER 23        // [m]
#define S_REPS_AT 24      // [buckets]
#define S_KEPT 25         // [units] 1: a kept unit
#define S_SORT 26         // [heads or 1][P] keys (ulongs, an even word offset): P the units' power of two
#define S_FIELDS 27

// Sorts `count` arrays of P keys (keys[c * P ..], P a power of two) ascending, side by side, by
// the work-group's lanes: a bitonic network, a barrier after each of its stages. Every lane calls it.
inline void sort_keys(__global ulong* keys, int P, int count, int lid, int L) {
    const int pairs = P / 2;
    for (int k = 2; k <= P; k <<= 1)
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (long p = lid; p < (long)count * pairs; p += L) {
                const int q = (int)(p % pairs);
                const int i = ((q & ~(j - 1)) << 1) | (q & (j - 1));  // q with a 0 put in at bit j
                __global ulong* a = keys + (p / pairs) * P;
                const ulong x = a[i], y = a[i | j];
                if ((x > y) == ((i & k) == 0)) {
                    a[i] = y;
                    a[i | j] = x;
                }
            }
            barrier(CLK_GLOBAL_MEM_FENCE);
        }
}

// The sort key of unit i with score x, the higher scores first, ties to the earlier unit
// (middle_rank's order): the float's bits made to order as unsigned integers, inverted.
inline ulong score_key(float x, int i) {
    const uint u = as_uint(x == 0.0f ? 0.0f : x);  // -0 ties +0, as the comparison does
    const uint ordered = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((ulong)(~ordered) << 32) | (uint)i;
}

// The sort key of unit i with an integer value v >= 0, the lower first, ties to the earlier unit.
inline ulong value_key(int v, int i) { return ((ulong)(uint)v << 32) | (uint)i; }

// The unit a sorted key stands for.
inline int key_unit(ulong key) { return (int)(key & 0xffffffffu); }

// The power of two at or past n (the sorts' length).
inline int sort_length(int n) {
    int P = 1;
    while (P < n) P <<= 1;
    return P;
}

// Word w of middle unit u's threshold signature: head 32 w + b's decision (its score at least its
// mean over the middle) as bit b (pack_signatures' word).
inline uint threshold_word(__global const float* sums, __global const float* means, int units, int H, int u,
                           int w) {
    uint word = 0;
    for (int b = 0; b < 32 && 32 * w + b < H; ++b) {
        const int h = 32 * w + b;
        word |= (uint)(sums[h * units + u] >= means[h]) << b;
    }
    return word;
}

// Word w of a mean anchor: bit b set where at least half the m evictable units' signatures have it
// (majority_bits' bits, packed).
inline uint majority_word(__global const uint* sigs, int W, __global const int* evictable, int m, int H, int w) {
    uint word = 0;
    for (int b = 0; b < 32 && 32 * w + b < H; ++b) {
        int ones = 0;
        for (int e = 0; e < m; ++e) ones += (sigs[evictable[e] * W + w] >> b) & 1u;
        word |= (uint)(m > 0 && 2 * ones >= m) << b;
    }
    return word;
}

// The kept slots, ascending (block_mask's and kept_slots' work): a kept unit's tokens, then the
// partial block's, taken by the work-group's lanes (the kept units in position order: sorted by
// (not kept, unit)). Every lane calls it.
inline void list_kept(__global const int* unit_kept, int units, int block, int n, int kept_units,
                      __global ulong* sorted, __global int* out, int lid, int L) {
    const int whole = units * block, P = sort_length(units);
    for (int i = lid; i < P; i += L) sorted[i] = i < units ? value_key(!unit_kept[i], i) : ULONG_MAX;
    barrier(CLK_GLOBAL_MEM_FENCE);
    sort_keys(sorted, P, 1, lid, L);
    for (int i = lid; i < kept_units * block; i += L) out[i] = key_unit(sorted[i / block]) * block + i % block;
    for (int t = whole + lid; t < n; t += L) out[kept_units * block + t - whole] = t;
}

// The steps of one row's selection, each by the work-group's lanes (every lane calls each), over
// the row's scratch (`row`, its fields' offsets in `f`), a barrier after each. The counts, in units:
#define MIDDLE(f) (f[S_UNITS] - f[S_SINKS] - f[S_RECENT])
#define EVICTABLE(f) (f[S_UNITS] - (f[S_BUDGET] - f[S_REPS]))
#define FLOATS(field) ((__global float*)(row + f[field]))
#define SORTED ((__global ulong*)(row + f[S_SORT]))

// The units' scores [H][units] (a block's sum, token order; a token's own score), their sum over
// the heads, head 0 first, and (the threshold signature) each head's mean over the middle.
inline void unit_scores(__global const float* scores, int score_stride, __global const int* f, __global int* row,
                        int lid, int L) {
    const int block = f[S_BLOCK], units = f[S_UNITS], sinks = f[S_SINKS], H = f[S_HEADS], mid = MIDDLE(f);
    __global float *sums = FLOATS(S_SUMS), *combined = FLOATS(S_COMBINED), *means = FLOATS(S_MEANS);
    for (int i = lid; i < H * units; i += L) {
        const int h = i / units, u = i % units;
        float acc = 0.0f;
        for (int t = u * block; t < (u + 1) * block; ++t) acc += scores[(long)h * score_stride + t];
        sums[i] = acc;
    }
    barrier(CLK_GLOBAL_MEM_FENCE);
    for (int u = lid; u < units; u += L) {
        float acc = 0.0f;
        for (int h = 0; h < H; ++h) acc += sums[h * units + u];
        combined[u] = acc;
    }
    for (int h = lid; h < H && !f[S_TOPK]; h += L) {
        float acc = 0.0f;
        for (int i = 0; i < mid; ++i) acc += sums[h * units + sinks + i];
        means[h] = acc / (float)mid;
    }
    barrier(CLK_GLOBAL_MEM_FENCE);
}

// The important units (the sinks, the recent ones and the summed scores' top of the middle:
// flags), then the evictable units and the important ones, each in position order (by_flag).
inline void important_units(__global const int* f, __global int* row, int lid, int L) {
    const int units = f[S_UNITS], sinks = f[S_SINKS], mid = MIDDLE(f), P = sort_length(units);
    const int heavy = f[S_BUDGET] - f[S_REPS] - sinks - f[S_RECENT];
    __global const float* combined = FLOATS(S_COMBINED);
    __global int *flags = row + f[S_FLAGS], *by_flag = row + f[S_BY_FLAG];
    __global ulong* sorted = SORTED;
    for (int u = lid; u < units; u += L) flags[u] = u < sinks || u >= sinks + mid;
    for (int i = lid; i < P; i += L) sorted[i] = i < mid ? score_key(combined[sinks + i], i) : ULONG_MAX;
    barrier(CLK_GLOBAL_MEM_FENCE);
    sort_keys(sorted, P, 1, lid, L);
    for (int p = lid; p < min(heavy, mid); p += L) flags[sinks + key_unit(sorted[p])] = 1;
    barrier(CLK_GLOBAL_MEM_FENCE);
    for (int i = lid; i < P; i += L) sorted[i] = i < units ? value_key(flags[i], i) : ULONG_MAX;
    barrier(CLK_GLOBAL_MEM_FENCE);
    sort_keys(sorted, P, 1, lid, L);
    for (int p = lid; p < units; p += L) by_flag[p] = key_unit(sorted[p]);
    barrier(CLK_GLOBAL_MEM_FENCE);
}

// Each unit's signature, a bit a head (sinks and recent units: 0): `topk`, the head keeps the unit
// among its top `keep` of the middle (each head's middle sorted by its scores, side by side, its
// top's bits set); `threshold`, its score is at least the head's mean.
inline void head_signatures(__global const int* f, __global int* row, int lid, int L) {
    const int units = f[S_UNITS], sinks = f[S_SINKS], H = f[S_HEADS], W = (H + 31) / 32, mid = MIDDLE(f);
    const int top = min(f[S_BUDGET] - sinks - f[S_RECENT], mid), P = sort_length(units);
    __global const float *sums = FLOATS(S_SUMS), *means = FLOATS(S_MEANS);
    __global uint* sigs = (__global uint*)(row + f[S_SIGS]);
    __global ulong* sorted = SORTED;
    if (f[S_TOPK]) {
        for (int i = lid; i < units * W; i += L) sigs[i] = 0u;
        for (long i = lid; i < (long)H * P; i += L) {
            const int h = (int)(i / P), j = (int)(i % P);
            sorted[i] = j < mid ? score_key(sums[h * units + sinks + j], j) : ULONG_MAX;
        }
        barrier(CLK_GLOBAL_MEM_FENCE);
        sort_keys(sorted, P, H, lid, L);
        for (long i = lid; i < (long)H * top; i += L) {
            const int h = (int)(i / top), u = sinks + key_unit(sorted[(long)h * P + i % top]);
            atomic_or((volatile __global uint*)(sigs + u * W + h / 32), 1u << (h % 32));
        }
    } else {
        for (int u = lid; u < units; u += L) {
            const bool middle = u >= sinks && u < sinks + mid;
            for (int w = 0; w < W; ++w) sigs[u * W + w] = middle ? threshold_word(sums, means, units, H, u, w) : 0u;
        }
    }
    barrier(CLK_GLOBAL_MEM_FENCE);
}

// The anchors' bits (given, or the evictable units' majority bits) and each evictable unit's
// Hamming distance to each.
inline void anchor_distances(__global const int* f, __global const uint* anchors, __global int* row, int lid,
                             int L) {
    const int H = f[S_HEADS], A = f[S_A], W = (H + 31) / 32, m = EVICTABLE(f);
    __global const uint* sigs = (__global const uint*)(row + f[S_SIGS]);
    __global uint* bits = (__global uint*)(row + f[S_ANCHOR_BITS]);
    __global const int* by_flag = row + f[S_BY_FLAG];
    __global int* dist = row + f[S_DIST];
    for (int i = lid; i < A * W; i += L) {
        const bool mean = (f[S_MEAN] >> (i / W)) & 1;
        bits[i] = mean ? majority_word(sigs, W, by_flag, m, H, i % W) : anchors[i];
    }
    barrier(CLK_GLOBAL_MEM_FENCE);
    for (int i = lid; i < m * A; i += L) {
        const int e = i / A, a = i % A;
        int d = 0;
        for (int w = 0; w < W; ++w) d += popcount(sigs[by_flag[e] * W + w] ^ bits[a * W + w]);
        dist[i] = d;
    }
    barrier(CLK_GLOBAL_MEM_FENCE);
}

// The bucketing order: the evictable units by their distances' key, ties by position (the
// reference's bucket_order): stable sorts from the least significant digit (an anchor's distance
// under `tuple`; or the one nearest_key), each by (digit, place in the order so far), `keys`
// holding the new order between them.
inline void bucketing_order(__global const int* f, __global int* row, int lid, int L) {
    const int H = f[S_HEADS], A = f[S_A], m = EVICTABLE(f), P = sort_length(f[S_UNITS]);
    const bool one_key = f[S_NEAREST] && A > 1;
    __global const int* dist = row + f[S_DIST];
    __global int *keys = row + f[S_KEYS], *order = row + f[S_ORDER];
    __global ulong* sorted = SORTED;
    for (int e = lid; e < m; e += L) order[e] = e;
    barrier(CLK_GLOBAL_MEM_FENCE);
    for (int a = one_key ? 0 : A - 1; a >= 0; --a) {
        for (int i = lid; i < P; i += L) {
            __global const int* d = dist + (i < m ? order[i] : 0) * A;
            sorted[i] = i < m ? value_key(one_key ? nearest_key(d, A, H) : d[a], i) : ULONG_MAX;
        }
        barrier(CLK_GLOBAL_MEM_FENCE);
        sort_keys(sorted, P, 1, lid, L);
        for (int p = lid; p < m; p += L) keys[p] = order[key_unit(sorted[p])];
        barrier(CLK_GLOBAL_MEM_FENCE);
        for (int p = lid; p < m; p += L) order[p] = keys[p];
        barrier(CLK_GLOBAL_MEM_FENCE);
    }
}

// One representative a bucket, and the kept units: the important ones and the representatives.
inline void kept_units_of(__global const int* f, __global int* row, int lid, int L) {
    const int units = f[S_UNITS], m = EVICTABLE(f), buckets = min(f[S_REPS], m);
    __global const int *flags = row + f[S_FLAGS], *by_flag = row + f[S_BY_FLAG], *order = row + f[S_ORDER];
    __global int *reps = row + f[S_REPS_AT], *unit_kept = row + f[S_KEPT];
    for (int j = lid; j < buckets; j += L)
        reps[j] = representative(by_flag, order, m, buckets, FLOATS(S_COMBINED), f[S_FIRST], j);
    for (int u = lid; u < units; u += L) unit_kept[u] = flags[u];
    barrier(CLK_GLOBAL_MEM_FENCE);
    for (int j = lid; j < buckets; j += L) unit_kept[reps[j]] = 1;
    barrier(CLK_GLOBAL_MEM_FENCE);
}

// Every step of one row's selection: its query heads' `scores` (rows score_stride apart) and its
// anchors (`anchors` [A][W]) in, each step's results in its scratch (`row`), the kept units' flags
// last (S_KEPT). Every lane of the work-group calls it.
inline void select_units(__global const float* scores, int score_stride, __global const int* f,
                         __global const uint* anchors, __global int* row, int lid, int L) {
    unit_scores(scores, score_stride, f, row, lid, L);
    important_units(f, row, lid, L);
    head_signatures(f, row, lid, L);
    anchor_distances(f, anchors, row, lid, L);
    bucketing_order(f, row, lid, L);
    kept_units_of(f, row, lid, L);
}

// The number of units a row keeps (select_units' kept units).
inline int kept_units(__global const int* f) { return f[S_UNITS] - EVICTABLE(f) + min(f[S_REPS], EVICTABLE(f)); }

__kernel void kvcrush_select(__global const float* scores, int score_stride, __global const int* f,
                             __global const uint* anchors, __global int* scratch, __global int* kept,
                             int kept_count) {
    const int r = get_group_id(1), lid = get_local_id(0), L = get_local_size(0);
    const int H = f[S_HEADS], A = f[S_A], W = (H + 31) / 32;
    __global int* row = scratch + (long)r * f[S_ROW_WORDS];
    select_units(scores + (long)r * H * score_stride, score_stride, f, anchors + (long)r * A * W, row, lid, L);
    list_kept(row + f[S_KEPT], f[S_UNITS], f[S_BLOCK], f[S_N], kept_units(f), (__global ulong*)(row + f[S_SORT]),
              kept + (long)r * kept_count, lid, L);
}

// A decode step's selections anew of the step's sequences in one launch (ov_kvcrush/gpu/step_work.py),
// each of which drops exactly one unit (token by token: a token past the budget; block-wise: a
// block's worth come past it): select_units over sequence s's row r, then the unit it does not
// keep, as its first slot, into dropped[s][kv] for the KV heads of the row (one row: every head;
// else row r is KV head r), which step_drop_slot (paged_store.cl) drops with the slots after it
// moved down. `fields` [sequences][field_stride]: a selection's S_* fields, then the scores' first
// word in `arena` (rows of query heads S_SCORE_STRIDE apart); S_N 0: no selection. Row r's
// scratch at scratch[(s * rows + r) * scratch_stride]. Global (lanes, rows, sequences), local
// (lanes, 1, 1).
#define S_SCORES_AT S_FIELDS        // the scores' first word in the arena
#define S_SCORE_STRIDE (S_FIELDS + 1)
__kernel void step_kvcrush_drop(__global int* arena, __global const int* fields, int field_stride,
                                __global const uint* anchors, __global int* scratch, int scratch_stride,
                                int kv_heads, __global int* dropped) {
    const int r = get_group_id(1), s = get_group_id(2), rows = get_num_groups(1);
    const int lid = get_local_id(0), L = get_local_size(0);
    __global const int* f = fields + (long)s * field_stride;
    if (f[S_N] == 0) return;  // the whole work-group: no barrier skipped by some lanes only
    const int H = f[S_HEADS], A = f[S_A], W = (H + 31) / 32, stride = f[S_SCORE_STRIDE];
    __global int* row = scratch + ((long)s * rows + r) * scratch_stride;
    __global const float* scores = (__global const float*)(arena + f[S_SCORES_AT]) + (long)r * H * stride;
    select_units(scores, stride, f, anchors + (long)r * A * W, row, lid, L);
    __global const int* unit_kept = row + f[S_KEPT];
    for (int u = lid; u < f[S_UNITS]; u += L) {
        if (unit_kept[u]) continue;
        for (int kv = rows == 1 ? 0 : r; kv < (rows == 1 ? kv_heads : r + 1); ++kv)
            dropped[s * kv_heads + kv] = u * f[S_BLOCK];
    }
}
