"""See inside a compressed cache: what a method kept, merged or quantized of a prompt, and the error it left.

``ov-kvcrush inspect --method M --budget B --prompt-file F`` runs the prompt through the torch
reference (the oracle the op is tested against, token for token: ``tests/test_op_methods.py``)
twice, once with the full cache and once with the method. Per layer and KV head it reports:

* ``kept``: prompt positions held in full precision (in the JSON as half-open runs
  ``[start, end]``); ``quantized``: those held in the 2-/4-bit store; ``merged``: slots standing
  for more than one token (Chelsea) and the tokens they absorb (the absorbed tokens show as
  evicted: a merged slot keeps one position);
* ``key_rel_err`` / ``value_rel_err``: ``||held - exact|| / ||exact||`` over the held slots, against
  the full cache's keys and values at the same positions (selection alone leaves none;
  quantization and merging do);
* ``tv_last_query``: the total-variation distance between the prompt's last query's attention
  over the full cache and over what the method holds (an evicted token gets probability 0; a
  merged slot's probability counts at its position; Chelsea's ``log(degree)`` bias included).

It writes JSON and a heatmap PNG: one row per (layer, KV head), one column per prompt position,
coloured evicted / kept / quantized / merged, with ``--needle TEXT`` marking where that text lies
in the prompt. ``docs/quality.md`` uses it to explain what each method loses.

Where it departs from the engines: it inspects the reference, not the op; the prompt's tokens
are the raw text (``--chat`` applies the chat template first).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ov_kvcrush.config import CompressionConfig
from ov_kvcrush.errors import UserError
from ov_kvcrush.methods.attention import LogitMap, attend

# Imported where used, inside functions: what pulls in matplotlib, platformdirs, transformers, heavy
# to import, so that importing this module stays light.

#: heatmap codes of a prompt position in one (layer, KV head)
EVICTED, KEPT, QUANTIZED, MERGED = 0, 1, 2, 3


@dataclass
class HeadReport:
    """One (layer, KV head): which prompt positions it holds, how, and the error left."""

    layer: int
    head: int
    kept: list[int] = field(default_factory=list)
    quantized: list[int] = field(default_factory=list)
    merged: dict[int, float] = field(default_factory=dict)  # slot position -> tokens it stands for
    key_rel_err: float = 0.0
    value_rel_err: float = 0.0
    tv_last_query: float = 0.0

    def codes(self, n: int) -> list[int]:
        row = [EVICTED] * n
        for p in self.kept:
            row[p] = KEPT
        for p in self.quantized:
            row[p] = QUANTIZED
        for p in self.merged:
            row[p] = MERGED
        return row


@dataclass
class Inspection:
    """Everything :func:`inspect_prompt` measured (``to_json`` is what the CLI writes)."""

    method: str
    budget: int | None
    options: dict[str, Any]
    tokens: int
    needle: tuple[int, int] | None  # token span [start, end) of --needle in the prompt
    heads: list[HeadReport]

    def to_json(self) -> dict[str, Any]:
        per_layer: dict[int, list[HeadReport]] = {}
        for h in self.heads:
            per_layer.setdefault(h.layer, []).append(h)

        def mean(xs: list[float]) -> float:
            return sum(xs) / len(xs) if xs else 0.0

        return {
            "method": self.method,
            "budget": self.budget,
            "options": {
                k: repr(v) if not isinstance(v, (int, float, str, bool)) else v for k, v in self.options.items()
            },
            "tokens": self.tokens,
            "needle": list(self.needle) if self.needle else None,
            "summary": {
                "tv_last_query_mean": mean([h.tv_last_query for h in self.heads]),
                "key_rel_err_mean": mean([h.key_rel_err for h in self.heads]),
                "value_rel_err_mean": mean([h.value_rel_err for h in self.heads]),
                "needle_tokens_kept": self.needle_kept(),
            },
            "layers": [
                {
                    "layer": layer,
                    "tv_last_query": mean([h.tv_last_query for h in heads]),
                    "heads": [
                        {
                            "head": h.head,
                            "kept": ranges(h.kept),
                            "quantized": ranges(h.quantized),
                            "merged": {str(p): d for p, d in h.merged.items()},
                            "key_rel_err": h.key_rel_err,
                            "value_rel_err": h.value_rel_err,
                            "tv_last_query": h.tv_last_query,
                        }
                        for h in heads
                    ],
                }
                for layer, heads in sorted(per_layer.items())
            ],
        }

    def needle_kept(self) -> dict[str, float] | None:
        """Share of the needle's token slots (over every layer and head) held exactly, quantized,
        merged or evicted; and the share of heads that hold all of its tokens (``whole_heads``) or
        only some (``partial_heads``): a needle split across heads is what token selection loses."""
        if not self.needle:
            return None
        start, end = self.needle
        counts = [0, 0, 0, 0]
        whole = partial = 0
        for h in self.heads:
            row = h.codes(self.tokens)[start:end]
            for code in row:
                counts[code] += 1
            held = sum(code != EVICTED for code in row)
            whole += held == len(row)
            partial += 0 < held < len(row)
        total = max(1, sum(counts))
        out = {name: c / total for name, c in zip(("evicted", "kept", "quantized", "merged"), counts, strict=True)}
        heads = max(1, len(self.heads))
        return {**out, "whole_heads": whole / heads, "partial_heads": partial / heads}


def ranges(positions: list[int]) -> list[list[int]]:
    """Ascending positions as half-open runs ``[[start, end], ...]`` (what the JSON stores: spans stay small)."""
    out: list[list[int]] = []
    for p in positions:
        if out and out[-1][1] == p:
            out[-1][1] = p + 1
        else:
            out.append([p, p + 1])
    return out


def _held(cache: Any, head: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """``(keys [n, d], values [n, d], positions [n], degrees [n] or None, quantized count)`` one KV head holds.

    The quantized tokens come first in the store's order (:class:`~ov_kvcrush.methods.store.QuantStore`).
    """
    merged_heads = getattr(cache, "merged_heads", None)
    store, degrees, row = cache.store, None, head
    if merged_heads is not None:  # Chelsea: merged heads in its store, outlier heads kept whole
        if head in merged_heads:
            row = merged_heads.index(head)
            degrees = cache.degrees[0, row] if cache.degrees is not None else None
        else:
            store, row = cache.full, cache.outlier_heads.index(head)
    k, v, p = store.dense()
    nq = getattr(store, "quantized_tokens", 0)
    return k[0, row].float(), v[0, row].float(), p[0, row], degrees, nq


def _rel_err(held: torch.Tensor, exact: torch.Tensor) -> float:
    den = float(exact.norm())
    return float((held - exact).norm()) / den if den else 0.0


def inspect_prompt(
    model_dir: str | Path,
    compression: CompressionConfig,
    prompt: str,
    *,
    chat: bool = False,
    needle: str | None = None,
    max_tokens: int = 16384,
) -> Inspection:
    """Run ``prompt`` through the full cache and through ``compression``; measure every (layer, KV head)."""
    from ov_kvcrush.engines.hf_cache import CompressedCache
    from ov_kvcrush.engines.torch_engine import TorchEngine

    if compression.method == "full":
        raise UserError("method=full is invalid for inspect: allowed a compressing method (full is the reference)")
    engine = TorchEngine(model_dir, compression, fast_path=False)
    ids, span = _tokens(engine.tokenizer, prompt, chat, needle)
    if len(ids) > max_tokens:
        raise UserError(f"prompt ({len(ids)} tokens) is invalid: allowed at most {max_tokens} tokens for inspect")
    caches: dict[str, CompressedCache] = {}
    last_q: dict[int, tuple[torch.Tensor, float | None]] = {}
    for which, method in (("full", CompressionConfig().method_config()), ("method", engine.method)):
        cache = CompressedCache(method, engine.model.config)
        if which == "method":
            for i, layer in enumerate(cache.layers):
                _capture_last_query(layer.method, i, last_q)
        with torch.no_grad():
            engine.model(torch.tensor([ids], device=engine.device), past_key_values=cache, use_cache=True)
        caches[which] = cache
    heads: list[HeadReport] = []
    for i, (full_layer, layer) in enumerate(zip(caches["full"].layers, caches["method"].layers, strict=True)):
        if getattr(layer, "is_sliding", False):
            continue  # the model's own window: not the method's
        fk, fv, fp = (x[0] for x in full_layer.method.store.dense())
        q, logit = last_q[i]
        hk = fk.shape[0]
        g = q.shape[1] // hk
        for h in range(hk):
            heads.append(
                _head_report(i, h, layer.method, fk[h].float(), fv[h].float(), fp[h], q[0, h * g : (h + 1) * g], logit)
            )
    return Inspection(compression.method, compression.budget, dict(compression.options), len(ids), span, heads)


def _capture_last_query(method_cache: Any, index: int, into: dict[int, tuple[torch.Tensor, LogitMap]]) -> None:
    """Record the prompt's last query of this layer when its prefill runs (the scale and cap are
    set by then)."""
    prefill = method_cache.prefill

    def recording(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        into[index] = (queries[:, :, -1:].detach().float().clone(), LogitMap(method_cache.scale, method_cache.softcap))
        return prefill(queries, keys, values)

    method_cache.prefill = recording


def _head_report(
    layer: int,
    head: int,
    cache: Any,
    full_k: torch.Tensor,
    full_v: torch.Tensor,
    full_pos: torch.Tensor,
    queries: torch.Tensor,
    logit: LogitMap,
) -> HeadReport:
    """One KV head: its held positions, errors, and the last query's attention distance (``queries``: its group)."""
    k, v, pos, degrees, nq = _held(cache, head)
    valid = pos >= 0
    k, v, pos = k[valid], v[valid], pos[valid]
    degrees = degrees[valid] if degrees is not None else None
    index = {int(p): i for i, p in enumerate(full_pos.tolist())}
    exact = torch.tensor([index[int(p)] for p in pos.tolist()], dtype=torch.long)
    rep = HeadReport(layer, head)
    for i, p in enumerate(pos.tolist()):
        if degrees is not None and float(degrees[i]) > 1.0:
            rep.merged[int(p)] = float(degrees[i])
        elif i < nq:
            rep.quantized.append(int(p))
        else:
            rep.kept.append(int(p))
    rep.kept.sort()
    rep.quantized.sort()
    rep.key_rel_err = _rel_err(k, full_k[exact])
    rep.value_rel_err = _rel_err(v, full_v[exact])
    # the last query's attention, full against held, per query head of the group, averaged
    q = queries.unsqueeze(0)  # [1, g, 1, d]
    p_full = attend(
        q, full_k[None, None], full_v[None, None], scale=logit.scale, softcap=logit.softcap, return_scores=True
    ).scores
    bias = degrees.log()[None, None] if degrees is not None else None
    p_held = attend(
        q, k[None, None], v[None, None], bias=bias, scale=logit.scale, softcap=logit.softcap, return_scores=True
    ).scores
    assert p_full is not None and p_held is not None
    on_full = torch.zeros_like(p_full)
    on_full[..., exact] = p_held
    rep.tv_last_query = float(0.5 * (p_full - on_full).abs().sum(-1).mean())
    return rep


