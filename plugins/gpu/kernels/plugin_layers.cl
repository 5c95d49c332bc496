// Our op's steps as layers of OpenVINO's GPU plugin (SimpleGPU custom layers, CONFIG_FILE:
// ov_kvcrush/gpu/plugin_layers.py writes the XML). A layer's kernel is given its input tensors,
// then its one output, and nothing else; so the pool and block tables come in as tensors (the
// pool a remote tensor the store layer writes in place), and the step's numbers in the tensor
// `step` (int32: the width of the block tables, the step's rows, the width of the 2-bit block
// tables, the query rows the methods read, the stride of the rows' logits: 0 for none, ...:
// ov_kvcrush/gpu/plugin_layers.py's STEP_FIELDS). The bodies are the pyopencl and
// SYCL hosts' kernels' own (paged_attention.h, paged_store.h, prefill.h): the same code on every
// host.
//
// A step of the model is one row of tokens from several sequences side by side (continuous
// batching: a prompt's chunk beside other sequences' decode tokens): `tokens` [T, 3] gives each
// token its sequence's index s in the step, its index i among that sequence's tokens, and whether
// its rows attend the step's own tokens exactly (1: its sequence's step is a prompt's or several
// tokens, the CPU op's prompt attention: those slots read from the model's k and v, not the
// store's rounded copies; 0: a decode token, which reads the store); the
// cache's tensors have a row per (sequence, KV head), row s * kv_heads + kv: `tables` [rows,
// step[0]] its block ids, `first` [rows] its first new slot, `lengths` [rows] its slots after the
// step. Token i of sequence s goes to slot first + i and sees the slots before first + i + 1 (the
// slots are in position order: every earlier token's, then the step's).
//
// Compile-time constants (-D, from the layer's attributes): SG, KV_PRECISION, BLOCK_SIZE,
// HEAD_DIM, GROUP, SCALE (the logit scale, a float), ACT_HALF (the store's and prompt layer's
// activations are f16: the plugin runs the model in f16); and the layer's guard (OVKC_LAYER_*):
// the plugin builds a layer's source as one program that must hold that layer's kernel only.
//
// Over MiniKV's 2-bit store (the flush and quant prefill layers; QUANT_TOKENS, QGROUP, KEY_BITS,
// VALUE_BITS: quant_block.h) each row also has its 2-bit blocks `qtables` [rows, step[2]] in the
// store's order and their slots `qlengths` [rows] after the step, in a second pool `qpool`; and
// `flush` [rows, 2]: the full-precision slots the step quantizes (their first, their count: whole
// 2-bit blocks, the last `count` slots of qlengths), the reference's flush as the residual fills.

#include "paged_attention.h"
#include "paged_store.h"
#include "prefill.h"
#include "clusterkv.h"
#include "quest.h"
#include "chelsea.h"

// A sliding-window layer's span (Gemma's local layers: a row sees the WINDOW slots up to its own;
// the layer holds no method, its slots consecutive positions); 0: a global layer.
#ifndef WINDOW
#define WINDOW 0
#endif
// The first slot a row that sees `visible` slots attends: the slots before it are left out as a
// hole (attend_slots').
#define WINDOW_START(visible) (WINDOW ? max((visible) - WINDOW, 0) : 0)

#define TOKEN_FIELDS 3
#define TOKEN_SEQ(t) tokens[TOKEN_FIELDS * (t)]
#define TOKEN_INDEX(t) tokens[TOKEN_FIELDS * (t) + 1]
#define TOKEN_OWN(t) tokens[TOKEN_FIELDS * (t) + 2]

// The own-token arguments of attend_slots (prefill.h) for token t's rows in KV head kv of its
// sequence's step, whose first slot is `first_slot`: the step's k and v where it attends them
// (TOKEN_OWN), else NO_OWN.
#define OWN_ARGS(t, kv, first_slot) \
    k, v, TOKEN_OWN(t) ? (first_slot) : INT_MAX, ((long)(kv) * step[1] + (t) - TOKEN_INDEX(t)) * HEAD_DIM

