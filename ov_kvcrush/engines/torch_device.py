"""The torch engine's device and dtype, checked before any loading work.

Apart from :mod:`~ov_kvcrush.engines.torch_model` so that a check (a plan's ``--device``, a bad
argument) needs only torch, not transformers' model code (seconds in a fresh interpreter).
"""

from __future__ import annotations

import torch

from ov_kvcrush.errors import ConfigError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(device: str) -> torch.device:
    """``cpu``/``CPU`` or ``cuda``/``cuda:N``/``GPU``; a clear error when CUDA is not there."""
    name = device.lower()
    if name == "gpu":
        name = "cuda"
    if name == "cpu":
        return torch.device("cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError("device", device, "cpu (no CUDA device is available on this machine)")
        try:
            dev = torch.device(name)
        except RuntimeError:
            raise ConfigError("device", device, "cpu, cuda or cuda:N") from None
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError("device", device, f"cuda:0 .. cuda:{torch.cuda.device_count() - 1}")
        return dev
    raise ConfigError("device", device, "cpu, cuda or cuda:N (backend torch)")


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto``: float32 on CPU (what the exported checkpoint holds), bfloat16 on CUDA."""
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in DTYPES:
        raise ConfigError("dtype", dtype, "auto, " + ", ".join(DTYPES))
    return DTYPES[dtype]
