"""Fused kernels of the CUDA path (Triton), and when to use them.

The references (:mod:`ov_kvcrush.methods`) attend in float32 with an explicit mask: exact, and
the oracle, but on a GPU a 32k prompt then costs 47× plain ``sdpa``. This package holds what
replaces that on the fast path, each tested against the reference:

* :mod:`~ov_kvcrush.kernels.prefill`: causal prefill attention in the model's dtype. Without
  scores it is torch's fused ``scaled_dot_product_attention(is_causal=True)``; with per-head
  scores (H2O, MiniKV, KVCrush on H2O) it is :mod:`~ov_kvcrush.kernels.flash_scores`, a Triton
  flash-attention kernel that also returns the column sums of the probabilities (MiniKV's
  selective flash attention, arXiv 2411.18077): the prompt's attention matrix is never
  materialised.

Which implementation runs is chosen by ``OV_KVCRUSH_KERNELS``:

* ``auto`` (default): Triton on CUDA tensors when Triton imports, torch otherwise;
* ``triton``: Triton on every device (CPU tensors need ``TRITON_INTERPRET=1``: how CI tests the
  kernels without a GPU);
* ``torch``: never Triton (the fused-SDPA path without scores still applies).

This package imports nothing else of ov_kvcrush but :mod:`ov_kvcrush.errors`: the methods call
it, never the reverse.
"""

from __future__ import annotations

import functools
import os

import torch

from ov_kvcrush.errors import ConfigError

# Imported where used, inside functions: what pulls in triton, heavy to import, so that importing
# this module stays light.

KERNEL_MODES = ("auto", "triton", "torch")

#: log2(e): the kernels take ``exp2`` of logits pre-scaled by it (one multiply folded into the scale)
LOG2E = 1.4426950408889634


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision for tensors of ``dtype``: float32 stays exact float32 (no TF32,
    so the kernels match the float32 reference); half types run on tensor cores as they are."""
    return "ieee" if dtype == torch.float32 else "tf32"


def kernel_mode() -> str:
    """``OV_KVCRUSH_KERNELS``, checked: one of :data:`KERNEL_MODES`."""
    mode = os.environ.get("OV_KVCRUSH_KERNELS", "auto").strip().lower() or "auto"
    if mode not in KERNEL_MODES:
        raise ConfigError("OV_KVCRUSH_KERNELS", mode, "one of " + ", ".join(KERNEL_MODES))
    return mode


@functools.cache
def triton_importable() -> bool:
    """Whether Triton imports here (it ships with CUDA builds of torch; CI installs it for the interpreter)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``), on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(device: torch.device) -> bool:
    """Whether to run the Triton kernels for tensors on ``device`` (see the module doc)."""
    mode = kernel_mode()
    if mode == "torch" or not triton_importable():
        if mode == "triton":
            raise ConfigError("OV_KVCRUSH_KERNELS", mode, "torch or auto (Triton is not installed here)")
        return False
    if device.type == "cuda":
        return True
    if mode == "triton":
        if not interpreting():
            raise ConfigError(
                "OV_KVCRUSH_KERNELS", mode, "torch or auto on CPU tensors (or set TRITON_INTERPRET=1 to interpret)"
            )
        return True
    return False
