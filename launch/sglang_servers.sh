#!/usr/bin/env bash
# Start one real SGLang server per GPU (tensor-parallel 1, as the authors run rollouts) on
# consecutive ports, wait until every /health answers 200, print their URLs (the last line of
# stdout, comma-separated), then stay in the foreground until the servers exit or the script is
# stopped (Ctrl-C, SIGTERM): on exit it stops the servers it started, and only those (by pid).
#
#   launch/sglang_servers.sh [OPTIONS] MODEL_DIR [NUM_GPUS=4] [FIRST_PORT=30000] [DTYPE=float16] [-- SGLANG_FLAGS...]
#
#   --interface IFACE   bind the servers to IFACE's IPv4 address (e.g. eth0, ib0) so that learner
#                       and router nodes reach them; default: 127.0.0.1 (this node only)
#   --host ADDR         bind to ADDR instead (an address of this node, or 0.0.0.0: the URLs
#                       then name this node's first address, from hostname -I, the others on
#                       stderr)
#   --shared-dir DIR    the directory the learner exports weights to (a shared filesystem on
#                       several nodes): checked readable here, since the weight sync points the
#                       servers at exports under it (/update_weights_from_disk)
#   --urls-file FILE    also write the URL line to FILE once every server is healthy
#   --log-dir DIR       server logs (DIR/sglang-<gpu>.log); default logs
#   --python PY         the Python with sglang installed; default python
#   --mem-fraction F    SGLang's --mem-fraction-static; default 0.6
#   --deterministic-inference
#                       pass SGLang's --enable-deterministic-inference (off by default): the same
#                       sampling_seed then gives the same tokens whatever else is batched, which
#                       an exact resume of a run needs (docs/sglang_api.md §3.8); it costs rollout
#                       throughput and needs a GPU attention backend (CPU refuses it)
#   --dry-run           print every command instead of running it (no prerequisite checks)
#
# The options go before MODEL_DIR. The words after `--` are appended, as they are, to every
# server's `sglang.launch_server` command line, after the script's own flags: e.g. what
# colocated rollouts need from real SGLang (docs/scaling.md, "Colocated placement"):
#   launch/sglang_servers.sh MODEL_DIR 4 30000 bfloat16 -- --enable-memory-saver --enable-weights-cpu-backup
# Any other word (a fifth argument, an option after MODEL_DIR) stops the script, naming it.
#
# MODEL_DIR is a local Hugging Face directory. The trainer then talks to the servers with
# --config.rollout.backend=sglang --config.rollout.server_urls=<the printed line>, directly (its
# own sticky routing) or through launch/router.sh.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/_common.sh"

usage="usage: $0 [--dry-run] [--interface IFACE | --host ADDR] [--shared-dir DIR] [--urls-file FILE] [--log-dir DIR] [--python PY] [--mem-fraction F] [--deterministic-inference] MODEL_DIR [NUM_GPUS] [FIRST_PORT] [DTYPE] [-- SGLANG_FLAGS...]"
extra=()
iface=""
host=""
shared=""
urls_file=""
log_dir=logs
py=python
mem=0.6
parse_args "$usage" leading --interface=iface --host=host --shared-dir=shared --urls-file=urls_file \
  --log-dir=log_dir --python=py --mem-fraction=mem \
  --deterministic-inference+extra=--enable-deterministic-inference -- "$@"
check_args "$usage" "MODEL_DIR NUM_GPUS FIRST_PORT DTYPE" sglang.launch_server
set -- ${ARGS[@]+"${ARGS[@]}"}
model=${1:?$usage}
gpus=${2:-4}
port0=${3:-30000}
dtype=${4:-float16}
[[ -z "$iface" || -z "$host" ]] || die "--interface and --host are exclusive"
[[ "$gpus" =~ ^[1-9][0-9]*$ ]] || die "NUM_GPUS must be a positive integer, got '$gpus'"
[[ "$port0" =~ ^[0-9]+$ ]] || die "FIRST_PORT must be an integer, got '$port0'"
host=$(bind_address "$py" "$iface" "$host")
url_host=$(url_host "$host")

if [[ "$DRY_RUN" != 1 ]]; then
  need_cmd curl "the readiness check polls each server's /health"
  need_cmd setsid "each server runs in its own session so that only it is stopped on exit"
  need_py_module "$py" sglang "pip install sglang on the rollout nodes (docs/scaling.md, 'Rollout fleets on several nodes')"
  [[ -z "$shared" ]] || need_readable_dir "$shared" "--shared-dir"
  mkdir -p "$log_dir"
  install_cleanup
fi

urls=()
pids=()
for ((g = 0; g < gpus; g++)); do
  port=$((port0 + g))
  run_bg "$log_dir/sglang-$g.log" env "CUDA_VISIBLE_DEVICES=$g" "$py" -m sglang.launch_server \
    --model-path "$model" --host "$host" --port "$port" --tp 1 --dtype "$dtype" \
    --mem-fraction-static "$mem" --skip-tokenizer-init ${extra[@]+"${extra[@]}"} \
    ${PASSTHROUGH[@]+"${PASSTHROUGH[@]}"}
  urls+=("http://$url_host:$port")
  pids+=("${LAST_PID:-}")
done
line=$(IFS=,; echo "${urls[*]}")
if [[ "$DRY_RUN" == 1 ]]; then
  echo "$line"
  exit 0
fi
for ((g = 0; g < gpus; g++)); do
  wait_healthy "${urls[$g]}" "${pids[$g]}" 1800 "$log_dir/sglang-$g.log"
done
if [[ -n "$urls_file" ]]; then
  echo "$line" >"$urls_file.tmp"
  mv "$urls_file.tmp" "$urls_file"
fi
echo "$line"
wait_started
