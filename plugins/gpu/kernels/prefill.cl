// Prompt (prefill) attention over the CPU op's block layout, for Intel GPUs: a step's query rows
// attend every slot of their KV head whose position is at most their own (the prompt's earlier
// chunks, then the step's own tokens, stored first by paged_store.cl), with an online softmax
// over the slots; and the column sums the methods score by: each slot's probability summed over
// the last `window` rows (SnapKV's window; every row for H2O's sums).
//
// One work-item per (query row, query head), rows in sub-group-wide tiles: the lanes of a
// sub-group read the same key element at once (one broadcast load), each against its own row, and
// slots after every row of the tile are skipped by the whole sub-group (the causal mask's upper
// half is never computed).
//
// Compile-time constants (-D): SG, KV_PRECISION (0 f32, 1 f16, 2 u8), BLOCK_SIZE, HEAD_DIM, GROUP.

#include "prefill.h"

// out[h][r] and lse[h][r] (log-sum-exp of the row's scaled logits) for query rows q[h][r] at
// positions qpos0 + r over the slots j < lengths[kv] with positions[kv][j] <= the row's. Global
// (rows rounded up to SG, query heads), local (SG, 1).
//
// The slots go CHUNK at a time: their logits first (each query element loaded once for the
// chunk), then one rescale of the accumulator and the chunk's values added to it (each
// accumulator element loaded and stored once for the chunk, not once a slot).
__attribute__((intel_reqd_sub_group_size(SG)))
__kernel void paged_prefill(__global const uchar* pool, __global const int* tables, int table_stride,
                            __global const int* lengths, __global const int* positions, int pos_stride,
                            __global const float* q, int rows, int qpos0, float scale, __global float* out,
                            __global float* lse) {
    const int r = get_global_id(0), h = get_global_id(1), kv = h / GROUP, n = lengths[kv];
    __global const int* pos = pos_stride > 0 ? positions + kv * pos_stride : 0;  // none: a decode row sees all
    prefill_row(r, h, pool, tables + kv * table_stride, n, n, pos, n, qpos0 + r, q, rows, scale, out, lse);
}

// scores[h][j] += the probability of slot j summed over rows [rows - window, rows) (each row's
// logits less its lse, slots after the row's position left out). Global (slots, query heads).
__kernel void window_scores(__global const uchar* pool, __global const int* tables, int table_stride,
                            __global const int* lengths, __global const int* positions, int pos_stride,
                            __global const float* q, int rows, int qpos0, float scale, __global const float* lse,
                            int window, __global float* scores, int score_stride) {
    const int j = get_global_id(0), h = get_global_id(1);
    const int kv = h / GROUP;
    if (j >= lengths[kv]) return;
    __global const uchar* block = pool + (ulong)tables[kv * table_stride + j / BLOCK_SIZE] * BLOCK_BYTES;
    const int jj = j % BLOCK_SIZE;
    float key[HEAD_DIM];
    for (int d = 0; d < HEAD_DIM; ++d) key[d] = load_key(block, d, jj);
    const int pos = positions[kv * pos_stride + j];
    float total = 0.0f;
    for (int r = max(rows - window, 0); r < rows; ++r) {
        if (pos > qpos0 + r) continue;
        __global const float* qr = q + ((long)h * rows + r) * HEAD_DIM;
        float s = 0.0f;
        for (int d = 0; d < HEAD_DIM; ++d) s = fma(qr[d] * scale, key[d], s);
        const float p = exp(CAP_LOGIT(s) - lse[h * rows + r]);
        total += p;
    }
    scores[h * score_stride + j] += total;
}
