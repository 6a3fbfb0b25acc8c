#!/usr/bin/env bash
# Paper-scale run on one node: SGLang rollout servers on the first ROLLOUT_GPUS GPUs, the JAX
# learner sharded over the remaining ones (the authors use 4 GPUs in total).
#
#   launch/train_single_node.sh [--deterministic-inference] CONFIG MODEL_DIR TRAIN_DATA WORKDIR [ROLLOUT_GPUS=2] [TOTAL_GPUS=4]
#
# --deterministic-inference (off by default) is passed to launch/sglang_servers.sh: the servers
# then honour sampling_seed, so a resumed run regenerates the same rollouts (slower rollouts;
# docs/sglang_api.md §3.8).
set -euo pipefail
det=()
if [[ "${1:-}" == "--deterministic-inference" ]]; then
  det+=(--deterministic-inference)
  shift
fi
config=${1:?usage: $0 [--deterministic-inference] CONFIG MODEL_DIR TRAIN_DATA WORKDIR [ROLLOUT_GPUS] [TOTAL_GPUS]}
model=${2:?}; data=${3:?}; workdir=${4:?}
rollout=${5:-2}; total=${6:-4}
here=$(cd "$(dirname "$0")" && pwd)
urls=$("$here/sglang_servers.sh" ${det[@]+"${det[@]}"} "$model" "$rollout" 30000 float16 | tail -n 1)
learner_gpus=$(seq -s, "$rollout" $((total - 1)))
trap 'pkill -f "sglang.launch_server" || true' EXIT
CUDA_VISIBLE_DEVICES=$learner_gpus XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 \
  python -m cleaner_jax.train --config "$config" --workdir "$workdir" \
  --config.model.path="$model" --config.data.train="$data" \
  --config.rollout.backend=sglang --config.rollout.server_urls="$urls"
