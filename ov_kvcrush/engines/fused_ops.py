"""A loaded model's element-wise steps on the fused kernels (:mod:`ov_kvcrush.kernels.model_ops`),
and its parallel projections as one matrix product each.

The torch engine on CUDA calls :func:`fuse_model_ops` on its model once, after the model is on
its device. It changes that model instance only, never transformers' classes or another loaded
model (the transformers baselines load their own):

* each RMSNorm of the Llama family (``LlamaRMSNorm``, ``MistralRMSNorm``, ``Qwen2RMSNorm``) runs
  :func:`~ov_kvcrush.kernels.model_ops.rms_norm`;
* each MLP of that family with a SiLU gate runs its gate and up projections as one product (their
  weights packed into one tensor, the two modules' weights left as views of it: no memory added)
  and :func:`~ov_kvcrush.kernels.model_ops.silu_mul` on its two halves;
* each attention module of that family runs its query, key and value projections as one product
  the same way: the query projection computes all three and hands the key and value projections
  their parts, which they return when called next on the same input (as the attention module
  calls them); called on anything else they compute their own;
* the rotary embedding: the attention modules call their module's ``apply_rotary_pos_emb``, so
  that function is wrapped once per modeling module. The wrapper rotates the queries and keys in
  one launch of :func:`~ov_kvcrush.kernels.model_ops.rotary_pair` only inside
  :func:`fused_forward` (the engine's own forward passes, and so the steps its CUDA graphs
  capture) and never while torch compiles; every other caller gets transformers' function
  unchanged.

A decode step of one token is bound by its launches outside the weights' and the cache's reads:
on an H200 a Llama-3-8B step was ~26 launches a layer (``docs/results/bench/``, the ClusterKV
profile at 128k); the packed products take three of them away, the paired rotary one.

Gemma 3 (``(1 + weight)`` norms, GELU gates) keeps transformers' steps.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

# Imported where used, inside functions: what pulls in triton, heavy to import, so that importing
# this module stays light.

#: the module classes whose forward the fused kernels replace, by class name
FUSED_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm")
FUSED_MLPS = ("LlamaMLP", "MistralMLP", "Qwen2MLP")
#: the activation modules the fused gate computes (SiLU: torch's, and transformers' own class)
SILU = ("SiLU", "SiLUActivation")
#: the attention classes whose modeling module's ``apply_rotary_pos_emb`` is wrapped
ROTARY_ATTENTION = ("LlamaAttention", "MistralAttention", "Qwen2Attention")

_ACTIVE = threading.local()


def _norm_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    from ov_kvcrush.kernels.model_ops import rms_norm

    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


class PackedLinears:
    """Several ``nn.Linear`` of one input as one product: their weights (and biases) packed in
    one tensor, each module's own weight left as a view of its rows."""

    def __init__(self, linears: list[torch.nn.Linear]) -> None:
        self.sizes = [lin.out_features for lin in linears]
        with torch.no_grad():
            self.weight = torch.cat([lin.weight for lin in linears])
            self.bias = None if linears[0].bias is None else torch.cat([lin.bias for lin in linears])
            for lin, weight in zip(linears, self.weight.split(self.sizes), strict=True):
                lin.weight.data = weight  # the separate copies are freed
            if self.bias is not None:
                for lin, bias in zip(linears, self.bias.split(self.sizes), strict=True):
                    lin.bias.data = bias

    @staticmethod
    def packable(linears: list[Any]) -> bool:
        """Whether ``linears`` are plain linear layers of one input, device and dtype, all with a bias or none."""
        if not all(type(lin) is torch.nn.Linear for lin in linears):
            return False
        first = linears[0]
        return all(
            lin.in_features == first.in_features
            and lin.weight.dtype == first.weight.dtype
            and lin.weight.device == first.weight.device
            and (lin.bias is None) == (first.bias is None)
            for lin in linears
        )

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., sum of the out features]``: every module's outputs side by side, in order."""
        return F.linear(x, self.weight, self.bias)

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each module's output (views of one product)."""
        return list(self.product(x).split(self.sizes, dim=-1))


