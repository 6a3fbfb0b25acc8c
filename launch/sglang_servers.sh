#!/usr/bin/env bash
# Start one real SGLang server per GPU (tensor-parallel 1, as the authors run rollouts) on
# consecutive ports, and wait until every /health answers 200. The trainer then talks to them
# with --config.rollout.backend=sglang --config.rollout.server_urls=http://127.0.0.1:30000,...
#
#   launch/sglang_servers.sh [--deterministic-inference] MODEL_DIR [NUM_GPUS=4] [FIRST_PORT=30000] [DTYPE=float16]
#
# --deterministic-inference (off by default) passes SGLang's --enable-deterministic-inference:
# the same sampling_seed then gives the same tokens whatever else is batched, which an exact
# resume of a run needs (docs/sglang_api.md §3.8); it costs rollout throughput and needs a GPU
# attention backend (fa3, flashinfer, triton; CPU refuses it).
# MODEL_DIR is a local Hugging Face directory (the trainer's weight sync later points the
# servers at its own exports through /update_weights_from_disk). Logs go to logs/sglang-<gpu>.log.
set -euo pipefail
extra=()
if [[ "${1:-}" == "--deterministic-inference" ]]; then
  extra+=(--enable-deterministic-inference)
  shift
fi
model=${1:?usage: $0 [--deterministic-inference] MODEL_DIR [NUM_GPUS] [FIRST_PORT] [DTYPE]}
gpus=${2:-4}
port0=${3:-30000}
dtype=${4:-float16}
mkdir -p logs
urls=()
for ((g = 0; g < gpus; g++)); do
  port=$((port0 + g))
  CUDA_VISIBLE_DEVICES=$g nohup python -m sglang.launch_server --model-path "$model" \
    --host 127.0.0.1 --port "$port" --tp 1 --dtype "$dtype" --mem-fraction-static 0.6 \
    --skip-tokenizer-init ${extra[@]+"${extra[@]}"} >"logs/sglang-$g.log" 2>&1 &
  urls+=("http://127.0.0.1:$port")
done
for u in "${urls[@]}"; do
  for _ in $(seq 1 600); do
    if curl -sf "$u/health" >/dev/null; then break; fi
    sleep 1
  done
  curl -sf "$u/health" >/dev/null || { echo "server $u did not become healthy; see logs/" >&2; exit 1; }
done
(IFS=,; echo "${urls[*]}")
