"""``ov-kvcrush bench``: one sequence at a time over lengths (:mod:`ov_kvcrush.bench`), a batch of
sequences decoding together on the torch backends (``--concurrency N``: the same harness, each
run a batch), or many requests over one pool on the OpenVINO backends (``--concurrency`` with
``--kv-pool-mib``: :mod:`ov_kvcrush.bench.serving`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ov_kvcrush.cli.values import parse_int, parse_name, split_values
from ov_kvcrush.errors import ConfigError, UserError
from ov_kvcrush.outputs import PLOT_SUFFIXES, prepare_output, write_atomic, write_text

# Imported where used, inside functions: what pulls in numpy, platformdirs, heavy to import, so that
# importing this module stays light.


def cmd_bench(args: argparse.Namespace) -> int:
    from ov_kvcrush.bench import BenchPlan, dry_run, format_markdown, format_table, plot, run_bench

    json_out = prepare_output("--json", args.json_out)
    plot_out = prepare_output("--plot", args.plot, PLOT_SUFFIXES)
    markdown_out = prepare_output("--markdown", args.markdown)
    from ov_kvcrush.serving.backends import ALL

    backends = split_values("--backends", args.backends, parse_name)
    batched = args.concurrency is not None and all(b in ALL and ALL[b].torch_devices for b in backends)
    if args.kv_pool_mib is not None or (args.concurrency is not None and not batched):
        return _bench_serving(args, json_out, plot_out, markdown_out)
    plan = BenchPlan(
        backends=backends,
        methods=split_values("--methods", args.methods, str),
        budgets=split_values("--budgets", args.budgets, parse_int),
        lengths=split_values("--lengths", args.lengths, parse_int),
        repeats=args.repeats,
        new_tokens=args.new_tokens,
        seed=args.seed,
        model=args.model,
        device=args.device,
        isolate=not args.no_isolate,
        batch=args.concurrency or 1,
        sparse_prefill=split_values("--sparse-prefill", args.sparse_prefill, str) if args.sparse_prefill else (),
    )
    if args.dry_run:
        print(dry_run(plan))
        return 0
    doc = run_bench(plan, progress=lambda line: print(line, flush=True))
    print()
    print(format_table(doc))
    measured = doc.get("device_bandwidth_gbps") or {"cpu": doc["bandwidth_gbps"]}
    print("\nmemory bandwidth (copy, read + write): " + ", ".join(f"{d} {g:.1f} GB/s" for d, g in measured.items()))
    if json_out is not None:
        write_text(json_out, json.dumps(doc, indent=2))
    if plot_out is not None:
        write_atomic(plot_out, lambda p: plot(doc, p))
    if markdown_out is not None:
        write_text(markdown_out, format_markdown(doc) + "\n")
    return 0


def _bench_serving(
    args: argparse.Namespace, json_out: Path | None, plot_out: Path | None, markdown_out: Path | None
) -> int:
    from ov_kvcrush.bench.serving import ServingPlan, checked_configs, format_serving, plot_serving, run_serving
    from ov_kvcrush.serving.scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS

    if args.concurrency is None or args.kv_pool_mib is None:
        missing = "--concurrency" if args.concurrency is None else "--kv-pool-mib"
        raise UserError(f"a serving run needs both --concurrency and --kv-pool-mib ({missing} is missing)")
    lengths = split_values("--lengths", args.lengths, parse_int)
    if len(lengths) != 1:
        raise ConfigError("lengths", args.lengths, "one prompt length for a serving run (--concurrency)")
    plan = ServingPlan(
        backends=split_values("--backends", args.backends, parse_name),
        methods=split_values("--methods", args.methods, str),
        budgets=split_values("--budgets", args.budgets, parse_int),
        concurrency=args.concurrency,
        length=lengths[0],
        new_tokens=args.new_tokens,
        kv_pool_mib=args.kv_pool_mib,
        max_num_batched_tokens=DEFAULT_MAX_NUM_BATCHED_TOKENS
        if args.max_num_batched_tokens is None
        else args.max_num_batched_tokens,
        seed=args.seed,
        model=args.model,
    )
    configs = checked_configs(plan)
    if args.dry_run:
        print(f"serving: {plan.concurrency} requests x {plan.length} tokens, {plan.kv_pool_mib} MiB pool")
        print("\n".join(f"  {c.label}" for c in configs))
        return 0
    doc = run_serving(plan, progress=lambda line: print(line, flush=True))
    doc["command"] = "ov-kvcrush " + " ".join(sys.argv[1:])
    table = format_serving(doc)
    print()
    print(table)
    if json_out is not None:
        write_text(json_out, json.dumps(doc, indent=2))
    if plot_out is not None:
        write_atomic(plot_out, lambda p: plot_serving(doc, p))
    if markdown_out is not None:
        write_text(markdown_out, table + "\n")
    return 0
