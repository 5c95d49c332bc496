// Our op's steps as layers of OpenVINO's GPU plugin (SimpleGPU custom layers, CONFIG_FILE:
// ov_kvcrush/gpu/plugin_layers.py writes the XML). A layer's kernel is given its input tensors,
// then its one output, and nothing else; so the pool and block tables come in as tensors (the
// pool a remote tensor the store layer writes in place), and the step's numbers in the tensor
// `step` (int32: the width of the block tables, the step's rows). The bodies are the pyopencl and
// SYCL hosts' kernels' own (paged_attention.h, paged_store.h, prefill.h): the same code on every
// host.
//
// A step of the model is one row of tokens from several sequences side by side (continuous
// batching: a prompt's chunk beside other sequences' decode tokens): `tokens` [T, 2] gives each
// token its sequence's index s in the step and its index i among that sequence's tokens; the
// cache's tensors have a row per (sequence, KV head), row s * kv_heads + kv: `tables` [rows,
// step[0]] its block ids, `first` [rows] its first new slot, `lengths` [rows] its slots after the
// step. Token i of sequence s goes to slot first + i and sees the slots before first + i + 1 (the
// slots are in position order: every earlier token's, then the step's).
//
// Compile-time constants (-D, from the layer's attributes): SG, KV_PRECISION, BLOCK_SIZE,
// HEAD_DIM, GROUP, SCALE (the logit scale, a float), ACT_HALF (the store's and prompt layer's
// activations are f16: the plugin runs the model in f16); and the layer's guard (OVKC_LAYER_*):
// the plugin builds a layer's source as one program that must hold that layer's kernel only.

#include "paged_attention.h"
#include "paged_store.h"
#include "prefill.h"

// k, v [kv_heads, T, HEAD_DIM] to each token's slot; the output is each token's slot [kv_heads,
// T], which the prompt layer takes as an input so that it runs after the store. Global (SG, T,
// kv_heads), local (SG, 1, 1).
#ifdef OVKC_LAYER_STORE
__attribute__((intel_reqd_sub_group_size(SG)))
__kernel void ovkc_store(__global uchar* pool, __global const int* tables, __global const int* first,
                         __global const int* tokens, __global const ACT* k, __global const ACT* v,
                         __global const int* step, __global int* slots) {
    const int t = get_global_id(1), kv = get_global_id(2), count = get_global_size(1);
    const int row = tokens[2 * t] * get_global_size(2) + kv, slot = first[row] + tokens[2 * t + 1];
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

// out [q_heads, T, HEAD_DIM]: each token's query rows q [q_heads, T, HEAD_DIM] over the slots its
// sequence's KV head holds that it sees (a prompt's chunk row by row; a decode token sees them
// all). Global (T rounded up to SG, q_heads), local (SG, 1).
#ifdef OVKC_LAYER_PREFILL
__attribute__((intel_reqd_sub_group_size(SG)))
__kernel void ovkc_prefill(__global const uchar* pool, __global const int* tables, __global const int* lengths,
                           __global const int* first, __global const int* tokens, __global const ACT* q,
                           __global const int* step, __global const int* stored, __global ACT* out) {
    const int r = get_global_id(0), h = get_global_id(1), rows = step[1];
    const int t = min(r, rows - 1);  // a lane past the last row reads the last (and writes nothing)
    const int row = tokens[2 * t] * (get_global_size(1) / GROUP) + h / GROUP;
    const int n = lengths[row], visible = first[row] + tokens[2 * t + 1] + 1;
    prefill_row(r, h, pool, tables + row * step[0], n, sub_group_reduce_max(n), 0, visible, 0, q, rows, SCALE, out,
                0);
}
#endif
