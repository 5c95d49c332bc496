"""A stable counting sort on the device (``plugins/gpu/kernels/sort.cl``): KVCrush's bucketing
order and its evictable tokens, ClusterKV's index of each head's tokens by label."""

from __future__ import annotations

from typing import Any

import numpy as np

from ov_kvcrush.gpu.device import KernelDevice

MAX_KEYS = 4096  # the kernel's local histogram: every key stays below it


def stable_order(dev: KernelDevice, keys: Any, m: int, key_range: int, rows: int = 1) -> Any:
    """Device buffer ``[rows][m]``: each row's ``m`` items in stable order by ``keys`` ``[rows][m]``
    (each below ``key_range``, at most :data:`MAX_KEYS`)."""
    if key_range > MAX_KEYS:
        raise ValueError(f"{key_range} keys exceed the device sort's {MAX_KEYS}")
    order = dev.empty(4 * max(m * rows, 1))
    if m:
        kernel = dev.kernel("sort.cl", "bucket_order", {"MAX_KEYS": MAX_KEYS})
        dev.run(kernel, (dev.sub_group, rows), (dev.sub_group, 1), keys, np.int32(m), np.int32(key_range), order)
    return order
