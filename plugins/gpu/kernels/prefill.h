// Prompt attention's body (one query row of one query head), shared by the hosts' kernel
// (prefill.cl) and the GPU plugin's prefill layers (plugin_layers.cl). Compile-time constants: as
// prefill.cl; with QUANT_TOKENS (and quant_block.h's constants) also the row over a head's 2-bit
// slots before its full-precision ones (MiniKV's store, prefill_row_quant).
#ifndef OVKC_PREFILL_H
#define OVKC_PREFILL_H

#include "paged_block.h"
#ifdef QUANT_TOKENS
#include "quant_block.h"
#endif

#define CHUNK 8

// The row's query (scaled) and its online softmax: the running max m, sum l and the
// probability-weighted values acc.
typedef struct {
    float q[HEAD_DIM];
    float acc[HEAD_DIM];
    float m, l;
} row_state;

inline void row_start(row_state* st, bool live, int h, int r, __global const ACT* q, int rows, float scale) {
    for (int d = 0; d < HEAD_DIM; ++d) {
        st->q[d] = live ? ACT_LOAD(q, ((long)h * rows + r) * HEAD_DIM + d) * scale : 0.0f;
        st->acc[d] = 0.0f;
    }
    st->m = -INFINITY;
    st->l = 0.0f;
}

// A tile's logits s (masked ones left out) into the softmax: p its probabilities under the new
// max, the accumulator rescaled by alpha; false where nothing of the row is in it yet.
inline bool tile_softmax(row_state* st, const float* s, const bool* masked, float* p, float* alpha) {
    float m_new = st->m;
    for (int c = 0; c < CHUNK; ++c) m_new = masked[c] ? m_new : fmax(m_new, s[c]);
    if (m_new == -INFINITY) return false;
    *alpha = exp(st->m - m_new);
    for (int c = 0; c < CHUNK; ++c) {
        p[c] = masked[c] ? 0.0f : exp(s[c] - m_new);
        st->l = c ? st->l + p[c] : st->l * *alpha + p[c];
    }
    st->m = m_new;
    return true;
}

// A prompt row's own tokens: the step's keys and values as the model gave them (`own_k`, `own_v`
// [kv_heads, T, HEAD_DIM], the activations' type), which it reads for its sequence's slots of the
// step (from `own_first` on; element `own_at` is that slot's first) rather than the store's
// rounded copies: a prompt attends its own tokens exactly at any store precision, as the CPU op's
// prompt attention and native's prefill do; a decode row reads the store (NO_OWN). own[c]: the
// element of tile slot c's key and value there, -1 for the store's.
#define NO_OWN 0, 0, INT_MAX, 0
inline void own_elements(int own_first, long own_at, const int* held, long* own) {
    for (int c = 0; c < CHUNK; ++c)
        own[c] = held[c] >= own_first ? own_at + (long)(held[c] - own_first) * HEAD_DIM : -1;
}

// A tile of CHUNK full-precision slots (each its block and slot in it, or its own token: own):
// the query's logits s.
inline void tile_logits(const row_state* st, __global const uchar** block, const int* slot,
                        __global const ACT* own_k, const long* own, float* s) {
    for (int c = 0; c < CHUNK; ++c) s[c] = 0.0f;
    for (int d = 0; d < HEAD_DIM; ++d) {
        const float qd = st->q[d];
        for (int c = 0; c < CHUNK; ++c)
            s[c] = fma(qd, own[c] >= 0 ? ACT_LOAD(own_k, own[c] + d) : load_key(block[c], d, slot[c]), s[c]);
    }
    for (int c = 0; c < CHUNK; ++c) s[c] = CAP_LOGIT(s[c]);
}

// Chelsea's log(degree) added to each slot's logit (the paper's equation 2: a merged slot stands
// for `degree` tokens), where the row has degrees (`degrees` by held slot; null: none, every
// degree 1).
inline void degree_bias(float* s, const int* held, __global const float* degrees) {
    if (!degrees) return;
    for (int c = 0; c < CHUNK; ++c) s[c] += log(degrees[held[c]]);
}

// The tile's logits s (masked ones left out) into the row: the softmax, then the values (own
// tokens' from own_v, as tile_logits').
inline void tile_values(row_state* st, __global const uchar** block, const int* slot, __global const ACT* own_v,
                        const long* own, const float* s, const bool* masked) {
    float p[CHUNK], alpha;
    if (!tile_softmax(st, s, masked, p, &alpha)) return;  // nothing of the row in it yet
    for (int d = 0; d < HEAD_DIM; ++d) {
        float a = st->acc[d] * alpha;
        for (int c = 0; c < CHUNK; ++c)
            a = fma(p[c], own[c] >= 0 ? ACT_LOAD(own_v, own[c] + d) : load_value(block[c], slot[c], d), a);
        st->acc[d] = a;
    }
}

