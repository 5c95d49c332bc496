// Quest's page recall over the CPU op's block layout, for Intel GPUs: each KV head's pages of
// PAGE tokens keep the channel-wise max and min of their keys; a decode step scores every page by
// the upper bound of its query's logits there, and attends the tokens of the best pages (the page
// holding the newest token always among them). The ranking between them is kvcrush.cl's
// head_decisions_topk (ties to the earlier page, as the reference's topk_indices).
//
// Compile-time constants (-D): KV_PRECISION (0 f32, 1 f16, 2 u8), BLOCK_SIZE, HEAD_DIM.

#include "paged_block.h"

// kmax[kv][p][d], kmin[kv][p][d] (heads `cap` pages apart) = the max and min over the slots of
// page p (p * page .. min(n, (p + 1) * page)) of KV head kv of their key's channel d, for pages
// first_page ... Global (HEAD_DIM, pages - first_page, kv heads).
__kernel void page_bounds(__global const uchar* pool, __global const int* tables, int table_stride, int page,
                          int first_page, int n, __global float* kmax, __global float* kmin, int cap) {
    const int d = get_global_id(0), p = first_page + get_global_id(1), kv = get_global_id(2);
    const int end = min(n, (p + 1) * page);
    float hi = -INFINITY, lo = INFINITY;
    for (int s = p * page; s < end; ++s) {
        __global const uchar* block = pool + (ulong)tables[kv * table_stride + s / BLOCK_SIZE] * BLOCK_BYTES;
        const float k = load_key(block, d, s % BLOCK_SIZE);
        hi = fmax(hi, k);
        lo = fmin(lo, k);
    }
    const long at = ((long)kv * cap + p) * HEAD_DIM + d;
    kmax[at] = hi;
    kmin[at] = lo;
}

// bound[kv][p] = the sum over the query heads g of KV head kv's group of the sum over channels d
// of max(q[g][d] * kmax[p][d], q[g][d] * kmin[p][d]): no key of the page gives a head's query a
// larger logit (summed over the group: the bounds are per KV head). Global (pages, kv heads).
__kernel void page_scores(__global const float* q, int group, __global const float* kmax,
                          __global const float* kmin, int cap, int pages, __global float* bound) {
    const int p = get_global_id(0), kv = get_global_id(1);
    if (p >= pages) return;
    __global const float* hi = kmax + ((long)kv * cap + p) * HEAD_DIM;
    __global const float* lo = kmin + ((long)kv * cap + p) * HEAD_DIM;
    float total = 0.0f;
    for (int g = 0; g < group; ++g) {
        __global const float* qh = q + (long)(kv * group + g) * HEAD_DIM;
        float s = 0.0f;
        for (int d = 0; d < HEAD_DIM; ++d) s += fmax(qh[d] * hi[d], qh[d] * lo[d]);
        total += s;
    }
    bound[(long)kv * pages + p] = total;
}

// slots[kv][..] = the tokens of KV head kv's recalled pages, ascending: those its decisions
// [kv][pages - 1] keep among the pages before the last, then the last (partial) page. One
// work-item per KV head: global (kv heads).
__kernel void page_slots(__global const uchar* decisions, int pages, int page, int n, __global int* slots,
                         int stride) {
    const int kv = get_global_id(0);
    __global int* out = slots + (long)kv * stride;
    int at = 0;
    for (int p = 0; p < pages; ++p) {
        if (p < pages - 1 && !decisions[(long)kv * (pages - 1) + p]) continue;
        for (int s = p * page; s < min(n, (p + 1) * page); ++s) out[at++] = s;
    }
}
