"""``ov-kvcrush inspect``: its arguments and its command (the work is :mod:`ov_kvcrush.eval.inspector`,
imported only when the command runs, so ``ov-kvcrush --help`` stays free of torch)."""

from __future__ import annotations

import argparse
import json

from ov_kvcrush.config import parse_method_budget, parse_options
from ov_kvcrush.outputs import PLOT_SUFFIXES, prepare_output, read_prompt_file, write_atomic, write_text

# Imported where used, inside functions: what pulls in numpy, platformdirs, torch, heavy to import,
# so that importing this module stays light.


def add_inspect_arguments(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "inspect",
        help="what a method kept, merged or quantized of a prompt, per layer and KV head, and the error left",
        description="Runs the prompt through the torch reference with the full cache and with the method; per "
        "layer and KV head reports the positions kept, quantized and merged, the key/value error against the full "
        "cache, and the last query's attention distance; writes JSON and a heatmap.",
    )
    p.add_argument("--method", required=True, help="a compressing registry method")
    p.add_argument("--budget", type=int, help="KV tokens kept per layer and KV head (required by budgeted methods)")
    p.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a field of the method's config, VALUE in JSON (e.g. block_size=32, quant='{\"bits\": 4}'); repeatable",
    )
    p.add_argument("--prompt-file", required=True, help="text file with the prompt ('-' for stdin)")
    p.add_argument("--needle", help="a substring of the prompt to mark (and count: how much of it each head kept)")
    p.add_argument("--chat", action="store_true", help="apply the chat template (default: raw text)")
    p.add_argument("--model", help="HF checkpoint directory or GGUF (default: the embedded model)")
    p.add_argument("--json", dest="json_out", help="write the per-layer, per-head report as JSON")
    p.add_argument("--plot", help="write the heatmap (PNG/SVG/PDF)")


def cmd_inspect(args: argparse.Namespace) -> int:
    from ov_kvcrush.eval.inspector import inspect_prompt, plot_inspection
    from ov_kvcrush.serving.backends import resolve_model

    json_out = prepare_output("--json", args.json_out)
    plot_out = prepare_output("--plot", args.plot, PLOT_SUFFIXES)
    compression = parse_method_budget(args.method, args.budget, options=parse_options(args.option))
    prompt = read_prompt_file(args.prompt_file)
    report = inspect_prompt(resolve_model("torch", args.model), compression, prompt, chat=args.chat, needle=args.needle)
    doc = report.to_json()
    s = doc["summary"]
    print(
        f"{report.method} @ {report.budget}, {report.tokens} tokens: last-query TV {s['tv_last_query_mean']:.3f}, "
        f"key error {s['key_rel_err_mean']:.3f}, value error {s['value_rel_err_mean']:.3f}"
    )
    if s["needle_tokens_kept"]:
        print("needle slots: " + ", ".join(f"{k} {v:.0%}" for k, v in s["needle_tokens_kept"].items()))
    for layer in doc["layers"]:
        print(f"  layer {layer['layer']:2d}: TV {layer['tv_last_query']:.3f}")
    if json_out is not None:
        print(f"JSON: {write_text(json_out, json.dumps(doc, separators=(',', ':')) + chr(10))}")
    if plot_out is not None:
        print(f"plot: {write_atomic(plot_out, lambda p: plot_inspection(report, p))}")
    return 0
