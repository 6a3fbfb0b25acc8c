#!/usr/bin/env bash
# Paper-scale run on one node: SGLang rollout servers on the first ROLLOUT_GPUS GPUs, the JAX
# learner sharded over the remaining ones (the authors use 4 GPUs in total).
#
#   launch/train_single_node.sh CONFIG MODEL_DIR TRAIN_DATA WORKDIR [ROLLOUT_GPUS=2] [TOTAL_GPUS=4]
set -euo pipefail
config=${1:?usage: $0 CONFIG MODEL_DIR TRAIN_DATA WORKDIR [ROLLOUT_GPUS] [TOTAL_GPUS]}
model=${2:?}; data=${3:?}; workdir=${4:?}
rollout=${5:-2}; total=${6:-4}
here=$(cd "$(dirname "$0")" && pwd)
urls=$("$here/sglang_servers.sh" "$model" "$rollout" 30000 float16 | tail -n 1)
learner_gpus=$(seq -s, "$rollout" $((total - 1)))
trap 'pkill -f "sglang.launch_server" || true' EXIT
CUDA_VISIBLE_DEVICES=$learner_gpus XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 \
  python -m cleaner_jax.train --config "$config" --workdir "$workdir" \
  --config.model.path="$model" --config.data.train="$data" \
  --config.rollout.backend=sglang --config.rollout.server_urls="$urls"
