"""Knorm: the reference against a brute-force replay, and the op against the reference.

The oracle is written from the method's definition alone: a list of ``(position, ||k||)``; after
the prompt and after every step, while a head holds more than the budget, the token between the
sinks and the recent window with the largest key norm (the latest one on ties) goes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import check_op_keeps_the_reference_tokens

from ov_kvcrush.errors import ConfigError
from ov_kvcrush.methods import QuantSettings, method_config
from ov_kvcrush.methods.knorm import key_norm_scores
from ov_kvcrush.methods.vectors import layer_vectors
from ov_kvcrush.op.method_spec import method_spec


def brute_force_positions(keys: np.ndarray, budget: int, sinks: int, recent: int, prompt: int) -> list[list[int]]:
    """Positions one head holds after the prompt and after each later token, replayed token by token."""
    norms = np.sqrt((keys.astype(np.float64) ** 2).sum(-1))
    held: list[int] = []
    history = []

    def evict() -> None:
        while len(held) > budget:
            middle = held[sinks : len(held) - recent]
            worst = max(middle, key=lambda p: (norms[p], p))  # largest norm, the latest on ties
            held.remove(worst)

    held.extend(range(prompt))
    evict()
    history.append(list(held))
    for p in range(prompt, keys.shape[0]):
        held.append(p)
        evict()
        history.append(list(held))
    return history


@pytest.mark.parametrize(("budget", "sinks", "recent"), [(48, 4, 8), (96, 16, 32), (33, 0, 1)])
def test_reference_keeps_what_the_replay_keeps(budget, sinks, recent):
    vec = layer_vectors(5, tokens=220)
    cfg = method_config("knorm", budget=budget, sink_tokens=sinks, recent_tokens=recent)
    cache = cfg.make_layer(0, 1)
    prompt = 160
    want = [brute_force_positions(vec.keys[0, g].numpy(), budget, sinks, recent, prompt) for g in range(3)]
    cache.prefill(*vec.prefix(prompt))
    for step in range(220 - prompt + 1):
        if step:
            cache.decode(*vec.step(prompt + step - 1))
        pos = cache.kept_positions()[0]
        for g in range(3):
            assert sorted(pos[g][pos[g] >= 0].tolist()) == want[g][step], (step, g)


def test_scores_sum_to_the_negative_norm_per_group():
    keys = torch.randn(2, 3, 10, 16)
    s = key_norm_scores(keys, 9).reshape(2, 3, 3, 10)
    torch.testing.assert_close(s.sum(2), -keys.norm(dim=-1))
    assert (s[:, :, 1:] == 0).all()


def test_config_is_validated_and_the_spec_is_complete():
    with pytest.raises(ConfigError, match="budget"):
        method_config("knorm", budget=10, sink_tokens=8, recent_tokens=8)
    spec = dict(item.split("=", 1) for item in method_spec(method_config("knorm", budget=128), 2, 9, 32).split(";"))
    assert spec == {"method": "knorm", "budgets": "128,128", "quant": "0", "sinks": "16", "recent": "64", "frozen": "0"}


@pytest.mark.parametrize("layer", [0, 3])
@pytest.mark.parametrize(
    "fields",
    [
        dict(budget=96, sink_tokens=4, recent_tokens=16),
        dict(budget=64, sink_tokens=0, recent_tokens=1),
        dict(budget=96, sink_tokens=4, recent_tokens=16, quant=QuantSettings(residual_tokens=32)),
    ],
)
def test_op_keeps_the_reference_tokens(ov_core, fields, layer):
    """The op's Knorm keeps the reference's tokens at every step, with the same attention output,
    the budget held and the block accounting exact (over the 2-bit store: frozen after the prompt)."""
    check_op_keeps_the_reference_tokens(ov_core, method_config("knorm", **fields), layer)
