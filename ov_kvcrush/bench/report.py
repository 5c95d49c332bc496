"""A bench run's results: medians and ratios per configuration and length (``summarize``), the
JSON schema check, the plot and the text and Markdown tables."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ov_kvcrush.bench.measure import floor_ms
from ov_kvcrush.serving.backends import backend_info

# Imported where used, inside functions: what pulls in matplotlib, heavy to import, so that
# importing this module stays light.

#: keys every entry of ``results`` carries (the JSON schema's required part; more keys are added)
RESULT_KEYS = ("backend", "method", "budget", "length", "ttft_ms", "tpot_ms", "kv_bytes", "peak_rss_bytes")


def summarize(
    runs: Iterable[dict[str, Any]],
    weight_bytes: dict[str, int],
    bandwidth_gbps: float | dict[str, float],
    anchor: str = "genai",
) -> list[dict[str, Any]]:
    """One result per (configuration, length): medians over the repeats, and the ratios.

    Ratios divide by the ``anchor`` backend's full cache at the same length (``*_vs_anchor``;
    also ``*_vs_native_full`` when that is native genai), and TPOT by transformers' compiled
    static cache where the run has it (``tpot_vs_hf_static_compiled``).

    ``weight_bytes`` maps a backend to the bytes of weights one decode step reads;
    ``bandwidth_gbps`` is the CPU's, or a mapping from device (a run's ``device``, default
    ``cpu``) to its bandwidth.
    """
    bandwidths = bandwidth_gbps if isinstance(bandwidth_gbps, dict) else {"cpu": bandwidth_gbps}
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["label"], run["length"]), []).append(run)
    results = []
    for (label, length), mine in groups.items():
        first = mine[0]
        batch = int(first.get("batch", 1))
        tpot = statistics.median(r["tpot_ms"] for r in mine)
        kv = statistics.median(r["kv_bytes"] for r in mine)
        kv_read = statistics.median(r.get("kv_read_bytes", r["kv_bytes"]) for r in mine)
        row = {
            "label": label,
            "backend": first["backend"],
            "method": first["method"],
            "budget": first["budget"],
            "options": first["options"],
            "length": length,
            "prompt_tokens": first["prompt_tokens"],
            "runs": len(mine),
            "batch": batch,
            "ttft_ms": statistics.median(r["ttft_ms"] for r in mine),
            "tpot_ms": tpot,
            "tpot_p90_ms": statistics.median(r["tpot_p90_ms"] for r in mine),
            "decode_tokens_per_s": batch * 1e3 / tpot if tpot else 0.0,
            "kv_bytes": int(kv),
            "kv_read_bytes": int(kv_read),
            "peak_rss_bytes": int(max(r["peak_rss_bytes"] for r in mine)),
            "engine_rss_bytes": first.get("engine_rss_bytes"),
            "device": first.get("device", "cpu"),
            "correct": None if any(r["correct"] is None for r in mine) else sum(int(r["correct"]) for r in mine),
        }
        for key in ("policy_decode_share", "policy_prefill_share", "clustering_prefill_share"):
            vals = [r[key] for r in mine if r.get(key) is not None]
            row[key] = statistics.median(vals) if vals else None
        # a step reads the weights once for the whole batch, and the KV its method must read
        row["floor_ms"] = floor_ms(weight_bytes[first["backend"]], row["kv_read_bytes"], bandwidths[row["device"]])
        row["tpot_vs_floor"] = tpot / row["floor_ms"] if row["floor_ms"] else None
        results.append(row)

    def by_length(backend: str) -> dict[int, dict[str, Any]]:
        return {r["length"]: r for r in results if r["backend"] == backend and r["method"] == "full"}

    def ratio(x: float, base: dict[str, Any] | None, key: str) -> float | None:
        return x / base[key] if base and base[key] else None

    anchors, static = by_length(anchor), by_length("hf-static-compiled")
    for r in results:
        base = anchors.get(r["length"])
        r["tpot_vs_anchor"] = ratio(r["tpot_ms"], base, "tpot_ms")
        r["kv_vs_anchor"] = ratio(r["kv_bytes"], base, "kv_bytes")
        r["ttft_vs_anchor"] = ratio(r["ttft_ms"], base, "ttft_ms")
        native = base if backend_info(anchor).native else None
        r["tpot_vs_native_full"] = ratio(r["tpot_ms"], native, "tpot_ms")
        r["kv_vs_native_full"] = ratio(r["kv_bytes"], native, "kv_bytes")
        if static:
            r["tpot_vs_hf_static_compiled"] = ratio(r["tpot_ms"], static.get(r["length"]), "tpot_ms")
    return results


def validate_doc(doc: dict[str, Any]) -> None:
    """Check a bench JSON document's schema (the keys and types other tools may rely on)."""
    for key, kind in (("results", list), ("bandwidth_gbps", (int, float)), ("machine", dict), ("runs", list)):
        if not isinstance(doc.get(key), kind):
            raise ValueError(f"bench JSON: {key!r} missing or not a {getattr(kind, '__name__', kind)}")
    for i, r in enumerate(doc["results"]):
        missing = [k for k in RESULT_KEYS if k not in r]
        if missing:
            raise ValueError(f"bench JSON: results[{i}] lacks {', '.join(missing)}")
        for k in ("length", "kv_bytes", "peak_rss_bytes"):
            if not isinstance(r[k], int) or r[k] < 0:
                raise ValueError(f"bench JSON: results[{i}].{k} must be a non-negative integer")
        for k in ("ttft_ms", "tpot_ms"):
            if not isinstance(r[k], (int, float)) or r[k] < 0:
                raise ValueError(f"bench JSON: results[{i}].{k} must be a non-negative number")
        if r["budget"] is not None and not isinstance(r["budget"], int):
            raise ValueError(f"bench JSON: results[{i}].budget must be an integer or null")