// k, v [kv_heads, T, HEAD_DIM] to each token's slot; the output is each token's slot [kv_heads,
// T], which the prompt layer takes as an input so that it runs after the store. Global (SG, T,
// kv_heads), local (SG, 1, 1).
#ifdef OVKC_LAYER_STORE
__attribute__((intel_reqd_sub_group_size(SG)))
__kernel void ovkc_store(__global uchar* pool, __global const int* tables, __global const int* first,
                         __global const int* tokens, __global const ACT* k, __global const ACT* v,
                         __global const int* step, __global int* slots) {
    const int t = get_global_id(1), kv = get_global_id(2), count = get_global_size(1);
    const int row = TOKEN_SEQ(t) * get_global_size(2) + kv, slot = first[row] + TOKEN_INDEX(t);
    store_token(t, kv, count, pool, tables + row * step[0], slot, k, v);
    if (get_sub_group_local_id() == 0) slots[kv * count + t] = slot;
}
#endif

// logits [q_heads, step[0] * BLOCK_SIZE] of the query q [q_heads, HEAD_DIM] over each KV head's
// lengths[kv] slots. Global (step[0] * BLOCK_SIZE, q_heads), local (SG, 1).
#ifdef OVKC_LAYER_LOGITS
__attribute__((intel_reqd_sub_group_size(SG)))
__kernel void ovkc_logits(__global const uchar* pool, __global const int* tables, __global const int* lengths,
                          __global const float* q, __global const int* step, __global const int* stored,
                          __global float* logits) {
    logits_item(get_global_id(0), get_global_id(1), pool, tables, step[0], lengths, 0, lengths, 0, q, SCALE, logits,
                step[0] * BLOCK_SIZE);
}
#endif

// probs [q_heads, step[0] * BLOCK_SIZE]: each head's softmax over its slots (what the importance
// methods accumulate). Global (SG, q_heads), local (SG, 1).
#ifdef OVKC_LAYER_SOFTMAX
__attribute__((intel_reqd_sub_group_size(SG)))
__kernel void ovkc_softmax(__global const float* logits, __global const int* lengths, __global const int* step,
                           __global float* probs) {
    softmax_head(get_global_id(1), logits, step[0] * BLOCK_SIZE, lengths, probs);
}
#endif

// out [q_heads, HEAD_DIM]: the probabilities' sum of each KV head's values. Global (HEAD_DIM,
// q_heads), local (SG, 1).
#ifdef OVKC_LAYER_VALUES
__attribute__((intel_reqd_sub_group_size(SG)))
__kernel void ovkc_values(__global const uchar* pool, __global const int* tables, __global const int* lengths,
                          __global const float* probs, __global const int* step, __global float* out) {
    values_item(get_global_id(0), get_global_id(1), pool, tables, step[0], lengths, 0, lengths, 0, probs,
                step[0] * BLOCK_SIZE, 0, out);
}
#endif

// Where step[4] (a stride) is set, each row's logits over its slots go to `logits` (bytes: our
// buffer, written in place), float [q_heads][T][step[4]]: a decode step's probabilities are
// exp(logit - lse), which the scoring methods add to their scores without reading the keys again.
// The slots a row sees, in the store's order: over the 2-bit store its 2-bit slots first, then its
// full-precision ones (the flushed left out). Each row's log-sum-exp [q_heads][T] follows them;
// where step[4] is not set but step[SUM_STRIDE] is (the window sums' stride: ovkc_rows), it goes
// at float step[LSE_AT] of `logits`, after the sums.
#define SUM_STRIDE 8
#define SUM_MAX 9
#define LSE_AT 10
#define PARTS_AT 11

inline __global float* row_logits(__global uchar* logits, __global const int* step, int h, int t) {
    return step[4] ? (__global float*)logits + ((long)h * step[1] + t) * step[4] : 0;
}

// In a step of decode rows alone (step[7]) each row's PARTS partitions' states (row_part_split) go
// at float step[PARTS_AT] of `logits`, [q_heads][T][PARTS][PART_FLOATS]; the rows layer merges them.
inline __global float* row_parts(__global uchar* logits, __global const int* step, int h, int r) {
    return (__global float*)logits + step[PARTS_AT] + ((long)h * step[1] + r) * PARTS * PART_FLOATS;
}

inline __global float* row_lse(__global uchar* logits, __global const int* step) {
    if (step[4]) return (__global float*)logits + (long)get_global_size(1) * step[1] * step[4];
    return step[SUM_STRIDE] ? (__global float*)logits + step[LSE_AT] : 0;
}

