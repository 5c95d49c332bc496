// Prompt attention's body (one query row of one query head), shared by the hosts' kernel
// (prefill.cl) and the GPU plugin's prefill layer (plugin_layers.cl). Compile-time constants: as
// prefill.cl.
#ifndef OVKC_PREFILL_H
#define OVKC_PREFILL_H

#include "paged_block.h"

#define CHUNK 8
// Row r (of `rows`) of query head h: its attention over the slots of its KV head's block table
// `table` (n slots held) that it sees: those whose position (`positions`, the head's row) is at
// most `qpos`, or, without positions, the first `visible` (the slots are in position order: every
// slot before the step's, then the step's own). `n_max`: the largest n over the sub-group's lanes
// (the loop's bound: the sub-group's collectives need every lane in it). `lse` may be null (the
// plugin's layer: no window scores).
inline void prefill_row(int r, int h, __global const uchar* pool, __global const int* table, int n, int n_max,
                        __global const int* positions, int visible, int qpos, __global const ACT* q, int rows,
                        float scale, __global ACT* out, __global float* lse) {
    const bool live = r < rows;
    float qr[HEAD_DIM], acc[HEAD_DIM];
    for (int d = 0; d < HEAD_DIM; ++d) {
        qr[d] = live ? ACT_LOAD(q, ((long)h * rows + r) * HEAD_DIM + d) * scale : 0.0f;
        acc[d] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    for (int j0 = 0; j0 < n_max; j0 += CHUNK) {
        __global const uchar* block[CHUNK];
        int slot[CHUNK];  // past the last slot: the last (finite values, times a zero probability)
        bool masked[CHUNK];
        bool all_masked = true;
        for (int c = 0; c < CHUNK; ++c) {
            const int j = clamp(j0 + c, 0, max(n - 1, 0));
            block[c] = pool + (ulong)table[j / BLOCK_SIZE] * BLOCK_BYTES;
            slot[c] = j % BLOCK_SIZE;
            masked[c] = !live || j0 + c >= n || (positions ? positions[j] > qpos : j0 + c >= visible);
            all_masked = all_masked && masked[c];
        }
        if (sub_group_all(all_masked)) continue;  // after every row of the tile: the causal square's upper half
        float s[CHUNK];
        for (int c = 0; c < CHUNK; ++c) s[c] = 0.0f;
        for (int d = 0; d < HEAD_DIM; ++d) {
            const float qd = qr[d];
            for (int c = 0; c < CHUNK; ++c) s[c] = fma(qd, load_key(block[c], d, slot[c]), s[c]);
        }
        float m_new = m;
        for (int c = 0; c < CHUNK; ++c) m_new = masked[c] ? m_new : fmax(m_new, s[c]);
        if (m_new == -INFINITY) continue;  // this row: nothing at or before it yet
        const float alpha = exp(m - m_new);
        float p[CHUNK];
        for (int c = 0; c < CHUNK; ++c) {
            p[c] = masked[c] ? 0.0f : exp(s[c] - m_new);
            l = c ? l + p[c] : l * alpha + p[c];
        }
        for (int d = 0; d < HEAD_DIM; ++d) {
            float a = acc[d] * alpha;
            for (int c = 0; c < CHUNK; ++c) a = fma(p[c], load_value(block[c], slot[c], d), a);
            acc[d] = a;
        }
        m = m_new;
    }
    if (!live) return;
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (int d = 0; d < HEAD_DIM; ++d) ACT_STORE(acc[d] * inv, ((long)h * rows + r) * HEAD_DIM + d, out);
    if (lse) lse[h * rows + r] = l > 0.0f ? m + log(l) : -INFINITY;
}

#endif  // OVKC_PREFILL_H
