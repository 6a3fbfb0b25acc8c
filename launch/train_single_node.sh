#!/usr/bin/env bash
# Paper-scale run on one node: SGLang rollout servers on the first ROLLOUT_GPUS GPUs, the JAX
# learner sharded over the remaining ones (the authors use 4 GPUs in total).
#
#   launch/train_single_node.sh [--dry-run] [--deterministic-inference] CONFIG MODEL_DIR TRAIN_DATA WORKDIR [ROLLOUT_GPUS=2] [TOTAL_GPUS=4]
#
# --deterministic-inference (off by default) is passed to launch/sglang_servers.sh: the servers
# then honour sampling_seed, so a resumed run regenerates the same rollouts (slower rollouts;
# docs/sglang_api.md §3.8). --dry-run prints every command (the servers' and the trainer's).
# The servers run under launch/sglang_servers.sh in the background; when the trainer ends (or
# this script is stopped) that script is stopped by its pid, and it stops the servers it
# started, and only those. The learner's GPUs are its own, so it takes 0.9 of each
# (--config.train.xla_mem_fraction=0.9: train's main sets XLA's variables from the config, and
# drops an XLA_PYTHON_CLIENT_MEM_FRACTION it finds in the environment).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/_common.sh"

usage="usage: $0 [--dry-run] [--deterministic-inference] CONFIG MODEL_DIR TRAIN_DATA WORKDIR [ROLLOUT_GPUS] [TOTAL_GPUS]"
det=()
parse_args "$usage" leading --deterministic-inference+det=--deterministic-inference -- "$@"
check_args "$usage" "CONFIG MODEL_DIR TRAIN_DATA WORKDIR ROLLOUT_GPUS TOTAL_GPUS"
set -- ${ARGS[@]+"${ARGS[@]}"}
config=${1:?$usage}
model=${2:?$usage}; data=${3:?$usage}; workdir=${4:?$usage}
rollout=${5:-2}; total=${6:-4}
((rollout >= 1 && rollout < total)) || die "ROLLOUT_GPUS ($rollout) must be at least 1 and below TOTAL_GPUS ($total)"
learner_gpus=$(seq -s, "$rollout" $((total - 1)))
servers=("$here/sglang_servers.sh" ${det[@]+"${det[@]}"})

start_trainer() {  # start_trainer URLS: the learner on the GPUs the servers leave
  run_bg - env "CUDA_VISIBLE_DEVICES=$learner_gpus" python -m cleaner_jax.train --config "$config" \
    --workdir "$workdir" "--config.model.path=$model" "--config.data.train=$data" \
    --config.rollout.backend=sglang "--config.rollout.server_urls=$1" --config.train.xla_mem_fraction=0.9
}

if [[ "$DRY_RUN" == 1 ]]; then
  out=$("${servers[@]}" --dry-run "$model" "$rollout" 30000 float16)
  printf '%s\n' "$out" | sed '$d'  # the servers' command lines
  start_trainer "$(printf '%s\n' "$out" | tail -n 1)"
  exit 0
fi

need_cmd setsid "the servers' launcher and the trainer run in their own sessions"
mkdir -p logs
install_cleanup
STOP_GRACE_S=60  # longer than the servers' launcher takes to stop its servers (its own grace)
urls_file=$(mktemp)
run_bg logs/sglang_servers.log "${servers[@]}" --urls-file "$urls_file" "$model" "$rollout" 30000 float16
await "$LAST_PID" logs/sglang_servers.log "" \
  "launch/sglang_servers.sh exited before its servers were healthy; see logs/" "" test -s "$urls_file"
urls=$(cat "$urls_file")
rm -f -- "$urls_file"
start_trainer "$urls"
wait "$LAST_PID"