// The row over the full-precision slots of its KV head's block table `table` (n held; n_max the
// largest n over the sub-group's lanes, the loop's bound: the sub-group's collectives need every
// lane in it) that it sees: those whose position (`positions`, the head's row) is at most `qpos`,
// or, without positions, the first `visible` (the slots are in position order: every slot before
// the step's, then the step's own), less the slots [hole_lo, hole_hi) (the step's flushed chunk,
// read from the 2-bit store instead). The slots go CHUNK at a time: their logits first (each query
// element loaded once for the chunk), then one rescale of the accumulator and the chunk's values
// added to it. Where `slot_logits` is given, each slot's logit goes there (the hole left out: the
// slots after it move down by its width), for the methods' scores. Where `slot_map` is given, the
// row's j-th slot is slot_map[j] of the table (ClusterKV's sinks, recalled and pending slots), not
// slot j. Where `degrees` is given (Chelsea's), each slot's log(degree) is added to its logit.
// own_k .. own_at: the row's own tokens (own_elements; NO_OWN: none).
inline void attend_slots(row_state* st, bool live, __global const uchar* pool, __global const int* table, int n,
                         int n_max, __global const int* positions, int visible, int qpos, int hole_lo, int hole_hi,
                         __global float* slot_logits, __global const int* slot_map, __global const float* degrees,
                         __global const ACT* own_k, __global const ACT* own_v, int own_first, long own_at) {
    for (int j0 = 0; j0 < n_max; j0 += CHUNK) {
        __global const uchar* block[CHUNK];
        int slot[CHUNK];  // past the last slot: the last (finite values, times a zero probability)
        int held[CHUNK];  // the slot's index among the row's (its degree's)
        bool masked[CHUNK];
        bool all_masked = true;
        for (int c = 0; c < CHUNK; ++c) {
            const int i = clamp(j0 + c, 0, max(n - 1, 0));
            const int j = slot_map ? slot_map[i] : i;
            block[c] = pool + (ulong)table[j / BLOCK_SIZE] * BLOCK_BYTES;
            slot[c] = j % BLOCK_SIZE;
            held[c] = j;
            masked[c] = !live || j0 + c >= n || (positions ? positions[j] > qpos : j0 + c >= visible) ||
                        (j0 + c >= hole_lo && j0 + c < hole_hi);
            all_masked = all_masked && masked[c];
        }
        if (sub_group_all(all_masked)) continue;  // after every row of the tile: the causal square's upper half
        float s[CHUNK];
        long own[CHUNK];
        own_elements(own_first, own_at, held, own);
        tile_logits(st, block, slot, own_k, own, s);
        degree_bias(s, held, degrees);
        if (slot_logits)
            for (int c = 0; c < CHUNK; ++c)
                if (!masked[c]) slot_logits[j0 + c - (j0 + c >= hole_hi ? hole_hi - hole_lo : 0)] = s[c];
        tile_values(st, block, slot, own_v, own, s, masked);
    }
}

#ifdef QUANT_TOKENS
// tile_logits and tile_values over 2-bit slots (each its 2-bit block and slot in it).
inline void tile_quant_logits(const row_state* st, __global const uchar** block, const int* slot, float* s) {
    for (int c = 0; c < CHUNK; ++c) s[c] = 0.0f;
    for (int d = 0; d < HEAD_DIM; ++d) {
        const float qd = st->q[d];
        for (int c = 0; c < CHUNK; ++c) s[c] = fma(qd, quant_key(block[c], slot[c], d), s[c]);
    }
}

inline void tile_quant_values(row_state* st, __global const uchar** block, const int* slot, const float* s,
                              const bool* masked) {
    float p[CHUNK], alpha;
    if (!tile_softmax(st, s, masked, p, &alpha)) return;
    for (int d = 0; d < HEAD_DIM; ++d) {
        float a = st->acc[d] * alpha;
        for (int c = 0; c < CHUNK; ++c) a = fma(p[c], quant_value(block[c], slot[c], d), a);
        st->acc[d] = a;
    }
}

