// KVCrush's selection steps (ov_kvcrush/methods/kvcrush.py; plugins/cpu/src/kvcrush.cpp), one
// kernel per step of the reference, for Intel GPUs (OpenCL C, Intel sub-groups). Every output is
// an integer (a head's decision, a packed signature, a Hamming distance, a bucketing order, a
// representative) and equals the reference's exactly.
//
// Scores are [H][n] (per query head, per token or per block for the block-wise form); the
// middle tokens are [lo, lo + mid). Signatures are packed as the reference packs them: head h is
// bit h % 32 of word h / 32, W = ceil(H / 32) words per token.
//
// The bucketing order itself is sort.cl's stable counting sort over bucket_keys' keys.
//
// Compile-time constants (-D): SG (sub-group size).

// How many of s[0 .. mid) rank above s[i] (greater, or equal and earlier), counted up to `keep`.
inline int middle_rank(__global const float* s, int mid, int i, int keep) {
    const float x = s[i];
    int rank = 0;
    for (int j = 0; j < mid && rank < keep; ++j) rank += s[j] > x || (s[j] == x && j < i);
    return rank;
}

// Of the items before item i, how many have the same value as it (a stable order's offset).
inline int same_before(__global const int* v, int i) {
    int c = 0;
    for (int j = 0; j < i; ++j) c += v[j] == v[i];
    return c;
}

inline int bucket_key_of(__global const int* d, int A, int H, int nearest) {
    if (nearest && A > 1) {
        int best = 0;
        for (int a = 1; a < A; ++a)
            if (d[a] < d[best]) best = a;
        return best * (H + 1) + d[best];
    }
    int key = 0;
    for (int a = 0; a < A; ++a) key = key * (H + 1) + d[a];
    return key;
}

// Would head h keep middle token i on its own: among its `keep` highest scores, ties to the
// earlier token (the rank of score i is the count of scores above it, or equal and earlier).
// Global size (mid, H). decisions [H][mid].
__kernel void head_decisions_topk(__global const float* scores, int n, int lo, int mid, int keep,
                                  __global uchar* decisions) {
    const int i = get_global_id(0);
    const int h = get_global_id(1);
    if (i >= mid) return;
    decisions[(long)h * mid + i] = middle_rank(scores + (long)h * n + lo, mid, i, keep) < keep;
}

// Would head h keep middle token i: its score is at least the head's mean over the middle. One
// sub-group per head: global size (SG, H), local (SG, 1).
__attribute__((intel_reqd_sub_group_size(SG)))
__kernel void head_decisions_threshold(__global const float* scores, int n, int lo, int mid,
                                       __global uchar* decisions) {
    const int h = get_global_id(1);
    const int lane = get_sub_group_local_id();
    __global const float* s = scores + (long)h * n + lo;
    float sum = 0.0f;
    for (int i = lane; i < mid; i += SG) sum += s[i];
    const float mean = sub_group_reduce_add(sum) / (float)mid;
    for (int i = lane; i < mid; i += SG) decisions[(long)h * mid + i] = s[i] >= mean;
}

// signatures[t][w] for every token t < n: bit h % 32 of word h / 32 is head h's decision (sinks
// and recent tokens, outside the middle, are 0). Global size (n).
__kernel void pack_signatures(__global const uchar* decisions, int H, int n, int lo, int mid,
                              __global uint* signatures) {
    const int t = get_global_id(0);
    if (t >= n) return;
    const int W = (H + 31) / 32;
    const bool middle = t >= lo && t < lo + mid;
    for (int w = 0; w < W; ++w) {
        uint word = 0;
        for (int b = 0; b < 32 && 32 * w + b < H; ++b)
            if (middle) word |= (uint)decisions[(long)(32 * w + b) * mid + (t - lo)] << b;
        signatures[(long)t * W + w] = word;
    }
}