def _tokens(tokenizer: Any, prompt: str, chat: bool, needle: str | None) -> tuple[list[int], tuple[int, int] | None]:
    """The prompt's token ids as the engines encode it, and the token span ``[start, end)`` of the
    first occurrence of ``needle`` (from the tokenizer's character offsets)."""
    if chat:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
        )
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)  # the template has the BOS
    else:
        text = prompt
        enc = tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
    ids = list(enc.input_ids)
    if needle is None:
        return ids, None
    at = text.find(needle)
    if at < 0:
        raise UserError(f"needle={needle[:40]!r} is invalid: allowed a substring of the prompt")
    hit = [i for i, (a, b) in enumerate(enc.offset_mapping) if b > at and a < at + len(needle)]
    return ids, (hit[0], hit[-1] + 1)


def plot_inspection(report: Inspection, path: str | Path) -> Path:
    """The heatmap: rows (layer, KV head), columns prompt positions; plus the per-layer attention distance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap

    rows = [h.codes(report.tokens) for h in report.heads]
    fig, (ax, side) = plt.subplots(
        1, 2, figsize=(12, 6), gridspec_kw={"width_ratios": [5, 1]}, sharey=False, constrained_layout=True
    )
    cmap = ListedColormap(["#f0f0f0", "#1f77b4", "#ff7f0e", "#2ca02c"])
    ax.imshow(rows, aspect="auto", interpolation="nearest", cmap=cmap, vmin=0, vmax=3)
    ax.set_xlabel("prompt position")
    ax.set_ylabel("layer x KV head")
    if report.needle:
        for x in report.needle:
            ax.axvline(x - 0.5, color="red", lw=0.8)
    title = f"{report.method} @ {report.budget}" + "".join(f" {k}={v}" for k, v in report.options.items())
    ax.set_title(f"{title}: grey evicted, blue kept, orange quantized, green merged (red: needle)", fontsize=9)
    layers = sorted({h.layer for h in report.heads})
    tv = [
        sum(h.tv_last_query for h in report.heads if h.layer == L) / max(1, sum(h.layer == L for h in report.heads))
        for L in layers
    ]
    side.barh(range(len(layers)), tv, color="#555555")
    side.set_yticks(range(len(layers)))
    side.set_yticklabels([str(L) for L in layers], fontsize=6)
    side.invert_yaxis()
    side.set_xlabel("last query TV distance")
    side.set_title("per layer", fontsize=9)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
