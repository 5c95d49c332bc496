// Writing tokens into the CPU op's block layout and moving them, for Intel GPUs: a step's new
// tokens stored at their slots (f32, f16 rounded to nearest even, or u8 codes with each token's
// min and scale, as plugins/cpu/src/kernels_store.cpp), and the gather that eviction uses (kept
// slots copied, in order, into fresh blocks; the host then rewrites the head's block table and
// frees the old blocks, so no slot is read after it is overwritten).
//
// Compile-time constants (-D): SG, KV_PRECISION (0 f32, 1 f16, 2 u8), BLOCK_SIZE, HEAD_DIM.

#include "paged_store.h"
#include "scores.h"

// Token t of k, v [kv_heads][tokens][HEAD_DIM] to slot first[kv] + t of KV head kv (its block
// table a row of `tables`). One sub-group per (token, head): global (SG, tokens, kv_heads), local
// (SG, 1, 1).
__attribute__((intel_reqd_sub_group_size(SG)))
__kernel void store_tokens(__global uchar* pool, __global const int* tables, int table_stride,
                           __global const int* first, __global const float* k, __global const float* v) {
    const int t = get_global_id(1), kv = get_global_id(2);
    store_token(t, kv, get_global_size(1), pool, tables + kv * table_stride, first[kv] + t, k, v);
}

// Element e of slot j (of a head's block table): for e < HEAD_DIM its key's and its value's dim e
// (ELEM_BYTES each, into k and v), for HEAD_DIM + p (u8) its parameter row p (into k).
inline void slot_element(__global const uchar* pool, __global const int* table, int j, int e, uint* k, uint* v) {
    __global const uchar* a = pool + (ulong)table[j / BLOCK_SIZE] * BLOCK_BYTES;
    const int jj = j % BLOCK_SIZE;
    if (e >= HEAD_DIM) {
        *k = ((__global const uint*)(a + KV_BYTES))[(e - HEAD_DIM) * BLOCK_SIZE + jj];
        return;
    }
    *k = *v = 0;
    for (int byte = 0; byte < ELEM_BYTES; ++byte) {
        *k |= (uint)a[(e * BLOCK_SIZE + jj) * ELEM_BYTES + byte] << (8 * byte);
        *v |= (uint)a[(BLOCK_SIZE * HEAD_DIM + jj * HEAD_DIM + e) * ELEM_BYTES + byte] << (8 * byte);
    }
}

inline void set_slot_element(__global uchar* pool, __global const int* table, int j, int e, uint k, uint v) {
    __global uchar* b = pool + (ulong)table[j / BLOCK_SIZE] * BLOCK_BYTES;
    const int jj = j % BLOCK_SIZE;
    if (e >= HEAD_DIM) {
        ((__global uint*)(b + KV_BYTES))[(e - HEAD_DIM) * BLOCK_SIZE + jj] = k;
        return;
    }
    for (int byte = 0; byte < ELEM_BYTES; ++byte) {
        b[(e * BLOCK_SIZE + jj) * ELEM_BYTES + byte] = (uchar)(k >> (8 * byte));
        b[(BLOCK_SIZE * HEAD_DIM + jj * HEAD_DIM + e) * ELEM_BYTES + byte] = (uchar)(v >> (8 * byte));
    }
}

// Element e of slot `slot` of a head's old blocks (`table`) to slot i of its new ones (`new_table`),
// where the store has that element (u8's parameter rows: e >= HEAD_DIM).
inline void gather_element(__global const uchar* src_pool, __global const int* table, __global uchar* dst_pool,
                           __global const int* new_table, int slot, int i, int e) {
    if (e >= HEAD_DIM && KV_PRECISION != 2) return;
    uint k, v;
    slot_element(src_pool, table, slot, e, &k, &v);
    set_slot_element(dst_pool, new_table, i, e, k, v);
}

