"""SnapKV's selection on the GPU path (issue 49) on Intel's OpenCL CPU runtime, at sub-group
sizes 8 and 16: each KV head's kept tokens equal the reference's (``methods.selection``:
``pool_scores``, ``group_heads``, ``keep_indices``), max and average pooling, and unpooled as
H2O and PyramidKV select. The kernels run in the ``gpu_worker`` process (conftest)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ov_kvcrush.gpu import snapkv
from ov_kvcrush.methods.attention import group_heads
from ov_kvcrush.methods.selection import keep_indices, pool_scores

SUB_GROUPS = (8, 16)
#: (query heads, KV heads, tokens, budget, sinks, recent)
SHAPES = [(9, 3, 300, 120, 4, 16), (8, 2, 257, 90, 0, 8), (4, 4, 64, 40, 8, 32)]


@pytest.mark.parametrize("sub_group", SUB_GROUPS)
@pytest.mark.parametrize(("width", "pool"), [(1, "max"), (7, "max"), (31, "max"), (7, "avg"), (31, "avg")])
def test_each_kv_head_keeps_the_references_tokens(gpu_worker, sub_group, width, pool):
    rng = np.random.default_rng(width * 10 + sub_group)
    for hq, hkv, n, budget, sinks, recent in SHAPES:
        # probabilities of few distinct values: ties everywhere (broken toward the earlier token)
        # beside a window's real spread
        scores = np.where(rng.random((hq, n)) < 0.5, rng.integers(0, 4, (hq, n)) / 8, rng.random((hq, n)))
        scores = scores.astype(np.float32)
        pooled = group_heads(pool_scores(torch.from_numpy(scores)[None], width, pool), hkv)
        ref = keep_indices(pooled, budget, sinks, recent)[0]
        got = gpu_worker.submit(
            snapkv.snapkv_keep, scores, hkv, budget, sinks, recent, width=width, pool=pool, sub_group=sub_group
        ).result()
        assert len(got) == hkv
        for g in range(hkv):
            np.testing.assert_array_equal(got[g], np.sort(ref[g].numpy()), err_msg=f"KV head {g} of {hq}/{hkv}, n={n}")


def test_bad_arguments_name_the_field(gpu_worker):
    scores = np.zeros((4, 32), np.float32)
    for kwargs, needle in [
        (dict(kv_heads=3, budget=16), "kv_heads=3"),
        (dict(kv_heads=2, budget=40), "budget"),
        (dict(kv_heads=2, budget=16, width=4), "width=4"),
        (dict(kv_heads=2, budget=16, pool="sum"), "pool"),
    ]:
        args = dict(sink_tokens=2, recent_tokens=4) | kwargs
        with pytest.raises(ValueError, match=needle):
            gpu_worker.submit(snapkv.snapkv_keep, scores, **args).result()
