// Quest's page recall over the CPU op's block layout, for Intel GPUs: each KV head's pages of
// PAGE tokens keep the channel-wise max and min of their keys; a decode step scores every page by
// the upper bound of its query's logits there, and attends the tokens of the best pages (the page
// holding the newest token always among them). The ranking between them is kvcrush.cl's
// head_decisions_topk (ties to the earlier page, as the reference's topk_indices).
//
// Compile-time constants (-D): KV_PRECISION (0 f32, 1 f16, 2 u8), BLOCK_SIZE, HEAD_DIM.

#include "quest.h"

// kmax[kv][p][d], kmin[kv][p][d] (heads `cap` pages apart) = the max and min over the slots of
// page p (p * page .. min(n, (p + 1) * page)) of KV head kv of their key's channel d, for pages
// first_page ... Global (HEAD_DIM, pages - first_page, kv heads).
__kernel void page_bounds(__global const uchar* pool, __global const int* tables, int table_stride, int page,
                          int first_page, int n, __global float* kmax, __global float* kmin, int cap) {
    const int d = get_global_id(0), p = first_page + get_global_id(1), kv = get_global_id(2);
    const long head = (long)kv * cap * HEAD_DIM;
    page_bound(pool, tables + kv * table_stride, page, p, n, d, kmax + head, kmin + head);
}

// bound[kv][p] = the sum over the query heads g of KV head kv's group of the sum over channels d
// of max(q[g][d] * kmax[p][d], q[g][d] * kmin[p][d]): no key of the page gives a head's query a
// larger logit (summed over the group: the bounds are per KV head). Global (pages, kv heads).
__kernel void page_scores(__global const float* q, int group, __global const float* kmax,
                          __global const float* kmin, int cap, int pages, __global float* bound) {
    const int p = get_global_id(0), kv = get_global_id(1);
    if (p >= pages) return;
    const long at = ((long)kv * cap + p) * HEAD_DIM;
    bound[(long)kv * pages + p] = page_score(q + (long)kv * group * HEAD_DIM, HEAD_DIM, group, kmax + at, kmin + at);
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
