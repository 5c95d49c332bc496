"""``ov-kvcrush bench``: speed and memory of every backend x method x budget x context length.

One run measures every configuration on the same machine, in an interleaved order (repeat ``r``
runs the configurations forward when ``r`` is even, backward when odd, each length in turn), so
that machine noise hits every configuration alike and the ratios between them are meaningful.
Every run gets a fresh prompt (passkey prompts with a per-run seed): native ``openvino_genai``
caches prefixes on CPU by default, and a repeated prompt would time the cache, not the prefill
(our ``genai`` engine also turns prefix caching off).

Reported per configuration and length (medians over the repeats): TTFT, TPOT (median and p90 of
the decode steps), decode tokens/s, peak process RSS during the run, KV bytes held at the end, the
share of prefill/decode time the method's own work took (measured inside our op), and:

* ratios to native ``openvino_genai`` with the full cache at the same length;
* the **bandwidth floor**: a decode step must at least read every weight once and every KV byte
  its method reads, so ``floor_ms = (weight_bytes + kv_read_bytes) / bandwidth`` (the bytes a
  step reads where the engine reports them, else every byte held), with the bandwidth measured
  in the same run (a large array copy, bytes read + written); ``tpot_vs_floor`` is TPOT / floor.

``--concurrency N`` on the torch backends makes every run a batch of ``N`` prompts of one
length decoding together (``BenchPlan.batch``): tok/s counts every row, KV bytes sum them.

Each configuration runs in its own worker process (``BenchPlan.isolate``, on by default), so
its peak RSS is its own: the engine, its compiled model and its KV cache, not every other
configuration's engines too. The parent only builds prompts and keeps time order; a worker that
dies (a crash inside native code) is reported as an error naming the configuration.

The JSON keeps every run too (``runs``), the machine, the package versions and the command.

The package: :mod:`~ov_kvcrush.bench.plan` (configurations and order), :mod:`~ov_kvcrush.bench.worker`
(where an engine runs), :mod:`~ov_kvcrush.bench.measure` (bandwidth, RSS, machine),
:mod:`~ov_kvcrush.bench.run` (the timed runs), :mod:`~ov_kvcrush.bench.report` (tables, plot).
"""

from ov_kvcrush.bench.plan import (
    BENCH_BACKENDS,
    DEFAULT_LENGTHS,
    BenchConfig,
    BenchPlan,
    backend_methods,
    check_config,
    checked_plan,
    dry_run,
    parse_method,
    plan_configs,
    schedule,
    with_sparse_prefill,
)
from ov_kvcrush.bench.report import RESULT_KEYS, format_markdown, format_table, plot, summarize, validate_doc
from ov_kvcrush.bench.run import run_bench
from ov_kvcrush.bench.worker import WorkerError

__all__ = [
    "BENCH_BACKENDS",
    "DEFAULT_LENGTHS",
    "RESULT_KEYS",
    "BenchConfig",
    "BenchPlan",
    "WorkerError",
    "backend_methods",
    "check_config",
    "checked_plan",
    "dry_run",
    "format_markdown",
    "format_table",
    "parse_method",
    "plan_configs",
    "plot",
    "run_bench",
    "schedule",
    "summarize",
    "validate_doc",
    "with_sparse_prefill",
]