// The fields of a row's `recall` under ClusterKV (RECALL_WIDTH ints; ov_kvcrush/gpu/plugin_layers.py:
// RECALL_FIELDS): the step's token whose query recalls (-1: the row attends its slots in order),
// the KV head, the clusters C, the word offsets in `index` of the centroids [C, HEAD_DIM] (float),
// sizes [C], offsets [C + 1] and sorted slots [N], the slots clustered N, the sinks, the first
// pending slot, the budget of recalled slots, and the slots held after the step.
#define RECALL_WIDTH 12
#define R_TOKEN 0
#define R_HEAD 1
#define R_CLUSTERS 2
#define R_CENTROIDS 3
#define R_SIZES 4
#define R_OFFSETS 5
#define R_SORTED 6
#define R_CLUSTERED 7
#define R_SINKS 8
#define R_PENDING 9
#define R_BUDGET 10
#define R_HELD 11

// A row's region of `recalled` (ints): the count, the slot list, the scores, the order.
inline __global int* recall_region(__global uchar* recalled, __global const int* step, int row) {
    return (__global int*)recalled + (long)row * (1 + step[5] + 2 * step[6]);
}

// The slots a row of the cache attends under a recall, where its recall listed them for the
// step's decode token (`recall` may be null: no recall): its region of `recalled`, the count then
// the list; null where the row attends its slots in order.
inline __global const int* row_list(__global const int* recall, __global uchar* recalled, __global const int* step,
                                    int row) {
    return recall && recall[row * RECALL_WIDTH + R_TOKEN] >= 0 ? recall_region(recalled, step, row) : 0;
}

// A row's degrees under Chelsea (`merge`: the rows' MERGE_WIDTH fields, null without merging), in
// `index`; null where it has none (every degree 1).
inline __global const float* row_degrees(__global const int* merge, __global const uchar* index, int row) {
    const int at = merge ? merge[row * MERGE_WIDTH + M_DEGREES] : -1;
    return at >= 0 ? (__global const float*)index + at : 0;
}

// out [q_heads, T, HEAD_DIM]: each token's query rows q [q_heads, T, HEAD_DIM] over the slots its
// sequence's KV head holds that it sees (a prompt's chunk row by row; a decode token sees them
// all; under a recall, a decode token whose row has a list sees its list: row_list). Global
// (T * SG * PARTS, q_heads), local (SG, 1): a step of decode rows alone (step[7]) gives each row
// PARTS sub-groups, each a partition of its slots split across the lanes (attend_slots_split),
// its state into row_parts for the rows layer to merge; otherwise the first T rounded up to SG
// work-items take a row each, the sub-group's lanes SG rows side by side. Each slot's
// logit and each row's log-sum-exp into `logits` where step[4] asks. In a sliding-window layer
// (WINDOW) each row sees the last WINDOW of its slots.
inline void prefill_layer(__global const uchar* pool, __global const int* tables, __global const int* lengths,
                          __global const int* first, __global const int* tokens, __global const ACT* q,
                          __global const ACT* k, __global const ACT* v,
                          __global const int* step, __global uchar* logits, __global const int* recall,
                          __global uchar* recalled, __global const int* merge, __global const uchar* index,
                          __global ACT* out) {
    const int h = get_global_id(1), rows = step[1];
    if (step[7]) {
        const int r = get_global_id(0) / SG / PARTS, part = get_global_id(0) / SG % PARTS;
        if (r >= rows) return;  // the whole sub-group: its work-items are consecutive in dim 0
        const int row = TOKEN_SEQ(r) * (get_global_size(1) / GROUP) + h / GROUP;
        __global const int* list = row_list(recall, recalled, step, row);
        const int n = list ? list[0] : min(lengths[row], first[row] + TOKEN_INDEX(r) + 1);
        int lo, hi;
        part_range(n, part, &lo, &hi);
        row_state st;
        row_start(&st, true, h, r, q, rows, SCALE);
        attend_slots_split(&st, pool, tables + row * step[0], n, 0, WINDOW_START(n), row_logits(logits, step, h, r),
                           list ? list + 1 : 0, row_degrees(merge, index, row), lo, hi);
        row_part_split(&st, row_parts(logits, step, h, r) + part * PART_FLOATS);
        return;
    }
    const int r = get_global_id(0);
    if (r >= (rows + SG - 1) / SG * SG) return;  // whole sub-groups past the rows
    const int t = min(r, rows - 1);  // a lane past the last row reads the last (and writes nothing)
    const int row = TOKEN_SEQ(t) * (get_global_size(1) / GROUP) + h / GROUP;
    __global const int* list = row_list(recall, recalled, step, row);
    const int n = list ? list[0] : lengths[row];
    const int visible = list ? n : first[row] + TOKEN_INDEX(t) + 1;
    const bool live = r < rows;
    row_state st;
    row_start(&st, live, h, r, q, rows, SCALE);
    attend_slots(&st, live, pool, tables + row * step[0], n, sub_group_reduce_max(n), 0, visible, 0, 0,
                 WINDOW_START(visible), row_logits(logits, step, h, t), list ? list + 1 : 0, row_degrees(merge, index, row),
                 OWN_ARGS(t, h / GROUP, list ? INT_MAX : first[row]));
    row_finish(&st, live, h, r, rows, out, row_lse(logits, step));
}

