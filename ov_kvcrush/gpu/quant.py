"""MiniKV's 2-/4-bit store on the GPU path (``plugins/gpu/kernels/quant2.cl``): blocks of tokens
quantized into the CPU op's 2-bit block layout, and read back. The store's decode attention is in
:mod:`ov_kvcrush.gpu.attention`."""

from __future__ import annotations

from typing import Any

import numpy as np

from ov_kvcrush.gpu.device import KernelDevice, device
from ov_kvcrush.gpu.layout import QuantShape


def launch_quantize(dev: KernelDevice, shape: QuantShape, k: Any, v: Any, ids: Any, blocks: int, pool: Any) -> None:
    """Enqueue the quantization of device ``k``, ``v`` ``[blocks, T, D]`` into blocks ``ids`` of
    the 2-bit device ``pool``."""
    d, t = shape.head_dim, shape.block_size
    consts = shape.constants()
    dev.run(dev.kernel("quant2.cl", "quantize_keys", consts), (d, t // shape.qgroup, blocks), None, k, ids, pool)
    dev.run(dev.kernel("quant2.cl", "quantize_values", consts), (d // shape.qgroup, t, blocks), None, v, ids, pool)


def quantize_blocks(
    shape: QuantShape, k: np.ndarray, v: np.ndarray, ids: np.ndarray, pool_blocks: int, sub_group: int | None = None
) -> np.ndarray:
    """A pool of ``pool_blocks`` 2-bit blocks (bytes) holding ``k``, ``v`` ``[nb, T, D]`` at block
    ``ids[b]`` (the other blocks zero)."""
    dev = device(sub_group)
    pool_b = dev.to_device(np.zeros(pool_blocks * shape.block_bytes, np.uint8))
    launch_quantize(dev, shape, dev.to_device(k.astype(np.float32)), dev.to_device(v.astype(np.float32)),
                    dev.to_device(ids.astype(np.int32)), k.shape[0], pool_b)  # fmt: skip
    return dev.to_host(pool_b, np.uint8, (pool_blocks * shape.block_bytes,))


def dequantize_blocks(
    shape: QuantShape, pool: np.ndarray, ids: np.ndarray, sub_group: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The tokens ``[nb, T, D]`` (keys, values) of the pool's blocks ``ids``."""
    dev = device(sub_group)
    nb, t, d = len(ids), shape.block_size, shape.head_dim
    k_b, v_b = dev.empty(4 * nb * t * d), dev.empty(4 * nb * t * d)
    dev.run(
        dev.kernel("quant2.cl", "dequantize_blocks", shape.constants()),
        (d, t, nb),
        None,
        dev.to_device(pool.view(np.uint8)),
        dev.to_device(ids.astype(np.int32)),
        k_b,
        v_b,
    )
    return dev.to_host(k_b, np.float32, (nb, t, d)), dev.to_host(v_b, np.float32, (nb, t, d))