// The row over its KV head's 2-bit slots (qtable: the head's 2-bit blocks in the store's order; nq
// held, nq_max the sub-group's largest), the first `visible` of them (the step's own flushed
// tokens after the row's are not); each slot's logit into `slot_logits` where given.
inline void attend_quant_slots(row_state* st, bool live, __global const uchar* qpool, __global const int* qtable,
                               int nq, int nq_max, int visible, __global float* slot_logits) {
    for (int j0 = 0; j0 < nq_max; j0 += CHUNK) {
        __global const uchar* block[CHUNK];
        int slot[CHUNK];
        bool masked[CHUNK];
        bool all_masked = true;
        for (int c = 0; c < CHUNK; ++c) {
            const int j = clamp(j0 + c, 0, max(nq - 1, 0));
            block[c] = qpool + (ulong)qtable[j / QUANT_TOKENS] * QBLOCK_BYTES;
            slot[c] = j % QUANT_TOKENS;
            masked[c] = !live || j0 + c >= nq || j0 + c >= visible;
            all_masked = all_masked && masked[c];
        }
        if (sub_group_all(all_masked)) continue;
        float s[CHUNK];
        tile_quant_logits(st, block, slot, s);
        if (slot_logits)
            for (int c = 0; c < CHUNK; ++c)
                if (!masked[c]) slot_logits[j0 + c] = s[c];
        tile_quant_values(st, block, slot, s, masked);
    }
}
#endif

// A decode row's slots [from, to) of its first n (through `slot_map` where given: one partition
// of the row, part_range), split across the sub-group's lanes (the whole sub-group is the
// partition's: every lane's state holds the same query): lane i takes slots j0 + c * SG + i of
// every SG * CHUNK from j0, CHUNK at a time into its own online softmax, so that the lanes read
// adjacent slots together; row_part_split merges them. The slots [hole_lo, hole_hi) are left out
// (over the 2-bit store: the step's flushed chunk, read from there instead). Each slot's logit
// into `slot_logits` where given (the hole left out: the slots after it move down by its width).
inline void attend_slots_split(row_state* st, __global const uchar* pool, __global const int* table, int n,
                               int hole_lo, int hole_hi, __global float* slot_logits,
                               __global const int* slot_map, __global const float* degrees, int from, int to) {
    const int lane = get_sub_group_local_id();
    n = min(n, to);
    for (int j0 = from; j0 < n; j0 += SG * CHUNK) {
        __global const uchar* block[CHUNK];
        int slot[CHUNK], held[CHUNK];
        bool masked[CHUNK];
        for (int c = 0; c < CHUNK; ++c) {
            const int i = j0 + c * SG + lane;
            const int k = clamp(i, 0, max(n - 1, 0));
            const int j = slot_map ? slot_map[k] : k;
            block[c] = pool + (ulong)table[j / BLOCK_SIZE] * BLOCK_BYTES;
            slot[c] = j % BLOCK_SIZE;
            held[c] = j;
            masked[c] = i >= n || (i >= hole_lo && i < hole_hi);
        }
        float s[CHUNK];
        long own[CHUNK];  // decode rows: the store
        for (int c = 0; c < CHUNK; ++c) own[c] = -1;
        tile_logits(st, block, slot, 0, own, s);
        degree_bias(s, held, degrees);
        if (slot_logits)
            for (int c = 0; c < CHUNK; ++c) {
                const int i = j0 + c * SG + lane;
                if (!masked[c]) slot_logits[i - (i >= hole_hi ? hole_hi - hole_lo : 0)] = s[c];
            }
        tile_values(st, block, slot, 0, own, s, masked);
    }
}

#ifdef QUANT_TOKENS
// attend_slots_split over a KV head's 2-bit slots (qtable: its 2-bit blocks in the store's order),
// those in [from, to) of the first nq: a decode row's, split across the sub-group's lanes as there.
inline void attend_quant_slots_split(row_state* st, __global const uchar* qpool, __global const int* qtable, int nq,
                                     __global float* slot_logits, int from, int to) {
    const int lane = get_sub_group_local_id();
    nq = min(nq, to);
    for (int j0 = from; j0 < nq; j0 += SG * CHUNK) {
        __global const uchar* block[CHUNK];
        int slot[CHUNK];
        bool masked[CHUNK];
        for (int c = 0; c < CHUNK; ++c) {
            const int i = j0 + c * SG + lane;
            const int j = clamp(i, 0, max(nq - 1, 0));
            block[c] = qpool + (ulong)qtable[j / QUANT_TOKENS] * QBLOCK_BYTES;
            slot[c] = j % QUANT_TOKENS;
            masked[c] = i >= nq;
        }
        float s[CHUNK];
        tile_quant_logits(st, block, slot, s);
        if (slot_logits)
            for (int c = 0; c < CHUNK; ++c)
                if (!masked[c]) slot_logits[j0 + c * SG + lane] = s[c];
        tile_quant_values(st, block, slot, s, masked);
    }
}
#endif

