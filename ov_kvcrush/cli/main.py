"""The ``ov-kvcrush`` command line.

Every user error (bad flag value, missing path, unusable model) prints one line to stderr and
exits with code 2, no traceback. Subcommands that later issues bring say which issue and exit 2.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import Any

from ov_kvcrush.bench.plan import DEFAULT_LENGTHS, MIN_LENGTH
from ov_kvcrush.cli.bench_command import cmd_bench
from ov_kvcrush.cli.chat import __doc__ as CHAT_DOC
from ov_kvcrush.cli.chat import add_arguments as add_chat_arguments
from ov_kvcrush.cli.chat import chat, methods_help
from ov_kvcrush.cli.demo import DEMO_TOKENS, NEW_TOKENS, run_demo
from ov_kvcrush.cli.inspect_command import add_inspect_arguments, cmd_inspect
from ov_kvcrush.cli.serve_command import add_serve_arguments, cmd_serve
from ov_kvcrush.cli.values import parse_float, parse_int, parse_name, parse_size, split_values
from ov_kvcrush.config import GenerationSettings, MethodSpec, parse_method_budget, parse_options
from ov_kvcrush.engines.base import model_context
from ov_kvcrush.engines.model_family import family_refusal
from ov_kvcrush.errors import UserError, one_line
from ov_kvcrush.gpu import HOSTS, runtime
from ov_kvcrush.models.export import cached_models, clear_cache, embedded_gguf_path, export_model, resolve_source
from ov_kvcrush.outputs import PLOT_SUFFIXES, prepare_output, read_prompt_file, write_atomic, write_text
from ov_kvcrush.serving.backends import check_backend, engine_options, make_engine, resolve_model
from ov_kvcrush.validation import check_int

# Imported where used, inside functions: what pulls in torch, transformers, heavy to import, so that
# importing this module stays light.


class _Parser(argparse.ArgumentParser):
    """argparse that exits with code 2 and one line (its default prints usage + message).

    An argument may carry ``help_from``, a function giving its help text when help is shown (the
    methods each backend runs, derived from the registry, which imports torch: ``--help`` of
    another command, and every real run, stay fast)."""

    def format_help(self) -> str:
        for action in self._actions:
            fill = getattr(action, "help_from", None)
            if fill is not None:
                action.help = fill()
        return super().format_help()

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"ov-kvcrush: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    return value


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="ov-kvcrush", description="KV-cache compression for LLM inference with OpenVINO.")
    p.add_argument(
        "--debug",
        action="store_true",
        default=bool(os.environ.get("OV_KVCRUSH_DEBUG")),
        help="show the traceback of an unexpected error (or set OV_KVCRUSH_DEBUG=1)",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    _add_export(sub)
    _add_demo(sub)
    _add_generate(sub)
    _add_eval(sub)
    c = sub.add_parser(
        "chat", help="streaming terminal chat (backend openvino keeps the cache across turns)", description=CHAT_DOC
    )
    add_chat_arguments(c)

    add_inspect_arguments(sub)
    _add_bench(sub)
    add_serve_arguments(sub)
    for command in sub.choices.values():  # --debug also after the command (ov-kvcrush generate --debug)
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return p


def _add_export(sub: Any) -> None:
    """``ov-kvcrush export``: the embedded model (or a local one) to OpenVINO IR."""
    e = sub.add_parser("export", help="export the embedded model (or --model PATH) to OpenVINO IR")
    e.add_argument(
        "--model", help="local HF model directory, GGUF file or embedded model (default smollm2-135m; gemma3-270m)"
    )
    e.add_argument("--weight-format", default="int8", help="int8 (default), fp16 or fp32")
    e.add_argument("--output", help="output directory (default: the user cache dir)")
    e.add_argument("--force", action="store_true", help="re-export even if a complete export exists")
    e.add_argument("--list", action="store_true", help="list the cached exports and checkpoints, with their sizes")
    e.add_argument("--clear", action="store_true", help="remove every cached export and checkpoint")


def _add_demo(sub: Any) -> None:
    """``ov-kvcrush demo``: the main job."""
    d = sub.add_parser(
        "demo",
        help="passkey in a ~2k-token prompt: native full and KVCrush beside our op's full, KVCrush, "
        "SnapKV over the 2-bit store and ClusterKV",
    )
    d.add_argument("--tokens", type=_positive_int, default=DEMO_TOKENS, help="prompt length (default 2000)")
    d.add_argument("--budget", type=_positive_int, default=512, help="KV budget of the compressed runs (default 512)")
    d.add_argument("--torch", action="store_true", help="also the torch reference (KVCrush, Chelsea, MiniKV)")


def _add_generate(sub: Any) -> None:
    """``ov-kvcrush generate``: one generation on any backend."""
    g = sub.add_parser("generate", help="one generation, printing text (and --json metrics)")
    g.add_argument(
        "--backend",
        default="genai",
        help="genai (native openvino_genai, default), openvino (our paged-attention op in the IR) or torch",
    )
    g.add_argument("--method", default="full").help_from = methods_help
    g.add_argument("--budget", type=_positive_int, help="KV tokens kept per layer and KV head (required unless full)")
    g.add_argument("--sink-tokens", type=_positive_int, help="first tokens always kept (default: the method's)")
    g.add_argument("--recent-tokens", type=_positive_int, help="newest tokens always kept (default: the method's)")
    g.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a field of the method's config, VALUE in JSON (e.g. representatives=64, quant=true, "
        'anchor=\'["random","zeros"]\', or preset=paper for a paper\'s own choices where the defaults '
        "depart from it); repeatable; backends torch and openvino (genai: the native fields)",
    )
    g.add_argument("--prompt-file", required=True, help="text file with the prompt ('-' for stdin)")
    g.add_argument("--max-new-tokens", type=_positive_int, default=32)
    g.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    g.add_argument(
        "--model",
        help="genai: exported IR directory; torch: HF checkpoint directory; either: a GGUF file or HF directory "
        "(converted once and cached); or an embedded model: smollm2-135m (default), gemma3-270m",
    )
    g.add_argument(
        "--device",
        default="CPU",
        help="CPU (default); GPU for --backend openvino on an Intel GPU; cuda for --backend torch",
    )
    g.add_argument("--dtype", default="auto", help="backend torch: auto (fp32 on CPU, bf16 on CUDA), float32 ...")
    g.add_argument("--kv-precision", help="backend openvino: KV cache u8 (default, as native), f16 or f32")
    g.add_argument(
        "--sparse-prefill",
        help="backends openvino and genai: sparse prompt attention, xattention (ours on openvino, native's on "
        "genai) or trishape (genai); default dense",
    )
    g.add_argument(
        "--paged-device",
        choices=HOSTS,
        help="backend torch: keep the KV cache on an Intel GPU (else Intel's OpenCL CPU runtime) and run it in "
        "the GPU path's kernels, hosted by pyopencl (opencl) or the C++ SYCL host (sycl) (docs/intel_gpu.md)",
    )
    g.add_argument(
        "--native-gguf",
        action="store_true",
        help="backend genai: run --model (a .gguf file; default the embedded one) directly, without export",
    )
    g.add_argument("--json", dest="json_out", help="write text and metrics as JSON to this file")


def _add_eval(sub: Any) -> None:
    """``ov-kvcrush eval``: score against KV memory per method and budget."""
    v = sub.add_parser(
        "eval",
        help="offline long-context evaluation: score vs KV memory per method and budget (tables, JSON, plot)",
        description="Runs generated long-context tasks (or --data FILE.jsonl) with the full cache and every "
        "method/budget on one engine, and reports score, agreement with the full cache and KV bytes held.",
    )
    v.add_argument("--tasks", default=",".join(_TASKS), help=f"comma-separated; default {','.join(_TASKS)}")
    v.add_argument("--lengths", default="1024,2048,4096", help="prompt lengths in tokens (default 1024,2048,4096)")
    v.add_argument(
        "--methods",
        help="comma-separated registry names, each optionally with :KEY=VALUE options and +2bit, +4bit "
        "or +k2v4 (keys 2, values 4 bits) for a quantized store, e.g. snapkv:block_size=32+4bit (default: all)",
    )
    v.add_argument("--budgets", default="128,256,512", help="token budgets (default 128,256,512)")
    mem = v.add_mutually_exclusive_group()
    mem.add_argument(
        "--kv-bytes", help="equal memory: each method gets the budget holding at most N bytes (e.g. 4MiB,8MiB)"
    )
    mem.add_argument("--kv-ratio", help="equal memory as fractions of the full cache (e.g. 0.1,0.2)")
    v.add_argument("--samples", type=_positive_int, default=1, help="samples per task and length (default 1)")
    v.add_argument("--seed", type=_positive_int, default=0)
    v.add_argument(
        "--backend",
        default="torch",
        help="torch (every method, default), openvino (our op: the methods it runs) or genai (native methods)",
    )
    v.add_argument("--max-new-tokens", type=_positive_int, default=32)
    v.add_argument("--ppl-tokens", type=_positive_int, default=64, help="tokens scored by the ppl task (default 64)")
    v.add_argument("--data", help="JSONL of {'prompt', 'answers', 'question' (optional)} (replaces --tasks/--lengths)")
    v.add_argument(
        "--question-after", action="store_true", help="compress the context first, then ask (query-agnostic)"
    )
    v.add_argument(
        "--prompt-format",
        default="chat",
        help="chat (the chat template, default) or completion (raw text + the answer's first words: base models, "
        "e.g. --model gemma3-270m)",
    )
    v.add_argument("--model", help="model for the backend (default: the embedded smollm2-135m; or gemma3-270m)")
    v.add_argument("--device", default="cpu")
    v.add_argument("--dtype", default="auto", help="backend torch: auto (fp32 on CPU), float32, bfloat16 ...")
    v.add_argument("--json", dest="json_out", help="write results (and per-sample outputs) as JSON")
    v.add_argument("--plot", help="write a PNG of score vs KV bytes")
    v.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_bench(sub: Any) -> None:
    """``ov-kvcrush bench``: speed and memory against native and the bandwidth floor."""
    bn = sub.add_parser(
        "bench",
        help="speed and memory: backends x methods x budgets x lengths vs native full cache and the bandwidth floor",
        description="Interleaved, repeated runs on fresh passkey prompts; reports TTFT, TPOT (median, p90), "
        "decode tokens/s, peak RSS, KV bytes and the ratios to native openvino_genai full cache and to the "
        "memory-bandwidth floor measured in the same run.",
    )
    bn.add_argument(
        "--backends",
        default="genai,openvino",
        help="genai, openvino, torch, and transformers' own cache as baselines: hf-sdpa, hf-static-compiled "
        "(CUDA) (default genai,openvino)",
    )
    bn.add_argument(
        "--methods",
        default="full,kvcrush,snapkv",
        help="methods, each optionally with options after colons, e.g. kvcrush:block_size=32 (default "
        "full,kvcrush,snapkv)",
    )
    bn.add_argument("--budgets", default="1024", help="token budgets (default 1024)")
    bn.add_argument(
        "--lengths",
        default=",".join(str(n) for n in DEFAULT_LENGTHS),
        help="prompt tokens, each at most the context less --new-tokens (default %(default)s)",
    )
    bn.add_argument("--repeats", type=_positive_int, default=2, help="interleaved repeats (default 2)")
    bn.add_argument("--new-tokens", type=_positive_int, default=32, help="decode steps per run (default 32)")
    bn.add_argument("--seed", type=_positive_int, default=0)
    bn.add_argument(
        "--model",
        help="model for every backend (default: the embedded model); random:llama-3-8b (or llama-3.2-1b, "
        "tiny-llama) builds that architecture with random weights on --device: speed only, torch backends",
    )
    bn.add_argument("--device", default="cpu", help="where the torch backend runs: cpu (default), cuda, cuda:N")
    bn.add_argument(
        "--no-isolate",
        action="store_true",
        help="run every configuration in this process (default: one worker process each, so each "
        "configuration's peak RSS is its own)",
    )
    bn.add_argument(
        "--concurrency",
        type=_positive_int,
        help="on the torch backends (torch, hf-sdpa, hf-static-compiled): each run is a batch of this many "
        "prompts of a length decoding together (tok/s counts every row); on the OpenVINO backends, with "
        "--kv-pool-mib: a serving run, this many requests of --lengths tokens (one length) arrive together and "
        "are served by continuous batching over one KV pool, natively and by our op; reports generated "
        "tokens/s, TTFT and TPOT p50/p90, peak RSS, waiting and passkeys",
    )
    bn.add_argument(
        "--sparse-prefill",
        help="sparse prompt attention beside each configuration whose backend has it: xattention (genai and "
        "openvino: our op's), trishape (genai) (comma-separated; openvino_genai's SparseAttentionConfig "
        "with its defaults)",
    )
    bn.add_argument("--kv-pool-mib", type=float, help="serving run: the KV pool every backend gets, in MiB")
    bn.add_argument(
        "--max-num-batched-tokens",
        type=_positive_int,
        help="serving run: tokens per step, prompt chunks included (default: openvino_genai's, 256)",
    )
    bn.add_argument("--json", dest="json_out", help="write the results as JSON")
    bn.add_argument("--plot", help="write a PNG: TPOT and KV bytes vs length")
    bn.add_argument("--markdown", help="write the results table as Markdown (for a results page)")
    bn.add_argument(
        "--dry-run", action="store_true", help="check the plan and list the configurations and runs; load nothing"
    )


_TASKS = ("passkey", "niah_single", "niah_multikey", "vt", "ppl")


def cmd_eval(args: argparse.Namespace) -> int:
    from ov_kvcrush.eval.report import format_table, plot, write_json
    from ov_kvcrush.eval.runner import EvalPlan, run_eval

    json_out = prepare_output("--json", args.json_out)
    plot_out = prepare_output("--plot", args.plot, PLOT_SUFFIXES)
    methods = (
        tuple(MethodSpec.parse(m) for m in split_values("--methods", args.methods, parse_name)) if args.methods else ()
    )
    plan = EvalPlan(
        tasks=split_values("--tasks", args.tasks, parse_name),
        lengths=split_values("--lengths", args.lengths, parse_int),
        methods=methods,
        budgets=split_values("--budgets", args.budgets, parse_int),
        kv_bytes=split_values("--kv-bytes", args.kv_bytes, parse_size) if args.kv_bytes else (),
        kv_ratio=split_values("--kv-ratio", args.kv_ratio, parse_float) if args.kv_ratio else (),
        samples=args.samples,
        seed=args.seed,
        backend=args.backend,
        max_new_tokens=args.max_new_tokens,
        ppl_tokens=args.ppl_tokens,
        data=args.data,
        question_after=args.question_after,
        prompt_format=args.prompt_format,
        model=args.model,
        device=args.device,
        dtype=args.dtype,
    )
    report = run_eval(plan, progress=not args.no_progress, log=lambda line: print(line, flush=True))
    print(format_table(report))
    command = "ov-kvcrush " + " ".join(shlex.quote(a) for a in args.argv)
    if json_out is not None:
        print(f"\nJSON: {write_atomic(json_out, lambda p: write_json(report, p, command))}")
    if plot_out is not None:
        print(f"plot: {write_atomic(plot_out, lambda p: plot(report, p, title=command))}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    if args.list:
        models = cached_models()
        for path, size in models:
            print(f"{size / 2**20:10.1f} MiB  {path}")
        print(f"{sum(s for _, s in models) / 2**20:10.1f} MiB in {len(models)} cached models")
        return 0
    if args.clear:
        print(f"removed {clear_cache() / 2**20:.1f} MiB of cached models")
        return 0
    out = export_model(args.model, weight_format=args.weight_format, output=args.output, force=args.force)
    print(out)
    refusal = family_refusal(out)
    if refusal:  # the export is still native openvino_genai's to run
        print(f"note: backends openvino and torch will refuse it: {refusal}; backend genai runs it", file=sys.stderr)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    json_out = prepare_output("--json", args.json_out)
    compression = parse_method_budget(
        args.method,
        args.budget,
        sink_tokens=args.sink_tokens,
        recent_tokens=args.recent_tokens,
        options=parse_options(args.option),
    )
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens, apply_chat_template=not args.no_chat_template)
    prompt = read_prompt_file(args.prompt_file)
    backend = check_backend(args.backend)
    flags = {"dtype": ("--dtype", args.dtype, "auto"), "paged_device": ("--paged-device", args.paged_device, None)}
    flags["kv_precision"] = ("--kv-precision", args.kv_precision, None)
    flags["sparse_prefill"] = ("--sparse-prefill", args.sparse_prefill, None)
    extra = engine_options(args.backend, flags)
    if "paged_device" in extra:
        runtime.prepare()  # before anything imports openvino (its TBB hides Intel's OpenCL runtime)
    if args.native_gguf:
        if not backend.native:
            raise UserError(f"--native-gguf is only for --backend genai, got --backend={args.backend}")

        source = resolve_source(args.model)
        if source.kind != "gguf":
            raise UserError(f"--native-gguf needs a .gguf file as --model, got a directory: {source.path}")
        model = source.path
    else:
        model = resolve_model(args.backend, args.model)
    engine = make_engine(args.backend, model, compression, args.device, **extra)
    result = engine.generate(prompt, settings)
    print(result.text)
    print(
        f"[{result.backend} {result.method} budget={result.budget}] prompt={result.prompt_tokens} tok, "
        f"TTFT {result.ttft_ms:.0f} ms, TPOT {result.tpot_ms:.1f} ms, "
        f"KV {result.kv_bytes / 2**20:.2f} MiB of {result.full_kv_bytes / 2**20:.2f} MiB full",
        file=sys.stderr,
    )
    if json_out is not None:
        write_text(json_out, result.to_json())
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    return chat(args)


def cmd_demo(args: argparse.Namespace) -> int:
    check_int("--tokens", args.tokens, MIN_LENGTH, model_context(embedded_gguf_path()) - NEW_TOKENS)
    run_demo(args.tokens, args.budget, args.torch)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    args.argv = argv
    if args.command is None:
        parser.print_help()
        return 0
    handler = {
        "export": cmd_export,
        "generate": cmd_generate,
        "demo": cmd_demo,
        "eval": cmd_eval,
        "inspect": cmd_inspect,
        "chat": cmd_chat,
        "bench": cmd_bench,
        "serve": cmd_serve,
    }[args.command]
    try:
        return handler(args)
    except UserError as exc:
        if args.debug:
            raise
        print(f"ov-kvcrush {args.command}: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug, or a failure nothing named yet: one line, the traceback on request
        if args.debug:
            raise
        print(
            f"ov-kvcrush {args.command}: unexpected error: {type(exc).__name__}: {one_line(exc)} "
            "(run with --debug for the traceback)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
