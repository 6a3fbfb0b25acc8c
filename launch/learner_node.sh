#!/usr/bin/env bash
# One learner process of a run on several nodes: `python -m cleaner_jax.train` joined to the
# others through JAX's multi-controller runtime (the `distributed` config section), rolling out
# against SGLang servers on other nodes and exporting weights to a shared directory that those
# servers read. Run it once per learner node with the same arguments except --process-id. It
# stays in the foreground; on exit it stops the trainer it started, and only that (by pid).
#
#   launch/learner_node.sh [OPTIONS] CONFIG MODEL_DIR TRAIN_DATA WORKDIR [-- TRAINER_FLAGS...]
#
#   --server-urls URLS  comma-separated rollout server URLs (what launch/sglang_servers.sh
#                       printed on each rollout node, joined with commas); required. The client's
#                       own sticky routing spreads trajectories over them and the weight sync
#                       reaches each one
#   --router-url URL    sglang-router in front of those servers (what launch/router.sh printed;
#                       rollout.router_url): generation goes through it, which balances the
#                       load, while the weight sync and the health and context checks still go
#                       to each server of --server-urls (docs/scaling.md, "Generation through
#                       sglang-router"); default: none, the trainer routes itself
#   --shared-dir DIR    where the weight exports go (train.weight_export_dir): a filesystem that
#                       every rollout node mounts at the same path; required, checked writable
#   --coordinator HOST:PORT   process 0's coordinator (distributed.coordinator_address); it
#                       listens on that address only (for every interface, pass
#                       -- --config.distributed.coordinator_bind_address=[::]:PORT)
#   --num-processes N   learner processes in all (distributed.num_processes)
#   --process-id I      this one's id, 0 .. N-1 (distributed.process_id)
#                       (the three together select distributed.mode=explicit; none of them: one
#                       learner process, distributed.mode stays as the config says)
#   --gpus LIST         CUDA_VISIBLE_DEVICES for the learner (e.g. 0,1,2,3); default: unchanged
#   --mem-fraction F    the learner's train.xla_mem_fraction (the share of each GPU XLA's pool
#                       takes: --config.train.xla_mem_fraction=F on the trainer's command line);
#                       default 0.9 (learner-only GPUs); none: not passed, the config's value
#                       (JAX's 0.75 when unset; train.xla_allocator=platform needs it unset).
#                       The XLA_*_MEM_FRACTION variables are not the way: train's main sets them
#                       from the config and drops or replaces what it finds in the environment
#   --wait-servers S    seconds to wait for every server's /health before starting; default 600
#   --python PY         the Python with cleaner_jax installed; default python
#   --dry-run           print the command instead of running it (no prerequisite checks)
#
# WORKDIR must be on a filesystem every learner process sees (Orbax checkpoints are written by
# all processes together). Anything after `--` is passed to the trainer (e.g.
# --config.train.steps=5), after the script's own overrides, so that a key given there wins.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/_common.sh"

usage="usage: $0 [--dry-run] --server-urls URLS [--router-url URL] --shared-dir DIR [--coordinator HOST:PORT --num-processes N --process-id I] [--gpus LIST] [--mem-fraction F|none] [--wait-servers S] [--python PY] CONFIG MODEL_DIR TRAIN_DATA WORKDIR [-- TRAINER_FLAGS...]"
servers=""
router=""
shared=""
coord=""
nproc=""
pid_=""
gpus=""
mem=0.9
wait_s=600
py=python
parse_args "$usage" mixed --server-urls=servers --router-url=router --shared-dir=shared --coordinator=coord \
  --num-processes=nproc --process-id=pid_ --gpus=gpus --mem-fraction=mem --wait-servers=wait_s \
  --python=py -- "$@"
[[ ${#ARGS[@]} -eq 4 ]] || die "expected CONFIG MODEL_DIR TRAIN_DATA WORKDIR, got ${#ARGS[@]} arguments; $usage"
config=${ARGS[0]}; model=${ARGS[1]}; data=${ARGS[2]}; workdir=${ARGS[3]}
[[ -n "$servers" ]] || die "--server-urls is required (the rollout servers, comma-separated); $usage"
[[ -n "$shared" ]] || die "--shared-dir is required (the weight exports the rollout servers read); $usage"
IFS=, read -r -a server_list <<<"$servers"
check_urls server "${server_list[@]}"
router_flags=()
if [[ -n "$router" ]]; then
  check_urls router "$router"
  router_flags=("--config.rollout.router_url=$router")
fi
dist=()
if [[ -n "$coord$nproc$pid_" ]]; then
  [[ -n "$coord" && -n "$nproc" && -n "$pid_" ]] \
    || die "--coordinator, --num-processes and --process-id go together (got '$coord', '$nproc', '$pid_')"
  [[ "$nproc" =~ ^[1-9][0-9]*$ && "$pid_" =~ ^[0-9]+$ ]] && ((pid_ < nproc)) \
    || die "--process-id $pid_ must be in 0 .. --num-processes-1 ($nproc)"
  dist=(--config.distributed.mode=explicit "--config.distributed.coordinator_address=$coord"
        "--config.distributed.num_processes=$nproc" "--config.distributed.process_id=$pid_")
fi
mem_flags=()
if [[ "$mem" != none ]]; then
  [[ "$mem" =~ ^(0?\.[0-9]*[1-9][0-9]*|1(\.0*)?)$ ]] \
    || die "--mem-fraction must be a number in (0, 1] (e.g. 0.9) or none (the config's train.xla_mem_fraction), got '$mem'"
  mem_flags=("--config.train.xla_mem_fraction=$mem")
fi

if [[ "$DRY_RUN" != 1 ]]; then
  need_cmd curl "the start-up check polls each rollout server's /health"
  need_cmd setsid "the trainer runs in its own session so that only it is stopped on exit"
  need_py_module "$py" cleaner_jax "pip install -e . in the checkout on this node"
  need_writable_dir "$shared" "--shared-dir"
  for u in "${server_list[@]}"; do
    wait_healthy "$u" "" "$wait_s" "the rollout node's logs"
  done
  [[ -z "$router" ]] || wait_healthy "$router" "" "$wait_s" "the router's log (launch/router.sh --log-dir)"
  install_cleanup
fi

cmd=("$py" -m cleaner_jax.train)
[[ -z "$gpus" ]] || cmd=(env "CUDA_VISIBLE_DEVICES=$gpus" "${cmd[@]}")
run_bg - "${cmd[@]}" --config "$config" --workdir "$workdir" \
  "--config.model.path=$model" "--config.data.train=$data" \
  --config.rollout.backend=sglang "--config.rollout.server_urls=$servers" ${router_flags[@]+"${router_flags[@]}"} \
  "--config.train.weight_export_dir=$shared" ${mem_flags[@]+"${mem_flags[@]}"} ${dist[@]+"${dist[@]}"} \
  ${PASSTHROUGH[@]+"${PASSTHROUGH[@]}"}
[[ "$DRY_RUN" == 1 ]] && exit 0
wait_started