// A decode row is split into PARTS partitions of its slots, a sub-group each (native's decode:
// the whole GPU busy for one long sequence), then merged (merge_parts). Partition `part` of a row
// of `total` slots: [*lo, *hi), whole tiles of SG * CHUNK slots (those past the row: empty).
#ifndef PARTS
#define PARTS 1
#endif
#define PART_FLOATS (HEAD_DIM + 2)
inline void part_range(int total, int part, int* lo, int* hi) {
    const int tile = SG * CHUNK, size = ((total + PARTS - 1) / PARTS + tile - 1) / tile * tile;
    *lo = min(part * size, total);
    *hi = min(*lo + size, total);
}

// A partition's softmax state, its lanes' merged (each scaled by exp(its max - the partition's
// max)): the max, the sum, then the unnormalized values [HEAD_DIM], PART_FLOATS floats at `part`.
inline void row_part_split(const row_state* st, __global float* part) {
    const int lane = get_sub_group_local_id();
    const float m = sub_group_reduce_max(st->m);
    const float w = st->m == -INFINITY ? 0.0f : exp(st->m - m);
    const float l = sub_group_reduce_add(st->l * w);
    for (int d = 0; d < HEAD_DIM; ++d) {
        const float a = sub_group_reduce_add(st->acc[d] * w);
        if (lane == d % SG) part[2 + d] = a;
    }
    if (lane == 0) {
        part[0] = m;
        part[1] = l;
    }
}

// A row's output from its PARTS partitions' states (`parts`, row_part_split's, in order), written
// by lane d % SG for dim d; its log-sum-exp, where `lse` is given.
inline void merge_parts(__global const float* parts, int h, int r, int rows, __global ACT* out, __global float* lse) {
    float m = -INFINITY;
    for (int p = 0; p < PARTS; ++p) m = fmax(m, parts[p * PART_FLOATS]);
    float w[PARTS], l = 0.0f;  // each partition's weight: exp(its max - the row's); 0 for an empty one
    for (int p = 0; p < PARTS; ++p) {
        w[p] = parts[p * PART_FLOATS] == -INFINITY ? 0.0f : exp(parts[p * PART_FLOATS] - m);
        l += parts[p * PART_FLOATS + 1] * w[p];
    }
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (int d = get_sub_group_local_id(); d < HEAD_DIM; d += SG) {
        float a = 0.0f;
        for (int p = 0; p < PARTS; ++p) a += w[p] > 0.0f ? parts[p * PART_FLOATS + 2 + d] * w[p] : 0.0f;
        ACT_STORE(a * inv, ((long)h * rows + r) * HEAD_DIM + d, out);
    }
    if (lse && get_sub_group_local_id() == 0) lse[h * rows + r] = l > 0.0f ? m + log(l) : -INFINITY;
}

// The row's output (and its log-sum-exp, where `lse` is given).
inline void row_finish(const row_state* st, bool live, int h, int r, int rows, __global ACT* out,
                       __global float* lse) {
    if (!live) return;
    const float inv = st->l > 0.0f ? 1.0f / st->l : 0.0f;
    for (int d = 0; d < HEAD_DIM; ++d) ACT_STORE(st->acc[d] * inv, ((long)h * rows + r) * HEAD_DIM + d, out);
    if (lse) lse[h * rows + r] = st->l > 0.0f ? st->m + log(st->l) : -INFINITY;
}

// Row r (of `rows`) of query head h over the full-precision slots it sees (attend_slots). `lse`
// may be null (the plugin's layer: no window scores).
inline void prefill_row(int r, int h, __global const uchar* pool, __global const int* table, int n, int n_max,
                        __global const int* positions, int visible, int qpos, __global const ACT* q, int rows,
                        float scale, __global ACT* out, __global float* lse) {
    const bool live = r < rows;
    row_state st;
    row_start(&st, live, h, r, q, rows, scale);
    attend_slots(&st, live, pool, table, n, n_max, positions, visible, qpos, 0, 0, 0, 0, 0, NO_OWN);
    row_finish(&st, live, h, r, rows, out, lse);
}

#endif  // OVKC_PREFILL_H