#ifdef OVKC_LAYER_PREFILL
__attribute__((intel_reqd_sub_group_size(SG)))
__kernel void ovkc_prefill(__global const uchar* pool, __global const int* tables, __global const int* lengths,
                           __global const int* first, __global const int* tokens, __global const ACT* q,
                           __global const ACT* k, __global const ACT* v, __global const int* step,
                           __global const int* stored, __global uchar* logits, __global ACT* out) {
    prefill_layer(pool, tables, lengths, first, tokens, q, k, v, step, logits, 0, 0, 0, 0, out);
}
#endif

// After the prompt layer, what the methods score the step by (the CPU op's scores are its
// attention's): the query rows `score_rows` names (step[3] indices among the step's T tokens,
// int64 in the model and int32 in the plugin, which runs i64 as i32, a sequence's adjacent),
// written as f32 [q_heads, step[3], HEAD_DIM] into `rows`, our buffer (bytes, written in place: a
// model output the plugin would copy into it through the host); and where step[SUM_STRIDE] asks
// (0: not), their window sums: for each sequence with score rows and query head h, each slot
// j < step[SUM_STRIDE]: the probability its score rows give it, summed (step[SUM_MAX]: the
// largest instead; 0 past the slots a row sees), each row's logit less the log-sum-exp the prompt
// layer wrote (row_lse). A slot of the step's own is keyed as the row attended it: from `k` where
// its sequence attends its own tokens exactly (TOKEN_OWN), else from the store; so a prompt's
// scores are those of its exact attention, and no host launch reads the keys again for them.
// Into `logits`, float [sequence][q_heads][step[SUM_STRIDE]]. The output is `attended` (the prompt
// layer's) passed on, so that the model's next layers run after this one. Global (T * SG,
// q_heads), local (SG, 1): work-item i copies its lane's elements of row i / SG (and of score row
// i / SG), then sums slots i, i + T * SG, ... A local layer (WINDOW) scores nothing.
#ifdef OVKC_LAYER_ROWS
inline float slot_sum(__global const uchar* pool, __global const int* table, int j, __global const ACT* k,
                      long own_at, __global const ACT* q, __global const int* tokens, __global const int* score_rows,
                      int a, int b, int first, __global const float* lse, int h, int rows, bool largest) {
    __global const uchar* block = pool + (ulong)table[j / BLOCK_SIZE] * BLOCK_BYTES;
    float key[HEAD_DIM];
    for (int d = 0; d < HEAD_DIM; ++d) key[d] = own_at >= 0 ? ACT_LOAD(k, own_at + d) : load_key(block, d, j % BLOCK_SIZE);
    float total = 0.0f;
    for (int i = a; i < b; ++i) {
        const int t = score_rows[i];
        if (j > first + TOKEN_INDEX(t)) continue;  // after the row: not seen
        float s = 0.0f;
        for (int d = 0; d < HEAD_DIM; ++d)
            s = fma(ACT_LOAD(q, ((long)h * rows + t) * HEAD_DIM + d) * (float)SCALE, key[d], s);
        const float p = exp(CAP_LOGIT(s) - lse[h * rows + t]);
        total = largest ? fmax(total, p) : total + p;
    }
    return total;
}

