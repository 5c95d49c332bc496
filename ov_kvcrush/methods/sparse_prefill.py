"""Sparse prompt attention by antidiagonal block scoring: the reference of the op's sparse prefill.

XAttention (Xu et al., 2025, arXiv 2503.16428): a prompt's attention is cut into blocks of
``block_size`` queries by ``block_size`` keys; each block's importance is estimated from the sums
along antidiagonals of its ``stride`` x ``stride`` sub-blocks (every ``stride``-th row and column,
one product per sub-block instead of ``stride**2``); each query block then attends only the key
blocks that carry ``threshold`` of its estimated mass. openvino.genai's ``SparseAttentionConfig``
(mode ``XATTENTION``) names the same three settings, and its CPU plugin estimates the same way
(the reversed query order inside a stride, the estimate's scale ``scale / stride``, the first and
the diagonal block always kept).

Departures, each for a reason:

* The rows whose outputs the method scores by (SnapKV's window, H2O's every row) and the last
  ``last_dense_tokens`` rows (the ones the first token reads most directly; native's
  ``num_last_dense_tokens_in_prefill``) attend densely: eviction ranks by their probabilities,
  which must sum to one over every key.
* Blocks are picked, after the first and diagonal ones, in descending estimated mass until what is
  kept reaches ``threshold`` of the row's total (native keeps the block that crosses it too; so
  does this: a block is added while the mass before it is short of the target).
* A prompt is sparse, whole or in chunks, while every head holds every earlier position (slots
  are then positions); a chat turn, like every decode step, attends densely. A chunk's estimate
  counts only the strided rows holding its own positions (``prefill_block_mask``'s ``past``).
* The first ``dense_layers`` layers attend densely (the engine's choice; the functions here are
  one layer's): on the embedded SmolLM2 at 8k, at threshold 0.9, a passkey the dense prompt finds
  is lost with layers 0-1 dense and kept with layers 0-3 dense; the early layers' sparse prompts
  lose it, the late ones' do not.
* Soft-capped models (Gemma 2) are estimated without the cap (a sum of ``stride`` logits is not a
  logit); their attention itself is capped as always.
"""

from __future__ import annotations

import math

import torch

from .attention import cap_logits