def _mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    from ov_kvcrush.kernels.model_ops import silu_mul

    return self.down_proj(silu_mul(self.ov_kvcrush_gate_up.product(x)))


def _lead_projection(self: Any, x: torch.Tensor) -> torch.Tensor:
    """The query projection's forward: all three products at once, the key's and value's parts
    handed to their modules for their next call on ``x``."""
    first, *rest = self.ov_kvcrush_packed(x)
    for follower, part in zip(self.ov_kvcrush_followers, rest, strict=True):
        follower.ov_kvcrush_ready = (x, part)
    return first


def _follower_projection(self: Any, x: torch.Tensor) -> torch.Tensor:
    """The key's or value's projection: the part computed with the query's, when called on its input."""
    ready, self.ov_kvcrush_ready = self.ov_kvcrush_ready, None
    if ready is not None and ready[0] is x:
        return ready[1]
    return F.linear(x, self.weight, self.bias)


def _pack_attention(module: Any) -> bool:
    """Pack an attention module's query, key and value projections (see the module doc)."""
    linears = [getattr(module, name, None) for name in ("q_proj", "k_proj", "v_proj")]
    if not PackedLinears.packable(linears):
        return False
    lead, *followers = linears
    lead.ov_kvcrush_packed = PackedLinears(linears)
    lead.ov_kvcrush_followers = followers
    lead.forward = types.MethodType(_lead_projection, lead)
    for follower in followers:
        follower.ov_kvcrush_ready = None
        follower.forward = types.MethodType(_follower_projection, follower)
    return True


def _fused_rotary(original: Callable[..., Any]) -> Callable[..., Any]:
    """``apply_rotary_pos_emb`` that rotates with the fused kernel inside :func:`fused_forward`."""

    def apply_rotary_pos_emb(
        q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *args: Any, **kw: Any
    ):
        if torch.compiler.is_compiling() or not getattr(_ACTIVE, "on", False) or args or kw or cos.dim() != 3:
            return original(q, k, cos, sin, *args, **kw)
        from ov_kvcrush.kernels.model_ops import rotary_pair

        return rotary_pair(q, k, cos, sin)

    apply_rotary_pos_emb.ov_kvcrush_original = original  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def fuse_model_ops(model: torch.nn.Module) -> int:
    """Run ``model``'s RMSNorms, SiLU gates and (in :func:`fused_forward`) rotary embeddings on
    the fused kernels, and its attention's and MLP's parallel projections as one product each,
    where its modules are of the Llama family; returns the modules changed. Calling it again
    changes nothing more."""
    changed = 0
    for module in model.modules():
        name = type(module).__name__
        if getattr(module, "ov_kvcrush_fused", False):
            continue
        if name in FUSED_NORMS and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_norm_forward, module)
        elif name in FUSED_MLPS and type(getattr(module, "act_fn", None)).__name__ in SILU:
            projections = [getattr(module, "gate_proj", None), getattr(module, "up_proj", None)]
            if not PackedLinears.packable(projections):
                continue
            module.ov_kvcrush_gate_up = PackedLinears(projections)
            module.forward = types.MethodType(_mlp_forward, module)
        elif name in ROTARY_ATTENTION:
            modeling = sys.modules[type(module).__module__]
            current = getattr(modeling, "apply_rotary_pos_emb", None)
            if current is None:
                continue
            if not hasattr(current, "ov_kvcrush_original"):
                modeling.apply_rotary_pos_emb = _fused_rotary(current)
            _pack_attention(module)
        else:
            continue
        module.ov_kvcrush_fused = True
        changed += 1
    return changed


@contextlib.contextmanager
def fused_forward() -> Iterator[None]:
    """The forward passes inside rotate with the fused kernel (in this thread)."""
    before = getattr(_ACTIVE, "on", False)
    _ACTIVE.on = True
    try:
        yield
    finally:
        _ACTIVE.on = before
