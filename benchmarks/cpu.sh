#!/usr/bin/env bash
# Regenerate every committed CPU benchmark result under docs/results/bench/ (JSON with the machine,
# versions and command; PNG; Markdown table), one `ov-kvcrush bench` run each. About 50 minutes on
# a 2-core machine. Run it on an idle machine: every number is a ratio within one run, but a busy
# machine widens the spread. Usage: bash benchmarks/cpu.sh [main|gemma|full|torch|serving|serving-decode ...]
# (default: all).
# DRY_RUN=1 checks the commands and lists what they would run, loading nothing (a test does).
set -euo pipefail
cd "$(dirname "$0")/.."
OV_KVCRUSH=${OV_KVCRUSH:-ov-kvcrush}
out=docs/results/bench
[ -n "${DRY_RUN:-}" ] || mkdir -p "$out"

bench() {  # bench NAME ARGS...: one run, its three files named NAME.*
    local name=$1
    shift
    if [ -n "${DRY_RUN:-}" ]; then
        "$OV_KVCRUSH" bench "$@" --dry-run
    else
        "$OV_KVCRUSH" bench "$@" --json "$out/$name.json" --plot "$out/$name.png" --markdown "$out/$name.md"
    fi
}

serve() {  # serve NAME ARGS...: one serving run (--concurrency), its three files under docs/results/serving/
    local name=$1
    shift
    if [ -n "${DRY_RUN:-}" ]; then
        "$OV_KVCRUSH" bench "$@" --dry-run
    else
        mkdir -p docs/results/serving
        "$OV_KVCRUSH" bench "$@" --json "docs/results/serving/$name.json" --plot "docs/results/serving/$name.png" \
            --markdown "docs/results/serving/$name.md"
    fi
}

runs=("$@")
[ ${#runs[@]} -eq 0 ] && runs=(main gemma full torch serving serving-decode)
for run in "${runs[@]}"; do
    case $run in
    main)  # every method of native openvino_genai and of our op, 1k-8k tokens, budget 1024
        bench bench_cpu --backends genai,openvino \
            --methods full,h2o,snapkv,pyramidkv,kvcrush,kvcrush:block_size=32,clusterkv,chelsea,minikv,snapkv:quant=true \
            --budgets 1024 --lengths 1024,2048,4096,8000 --repeats 2 --new-tokens 32 ;;
    gemma)  # Gemma 3 270M (32k context, sliding-window layers): native full and native eviction against our
        # op at 8k, 16k and 32k tokens, budget 2048
        bench bench_cpu_gemma3 --model gemma3-270m --backends genai,openvino --methods full,snapkv,kvcrush \
            --budgets 2048 --lengths 8192,16384,32000 --repeats 1 --new-tokens 32 ;;
    gemma-blocks)  # Gemma 3 at 32k: block-wise KVCrush (the method that kept the needles there) against full caches
        bench bench_cpu_gemma3_blocks --model gemma3-270m --backends genai,openvino --methods full,kvcrush:block_size=32 \
            --budgets 2048 --lengths 32000 --repeats 1 --new-tokens 32 ;;
    full)  # full cache, our op against native: more repeats and decode steps, fewer lengths
        bench bench_cpu_full_cache --backends genai,openvino --methods full \
            --lengths 2048,4096 --repeats 5 --new-tokens 64 ;;
    torch)  # the torch engine (the reference methods over transformers), native full as the anchor
        bench bench_cpu_torch --backends torch --methods full,snapkv,kvcrush,clusterkv,chelsea,minikv \
            --budgets 1024 --lengths 2048,4096 --repeats 2 --new-tokens 32 ;;
    serving)  # 16 requests of 4k tokens arriving together, 64 new tokens each, over a KV pool of 220 MiB
        # (four full sequences at native's u8): continuous batching, native against our op
        serve serving_16x4k_cpu --concurrency 16 --lengths 4096 --new-tokens 64 --kv-pool-mib 220 \
            --methods full,snapkv,kvcrush,kvcrush:block_size=32 --budgets 1024 ;;
    serving-decode)  # decode-heavy: 16 requests of 1k tokens, 256 new tokens each, over 70 MiB (four full
        # sequences at native's u8): where a compressed cache fits more sequences per pool
        serve serving_16x1k_decode_cpu --concurrency 16 --lengths 1024 --new-tokens 256 --kv-pool-mib 70 \
            --methods full,snapkv,kvcrush:block_size=32 --budgets 512 ;;
    serving-2bit)  # the decode-heavy run with the 2-bit store under SnapKV and KVCrush (its blocks
        # count by their bytes against the same pool)
        serve serving_16x1k_decode_2bit_cpu --concurrency 16 --lengths 1024 --new-tokens 256 --kv-pool-mib 70 \
            --methods full,snapkv,snapkv:quant=true,kvcrush:quant=true,kvcrush:block_size=32 --budgets 512 ;;
    serving-4bit)  # the decode-heavy run with SnapKV and block-wise KVCrush spans over the 4-bit store
        serve serving_16x1k_decode_4bit_cpu --concurrency 16 --lengths 1024 --new-tokens 256 --kv-pool-mib 70 \
            --methods full,snapkv,snapkv:block_size=32,snapkv:block_size=32+4bit,kvcrush:block_size=32+4bit --budgets 512 ;;
    *)
        echo "benchmarks/cpu.sh: unknown run '$run' (main, gemma, gemma-blocks, full, torch, serving, serving-decode, serving-2bit, serving-4bit)" >&2
        exit 2 ;;
    esac
done
