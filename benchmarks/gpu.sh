#!/usr/bin/env bash
# The CUDA benchmark of the torch engine (issue 22's targets): a random-weight Llama-3-8B shape in
# bf16, one sequence, our fast path (ClusterKV, Quest, SnapKV, MiniKV, the full cache) beside
# transformers' own cache (hf-sdpa: the TTFT anchor; hf-static-compiled: StaticCache + CUDA graphs,
# the TPOT to beat), in one run. Speed only: random weights make no quality claim.
#   bash benchmarks/gpu.sh [main|long|headline|batch|ours|profile|profile-batch|kernels ...]  (default: main)
# Runs from a checkout without installing (the device image has torch, transformers and Triton;
# platformdirs goes with it as a wheel on PYTHONPATH: benchmarks/README.md, 'Re-checked'):
#   OV_KVCRUSH="python3 -m ov_kvcrush" OUT_DIR=$OUT bash benchmarks/gpu.sh main
# DRY_RUN=1 checks the commands and lists what they would run, loading nothing (a test does).
# One engine process holds every configuration (--no-isolate): isolated workers would each hold
# the 16 GB of weights; the engines share one model per attention implementation.
set -euo pipefail
cd "$(dirname "$0")/.."
OV_KVCRUSH=${OV_KVCRUSH:-ov-kvcrush}
out=${OUT_DIR:-docs/results/bench}
[ -n "${DRY_RUN:-}" ] || mkdir -p "$out"
gpu=nogpu  # the card's name, in the files' names (a dry run writes none)
[ -n "${DRY_RUN:-}" ] ||
    gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name().split()[1].lower() if torch.cuda.is_available() else 'nogpu')" 2>/dev/null || echo nogpu)

bench() {  # bench NAME ARGS...: one run, its three files named NAME_<gpu>.*
    local name=${1}_$gpu
    shift
    if [ -n "${DRY_RUN:-}" ]; then
        $OV_KVCRUSH bench "$@" --dry-run
    else
        $OV_KVCRUSH bench "$@" --json "$out/$name.json" --plot "$out/$name.png" --markdown "$out/$name.md"
    fi
}

script() {  # script NAME SCRIPT ARGS...: a benchmarks/ script's run, its JSON named NAME_<gpu>.json
    local name=${1}_$gpu file=benchmarks/$2
    shift 2
    if [ -n "${DRY_RUN:-}" ]; then
        echo "python3 $file $*"
    else
        python3 "$file" "$@" --json "$out/$name.json"
    fi
}

common=(--device cuda --model random:llama-3-8b --budgets 1024 --no-isolate)
runs=("$@")
[ ${#runs[@]} -eq 0 ] && runs=(main)
for run in "${runs[@]}"; do
    case $run in
    main)  # 8k and 32k: every fast-path method and both transformers baselines
        bench bench_cuda_llama3_8b_random --backends torch,hf-sdpa,hf-static-compiled \
            --methods full,clusterkv,quest,snapkv,minikv,minikv:preset=paper "${common[@]}" \
            --lengths 8192,32768 --repeats 2 --new-tokens 64 ;;
    long)  # 64k and 128k, where the memory allows: the full cache against ClusterKV
        bench bench_cuda_llama3_8b_random_long --backends torch,hf-sdpa \
            --methods full,clusterkv "${common[@]}" --lengths 65536,131000 --repeats 1 --new-tokens 64 ;;
    headline)  # issue 52, one sequence: 32k (no regression) and 128k (where the KV weighs as much as the weights)
        bench bench_cuda_llama3_8b_random_headline --backends torch,hf-sdpa \
            --methods full,clusterkv,quest,minikv "${common[@]}" --lengths 32768,131000 --repeats 1 --new-tokens 64 ;;
    batch)  # issue 52, a batch of 8 at 32k: ours beside transformers' batched sdpa and compiled static cache
        bench bench_cuda_llama3_8b_random_batch8 --backends torch,hf-sdpa,hf-static-compiled \
            --methods full,clusterkv,quest,minikv "${common[@]}" --lengths 32768 --concurrency 8 --repeats 1 \
            --new-tokens 32 ;;
    profile)  # issue 52: ClusterKV's and the full cache's decode step at 128k, kernel by kernel
        script profile_cuda_llama3_8b_random_128k gpu_profile.py --lengths 131000 --methods clusterkv,full --steps 8 ;;
    profile-batch)  # issue 52: ClusterKV's and the full cache's step for a batch of 8 at 32k, kernel by kernel
        script profile_cuda_llama3_8b_random_32k_batch8 gpu_profile.py --lengths 32768 --batch 8 --methods clusterkv,full \
            --steps 8 ;;
    ours)  # issue 74's targets alone, in a third of headline + batch's time: our full cache beside ClusterKV
        bench bench_cuda_llama3_8b_random_headline_ours --backends torch --methods full,clusterkv "${common[@]}" \
            --lengths 32768,131000 --repeats 1 --new-tokens 64
        bench bench_cuda_llama3_8b_random_batch8_ours --backends torch --methods full,clusterkv "${common[@]}" \
            --lengths 32768 --concurrency 8 --repeats 1 --new-tokens 32 ;;
    kernels)  # issue 74: a step's small kernels alone, graphed (ClusterKV's selection, its attention, the append)
        script kernels_cuda gpu_kernels.py --min-chunks 128,256 ;;
    *)
        echo "benchmarks/gpu.sh: unknown run '$run' (main, long, headline, batch, ours, profile, profile-batch, kernels)" >&2
        exit 2 ;;
    esac
done