__attribute__((intel_reqd_sub_group_size(SG)))
__kernel void ovkc_rows(__global uchar* rows_out, __global const uchar* pool, __global const int* tables,
                        __global const int* lengths, __global const int* first, __global const int* tokens,
                        __global const ACT* q, __global const ACT* k, __global const int* step,
                        __global const int* score_rows, __global const ACT* attended, __global uchar* logits,
                        __global ACT* out) {
    const int i = get_global_id(0), h = get_global_id(1), items = get_global_size(0), rows = step[1];
    const int q_heads = get_global_size(1), kv = h / GROUP, kv_heads = q_heads / GROUP, t = i / SG, n = step[3];
    if (step[7])  // decode rows alone: the row's partitions merged
        merge_parts(row_parts(logits, step, h, t), h, t, rows, out, row_lse(logits, step));
    for (int d = get_sub_group_local_id(); d < HEAD_DIM; d += SG) {
        if (!step[7]) out[((long)h * rows + t) * HEAD_DIM + d] = attended[((long)h * rows + t) * HEAD_DIM + d];
        if (t < n)
            ((__global float*)rows_out)[((long)h * n + t) * HEAD_DIM + d] =
                ACT_LOAD(q, ((long)h * rows + score_rows[t]) * HEAD_DIM + d);
    }
    const int stride = step[SUM_STRIDE];
    if (!stride || WINDOW) return;
    __global const float* lse = (__global const float*)logits + step[LSE_AT];
    __global float* sums = (__global float*)logits;
    for (int a = 0, b; a < n; a = b) {  // a sequence's score rows: a .. b
        const int seq = TOKEN_SEQ(score_rows[a]), row = seq * kv_heads + kv;
        for (b = a + 1; b < n && TOKEN_SEQ(score_rows[b]) == seq; ++b) {}
        const int held = lengths[row], from = first[row];
        const long own0 = ((long)kv * rows + score_rows[a] - TOKEN_INDEX(score_rows[a])) * HEAD_DIM;
        for (int j = i; j < stride; j += items) {
            const long own_at = TOKEN_OWN(score_rows[a]) && j >= from ? own0 + (long)(j - from) * HEAD_DIM : -1;
            const float total = j < held ? slot_sum(pool, tables + row * step[0], j, k, own_at, q, tokens, score_rows,
                                                    a, b, from, lse, h, rows, step[SUM_MAX]) : 0.0f;
            sums[((long)seq * q_heads + h) * stride + j] = total;
        }
    }
}
#endif

// ClusterKV's recall of each row whose token is a decode step's (the reference's decode, in the
// hosts' steps: centroid_scores, rank_order, recall_slots, attended_slots): the row's query group
// scores its centroids, ranks them, recalls whole clusters up to the budget, and lists the slots
// it attends into its region of `recalled`. The output is `recall` passed on, so that the prompt
// layer runs after it. Global (SG, rows), local (SG, 1): a sub-group (the work-group) per row.
#ifdef OVKC_LAYER_RECALL
__attribute__((intel_reqd_sub_group_size(SG)))
__kernel void ovkc_recall(__global const uchar* index, __global const int* recall, __global const ACT* q,
                          __global const int* step, __global const int* stored, __global uchar* recalled,
                          __global int* out) {
    const int row = get_global_id(1), lane = get_sub_group_local_id();
    __global const int* r = recall + row * RECALL_WIDTH;
    for (int i = lane; i < RECALL_WIDTH; i += SG) out[row * RECALL_WIDTH + i] = r[i];
    if (r[R_TOKEN] < 0) return;
    const int C = r[R_CLUSTERS], tokens = step[1];
    __global const float* words = (__global const float*)index;
    __global const int* ints = (__global const int*)index;
    __global int* region = recall_region(recalled, step, row);
    __global int* map = region + 1;
    __global float* scores = (__global float*)(map + step[5]);
    __global int* order = (__global int*)(scores + step[6]);
    __global const ACT* qg = q + ((long)r[R_HEAD] * GROUP * tokens + r[R_TOKEN]) * HEAD_DIM;
    for (int c = lane; c < C; c += SG)
        scores[c] = centroid_score(qg, (long)tokens * HEAD_DIM, words + r[R_CENTROIDS] + (long)c * HEAD_DIM);
    barrier(CLK_GLOBAL_MEM_FENCE);
    for (int c = lane; c < C; c += SG) order[cluster_rank(scores, C, c)] = c;
    barrier(CLK_GLOBAL_MEM_FENCE);
    const int sinks = r[R_SINKS], pending = r[R_PENDING], held = r[R_HELD];
    const int count = recall_clusters(order, ints + r[R_SIZES], ints + r[R_OFFSETS], ints + r[R_SORTED], C,
                                      r[R_BUDGET], map + sinks);
    for (int j = lane; j < sinks; j += SG) map[j] = attended_slot(j, sinks, count, pending, map + sinks);
    const int n = sinks + count + (held - pending);
    for (int j = sinks + count + lane; j < n; j += SG) map[j] = attended_slot(j, sinks, count, pending, map + sinks);
    if (lane == 0) region[0] = n;
}
#endif

