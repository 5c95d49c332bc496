"""Knorm: keep the tokens whose keys have the smallest L2 norm.

Paper: Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression",
EMNLP 2024, arXiv 2406.11430. A key's L2 norm anticorrelates with the attention it receives
later, so the lowest-norm keys are the ones to keep, and no attention score is needed: the method
costs one norm per token and works with attention kernels that never form probabilities.

Per layer and KV head, ``budget`` tokens are kept: the first ``sink_tokens``, the last
``recent_tokens`` and, between them, the keys with the smallest norm (ties to the earlier token).
The norm is taken of the key as cached (after RoPE). The selection runs after the prompt and
whenever a step leaves a head above its budget; a decode step attends without scores.

Where this departs from the paper:

* Sinks and a recent window are always kept, as in every eviction method here (the paper ranks
  all cached tokens by norm alone), so methods compare at the same settings.
* The budget is enforced at every decode step (the paper's experiments compress a given cache to
  a ratio), so a long generation stays within it.
* Over the 2-bit store (``quant``) the selection is made once, after the prompt, and frozen, as
  for every selection method here (quantized key groups cannot lose members).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ov_kvcrush.methods.attention import LogitMap
from ov_kvcrush.methods.base import LayerCache, check_layer
from ov_kvcrush.methods.importance import EvictionConfig, ImportanceLayerCache
from ov_kvcrush.methods.runtimes import TWO_BIT_STORE, Declaration


def key_norm_scores(keys: torch.Tensor, q_heads: int) -> torch.Tensor:
    """``[b, q_heads, n]`` selection scores of ``keys`` ``[b, kv_heads, n, d]``: ``-||k||`` in the
    first query head of each KV head's group and 0 in the others, so that a group's sum (what
    the selection ranks by, and what the op keeps per slot) is exactly ``-||k||``."""
    b, hk, n, _ = keys.shape
    scores = torch.zeros(b, hk, q_heads // hk, n, device=keys.device)
    scores[:, :, 0] = -torch.linalg.vector_norm(keys.float(), dim=-1)
    return scores.reshape(b, q_heads, n)


@dataclass(frozen=True)
class KnormConfig(EvictionConfig):
    """Knorm: keep the keys with the smallest L2 norm, beside sinks and the recent window.

    Attributes:
        budget: tokens kept per layer and KV head, sinks and recent included. Required.
        sink_tokens: first tokens always kept.
        recent_tokens: newest tokens always kept.
        quant: the 2-bit store (``None``: full precision); the selection is then frozen after the prompt.
    """

    name: ClassVar[str] = "knorm"
    departure: ClassVar[str] = "the paper's, with sinks and a recent window kept"
    runtimes: ClassVar[Declaration] = {
        "reference": (),
        "cpu-op": (),
        "gpu-plugin": (TWO_BIT_STORE,),
        "gpu-pool": (TWO_BIT_STORE,),
    }

    scoring: ClassVar[str] = "knorm"
    #: a token's score is its key's, set once when it arrives: decode attention adds nothing
    decode_attention_scores: ClassVar[bool] = False

    def prompt_scores(
        self, queries: torch.Tensor, keys: torch.Tensor, attention_scores: torch.Tensor | None, logit: LogitMap
    ) -> torch.Tensor:
        return key_norm_scores(keys, queries.shape[1])

    def new_token_scores(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        return key_norm_scores(keys, queries.shape[1])

    def op_fields(self, layers: int, q_heads: int, block_size: int) -> dict[str, object]:
        return {"sinks": self.sink_tokens, "recent": self.recent_tokens, "frozen": int(self.selection_frozen())}

    def make_layer(self, layer_idx: int, num_layers: int) -> LayerCache:
        check_layer(layer_idx, num_layers)
        assert self.budget is not None
        return ImportanceLayerCache(self, budget=self.budget, sinks=self.sink_tokens, recent=self.recent_tokens)
