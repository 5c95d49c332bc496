// The bodies of a decode step's scoring work over a method's scores [Hq][stride] (the reference's
// `acc`, ov_kvcrush/methods/importance.py), shared by the one-sequence kernels (snapkv.cl) and the
// launches over a step's sequences (paged_store.cl's step_*).
#ifndef OVKC_SCORES_H
#define OVKC_SCORES_H

// acc[h][j] = held[h][j] + exp(logits[h][row][col] - lse[h][row]) (j >= before: a new slot, from
// 0): a decode step's probability of slot j in query head h (of q_heads) added to its score so
// far (`held`: acc itself, or the rows the scores grew out of) from the logits and log-sum-exp
// the model's attention wrote (logits [q_heads][rows][stride], then lse [q_heads][rows]); the
// slot's logit is column col (j, but where the store's order changed since).
inline void add_logit(__global const float* held, int held_stride, __global float* acc, int acc_stride, int before,
                      __global const float* logits, int stride, int rows, int row, int q_heads, int h, int j,
                      int col) {
    const float lse = logits[(long)q_heads * rows * stride + h * rows + row];
    const float old = j < before ? held[(long)h * held_stride + j] : 0.0f;
    acc[(long)h * acc_stride + j] = old + exp(logits[((long)h * rows + row) * stride + col] - lse);
}

// The middle slot KV head g drops when one goes: the lowest of its query group's summed scores
// over slots sinks .. sinks + mid (summed as pooled_group_scores sums them at width 1), ties to the
// later slot (head_decisions_topk keeps the earlier). One sub-group; every lane returns it.
inline int lowest_middle_slot(__global const float* scores, int stride, int group, int sinks, int mid, int g) {
    const int lane = get_sub_group_local_id();
    float best = INFINITY;
    int at = -1;
    for (int i = lane; i < mid; i += SG) {
        float acc = 0.0f;
        for (int h = g * group; h < (g + 1) * group; ++h) acc += scores[(long)h * stride + sinks + i];
        if (acc <= best) {  // a lane's slots ascend: the later of equal scores
            best = acc;
            at = i;
        }
    }
    const float low = sub_group_reduce_min(best);
    return sinks + sub_group_reduce_max(best == low ? at : -1);
}

#endif