// Slot i of KV head kv's new blocks (new_tables) = its slot src[kv][i] in its old blocks
// (tables), i < counts[kv]: keys, values and (u8) the slot's min and scale. One work-item per
// (element, slot, head): global (HEAD_DIM + 4, max count, kv_heads); element HEAD_DIM + p copies
// u8 parameter row p.
__kernel void gather_slots(__global const uchar* src_pool, __global const int* tables, int table_stride,
                           __global uchar* dst_pool, __global const int* new_tables, int new_stride,
                           __global const int* src, int src_stride, __global const int* counts) {
    const int e = get_global_id(0), i = get_global_id(1), kv = get_global_id(2);
    if (i >= counts[kv]) return;
    gather_element(src_pool, tables + kv * table_stride, dst_pool, new_tables + kv * new_stride,
                   src[kv * src_stride + i], i, e);
}

// out[kv][i][d] = the key (or, with `values`, the value) of slot first + i of KV head kv, read
// back as attention reads it: the keys ClusterKV's k-means clusters and the tokens the 2-bit
// store's flush quantizes (quant2.cl), without crossing to the host. Global (HEAD_DIM, count,
// kv_heads).
__kernel void read_slots(__global const uchar* pool, __global const int* tables, int table_stride, int first,
                         int count, int values, __global float* out) {
    const int d = get_global_id(0), i = get_global_id(1), kv = get_global_id(2);
    if (i >= count) return;
    const int slot = first + i, j = slot % BLOCK_SIZE;
    __global const uchar* block = pool + (ulong)tables[kv * table_stride + slot / BLOCK_SIZE] * BLOCK_BYTES;
    out[((long)kv * count + i) * HEAD_DIM + d] = values ? load_value(block, j, d) : load_key(block, d, j);
}

// scores[kv * group][first + i] (rows `stride` apart) = -||key||: Knorm's score of slot first + i
// of KV head kv (the key as attention reads it), in the first query head of the head's group, as
// the reference's key_norm_scores puts it (the group's other rows stay 0, so a group's sum is
// exactly -||key||). Global (count, kv_heads).
inline float key_norm(__global const uchar* pool, __global const int* table, int slot) {
    __global const uchar* block = pool + (ulong)table[slot / BLOCK_SIZE] * BLOCK_BYTES;
    const int j = slot % BLOCK_SIZE;
    float s = 0.0f;
    for (int d = 0; d < HEAD_DIM; ++d) {
        const float k = load_key(block, d, j);
        s = fma(k, k, s);
    }
    return -sqrt(s);
}

__kernel void key_norm_scores(__global const uchar* pool, __global const int* tables, int table_stride, int first,
                              int count, int group, __global float* scores, int stride) {
    const int i = get_global_id(0), kv = get_global_id(1);
    if (i >= count) return;
    scores[(long)kv * group * stride + first + i] = key_norm(pool, tables + kv * table_stride, first + i);
}

// Where the slots' positions live (one int per slot, rows `stride` apart per KV head): a step's
// new slots first .. first + count take positions first_position .. . Global (count, kv_heads).
__kernel void fill_positions(__global int* positions, int stride, int first, int first_position, int count) {
    const int i = get_global_id(0), kv = get_global_id(1);
    if (i < count) positions[(long)kv * stride + first + i] = first_position + i;
}

// The position of slot j of a head's row `pos`: slots from `fresh` on are not written yet, at
// fresh_position + (j - fresh) (SlotPositions' fresh range).
inline int slot_position(__global const int* pos, int j, int fresh, int fresh_position) {
    return j >= fresh ? fresh_position + j - fresh : pos[j];
}

