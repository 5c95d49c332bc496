"""The methods' layer caches with their KV on the GPU path's device: a real decode through the
OpenCL kernels.

Each class here is a :class:`~ov_kvcrush.methods.LayerCache` (the protocol the torch engine's
:class:`~ov_kvcrush.engines.hf_cache.CompressedCache` drives) whose tokens live in a
:class:`~ov_kvcrush.gpu.pool.DevicePool` and whose steps run as kernels: the step's keys and
values are stored in place (``paged_store.cl``), the prompt and decode attention read the pool
(``prefill.cl``, ``paged_attention.cl``), an importance method's scores stay on the device (the
window's column sums, pooled per query head, then each decode step's probabilities added:
``snapkv.cl``), its selection runs there (``pooled_group_scores`` then ``kvcrush.cl``'s rank
rule) and eviction gathers the kept slots into fresh blocks. The policy is the reference's
(:mod:`ov_kvcrush.methods.importance`): when to select, how many to keep, sinks and recent
tokens; what crosses to the host per step is the step's queries, keys, values and output (the
model runs on the host here) and the block tables when they change; a selection's decisions and
the kept slots' positions stay on the device (KVCrush's kept tokens come back, once, at the
prompt). :attr:`DevicePool.crossings` counts it.

Here: the full cache, which every method's extends; H2O, SnapKV and Knorm (uniform budgets, single
tokens) over the full-precision store are in :mod:`ov_kvcrush.gpu.importance_cache`,
StreamingLLM's in :mod:`ov_kvcrush.gpu.streaming_cache`, KVCrush's in
:mod:`ov_kvcrush.gpu.kvcrush_cache`, the 2-bit store's in :mod:`ov_kvcrush.gpu.quant_cache`,
ClusterKV's in :mod:`ov_kvcrush.gpu.recall_cache`, Quest's in :mod:`ov_kvcrush.gpu.quest_cache`, and
:mod:`ov_kvcrush.gpu.device_layers` says which configs the path serves.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ov_kvcrush.errors import ConfigError
from ov_kvcrush.gpu.clusterkv import StepClustering
from ov_kvcrush.gpu.pool import DevicePool, PagedLayer
from ov_kvcrush.gpu.slots import StepLogits
from ov_kvcrush.gpu.step_work import StepWork
from ov_kvcrush.methods import LayerCache


def host_array(x: torch.Tensor) -> np.ndarray:
    """One sequence's ``[1, heads, t, D]`` tensor as float32 ``[heads, t, D]``."""
    if x.shape[0] != 1:
        raise ConfigError("batch", x.shape[0], "1 (the GPU path's caches hold one sequence each)")
    return x[0].detach().to(torch.float32).cpu().numpy()