// The fields of a row's `recall` under Quest (ov_kvcrush/gpu/plugin_layers.py: PAGE_FIELDS).
#define P_TOKEN 0
#define P_HEAD 1
#define P_PAGES 2
#define P_KMAX 3
#define P_KMIN 4
#define P_FIRST 5
#define P_WANT 6
#define P_HELD 7
#define P_PAGE 8

// Quest's recall of each row whose token is a decode step's (the hosts' steps: page_bounds,
// page_scores, head_decisions_topk, page_slots): the bounds of the pages from P_FIRST on (the
// step's token is stored: the newest page's bounds follow it, and a page that filled is final)
// into `index`, every page but the newest scored by the row's query group's upper bound, the
// top P_WANT - 1 of them (ties to the earlier page) and the newest kept, and the slots of the
// kept pages listed in page order into the row's region of `recalled`. The output is `recall`
// passed on. Global (SG, rows), local (SG, 1): a sub-group (the work-group) per row.
#ifdef OVKC_LAYER_PAGES
__attribute__((intel_reqd_sub_group_size(SG)))
__kernel void ovkc_pages(__global const uchar* pool, __global const int* tables, __global uchar* index,
                         __global const int* recall, __global const ACT* q, __global const int* step,
                         __global const int* stored, __global uchar* recalled, __global int* out) {
    const int row = get_global_id(1), lane = get_sub_group_local_id();
    __global const int* r = recall + row * RECALL_WIDTH;
    for (int i = lane; i < RECALL_WIDTH; i += SG) out[row * RECALL_WIDTH + i] = r[i];
    if (r[P_TOKEN] < 0) return;
    const int page = r[P_PAGE], pages = r[P_PAGES], held = r[P_HELD], tokens = step[1];
    __global float* kmax = (__global float*)index + r[P_KMAX];
    __global float* kmin = (__global float*)index + r[P_KMIN];
    __global const int* table = tables + row * step[0];
    for (int p = r[P_FIRST]; p < pages; ++p)
        for (int d = lane; d < HEAD_DIM; d += SG) page_bound(pool, table, page, p, held, d, kmax, kmin);
    barrier(CLK_GLOBAL_MEM_FENCE);
    __global int* region = recall_region(recalled, step, row);
    __global int* map = region + 1;
    __global float* scores = (__global float*)(map + step[5]);
    __global int* kept = (__global int*)(scores + step[6]);
    __global const ACT* qg = q + ((long)r[P_HEAD] * GROUP * tokens + r[P_TOKEN]) * HEAD_DIM;
    for (int p = lane; p < pages - 1; p += SG)
        scores[p] = page_score(qg, (long)tokens * HEAD_DIM, GROUP, kmax + (long)p * HEAD_DIM, kmin + (long)p * HEAD_DIM);
    barrier(CLK_GLOBAL_MEM_FENCE);
    for (int p = lane; p < pages - 1; p += SG) kept[p] = cluster_rank(scores, pages - 1, p) < r[P_WANT] - 1;
    barrier(CLK_GLOBAL_MEM_FENCE);
    int at = 0;
    for (int p = 0; p < pages; ++p) {
        if (p < pages - 1 && !kept[p]) continue;
        const int size = min(held, (p + 1) * page) - p * page;
        for (int s = lane; s < size; s += SG) map[at + s] = p * page + s;
        at += size;
    }
    if (lane == 0) region[0] = at;
}
#endif