def plot(doc: dict[str, Any], out: str | Path) -> None:
    """TPOT vs length and KV bytes vs length, one line per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(14, 5.5))
    labels = list(dict.fromkeys(r["label"] for r in doc["results"]))
    # one colour per method and options (the same across backends), one line style per backend
    kinds = list(dict.fromkeys(label.split(" ", 1)[1] for label in labels))
    colours = plt.get_cmap("tab20" if len(kinds) > 10 else "tab10")
    styles = {"genai": "--", "openvino": "-", "torch": ":", "hf-sdpa": "-.", "hf-static-compiled": "-."}
    for label in labels:
        rows = sorted((r for r in doc["results"] if r["label"] == label), key=lambda r: r["length"])
        xs = [r["length"] for r in rows]
        kw = {"color": colours(kinds.index(label.split(" ", 1)[1])), "marker": "o", "label": label}
        a.plot(xs, [r["tpot_ms"] for r in rows], styles.get(rows[0]["backend"], "-"), **kw)
        b.plot(xs, [r["kv_bytes"] / 2**20 for r in rows], styles.get(rows[0]["backend"], "-"), **kw)
    a.set(xlabel="context length (tokens)", ylabel="TPOT (ms, median)", title="decode time per token")
    b.set(xlabel="context length (tokens)", ylabel="KV cache held (MiB)", title="KV memory", yscale="log")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.set_xscale("log", base=2)
    b.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    gpus = ", ".join(doc["machine"].get("gpus", {}).values())
    where = (
        f"{gpus}, {max(doc.get('device_bandwidth_gbps', {}).values(), default=0):.0f}"
        if gpus
        else (f"{doc['machine']['cpu']}, {doc['bandwidth_gbps']:.1f}")
    )
    speed = "; random weights: speed only" if doc.get("speed_only") else ""
    fig.suptitle(f"ov-kvcrush bench ({where} GB/s copy bandwidth{speed})")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def format_table(doc: dict[str, Any]) -> str:
    """The results as a text table (one line per configuration and length).

    ``xTPOT``/``xKV``: ratios to the anchor's full cache at that length (native genai; hf-sdpa for a
    random-weight model); ``xfloor``: TPOT over the
    bandwidth floor; ``pre%``/``dec%``: the method's own share of prefill/decode time (selection,
    clustering, merging, quantising; measured inside our op and the torch cache); ``RSS``: peak
    resident memory of the configuration's process during its runs."""
    head = (
        f"{'configuration':38s} {'tokens':>6s} {'TTFT ms':>8s} {'TPOT ms':>8s} {'p90':>6s} {'tok/s':>6s} "
        f"{'KV MiB':>8s} {'xTPOT':>6s} {'xKV':>6s} {'xfloor':>6s} {'pre%':>5s} {'dec%':>5s} {'RSS MiB':>8s}"
    )
    batch = int(doc.get("plan", {}).get("batch", 1))
    rows = f"; every run a batch of {batch} sequences (xN after a label), tok/s counts every row" if batch > 1 else ""
    lines = [f"ratios to {doc.get('anchor', 'genai full')}{rows}", head]

    def ratio(x: float | None, digits: int = 2) -> str:
        return f"{x:6.{digits}f}" if x is not None else f"{'':6s}"

    def share(x: float | None) -> str:
        return f"{100 * x:5.1f}" if x is not None else f"{'':5s}"

    for r in doc["results"]:
        lines.append(
            f"{_batched(r, 'x'):38s} {r['length']:6d} {r['ttft_ms']:8.0f} {r['tpot_ms']:8.1f} {r['tpot_p90_ms']:6.1f} "
            f"{r['decode_tokens_per_s']:6.1f} {r['kv_bytes'] / 2**20:8.2f} {ratio(_anchored(r, 'tpot'))} "
            f"{ratio(_anchored(r, 'kv'), 3)} {ratio(r['tpot_vs_floor'])} "
            f"{share(r.get('policy_prefill_share'))} {share(r.get('policy_decode_share'))} "
            f"{r['peak_rss_bytes'] / 2**20:8.0f}"
        )
    return "\n".join(lines)