// An eviction in one launch: slot i of KV head kv's new blocks (new_tables) = its slot
// kept[kv][i] (kept_stride 0: one list every head keeps), i < count: its elements
// (gather_slots'), its position (positions [kv][pos_stride]; slots from `fresh` on were stored
// since they were last written, at fresh_position + (slot - fresh): a decode step's token) and,
// where score_width is not 0, its scores in the head's query group (snapkv.cl's gather_rows: the
// new rows written to score_width, zero past count). Global (HEAD_DIM + 5 + group,
// max(count, score_width), kv_heads): element HEAD_DIM + 4 is the position, HEAD_DIM + 5 + g the
// score of query head kv * group + g.
__kernel void keep_slots(__global uchar* pool, __global const int* tables, int table_stride,
                         __global const int* new_tables, int new_stride, __global const int* kept, int kept_stride,
                         int count, __global const int* positions, int pos_stride, int fresh, int fresh_position,
                         __global int* new_positions, int new_pos_stride, __global const float* scores,
                         int score_stride, __global float* new_scores, int score_width, int group) {
    const int e = get_global_id(0), i = get_global_id(1), kv = get_global_id(2);
    const int slot = i < count ? kept[kv * kept_stride + i] : 0;
    if (e > HEAD_DIM + 4) {
        const long h = (long)kv * group + e - HEAD_DIM - 5;
        if (i < score_width) new_scores[h * score_width + i] = i < count ? scores[h * score_stride + slot] : 0.0f;
        return;
    }
    if (i >= count) return;
    if (e == HEAD_DIM + 4) {
        new_positions[(long)kv * new_pos_stride + i] =
            slot_position(positions + (long)kv * pos_stride, slot, fresh, fresh_position);
        return;
    }
    gather_element(pool, tables + kv * table_stride, pool, new_tables + kv * new_stride, slot, i, e);
}

// Each KV head drops its slot dropped[kv] (of n): the slots after it move down one in place, each
// with its position and its scores in the head's query group: an eviction of one slot a head moves
// the slots after it, not every kept slot into fresh blocks. A work-item per element of a slot
// (the keys' and values' dims, u8's 4 parameter rows, the position, the group's scores: global
// (HEAD_DIM + 4 + 1 + group, kv_heads)) walks the slots after the dropped one, MOVE_CHUNK read
// then MOVE_CHUNK written: each element is read and written by its work-item alone, the later
// slot read before it is overwritten. positions [kv][pos_stride]: slots from `fresh` on hold
// fresh_position + (slot - fresh), not yet written (SlotPositions); written from min(dropped,
// fresh) on. scores [Hq][score_stride], none where score_stride is 0.
#define MOVE_CHUNK 8
// The drop of `count` slots from d (of n) for one element e of a slot: drop_slot's body (count 1),
// and a 2-bit flush's (the chunk's full-precision slots gone, those after it moved down).
inline void drop_element(__global uchar* pool, __global const int* table, int d, int count, int n, __global int* pos,
                         int fresh, int fresh_position, __global float* scores, int score_stride, int group, int e,
                         int kv) {
    if (e == HEAD_DIM + 4) {  // the position
        for (int j = min(d, fresh); j < n - count; ++j) {
            const int src = j + (j >= d ? count : 0);
            pos[j] = slot_position(pos, src, fresh, fresh_position);
        }
        return;
    }
    if (e > HEAD_DIM + 4) {  // a score of the group's query head e - HEAD_DIM - 5
        if (score_stride == 0) return;
        __global float* s = scores + (long)(kv * group + e - HEAD_DIM - 5) * score_stride;
        for (int j = d; j < n - count; ++j) s[j] = s[j + count];
        return;
    }
#if KV_PRECISION != 2
    if (e >= HEAD_DIM) return;  // the u8 parameters' rows: none
#endif
    for (int j0 = d; j0 < n - count; j0 += MOVE_CHUNK) {
        uint kx[MOVE_CHUNK], vx[MOVE_CHUNK];
        for (int c = 0; c < MOVE_CHUNK && j0 + c + count < n; ++c)
            slot_element(pool, table, j0 + c + count, e, &kx[c], &vx[c]);
        for (int c = 0; c < MOVE_CHUNK && j0 + c + count < n; ++c) set_slot_element(pool, table, j0 + c, e, kx[c], vx[c]);
    }
}

__kernel void drop_slot(__global uchar* pool, __global const int* tables, int table_stride,
                        __global const int* dropped, int n, __global int* positions, int pos_stride, int fresh,
                        int fresh_position, __global float* scores, int score_stride, int group) {
    const int e = get_global_id(0), kv = get_global_id(1);
    drop_element(pool, tables + kv * table_stride, dropped[kv], 1, n, positions + (long)kv * pos_stride, fresh,
                 fresh_position, scores, score_stride, group, e, kv);
}