class DeviceFullLayerCache(LayerCache):
    """Every token, attended in place on the device."""

    softcap_refusal = (
        "the torch engine's Intel GPU device pool (paged_device) takes raw logits; the openvino backend "
        "runs it on device GPU and CPU"
    )
    #: whether the sequence's method runs on this layer (not on a local layer: window_cache.py)
    method_runs = True
    #: the model's window sums give each slot its largest probability over the score rows (KVzip's
    #: reconstruction scores), not their sum (:class:`~ov_kvcrush.gpu.layer_inputs.WindowSums`)
    sums_by_largest = False

    def __init__(self, pool: DevicePool, kv_heads: int, q_heads: int) -> None:
        super().__init__()
        self.layer = PagedLayer(pool, kv_heads, q_heads)
        self._window_scores: Any = None  # device [Hq, held]: the last prompt step's window sums
        #: the tokens of a prompt fed in chunks (:meth:`set_prompt`), while it is; 0: prompts whole
        self.prompt_end = 0
        #: device [Hq, prompt_end]: a chunked prompt's window sums so far, for the methods that
        #: score its window (None: none yet)
        self._chunk_sums: Any = None

    def _scale(self, head_dim: int) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(head_dim)

    def _step(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, window: int) -> torch.Tensor:
        """Store the step's tokens, then attend its rows (the last ``window`` rows' probabilities
        summed per slot on the device, for the subclasses' scores)."""
        first = self.seen - keys.shape[2]
        self.layer.append(host_array(keys), host_array(values), first)
        q = host_array(queries)
        scale = self._scale(q.shape[2])
        if q.shape[1] == 1 and not window:
            out = self.layer.attend_decode(q[:, 0], scale)[0][:, None]
        else:
            out, self._window_scores = self.layer.attend_prompt(q, first, scale, window)
        return torch.from_numpy(out)[None].to(queries.dtype)

    def prefill(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        self._start_prefill(queries, keys, values)
        return self._step(queries, keys, values, 0)

    def _decode_step(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        self._positions(keys.shape[2], keys.device)
        self.layer.pool.phase = "decode"
        return self._step(queries, keys, values, 0)

    def heads_held(self) -> np.ndarray:
        """Each KV head's held slots ``[kv]`` (int64): the layer's one count, or each head's own
        where its method keeps them apart (KVzip, Chelsea)."""
        return np.full(self.layer.kv_heads, self.layer.held, np.int64)

    def tokens_held(self) -> torch.Tensor:
        return torch.from_numpy(self.heads_held().copy())[None]

    def memory(self) -> dict[str, int]:
        kv = self.layer.kv_bytes()
        meta = self.layer.slot_positions.nbytes + self._metadata_bytes()
        return {"kv": kv, "metadata": meta, "total": kv + meta}

    def _metadata_bytes(self) -> int:
        """Device bytes beside the blocks (the importance methods' scores)."""
        return 0

    def quant_blocks_held(self) -> int:
        """The 2-bit store's blocks this layer holds (none beside a full-precision store)."""
        return 0

    def model_step_read(self) -> int:
        """The KV bytes the model's attention reads in this layer for one row of the step
        :meth:`reserve` made room for: every held slot's key and value."""
        return int(self.heads_held().sum()) * self._slot_bytes()

    def _full_precision_read(self, slots: int) -> int:
        """The bytes of ``slots`` full-precision slots' keys and values in every KV head."""
        return slots * self.layer.kv_heads * self._slot_bytes()

    def _slot_bytes(self) -> int:
        """One full-precision slot's key and value in one KV head."""
        shape = self.layer.pool.shape
        return 2 * shape.head_dim * shape.elem_bytes

    def release(self) -> None:
        """Give the layer's blocks back to the pool."""
        self.layer.release()

    # ---- a model that stores and attends itself (our layers in OpenVINO's GPU plugin)
    #: whether a step of several tokens may follow the prompt (a chat's next turn over the kept cache)
    several_tokens_after_prompt = True

    def set_prompt(self, tokens: int) -> None:
        """The next steps feed a prompt of ``tokens`` tokens in chunks: each chunk is stored and
        attended over everything before it, and the method's prompt work (its scores, its
        selection) is done once, after the last chunk, as for the prompt in one step."""
        self.prompt_end = tokens

    @property
    def in_prompt(self) -> bool:
        """Whether the next step feeds (more of) the prompt."""
        return not self.seen or self.seen < self.prompt_end

    def attends_own(self, t: int) -> bool:
        """Whether the next step's ``t`` tokens attend the step's own tokens as the model gave
        them, not the store's rounded copies (asked before :meth:`reserve`): several tokens, or a
        chunk of a prompt, as the CPU op's prompt attention; a decode token reads the store."""
        return t > 1 or self.seen < self.prompt_end

    def _prompt_continues(self) -> bool:
        """After a step: whether it was a chunk of the prompt before its last (the method's prompt
        work waits for the last)."""
        return self.seen < self.prompt_end

    def finish_step(self) -> None:
        """After :meth:`after_model_step`: a prompt's last chunk ends its chunks."""
        if not self._prompt_continues():
            self.prompt_end = 0

    def _add_chunk_sums(self, sums: Any) -> Any:
        """A prompt chunk's window sums over the slots held (``sums`` ``[Hq, held]``; None: none
        of its rows is in the window) added to the prompt's so far; those so far (None: none yet).
        A row's probabilities are over the slots before it alone, so the chunks' sums add up to the
        whole prompt's."""
        if sums is None:
            return self._chunk_sums
        held, i32 = self.layer.held, np.int32
        if self._chunk_sums is None:
            self._chunk_sums = self.layer.pool.dev.zeros(4 * self.layer.q_heads * self.prompt_end)
        dev = self.layer.pool.dev
        dev.run(dev.kernel("snapkv.cl", "add_step_scores", {}), (held, self.layer.q_heads), None, self._chunk_sums,
                i32(self.prompt_end), i32(held), i32(held), sums, i32(held))  # fmt: skip
        return self._chunk_sums

    def reserve(self, t: int) -> None:
        """Room for the next step's ``t`` tokens, which the model's own store layer writes and its
        prompt layer attends (:mod:`ov_kvcrush.gpu.plugin_cache`): what :meth:`prefill` and
        :meth:`decode` do before their store."""
        self.layer.pool.phase = "prompt" if self.in_prompt else "decode"  # the pool's next sequence starts a prompt
        self.layer.reserve(t, self.seen)
        self.seen += t

    def score_rows(self, t: int) -> int:
        """How many of a ``t``-token step's last query rows :meth:`after_model_step` reads: none."""
        return 0

    def model_slots(self) -> np.ndarray:
        """Each KV head's slots as the model's layers see them ``[kv]``: before :meth:`reserve`,
        where the step's tokens go; after it, the slots its rows attend (the step's own among them)."""
        return np.full(self.layer.kv_heads, self.layer.held, np.int32)

    def model_tables(self) -> list[list[int]]:
        """Each KV head's blocks as the model's layers read them in the step :meth:`reserve` made room for."""
        return self.layer.tables

    def truncate(self, tokens: int) -> bool:
        """Forget every token at position ``tokens`` or later, as the CPU op's sequence does (the
        kept slots' state stays); False where the heads would keep different counts."""
        if not self.layer.truncate(tokens):
            return False
        self.seen = min(self.seen, tokens)
        return True

    def after_model_step(self, rows: Any, t: int, logits: StepLogits | None = None, sums: Any = None) -> None:
        """The method's work after a model step stored and attended ``t`` tokens (``rows``: the
        step's last :meth:`score_rows` query rows ``[Hq, rows, D]`` on the device; ``logits``: a
        decode row's logits as the model's attention wrote them, where it was asked to; ``sums``:
        each slot's probability summed over those rows ``[Hq, slots]`` on the device, as the
        model's attention gave them, where it was asked to: :class:`~ov_kvcrush.gpu.layer_inputs.WindowSums`):
        the full cache's is none."""

    def step_work(self, t: int, logits: StepLogits | None) -> StepWork | None:
        """:meth:`after_model_step`'s work as its sequence's row of a launch over the step's
        sequences (:mod:`ov_kvcrush.gpu.step_work`), the host's side done here; None where the
        step's work is not such a row (then :meth:`after_model_step` does it). The full cache's: none."""
        return None

    def take_step_clustering(self) -> StepClustering | None:
        """The clustering due before the model's step (:meth:`reserve` planned it), to launch with
        the step's other sequences' (:func:`~ov_kvcrush.gpu.step_work.launch_layer_clusterings`):
        ClusterKV's; None: none."""
        return None
