// SnapKV's importance per KV head (ov_kvcrush/methods/selection.py: pool_scores, then
// attention.group_heads), for Intel GPUs (OpenCL C). The selection over it (sinks, the top scores
// between, recent) is kvcrush.cl's head_decisions_topk: the same rank rule, ties to the earlier
// token. H2O and PyramidKV select the same way over unpooled scores (width 1).
//
// Compile-time constants (-D): SG (sub-group size).

#include "scores.h"

// One head's scores s pooled over [lo, hi): their max, or with `average` their mean.
inline float pooled(__global const float* s, int lo, int hi, int average) {
    float out = s[lo];
    if (average) {
        for (int j = lo + 1; j < hi; ++j) out += s[j];
        return out / (float)(hi - lo);
    }
    for (int j = lo + 1; j < hi; ++j) out = fmax(out, s[j]);
    return out;
}

// out[g][i]: query heads g * group .. g * group + group - 1 (the first first), each head's window
// scores pooled over the `width` tokens around i (odd width; max, or with `average` the mean of
// those inside the prompt: the reference's count_include_pad=False), summed. scores
// [Hq][stride] (stride >= n), out [Hkv][n]. Global size (n, Hkv).
__kernel void pooled_group_scores(__global const float* scores, int stride, int n, int group, int width,
                                  int average, __global float* out) {
    const int i = get_global_id(0);
    const int g = get_global_id(1);
    if (i >= n) return;
    const int lo = max(0, i - width / 2), hi = min(n, i + width / 2 + 1);
    float acc = 0.0f;
    for (int h = g * group; h < (g + 1) * group; ++h) acc += pooled(scores + (long)h * stride, lo, hi, average);
    out[(long)g * n + i] = acc;
}

// The scores a decoding sequence keeps per query head and slot (the reference's `acc`
// ov_kvcrush/methods/importance.py): the prompt's pooled window scores, then each decode step's
// probabilities on top, gathered with the slots an eviction keeps.

// out[h][i]: head h's scores pooled over the `width` tokens around i, as pooled_group_scores
// pools them (one head per row, not summed). scores, out [rows][stride]. Global (n, rows).
__kernel void pool_rows(__global const float* scores, int stride, int n, int width, int average,
                        __global float* out) {
    const int i = get_global_id(0);
    const int h = get_global_id(1);
    if (i >= n) return;
    const int lo = max(0, i - width / 2), hi = min(n, i + width / 2 + 1);
    out[(long)h * stride + i] = pooled(scores + (long)h * stride, lo, hi, average);
}

// acc[h][j] = (j < before ? acc[h][j] : 0) + probs[h][j] for j < held: a step's new slots start
// at zero, then every held slot gets the step's probability. Global (held, rows).
__kernel void add_step_scores(__global float* acc, int acc_stride, int before, int held,
                              __global const float* probs, int prob_stride) {
    const int j = get_global_id(0);
    const int h = get_global_id(1);
    if (j >= held) return;
    const float old = j < before ? acc[(long)h * acc_stride + j] : 0.0f;
    acc[(long)h * acc_stride + j] = old + probs[(long)h * prob_stride + j];
}

// dst[h][i] = src[h][kept[h / group][i]] for i < count, and 0 from count to dst_stride (where the
// next tokens' scores start): the scores of the slots each KV head keeps (its query heads h of
// the group alike); kept_stride < 0: slot i itself (the first count slots copied into rows of
// another stride, without a list). Global (dst_stride, rows).
__kernel void gather_rows(__global const float* src, int src_stride, __global const int* kept, int kept_stride,
                          int count, int group, __global float* dst, int dst_stride) {
    const int i = get_global_id(0);
    const int h = get_global_id(1);
    const int slot = i < count ? (kept_stride < 0 ? i : kept[(h / group) * kept_stride + i]) : 0;
    dst[(long)h * dst_stride + i] = i < count ? src[(long)h * src_stride + slot] : 0.0f;
}

// kept[kv][0 ..): head kv's sinks, the middle tokens its decisions keep (in order), then its
// recent tokens: the slots an eviction gathers, listed on the device from the decisions, so that
// nothing of a selection crosses (the slots' positions are gathered on the device too). One
// work-item per KV head: global (kv_heads).
__kernel void kept_slots(__global const uchar* decisions, int mid, int sinks, int recent, int n,
                         __global int* kept, int kept_stride) {
    const int kv = get_global_id(0);
    __global int* out = kept + (long)kv * kept_stride;
    int at = 0;
    for (int i = 0; i < sinks; ++i) out[at++] = i;
    for (int i = 0; i < mid; ++i)
        if (decisions[(long)kv * mid + i]) out[at++] = sinks + i;
    for (int i = n - recent; i < n; ++i) out[at++] = i;
}

// acc[h][j] = 0: a new token's score starts at zero wherever the store's order puts it (the
// 2-bit store's flush can move it among the quantized chunk's slots). Global (rows).
__kernel void zero_slot(__global float* acc, int acc_stride, int j) {
    acc[(long)get_global_id(0) * acc_stride + j] = 0.0f;
}

// out[i] for i < total: a list of slots sent as its runs of consecutive slots, runs[r] = (the
// run's first index in out, its first slot), ascending in index: a store's reorder (a flush's
// chunk moved after the older ones) crosses as a few runs, not a slot list. Global (total).
__kernel void expand_runs(__global const int* runs, int n_runs, __global int* out) {
    const int i = get_global_id(0);
    int r = 0;
    while (r + 1 < n_runs && runs[2 * (r + 1)] <= i) ++r;
    out[i] = runs[2 * r + 1] + i - runs[2 * r];
}

// dst[pairs[2 i]] = pairs[2 i + 1]: the words of a table kept on the device that changed since
// it was sent (gpu/table_mirror.py), each index once. Global (pairs).
__kernel void set_elements(__global int* dst, __global const int* pairs) {
    const int i = get_global_id(0);
    dst[pairs[2 * i]] = pairs[2 * i + 1];
}

// add_logit over every held slot of one sequence: a decode step's probabilities added to the
// scores from the logits and log-sum-exp the model's attention wrote, so the keys are not read
// again. Global (held, q_heads).
__kernel void add_step_logits(__global float* acc, int acc_stride, int before, __global const float* logits,
                              int stride, int rows, int row) {
    const int j = get_global_id(0);
    add_logit(acc, acc_stride, acc, acc_stride, before, logits, stride, rows, row, get_global_size(1),
              get_global_id(1), j, j);
}

// The middle slot each KV head drops when one goes (an eviction of one slot a head: a decode step
// past the budget): lowest_middle_slot. One sub-group per KV head: global (SG, kv_heads), local
// (SG, 1).
__attribute__((intel_reqd_sub_group_size(SG)))
__kernel void drop_lowest(__global const float* scores, int stride, int group, int sinks, int mid,
                          __global int* dropped) {
    const int g = get_global_id(1);
    const int slot = lowest_middle_slot(scores, stride, group, sinks, mid, g);
    if (get_sub_group_local_id() == 0) dropped[g] = slot;
}
