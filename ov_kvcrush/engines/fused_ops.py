"""A loaded model's element-wise steps on the fused kernels (:mod:`ov_kvcrush.kernels.model_ops`).

The torch engine on CUDA calls :func:`fuse_model_ops` on its model once. It changes that model
instance only, never transformers' classes or another loaded model (the transformers baselines
load their own):

* each RMSNorm of the Llama family (``LlamaRMSNorm``, ``MistralRMSNorm``, ``Qwen2RMSNorm``) runs
  :func:`~ov_kvcrush.kernels.model_ops.rms_norm`;
* each MLP of that family with a SiLU gate runs :func:`~ov_kvcrush.kernels.model_ops.silu_mul`
  between its projections;
* the rotary embedding: the attention modules call their module's ``apply_rotary_pos_emb``, so
  that function is wrapped once per modeling module. The wrapper rotates with
  :func:`~ov_kvcrush.kernels.model_ops.rotary` only inside :func:`fused_forward` (the engine's
  own forward passes, and so the steps its CUDA graphs capture) and never while torch compiles;
  every other caller gets transformers' function unchanged.

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


def _mlp_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    from ov_kvcrush.kernels.model_ops import silu_mul

    return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


def _fused_rotary(original: Callable[..., Any]) -> Callable[..., Any]:
    """``apply_rotary_pos_emb`` that rotates with the fused kernel inside :func:`fused_forward`."""

    def apply_rotary_pos_emb(
        q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *args: Any, **kw: Any
    ):
        if torch.compiler.is_compiling() or not getattr(_ACTIVE, "on", False) or args or kw or cos.dim() != 3:
            return original(q, k, cos, sin, *args, **kw)
        from ov_kvcrush.kernels.model_ops import rotary

        return rotary(q, cos, sin), rotary(k, cos, sin)

    apply_rotary_pos_emb.ov_kvcrush_original = original  # type: ignore[attr-defined]
    return apply_rotary_pos_emb


def fuse_model_ops(model: torch.nn.Module) -> int:
    """Run ``model``'s RMSNorms, SiLU gates and (in :func:`fused_forward`) rotary embeddings on
    the fused kernels where its modules are of the Llama family; returns the modules changed.
    Calling it again changes nothing more."""
    changed = 0
    for module in model.modules():
        name = type(module).__name__
        if getattr(module, "ov_kvcrush_fused", False):
            continue
        if name in FUSED_NORMS and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(_norm_forward, module)
        elif name in FUSED_MLPS and type(getattr(module, "act_fn", None)).__name__ in SILU:
            module.forward = types.MethodType(_mlp_forward, module)
        elif name in ROTARY_ATTENTION:
            modeling = sys.modules[type(module).__module__]
            current = getattr(modeling, "apply_rotary_pos_emb", None)
            if current is None:
                continue
            if not hasattr(current, "ov_kvcrush_original"):
                modeling.apply_rotary_pos_emb = _fused_rotary(current)
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