// ---- A decode step's method work for every sequence of the step in one launch (the GPU plugin's
// model: ov_kvcrush/gpu/step_work.py). Each sequence's scores and slot positions lie in one
// buffer (`arena`, int32 words; the scores float bits), and `work` holds a row of WORK_FIELDS ints
// per sequence (the fields below, as StepWork packs them); the step's block tables are the model's
// (`tables`: its layer's rows from `table_first`, a row per (sequence, KV head)). The bodies are the
// one-sequence kernels' (drop_slot, key_norm_scores; scores.h's add_logit and lowest_middle_slot).

#define W_SCORES 0          // the scores' first word in the arena, rows W_SCORE_STRIDE apart
#define W_SCORE_STRIDE 1
#define W_ADD_FROM 2        // the step's probabilities added over W_SCORED slots, new from here (-1: none)
#define W_SCORED 3
#define W_LOGIT_ROW 4       // the sequence's row among the step's logits
#define W_NORMS_FROM 5      // Knorm: the slots from here to W_HELD scored by -||key|| (-1: none)
#define W_DROP 6            // the slot each head drops: -1 none, -2 the lowest middle one, -3 a
                            // selection's (kvcrush.cl's step_kvcrush_drop), else that slot
#define W_SINKS 7
#define W_MID 8
#define W_HELD 9            // slots a head holds before the drop
#define W_POSITIONS 10      // the positions' first word, rows W_POS_STRIDE apart
#define W_POS_STRIDE 11
#define W_FRESH 12          // slots from here hold W_FRESH_POSITION + (slot - W_FRESH), not yet written
#define W_FRESH_POSITION 13
#define W_FLUSH_FROM 14     // a 2-bit flush: the scores' first full-precision slot before it (-1: none)
#define W_FLUSH_PINNED 15   // the full-precision slots before the flushed chunk (the pinned prompt tail)
#define W_FLUSH_COUNT 16    // the chunk's slots
#define W_DROP_COUNT 17     // the slots dropped from W_DROP (a drop: 1; a flush: the chunk's)
#define W_DROP_SCORES 18    // whether the scores move with them (a flush reorders them itself)
#define W_GROWN 19          // the scores grew this step: the held ones' first word before (-1: not)
#define W_GROWN_STRIDE 20   // and their rows' stride there
#define WORK_FIELDS 22
#define DROP_NONE (-1)
#define DROP_LOWEST (-2)
#define DROP_SELECTED (-3)

inline __global float* work_scores(__global int* arena, __global const int* w) {
    return (__global float*)(arena + w[W_SCORES]);
}

// key_norm_scores of each sequence's new slots. Global (most new slots, kv_heads, sequences).
__kernel void step_key_norms(__global const uchar* pool, __global const int* tables, int table_first,
                             int table_stride, int group, __global int* arena, __global const int* work) {
    const int i = get_global_id(0), kv = get_global_id(1), s = get_global_id(2);
    __global const int* w = work + s * WORK_FIELDS;
    const int slot = w[W_NORMS_FROM] + i;
    if (w[W_NORMS_FROM] < 0 || slot >= w[W_HELD]) return;
    __global const int* table = tables + (long)(table_first + s * get_global_size(1) + kv) * table_stride;
    work_scores(arena, w)[(long)kv * group * w[W_SCORE_STRIDE] + slot] = key_norm(pool, table, slot);
}

// After a 2-bit flush of the full-precision slots after the pinned ones (the model quantized them,
// the step's token among them or after them): a query head's scores (`run`: from the first
// full-precision slot before the flush) in the store's new order, the
// chunk's before the pinned slots' (the reference's order after a flush; the slots after the chunk
// stay; the one-sequence path: zero_slot of the step's token, then gather_rows of that order). A
// rotation of the run by three reversals, in place, after step_add_logits added the step's
// probabilities in the order before (flushed_column: where each slot's logit lies).
inline void reverse_run(__global float* x, int lo, int hi) {
    for (--hi; lo < hi; ++lo, --hi) {
        const float t = x[lo];
        x[lo] = x[hi];
        x[hi] = t;
    }
}

inline void flushed_scores(__global float* run, int pinned, int count) {
    reverse_run(run, 0, pinned);
    reverse_run(run, pinned, pinned + count);
    reverse_run(run, 0, pinned + count);
}

