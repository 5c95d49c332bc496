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

// Would head h keep middle token i on its own: among its `keep` highest scores, ties to the
// earlier token (the rank of score i is the count of scores above it, or equal and earlier).
// Global size (mid, H). decisions [H][mid].
__kernel void head_decisions_topk(__global const float* scores, int n, int lo, int mid, int keep,
                                  __global uchar* decisions) {
    const int i = get_global_id(0);
    const int h = get_global_id(1);
    if (i >= mid) return;
    __global const float* s = scores + (long)h * n + lo;
    const float x = s[i];
    int rank = 0;
    for (int j = 0; j < mid && rank < keep; ++j) rank += s[j] > x || (s[j] == x && j < i);
    decisions[(long)h * mid + i] = rank < keep;
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
    __global const int* d = distances + (long)e * A;
    int key = 0;
    if (nearest && A > 1) {
        int best = 0;
        for (int a = 1; a < A; ++a)
            if (d[a] < d[best]) best = a;
        key = best * (H + 1) + d[best];
    } else {
        for (int a = 0; a < A; ++a) key = key * (H + 1) + d[a];
    }
    keys[e] = key;
}

// One token per bucket: the m ordered tokens cut into `buckets` contiguous near-equal ranges
// [j * m / buckets, (j + 1) * m / buckets); a bucket's first token, or (first == 0) its highest
// `score`, the first on ties. members[i] = evictable[order[i]]. Global size (buckets).
__kernel void representatives(__global const int* evictable, __global const int* order, int m, int buckets,
                              __global const float* score, int first, __global int* reps) {
    const int j = get_global_id(0);
    if (j >= buckets) return;
    const int s = (int)((long)j * m / buckets), e = (int)((long)(j + 1) * m / buckets);
    int best = s;
    if (!first)
        for (int i = s + 1; i < e; ++i)
            if (score[evictable[order[i]]] > score[evictable[order[best]]]) best = i;
    reps[j] = evictable[order[best]];
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
