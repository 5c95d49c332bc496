"""A decode step's small kernels timed alone, as a replayed graph runs them: ClusterKV's selection,
the split-key attention over its recalled slots, and the store's append.

Each operation is captured 30 times in one CUDA graph (a layer after another, as a step's graph
holds them, so the gaps between launches count) and the graph replayed; the time per operation
is the median replay over 30. Shapes are the headline's: a Llama-3-8B layer (8 KV heads of 128,
4 query heads each) at 128k tokens for one sequence and 32k for a batch of eight, ClusterKV's
clusters of 80 tokens and budget 1024 (16 sinks, 1008 recalled, a window of 320).

    python3 benchmarks/gpu_kernels.py --json kernels.json

It runs against whichever ``ov_kvcrush`` is first on ``PYTHONPATH`` (an older checkout's for
*before*); a part the package does not have is skipped. ``--min-chunks`` also times the split
attention with other smallest chunks (the module's ``MIN_CHUNK``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ov_kvcrush.kernels import cluster_select, decode
from ov_kvcrush.methods.clusterkv import ClusterIndex

HK, GROUP, D = 8, 4, 128
LAYERS = 30  # ClusterKV's sparse layers of a step


def graphed_ms(op, repeats: int = 30) -> float:
    """Median ms of one ``op()`` inside a graph of :data:`LAYERS` of them."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            op()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAYERS):
            op()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) / LAYERS)
    return round(statistics.median(times), 5)


def selection_case(batch: int, tokens: int, dev: torch.device, min_chunks: list[int]) -> dict[str, object]:
    """ClusterKV's selection (:func:`cluster_select.select_recalled`) and its attention (also with
    each of ``min_chunks`` as the attention's smallest chunk)."""
    gen = torch.Generator(device=dev).manual_seed(tokens)
    rows, sinks, window = batch * HK, 16, 320
    clustered = tokens - sinks
    c = -(-clustered // 80)
    labels = torch.randint(0, c, (rows, clustered), device=dev, generator=gen)
    centroids = torch.randn(rows, c, D, device=dev, generator=gen)
    index = ClusterIndex.build(centroids, labels, torch.arange(sinks, tokens, device=dev))
    queries = torch.randn(batch, HK * GROUP, 1, D, device=dev, generator=gen, dtype=torch.bfloat16)
    take = min(1024 - sinks, clustered)
    slots = torch.cat(
        [torch.arange(sinks, device=dev), torch.zeros(take, dtype=torch.long, device=dev),
         torch.arange(tokens, tokens + window, device=dev)]
    ).expand(rows, -1).contiguous()  # fmt: skip
    ring = torch.zeros((1, rows, c), dtype=torch.int8, device=dev)
    ptr = torch.zeros(1, dtype=torch.long, device=dev)
    counts = torch.zeros(3, dtype=torch.long, device=dev)

    def select() -> None:
        cluster_select.select_recalled(
            queries, index.centroids, index.sizes, index.offsets, index.sorted_tokens, budget=1024 - sinks,
            slots=slots, offset=sinks, counts=counts, ring=ring, ring_ptr=ptr,
        )  # fmt: skip

    out: dict[str, object] = {"batch": batch, "tokens": tokens, "clusters": c, "select_ms": graphed_ms(select)}
    select()
    capacity = tokens + 512
    keys = torch.randn(batch, HK, capacity, D, device=dev, dtype=torch.bfloat16, generator=gen)
    values = torch.randn_like(keys)
    n = torch.tensor([tokens + 1], device=dev)
    chosen = slots.view(batch, HK, -1)
    attend = lambda: decode.decode_attention(queries, keys, values, length=n, slots=chosen)  # noqa: E731
    out["attend_ms"] = graphed_ms(attend)
    out["attend_full_ms"] = graphed_ms(lambda: decode.decode_attention(queries, keys, values, length=n))
    default = decode.MIN_CHUNK
    for chunk in min_chunks:
        decode.MIN_CHUNK = chunk
        out[f"attend_ms_min_chunk_{chunk}"] = graphed_ms(attend)
    decode.MIN_CHUNK = default
    out["min_chunk"] = default
    return out


def append_case(batch: int, dev: torch.device) -> dict[str, object]:
    """A token into the store: :mod:`ov_kvcrush.kernels.kv_store` where the package has it, beside
    the torch operations it replaces."""
    keys = torch.zeros(batch, HK, 4096, D, device=dev, dtype=torch.bfloat16)
    values = torch.zeros_like(keys)
    k, v = (torch.randn(batch, HK, 1, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
    n = torch.zeros(1, dtype=torch.long, device=dev)

    def torch_ops() -> None:
        keys.index_copy_(2, n, k)
        values.index_copy_(2, n, v)
        n.add_(1)

    out: dict[str, object] = {"batch": batch, "torch_ops_ms": graphed_ms(torch_ops)}
    try:
        from ov_kvcrush.kernels.kv_store import append_token
    except ImportError:
        return out
    n.zero_()
    out["append_token_ms"] = graphed_ms(lambda: append_token(keys, values, k, v, n))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", dest="json_out")
    ap.add_argument("--min-chunks", default="", help="comma-separated MIN_CHUNK values to time the attention with")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows: list[dict[str, object]] = []
    min_chunks = [int(x) for x in args.min_chunks.split(",") if x]
    for batch, tokens in ((1, 131000), (8, 32768)):
        rows.append(selection_case(batch, tokens, dev, min_chunks))
        print(json.dumps(rows[-1]), flush=True)
    for batch in (1, 8):
        rows.append(append_case(batch, dev))
        print(json.dumps(rows[-1]), flush=True)
    if args.json_out:
        package = str(Path(decode.__file__).parents[1])
        result = {"device": torch.cuda.get_device_name(), "package": package, "rows": rows}
        Path(args.json_out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