// The column of score j's logit in a row whose step flushed a chunk: the model attended the store
// in its order after the flush (flushed_scores'), the scores are still in the order before.
inline int flushed_column(__global const int* w, int j) {
    const int k = j - w[W_FLUSH_FROM], pinned = w[W_FLUSH_PINNED], count = w[W_FLUSH_COUNT];
    if (w[W_FLUSH_FROM] < 0 || k < 0 || k >= pinned + count) return j;
    return w[W_FLUSH_FROM] + (k < pinned ? count + k : k - pinned);
}

// add_step_logits of each sequence's decode row; where its scores grew this step (W_GROWN), the
// held ones read from where they were: the copy into the grown rows is this launch's, not a
// command of its own. Global (most scored slots, q_heads, sequences).
__kernel void step_add_logits(__global int* arena, __global const int* work, __global const float* logits,
                              int stride, int rows) {
    const int j = get_global_id(0), h = get_global_id(1), s = get_global_id(2);
    __global const int* w = work + s * WORK_FIELDS;
    if (w[W_ADD_FROM] < 0 || j >= w[W_SCORED]) return;
    const int grown = w[W_GROWN] >= 0;
    __global const float* held = grown ? (__global const float*)(arena + w[W_GROWN]) : work_scores(arena, w);
    add_logit(held, grown ? w[W_GROWN_STRIDE] : w[W_SCORE_STRIDE], work_scores(arena, w), w[W_SCORE_STRIDE],
              w[W_ADD_FROM], logits, stride, rows, w[W_LOGIT_ROW], get_global_size(1), h, j, flushed_column(w, j));
}

// drop_lowest for each sequence that drops its lowest middle slot, into dropped[s][kv]. One
// sub-group per (KV head, sequence): global (SG, kv_heads, sequences), local (SG, 1, 1).
__attribute__((intel_reqd_sub_group_size(SG)))
__kernel void step_drop_lowest(__global int* arena, __global const int* work, int group, __global int* dropped) {
    const int g = get_global_id(1), s = get_global_id(2);
    __global const int* w = work + s * WORK_FIELDS;
    if (w[W_DROP] != DROP_LOWEST) return;
    const int slot = lowest_middle_slot(work_scores(arena, w), w[W_SCORE_STRIDE], group, w[W_SINKS], w[W_MID], g);
    if (get_sub_group_local_id() == 0) dropped[s * get_global_size(1) + g] = slot;
}

// drop_slot for each sequence that drops slots (W_DROP_COUNT of them a head from its W_DROP, or
// from the slot found before: step_drop_lowest's lowest, step_kvcrush_drop's unit); a 2-bit
// flush's scores are step_quant_store's. Global (HEAD_DIM + 5 + group, kv_heads, sequences).
__kernel void step_drop_slot(__global uchar* pool, __global const int* tables, int table_first, int table_stride,
                             __global int* arena, __global const int* work, __global const int* dropped, int group) {
    const int e = get_global_id(0), kv = get_global_id(1), s = get_global_id(2);
    __global const int* w = work + s * WORK_FIELDS;
    if (w[W_DROP] == DROP_NONE) return;
    const int kv_heads = get_global_size(1);
    const int d = w[W_DROP] <= DROP_LOWEST ? dropped[s * kv_heads + kv] : w[W_DROP];  // found on the device
    __global const int* table = tables + (long)(table_first + s * kv_heads + kv) * table_stride;
    __global int* pos = arena + w[W_POSITIONS] + (long)kv * w[W_POS_STRIDE];
    const int score_stride = w[W_DROP_SCORES] ? w[W_SCORE_STRIDE] : 0;
    __global float* scores = score_stride ? work_scores(arena, w) : (__global float*)arena;
    drop_element(pool, table, d, w[W_DROP_COUNT], w[W_HELD], pos, w[W_FRESH], w[W_FRESH_POSITION], scores,
                 score_stride, group, e, kv);
}