// distances[e][a] = popcount(signature of token evictable[e] ^ anchor a), over W words.
// Global size (m, A).
__kernel void anchor_distances(__global const uint* signatures, int W, __global const int* evictable, int m,
                               __global const uint* anchors, __global int* distances) {
    const int e = get_global_id(0);
    const int a = get_global_id(1);
    if (e >= m) return;
    __global const uint* s = signatures + (long)evictable[e] * W;
    int d = 0;
    for (int w = 0; w < W; ++w) d += popcount(s[w] ^ anchors[a * W + w]);
    distances[(long)e * get_global_size(1) + a] = d;
}

// Each evictable token's bucketing key: one anchor or `tuple`, the distances as digits base
// H + 1 (lexicographic order); `nearest` with several anchors, (the nearest anchor's index, its
// distance), the lowest anchor on ties. Global size (m).
__kernel void bucket_keys(__global const int* distances, int m, int A, int H, int nearest, __global int* keys) {
    const int e = get_global_id(0);
    if (e >= m) return;
    keys[e] = bucket_key_of(distances + (long)e * A, A, H, nearest);
}

// One token per bucket: the m ordered tokens cut into `buckets` contiguous near-equal ranges
// [j * m / buckets, (j + 1) * m / buckets); bucket j's first token, or (first == 0) its highest
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

// representative() of every bucket. Global size (buckets).
__kernel void representatives(__global const int* evictable, __global const int* order, int m, int buckets,
                              __global const float* score, int first, __global int* reps) {
    const int j = get_global_id(0);
    if (j < buckets) reps[j] = representative(evictable, order, m, buckets, score, first, j);
}

// Block-wise scores: sums[h][b] = the sum of scores[h][t] over block b's tokens (the last block
// may be partial). Global size (blocks, H).
__kernel void block_sums(__global const float* scores, int n, int block, __global float* sums) {
    const int b = get_global_id(0);
    const int h = get_global_id(1);
    const int blocks = (n + block - 1) / block;
    if (b >= blocks) return;
    float acc = 0.0f;
    for (int t = b * block; t < min(n, (b + 1) * block); ++t) acc += scores[(long)h * n + t];
    sums[(long)h * blocks + b] = acc;
}

// The heads' scores summed per token, head 0 first (the reference's sum over heads): global (n).
__kernel void head_sums(__global const float* scores, int H, int n, __global float* combined) {
    const int t = get_global_id(0);
    if (t >= n) return;
    float acc = 0.0f;
    for (int h = 0; h < H; ++h) acc += scores[(long)h * n + t];
    combined[t] = acc;
}

// flags[t] = 1 for an important token: a sink (t < lo), a recent one (t >= lo + mid), or a middle
// token among the top (`top`, from head_decisions_topk over the summed scores). Global (n).
__kernel void important_flags(__global const uchar* top, int n, int lo, int mid, __global int* flags) {
    const int t = get_global_id(0);
    if (t >= n) return;
    flags[t] = t < lo || t >= lo + mid || top[t - lo];
}

// A mean anchor: bit h is set when at least half the evictable tokens' signatures have it.
// Global (H).
__kernel void majority_bits(__global const uint* signatures, int W, __global const int* evictable, int m,
                            __global uchar* bits) {
    const int h = get_global_id(0);
    int ones = 0;
    for (int e = 0; e < m; ++e) ones += (signatures[(long)evictable[e] * W + h / 32] >> (h % 32)) & 1u;
    bits[h] = m > 0 && 2 * ones >= m;
}

// mask[t] = 1 for the tokens KVCrush keeps: the important ones (flags, from important_flags) and
// the bucket representatives; what comes back to the host (a byte a token) and what the kept
// slots are listed from on the device (snapkv.cl's kept_slots). Global (n).
__kernel void kept_mask(__global const int* flags, int n, __global const int* reps, int buckets,
                        __global uchar* mask) {
    const int t = get_global_id(0);
    if (t >= n) return;
    int keep = flags[t];
    for (int j = 0; j < buckets && !keep; ++j) keep = reps[j] == t;
    mask[t] = (uchar)keep;
}

// Block-wise: mask[t] = blocks[t / block] (a kept block keeps its tokens) for the whole blocks'
// tokens (t < whole), 1 for the partial block being filled. Global (n).
__kernel void block_mask(__global const uchar* blocks, int block, int whole, int n, __global uchar* mask) {
    const int t = get_global_id(0);
    if (t >= n) return;
    mask[t] = t < whole ? blocks[t / block] : (uchar)1;
}