// The prompt layer under ClusterKV and Quest: ovkc_prefill's, a decode row over the slots its
// recall listed for it (every one it sees), the other rows over their slots in order. Global,
// local: ovkc_prefill's.
#ifdef OVKC_LAYER_RPREFILL
__attribute__((intel_reqd_sub_group_size(SG)))
__kernel void ovkc_recall_prefill(__global const uchar* pool, __global const int* tables, __global const int* lengths,
                                  __global const int* first, __global const int* tokens, __global const ACT* q,
                                  __global const ACT* k, __global const ACT* v, __global const int* step,
                                  __global const int* stored, __global uchar* logits, __global uchar* recalled,
                                  __global ACT* out) {
    // `stored` is the recall layer's output: the rows' recall
    prefill_layer(pool, tables, lengths, first, tokens, q, k, v, step, logits, stored, recalled, 0, 0, out);
}
#endif

// Chelsea's merge of each row whose merge says so (M_HELD > 0: a decode step took it to the
// budget plus the merge interval), after the store and before the prompt layer attends
// (chelsea.h's merge_row over the row's degrees and scores in `index`, working in its words of
// `scratch`). The output is `merge` passed on, so that the prompt layer runs after it and finds
// each row's degrees. Global (SG, rows), local (SG, 1): a sub-group (the work-group) per row.
#ifdef OVKC_LAYER_MERGE
__attribute__((intel_reqd_sub_group_size(SG)))
__kernel void ovkc_merge(__global uchar* pool, __global const int* tables, __global uchar* index,
                         __global const int* merge, __global uchar* scratch, __global const int* step,
                         __global const int* stored, __global int* out) {
    const int row = get_global_id(1), lane = get_sub_group_local_id();
    __global const int* mv = merge + row * MERGE_WIDTH;
    for (int i = lane; i < MERGE_WIDTH; i += SG) out[row * MERGE_WIDTH + i] = mv[i];
    if (!mv[M_HELD]) return;
    __global float* words = (__global float*)index;
    __global float* degrees = mv[M_DEGREES] >= 0 ? words + mv[M_DEGREES] : 0;
    __global float* scores = mv[M_SCORES] >= 0 ? words + mv[M_SCORES] : 0;
    merge_row(pool, tables + row * step[0], mv, degrees, scores, 1, 0, degrees, scores,
              (__global int*)scratch + mv[M_SCRATCH]);
}
#endif

// The prompt layer under Chelsea: ovkc_prefill's, each slot's log(degree) added to its logit
// (`stored` is the merge layer's output: the rows' merge, which says where their degrees are).
// Global, local: ovkc_prefill's.
#ifdef OVKC_LAYER_MPREFILL
__attribute__((intel_reqd_sub_group_size(SG)))
__kernel void ovkc_merge_prefill(__global const uchar* pool, __global const int* tables, __global const int* lengths,
                                 __global const int* first, __global const int* tokens, __global const ACT* q,
                                 __global const ACT* k, __global const ACT* v, __global const int* step,
                                 __global const int* stored, __global uchar* logits, __global const uchar* index,
                                 __global ACT* out) {
    prefill_layer(pool, tables, lengths, first, tokens, q, k, v, step, logits, 0, 0, stored, index, out);
}
#endif

// The step's flush: each row's full-precision slots [flush[row][0], + flush[row][1]) (whole 2-bit
// blocks, the step's own tokens among them: the reference quantizes a chunk as it fills, before
// attending) quantized into the row's last 2-bit blocks. The full-precision slots stay (the prompt
// layer skips them; the host drops them after the step). Output [rows, QUANT_TOKENS]: each
// token's count, so that the prompt layer runs after it. Global (QUANT_TOKENS, rows), local (1, 1):
// token t of each chunk writes its key groups (t a multiple of QGROUP) and its value groups.
#ifdef OVKC_LAYER_FLUSH
__kernel void ovkc_flush(__global const uchar* pool, __global const int* tables, __global uchar* qpool,
                         __global const int* qtables, __global const int* qlengths, __global const int* flush,
                         __global const int* step, __global const int* stored, __global int* out) {
    const int t = get_global_id(0), row = get_global_id(1);
    const int start = flush[2 * row], count = flush[2 * row + 1];
    out[row * QUANT_TOKENS + t] = count;
    __global const int* table = tables + row * step[0];
    const int first_block = (qlengths[row] - count) / QUANT_TOKENS;
    for (int c = 0; c < count / QUANT_TOKENS; ++c) {
        __global uchar* blk = qpool + (ulong)qtables[row * step[2] + first_block + c] * QBLOCK_BYTES;
        const int base = start + c * QUANT_TOKENS;
        if (t % QGROUP == 0) {
            for (int ch = 0; ch < HEAD_DIM; ++ch) {
                float group[QGROUP];
                for (int i = 0; i < QGROUP; ++i) {
                    const int j = base + t + i;
                    group[i] = slot_key(pool, table, j, ch);
                }
                store_key_group(group, blk, t / QGROUP, ch);
            }
        }
        const int j = base + t;
        __global const uchar* src = pool + (ulong)table[j / BLOCK_SIZE] * BLOCK_BYTES;
        for (int cg = 0; cg < HEAD_DIM / QGROUP; ++cg) {
            float group[QGROUP];
            for (int i = 0; i < QGROUP; ++i) group[i] = load_value(src, j % BLOCK_SIZE, cg * QGROUP + i);
            store_value_group(group, blk, t, cg);
        }
    }
}
#endif