// ---- The 2-bit store's work after the others of a step (ov_kvcrush/gpu/quant_step.py), one
// work-group a row (a sequence's layer), nothing read back:
//   1. a flush's scores in the store's order (flushed_scores, a work-item a query head);
//   2. an eviction of whole chunks under a selection not frozen (SnapKV or H2O with `quant`; the
//      reference's ImportanceLayerCache._evict_quantized_chunks): each KV head's chunks summed from
//      its query heads' scores (slot by slot the group's heads first, the reference's group_heads;
//      then the chunk's slots in order), with layer scope (KVCrush's) ranked by every head's sums
//      summed, head 0 first; each head drops the row's Q_DROP lowest of its chunks [first, end)
//      that may go (ties: the older), the host having counted them and the chunks that stay; the
//      kept chunks moved down in order, their 2-bit blocks' words into the head's first blocks
//      (its last Q_DROP blocks are then free) and their scores, then the full-precision slots'
//      scores after them, those left behind zeroed.
// A row is QUANT_STEP_FIELDS ints, then each KV head's first chunk that may go and the end of
// those. tables: the heads' 2-bit block ids (a head's row Q_TABLE_STRIDE words on from the last);
// blocks: the 2-bit blocks, `block_words` words each, of `chunk` tokens; scratch: (2 kv + 1)
// max_chunks words a row. Global (L, rows), local (L, 1).
#define QUANT_STEP_FIELDS 11
#define Q_SCORES 0          // the scores' first word in the arena, rows Q_SCORE_STRIDE apart
#define Q_SCORE_STRIDE 1
#define Q_QUANTIZED 2       // the 2-bit slots (the flush's chunk among them)
#define Q_HELD 3            // the full-precision slots after them
#define Q_DROP 4            // the chunks each head drops (0: none)
#define Q_LAYER_SCOPE 5
#define Q_TABLE 6
#define Q_TABLE_STRIDE 7
#define Q_FLUSH_FROM 8      // a flush: the scores' first full-precision slot before it (-1: none)
#define Q_FLUSH_PINNED 9
#define Q_FLUSH_COUNT 10

inline float chunk_key(__global const float* sums, __global const float* totals, int layer_scope, int h,
                       int max_chunks, int c) {
    return layer_scope ? totals[c] : sums[(long)h * max_chunks + c];
}

// Each KV head's chunk sums (sums[h][c]) and the layer's (totals[c]), from the scores s.
inline void chunk_sums(__global const float* s, int stride, int kv, int group, int chunk, int chunks,
                       int max_chunks, __global float* sums, __global float* totals) {
    const int lid = get_local_id(0), L = get_local_size(0);
    for (int i = lid; i < kv * chunks; i += L) {
        const int h = i / chunks, c = i % chunks;
        float acc = 0.0f;
        for (int j = c * chunk; j < (c + 1) * chunk; ++j) {
            float slot = 0.0f;
            for (int g = 0; g < group; ++g) slot += s[(long)(h * group + g) * stride + j];
            acc += slot;
        }
        sums[(long)h * max_chunks + c] = acc;
    }
    barrier(CLK_GLOBAL_MEM_FENCE);
    for (int c = lid; c < chunks; c += L) {
        float acc = 0.0f;
        for (int h = 0; h < kv; ++h) acc += sums[(long)h * max_chunks + c];
        totals[c] = acc;
    }
    barrier(CLK_GLOBAL_MEM_FENCE);
}

// gone[h][c]: whether head h drops chunk c, one of its `drop` lowest among [first, end) (the
// row's ranges after its fields; ties: the older), by its rank among them.
inline void mark_dropped(__global const int* w, int kv, int chunks, int max_chunks, __global const float* sums,
                         __global const float* totals, __global int* gone) {
    const int lid = get_local_id(0), L = get_local_size(0), layer_scope = w[Q_LAYER_SCOPE];
    for (int i = lid; i < kv * chunks; i += L) {
        const int h = i / chunks, c = i % chunks;
        const int first = w[QUANT_STEP_FIELDS + 2 * h], end = w[QUANT_STEP_FIELDS + 2 * h + 1];
        int out = 0;
        if (c >= first && c < end) {
            const float mine = chunk_key(sums, totals, layer_scope, h, max_chunks, c);
            int rank = 0;
            for (int j = first; j < end; ++j) {
                const float other = chunk_key(sums, totals, layer_scope, h, max_chunks, j);
                rank += other < mine || (other == mine && j < c);
            }
            out = rank < w[Q_DROP];
        }
        gone[(long)h * max_chunks + c] = out;
    }
    barrier(CLK_GLOBAL_MEM_FENCE);
}