def format_markdown(doc: dict[str, Any]) -> str:
    """The results as a Markdown table, for the committed results page."""

    def x(v: float | None, digits: int = 2) -> str:
        return "" if v is None else f"{v:.{digits}f}×"

    def pct(v: float | None) -> str:
        return "" if v is None else f"{100 * v:.1f} %"

    anchor = doc.get("anchor", "genai full").replace("genai full", "native full")
    lines = [
        f"| configuration | tokens | TTFT ms | TTFT vs {anchor} | TPOT ms (median) | p90 | tok/s | KV MiB "
        f"| TPOT vs {anchor} | KV vs {anchor} | TPOT vs floor | method share of prefill | of decode "
        "| clustering share of prefill | peak RSS MiB | passkey |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["results"]:
        passkey = "speed only" if r["correct"] is None else f"{r['correct']}/{r['runs'] * r.get('batch', 1)}"
        lines.append(
            f"| {_batched(r, '×')} | {r['prompt_tokens']} | {r['ttft_ms']:.0f} | {x(r.get('ttft_vs_anchor'))} "
            f"| {r['tpot_ms']:.1f} | {r['tpot_p90_ms']:.1f} "
            f"| {r['decode_tokens_per_s']:.1f} | {r['kv_bytes'] / 2**20:.2f} | {x(_anchored(r, 'tpot'))} "
            f"| {x(_anchored(r, 'kv'), 3)} | {x(r['tpot_vs_floor'])} | {pct(r.get('policy_prefill_share'))} "
            f"| {pct(r.get('policy_decode_share'))} | {pct(r.get('clustering_prefill_share'))} "
            f"| {r['peak_rss_bytes'] / 2**20:.0f} | {passkey} |"
        )
    return "\n".join(lines)


def _batched(row: dict[str, Any], times: str) -> str:
    """A result's label, with its batch (``torch clusterkv @1024 x8``) where it decoded several rows."""
    batch = int(row.get("batch", 1))
    return row["label"] if batch == 1 else f"{row['label']} {times}{batch}"


def _anchored(row: dict[str, Any], what: str) -> float | None:
    """``tpot``/``kv`` over the anchor's (results written before anchors were named: native full)."""
    return row.get(f"{what}_vs_anchor", row.get(f"{what}_vs_native_full"))