// The prompt layer over the 2-bit store: each token's rows over its row's 2-bit slots (those of
// the step's flushed chunk at or before it: the rest are older and all seen), then over its
// full-precision slots as ovkc_prefill, less the flushed ones, under one softmax. Global, local:
// ovkc_prefill's (a step of decode rows alone: PARTS sub-groups a row, each a partition of its
// slots of both stores, the 2-bit ones first, split across the lanes; the rows layer merges them).
#ifdef OVKC_LAYER_QPREFILL
__attribute__((intel_reqd_sub_group_size(SG)))
__kernel void ovkc_quant_prefill(__global const uchar* pool, __global const int* tables, __global const int* lengths,
                                 __global const int* first, __global const int* tokens, __global const ACT* q,
                                 __global const ACT* k, __global const ACT* v,
                                 __global const int* step, __global const int* stored, __global const uchar* qpool,
                                 __global const int* qtables, __global const int* qlengths,
                                 __global const int* flush, __global uchar* logits, __global ACT* out) {
    if (step[7]) {  // decode rows alone: a sub-group a partition of a row
        const int r = get_global_id(0) / SG / PARTS, part = get_global_id(0) / SG % PARTS;
        const int h = get_global_id(1), rows = step[1];
        if (r >= rows) return;  // the whole sub-group
        const int row = TOKEN_SEQ(r) * (get_global_size(1) / GROUP) + h / GROUP;
        const int n = lengths[row], visible = min(n, first[row] + TOKEN_INDEX(r) + 1);
        const int start = flush[2 * row], count = flush[2 * row + 1], nq = qlengths[row];
        int lo, hi;  // of the 2-bit slots, then the full-precision ones
        part_range(nq + visible, part, &lo, &hi);
        row_state st;
        row_start(&st, true, h, r, q, rows, SCALE);
        __global float* lg = row_logits(logits, step, h, r);
        attend_quant_slots_split(&st, qpool, qtables + row * step[2], nq, lg, lo, hi);
        attend_slots_split(&st, pool, tables + row * step[0], visible, start, start + count, lg ? lg + nq : 0, 0, 0,
                           max(lo - nq, 0), hi - nq);
        row_part_split(&st, row_parts(logits, step, h, r) + part * PART_FLOATS);
        return;
    }
    const int r = get_global_id(0), h = get_global_id(1), rows = step[1];
    if (r >= (rows + SG - 1) / SG * SG) return;  // whole sub-groups past the rows
    const int t = min(r, rows - 1);
    const int row = TOKEN_SEQ(t) * (get_global_size(1) / GROUP) + h / GROUP;
    const int n = lengths[row], visible = first[row] + TOKEN_INDEX(t) + 1;
    const int start = flush[2 * row], count = flush[2 * row + 1], nq = qlengths[row];
    const int qvisible = count ? min(nq, nq - count + max(visible - start, 0)) : nq;
    const bool live = r < rows;
    row_state st;
    row_start(&st, live, h, r, q, rows, SCALE);
    __global float* lg = row_logits(logits, step, h, t);
    attend_quant_slots(&st, live, qpool, qtables + row * step[2], nq, sub_group_reduce_max(nq), qvisible, lg);
    attend_slots(&st, live, pool, tables + row * step[0], n, sub_group_reduce_max(n), 0, visible, 0, start,
                 start + count, lg ? lg + qvisible : 0, 0, 0, OWN_ARGS(t, h / GROUP, first[row]));
    row_finish(&st, live, h, r, rows, out, row_lse(logits, step));
}
#endif