// ---- The whole selection of a row in one launch (kvcrush_select): every step above, in the same
// order and with the same arithmetic (but the threshold signature's mean, summed here in token
// order, there by a sub-group's lanes), taken by the lanes of one work-group, each step's results
// in the row's scratch (global memory) behind a barrier. A decode step's selection anew (a block's
// worth of tokens come, or a token past the budget) is then one command a layer, not twenty; the
// quadratic steps (the top-k ranks, the bucketing order) stay within one work-group, which is
// why a long prompt's selection takes the step kernels above (gpu/kvcrush.py chooses).
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
#define S_KEYS 22         // [m]
#define S_ORDER 23        // [m]
#define S_REPS_AT 24      // [buckets]
#define S_KEPT 25         // [units] 1: a kept unit
#define S_FIELDS 26

// Word w of middle unit u's signature: head 32 w + b's decision as bit b (pack_signatures' word).
inline uint signature_word(__global const float* sums, __global const float* means, int units, int H, int sinks,
                           int mid, int keep, int topk, int u, int w) {
    uint word = 0;
    for (int b = 0; b < 32 && 32 * w + b < H; ++b) {
        __global const float* s = sums + (32 * w + b) * units + sinks;
        const bool on = topk ? middle_rank(s, mid, u - sinks, keep) < keep : s[u - sinks] >= means[32 * w + b];
        word |= (uint)on << b;
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
// partial block's, taken by the work-group's lanes.
inline void list_kept(__global const int* unit_kept, int units, int block, int n, int kept_units, __global int* out,
                      int lid, int L) {
    const int whole = units * block;
    for (int u = lid; u < units; u += L) {
        if (!unit_kept[u]) continue;
        int at = 0;
        for (int j = 0; j < u; ++j) at += unit_kept[j];
        for (int t = 0; t < block; ++t) out[at * block + t] = u * block + t;
    }
    for (int t = whole + lid; t < n; t += L) out[kept_units * block + t - whole] = t;
}

// Every step of one row's selection, by the work-group's lanes: its query heads' `scores` (rows
// score_stride apart) and its anchors (`anchors` [A][W]) in, each step's results in its scratch
// (`row`), the kept units' flags last (S_KEPT). Every lane of the work-group calls it.
inline void select_units(__global const float* scores, int score_stride, __global const int* f,
                         __global const uint* anchors, __global int* row, int lid, int L) {
    const int block = f[S_BLOCK], units = f[S_UNITS], sinks = f[S_SINKS], recent = f[S_RECENT];
    const int budget = f[S_BUDGET], H = f[S_HEADS], A = f[S_A], W = (H + 31) / 32;
    const int mid = units - sinks - recent, m = units - (budget - f[S_REPS]);
    const int buckets = min(f[S_REPS], m);
    __global float* sums = (__global float*)(row + f[S_SUMS]);
    __global float* combined = (__global float*)(row + f[S_COMBINED]);
    __global float* means = (__global float*)(row + f[S_MEANS]);
    __global int *flags = row + f[S_FLAGS], *by_flag = row + f[S_BY_FLAG];
    __global uint* sigs = (__global uint*)(row + f[S_SIGS]);
    __global uint* bits = (__global uint*)(row + f[S_ANCHOR_BITS]);
    __global int *dist = row + f[S_DIST], *keys = row + f[S_KEYS], *order = row + f[S_ORDER];
    __global int *reps = row + f[S_REPS_AT], *unit_kept = row + f[S_KEPT];
    // the units' scores: a block's sum, token order (block_sums); a token's own score
    for (int i = lid; i < H * units; i += L) {
        const int h = i / units, u = i % units;
        float acc = 0.0f;
        for (int t = u * block; t < (u + 1) * block; ++t) acc += scores[(long)h * score_stride + t];
        sums[i] = acc;
    }
    barrier(CLK_GLOBAL_MEM_FENCE);
    for (int u = lid; u < units; u += L) {  // head_sums
        float acc = 0.0f;
        for (int h = 0; h < H; ++h) acc += sums[h * units + u];
        combined[u] = acc;
    }
    for (int h = lid; h < H && !f[S_TOPK]; h += L) {  // the threshold's means over the middle
        float acc = 0.0f;
        for (int i = 0; i < mid; ++i) acc += sums[h * units + sinks + i];
        means[h] = acc / (float)mid;
    }
    barrier(CLK_GLOBAL_MEM_FENCE);
    const int heavy = budget - f[S_REPS] - sinks - recent;
    for (int u = lid; u < units; u += L)  // important_flags over the summed scores' top
        flags[u] = u < sinks || u >= sinks + mid || middle_rank(combined + sinks, mid, u - sinks, heavy) < heavy;
    barrier(CLK_GLOBAL_MEM_FENCE);
    for (int u = lid; u < units; u += L) by_flag[(flags[u] ? m : 0) + same_before(flags, u)] = u;
    const int keep = budget - sinks - recent;  // a head's own decision: its top `keep` of the middle
    for (int u = lid; u < units; u += L) {  // pack_signatures (sinks and recent units: 0)
        const bool middle = u >= sinks && u < sinks + mid;
        for (int w = 0; w < W; ++w)
            sigs[u * W + w] = middle ? signature_word(sums, means, units, H, sinks, mid, keep, f[S_TOPK], u, w) : 0u;
    }
    barrier(CLK_GLOBAL_MEM_FENCE);
    for (int i = lid; i < A * W; i += L) {  // the anchors: given, or the evictable's majority bits
        const bool mean = (f[S_MEAN] >> (i / W)) & 1;
        bits[i] = mean ? majority_word(sigs, W, by_flag, m, H, i % W) : anchors[i];
    }
    barrier(CLK_GLOBAL_MEM_FENCE);
    for (int i = lid; i < m * A; i += L) {  // anchor_distances
        const int e = i / A, a = i % A;
        int d = 0;
        for (int w = 0; w < W; ++w) d += popcount(sigs[by_flag[e] * W + w] ^ bits[a * W + w]);
        dist[i] = d;
    }
    barrier(CLK_GLOBAL_MEM_FENCE);
    for (int e = lid; e < m; e += L) keys[e] = bucket_key_of(dist + e * A, A, H, f[S_NEAREST]);
    barrier(CLK_GLOBAL_MEM_FENCE);
    for (int e = lid; e < m; e += L) {  // the bucketing order: by key, ties by position
        int rank = same_before(keys, e);
        for (int j = 0; j < m; ++j) rank += keys[j] < keys[e];
        order[rank] = e;
    }
    barrier(CLK_GLOBAL_MEM_FENCE);
    for (int j = lid; j < buckets; j += L)  // representatives
        reps[j] = representative(by_flag, order, m, buckets, combined, f[S_FIRST], j);
    barrier(CLK_GLOBAL_MEM_FENCE);
    for (int u = lid; u < units; u += L) {  // kept_mask
        int on = flags[u];
        for (int j = 0; j < buckets && !on; ++j) on = reps[j] == u;
        unit_kept[u] = on;
    }
    barrier(CLK_GLOBAL_MEM_FENCE);
}

// The number of units a row keeps (select_units' kept units).
inline int kept_units(__global const int* f) {
    const int m = f[S_UNITS] - (f[S_BUDGET] - f[S_REPS]);
    return f[S_UNITS] - m + min(f[S_REPS], m);
}

__kernel void kvcrush_select(__global const float* scores, int score_stride, __global const int* f,
                             __global const uint* anchors, __global int* scratch, __global int* kept,
                             int kept_count) {
    const int r = get_group_id(1), lid = get_local_id(0), L = get_local_size(0);
    const int H = f[S_HEADS], A = f[S_A], W = (H + 31) / 32;
    __global int* row = scratch + (long)r * f[S_ROW_WORDS];
    select_units(scores + (long)r * H * score_stride, score_stride, f, anchors + (long)r * A * W, row, lid, L);
    list_kept(row + f[S_KEPT], f[S_UNITS], f[S_BLOCK], f[S_N], kept_units(f), kept + (long)r * kept_count, lid, L);
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
