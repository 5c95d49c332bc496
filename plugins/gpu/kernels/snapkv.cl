// SnapKV's importance per KV head (ov_kvcrush/methods/selection.py: pool_scores, then
// attention.group_heads), for Intel GPUs (OpenCL C). The selection over it (sinks, the top scores
// between, recent) is kvcrush.cl's head_decisions_topk: the same rank rule, ties to the earlier
// token. H2O and PyramidKV select the same way over unpooled scores (width 1).
//
// Compile-time constants (-D): SG (sub-group size; unused here, every source gets it).

// out[g][i]: query heads g * group .. g * group + group - 1 (the first first), each head's window
// scores pooled over the `width` tokens around i (odd width; max, or with `average` the mean of
// those inside the prompt: the reference's count_include_pad=False), summed. scores [Hq][n],
// out [Hkv][n]. Global size (n, Hkv).
__kernel void pooled_group_scores(__global const float* scores, int n, int group, int width, int average,
                                  __global float* out) {
    const int i = get_global_id(0);
    const int g = get_global_id(1);
    if (i >= n) return;
    const int lo = max(0, i - width / 2), hi = min(n, i + width / 2 + 1);
    float acc = 0.0f;
    for (int h = g * group; h < (g + 1) * group; ++h) {
        __global const float* s = scores + (long)h * n;
        float pooled = s[lo];
        if (average) {
            for (int j = lo + 1; j < hi; ++j) pooled += s[j];
            pooled /= (float)(hi - lo);
        } else {
            for (int j = lo + 1; j < hi; ++j) pooled = fmax(pooled, s[j]);
        }
        acc += pooled;
    }
    out[(long)g * n + i] = acc;
}
