// Quest's page bounds and upper bounds (ov_kvcrush/methods/quest.py), one page channel's or one
// page's share, shared by the hosts' kernels (quest.cl) and the GPU plugin's pages layer
// (plugin_layers.cl). Compile-time constants: KV_PRECISION, BLOCK_SIZE, HEAD_DIM; GROUP (the
// plugin's; the hosts' kernel takes the group as an argument); ACT (the query's type).
#ifndef OVKC_QUEST_H
#define OVKC_QUEST_H

#include "paged_block.h"

// kmax[p][d], kmin[p][d] of one KV head (its block table `table`) = the max and min of channel d
// of the keys of page p's slots (p * page .. min(n, (p + 1) * page)).
inline void page_bound(__global const uchar* pool, __global const int* table, int page, int p, int n, int d,
                       __global float* kmax, __global float* kmin) {
    const int end = min(n, (p + 1) * page);
    float hi = -INFINITY, lo = INFINITY;
    for (int s = p * page; s < end; ++s) {
        const float k = slot_key(pool, table, s, d);
        hi = fmax(hi, k);
        lo = fmin(lo, k);
    }
    kmax[(long)p * HEAD_DIM + d] = hi;
    kmin[(long)p * HEAD_DIM + d] = lo;
}

// A page's upper bound for a KV head's query group (q its first query head, head_stride the
// elements between heads, `group` heads): the sum over the group and the channels d of
// max(q[d] * hi[d], q[d] * lo[d]): no key of the page gives a head's query a larger logit.
inline float page_score(__global const ACT* q, long head_stride, int group, __global const float* hi,
                        __global const float* lo) {
    float total = 0.0f;
    for (int g = 0; g < group; ++g) {
        float s = 0.0f;
        for (int d = 0; d < HEAD_DIM; ++d) {
            const float qd = ACT_LOAD(q, g * head_stride + d);
            s += fmax(qd * hi[d], qd * lo[d]);
        }
        total += s;
    }
    return total;
}

#endif  // OVKC_QUEST_H