// The kept chunks down in order, each head's: a block's word i, and a chunk's score i, is always
// this work-item's, so it reads a block's words before it writes over them (no barrier between).
inline void move_kept_chunks(__global float* s, int stride, int kv, int group, int chunk, int chunks,
                             int max_chunks, __global const int* table, int table_stride, __global uint* blocks,
                             int block_words, __global const int* gone) {
    const int lid = get_local_id(0), L = get_local_size(0);
    for (int h = 0; h < kv; ++h) {
        int to = 0;
        for (int c = 0; c < chunks; ++c) {
            if (gone[(long)h * max_chunks + c]) continue;
            if (to != c) {
                __global const uint* src = blocks + (ulong)table[(long)h * table_stride + c] * block_words;
                __global uint* dst = blocks + (ulong)table[(long)h * table_stride + to] * block_words;
                for (int i = lid; i < block_words; i += L) dst[i] = src[i];
                for (int i = lid; i < group * chunk; i += L) {
                    __global float* q = s + (long)(h * group + i / chunk) * stride;
                    q[to * chunk + i % chunk] = q[c * chunk + i % chunk];
                }
            }
            ++to;
        }
    }
    barrier(CLK_GLOBAL_MEM_FENCE);
}

// The `held` full-precision slots' scores after the nq 2-bit ones down by `by` slots, a round of
// them at a time, those left behind zeroed.
inline void move_full_precision_scores(__global float* s, int stride, int heads, int nq, int held, int by) {
    const int lid = get_local_id(0), L = get_local_size(0);
    for (int base = 0; base < held; base += by) {
        const int n = min(by, held - base);
        for (int i = lid; i < heads * n; i += L) {
            __global float* q = s + (long)(i / n) * stride;
            q[nq + base + i % n - by] = q[nq + base + i % n];
        }
        barrier(CLK_GLOBAL_MEM_FENCE);
    }
    for (int i = lid; i < heads * by; i += L) s[(long)(i / by) * stride + nq + held - by + i % by] = 0.0f;
}

__kernel void step_quant_store(__global int* arena, __global const int* rows, int kv, int group, int chunk,
                               int block_words, int max_chunks, __global const int* tables,
                               __global uint* blocks, __global float* scratch) {
    const int row = get_group_id(1);
    __global const int* w = rows + (long)row * (QUANT_STEP_FIELDS + 2 * kv);
    __global float* s = (__global float*)(arena + w[Q_SCORES]);
    const int stride = w[Q_SCORE_STRIDE], nq = w[Q_QUANTIZED], drop = w[Q_DROP];
    // a flush's scores in the store's order
    if (w[Q_FLUSH_FROM] >= 0)
        for (int h = get_local_id(0); h < kv * group; h += get_local_size(0))
            flushed_scores(s + (long)h * stride + w[Q_FLUSH_FROM], w[Q_FLUSH_PINNED], w[Q_FLUSH_COUNT]);
    if (drop <= 0) return;  // the whole work-group: a row with no eviction
    barrier(CLK_GLOBAL_MEM_FENCE);
    const int chunks = nq / chunk;
    __global float* sums = scratch + (long)row * (2 * kv + 1) * max_chunks;  // [kv][max_chunks]
    __global float* totals = sums + (long)kv * max_chunks;                   // [max_chunks]
    __global int* gone = (__global int*)(totals + max_chunks);               // [kv][max_chunks]
    chunk_sums(s, stride, kv, group, chunk, chunks, max_chunks, sums, totals);
    mark_dropped(w, kv, chunks, max_chunks, sums, totals, gone);
    move_kept_chunks(s, stride, kv, group, chunk, chunks, max_chunks, tables + w[Q_TABLE], w[Q_TABLE_STRIDE], blocks,
                     block_words, gone);
    move_full_precision_scores(s, stride, kv * group, nq, w[Q_HELD], drop * chunk);
}