def strided_queries(queries: torch.Tensor, stride: int) -> torch.Tensor:
    """``[h, ceil(t / stride), stride * d]``: row ``a`` is queries ``a*stride + stride-1-s`` for
    ``s = 0 .. stride-1``, in that (reversed) order, zeros past the end."""
    h, t, d = queries.shape
    a = -(-t // stride)
    padded = torch.nn.functional.pad(queries, (0, 0, 0, a * stride - t))
    return padded.view(h, a, stride, d).flip(2).reshape(h, a, stride * d)


def strided_keys(keys: torch.Tensor, stride: int) -> torch.Tensor:
    """``[h, ceil(n / stride), stride * d]``: row ``b`` is keys ``b*stride + s`` in order, zeros
    past the end. A strided query row times a strided key row is the sum of the antidiagonal of
    their ``stride x stride`` sub-block of ``q . k``."""
    h, n, d = keys.shape
    b = -(-n // stride)
    return torch.nn.functional.pad(keys, (0, 0, 0, b * stride - n)).reshape(h, b, stride * d)


def antidiagonal_probabilities(
    queries: torch.Tensor, keys: torch.Tensor, stride: int, scale: float, bf16: bool = False
) -> torch.Tensor:
    """``[hq, A, A]``: each strided query row's softmax over the strided key rows at or before it,
    of the antidiagonal sums times ``scale / stride`` (queries ``[hq, t, d]``, keys ``[hk, t, d]``).
    ``bf16``: the products of bf16 operands (the scaled queries and the keys rounded), summed in
    float32, as the op's bf16 prompt path estimates."""
    group = queries.shape[0] // keys.shape[0]
    qs = strided_queries(queries.float(), stride) * (scale / stride)
    ks = strided_keys(keys.float(), stride).repeat_interleave(group, 0)
    if bf16:
        qs, ks = qs.bfloat16().float(), ks.bfloat16().float()
    logits = qs @ ks.transpose(1, 2)
    a = qs.shape[1]
    causal = torch.ones(a, a, dtype=torch.bool).tril()
    return logits.masked_fill(~causal, float("-inf")).softmax(-1)


def block_mass(probabilities: torch.Tensor, block_size: int, stride: int) -> torch.Tensor:
    """``[hq, nb, nb]``: the estimated probability mass of each (query block, key block)."""
    per = block_size // stride
    h, a, _ = probabilities.shape
    nb = -(-a // per)
    p = torch.nn.functional.pad(probabilities, (0, nb * per - a, 0, nb * per - a))
    return p.view(h, nb, per, nb, per).sum((2, 4))


def select_blocks(mass: torch.Tensor, threshold: float) -> torch.Tensor:
    """``[hq, nb, nb]`` bool: per query block ``i``, key block 0 and ``i`` itself, then the others
    of ``1 .. i-1`` by descending mass (ties: the earlier block) while the kept mass is short of
    ``threshold`` of the row's total (sums in float64, as the op keeps them)."""
    h, nb, _ = mass.shape
    keep = torch.zeros(h, nb, nb, dtype=torch.bool)
    m = mass.double()
    for head in range(h):
        for i in range(nb):
            row = m[head, i, : i + 1]
            need = threshold * float(row.sum())
            keep[head, i, 0] = keep[head, i, i] = True
            kept = float(row[0]) + (float(row[i]) if i else 0.0)
            order = torch.sort(row[1:i], descending=True, stable=True).indices + 1
            for j in order.tolist():
                if kept >= need:
                    break
                keep[head, i, j] = True
                kept += float(row[j])
    return keep


def dense_blocks_from(keep: torch.Tensor, first_dense_row: int, block_size: int) -> torch.Tensor:
    """``keep`` with every causal block of the query blocks holding a row at or after
    ``first_dense_row`` set: those rows attend densely."""
    keep = keep.clone()
    nb = keep.shape[1]
    for i in range(min(first_dense_row, nb * block_size) // block_size, nb):
        keep[:, i, : i + 1] = True
    return keep


def prefill_block_mask(
    queries: torch.Tensor,
    keys: torch.Tensor,
    *,
    block_size: int,
    stride: int,
    threshold: float,
    last_dense_tokens: int,
    scale: float,
    first_scored_row: int,
    past: int = 0,
    prompt_tokens: int | None = None,
    bf16: bool = False,
) -> torch.Tensor:
    """The key blocks each query block attends (``[hq, nb, nb]`` bool, by position) in a prompt
    step whose queries (``[hq, t, d]``) sit at positions ``[past, past + t)`` over the keys of
    every position up to its end (``[hk, past + t, d]``): the estimate (over the strided rows
    holding a step position; other positions count as zero queries), the selection, then dense
    rows from the step's first scored row (``first_scored_row``, counted in the step) or the
    prompt's last ``last_dense_tokens`` rows on
    (``prompt_tokens``: the whole prompt's, when the step is a chunk of it). The settings are
    :class:`~ov_kvcrush.config.SparsePrefill`'s; rows of blocks before the step's are unused.
    ``bf16``: the estimate's products as the op's bf16 path takes them."""
    t = queries.shape[1]
    padded = torch.nn.functional.pad(queries, (0, 0, past, 0))
    probabilities = antidiagonal_probabilities(padded, keys, stride, scale, bf16)
    probabilities[:, : past // stride] = 0.0  # strided rows wholly before the step are not its
    mass = block_mass(probabilities, block_size, stride)
    prompt = past + t if prompt_tokens is None else prompt_tokens
    first_dense = max(0, min(past + first_scored_row, prompt - last_dense_tokens))
    return dense_blocks_from(select_blocks(mass, threshold), first_dense, block_size)


def attend_blocks(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    keep: torch.Tensor,
    block_size: int,
    scale: float | None = None,
    softcap: float | None = None,
    past: int = 0,
) -> torch.Tensor:
    """Causal attention of a prompt step (queries ``[hq, t, d]`` at positions ``[past, past + t)``
    over ``[hk, past + t, d]``) where the query block of position ``p`` sees only the key blocks
    ``keep[:, p // block_size]`` marks: ``[hq, t, d]``."""
    hq, t, d = queries.shape
    n = keys.shape[1]
    group = hq // keys.shape[0]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    k = keys.float().repeat_interleave(group, 0)
    v = values.float().repeat_interleave(group, 0)
    logits = cap_logits(queries.float() @ k.transpose(1, 2) * scale, softcap)
    rows, cols = (torch.arange(past, past + t) // block_size), torch.arange(n) // block_size
    causal = torch.arange(n)[None, :] <= torch.arange(past, past + t)[:, None]
    allowed = keep[:, rows][:, :, cols] & causal
    return logits.masked_fill(~allowed, float("-inf")).softmax(-1) @ v
