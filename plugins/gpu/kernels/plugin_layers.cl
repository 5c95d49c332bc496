// Our op's decode step as layers of OpenVINO's GPU plugin (SimpleGPU custom layers, CONFIG_FILE:
// ov_kvcrush/gpu/plugin_layers.py writes the XML). A layer's kernel is given its input tensors,
// then its one output, and nothing else; so the pool and block tables come in as tensors (the
// pool a remote tensor the store layer writes in place), and the step's numbers in the tensor
// `step` (int32 [4]: the width of the block tables, the width of the positions, the position of
// the step's first row, its rows). The bodies are the pyopencl and SYCL hosts'
// kernels' own (paged_attention.h, paged_store.h): the same code on every host.
//
// Compile-time constants (-D, from the layer's attributes): SG, KV_PRECISION, BLOCK_SIZE,
// HEAD_DIM, GROUP, SCALE (the logit scale, a float), ACT_HALF (the store's and prompt layer's
// activations are f16: the plugin runs the model in f16); and the layer's guard (OVKC_LAYER_*):
// the plugin builds a layer's source as one program that must hold that layer's kernel only.

#include "paged_attention.h"
#include "paged_store.h"
#include "prefill.h"

// k, v [kv_heads, tokens, HEAD_DIM] to slots first[kv] + t; the output is each token's slot
// [kv_heads, tokens], which the attention layers take as an input so that they run after the
// store. Global (SG, tokens, kv_heads), local (SG, 1, 1).
#ifdef OVKC_LAYER_STORE
__attribute__((intel_reqd_sub_group_size(SG)))
__kernel void ovkc_store(__global uchar* pool, __global const int* tables, __global const int* first,
                         __global const ACT* k, __global const ACT* v, __global const int* step,
                         __global int* slots) {
    const int t = get_global_id(1), kv = get_global_id(2), tokens = get_global_size(1);
    store_token(t, kv, tokens, pool, tables, step[0], first[kv], k, v);
    if (get_sub_group_local_id() == 0) slots[kv * tokens + t] = first[kv] + t;
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

// out [q_heads, rows, HEAD_DIM]: the step's rows q [q_heads, rows, HEAD_DIM], at positions
// step[2] + r, over each KV head's lengths[kv] slots whose positions (positions [kv_heads,
// step[1]]) are at most the row's: a prompt's chunk, or a decode step as one row. Global (rows
// rounded up to SG, q_heads), local (SG, 1).
#ifdef OVKC_LAYER_PREFILL
__attribute__((intel_reqd_sub_group_size(SG)))
__kernel void ovkc_prefill(__global const uchar* pool, __global const int* tables, __global const int* lengths,
                           __global const int* positions, __global const ACT* q, __global const int* step,
                           __global const int* stored, __global ACT* out) {
    prefill_row(get_global_id(0), get_global_id(1), pool, tables, step[0], lengths, positions, step[1], q, step[3],
                step[2], SCALE, out, 0);
}
#endif
