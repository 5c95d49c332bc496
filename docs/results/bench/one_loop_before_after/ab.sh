#!/bin/bash
# before/after, interleaved: each round runs the old code then the new, same command
set -e
for round in 1 2 3; do
  for which in before after; do
    PYTHONPATH=/tmp/${which}_wt /work/main/.venv/bin/python -m ov_kvcrush bench --backends genai,openvino --methods full,snapkv,minikv --budgets 1024 --lengths 8000 --repeats 1 --new-tokens 32 --json /tmp/bench/${which}_${round}.json > /tmp/bench/${which}_${round}.log 2>&1
  done
done
