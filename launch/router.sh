#!/usr/bin/env bash
# Start the real sglang-router (pip package sglang-router, Rust) in front of SGLang servers (or
# ours), wait until it is ready, print its URL (the last line of stdout), then stay in the
# foreground; on exit it stops the router it started, and only that (by pid).
#
#   launch/router.sh [OPTIONS] WORKER_URL[,WORKER_URL...] [WORKER_URL...] [-- ROUTER_FLAGS...]
#
#   --interface IFACE   bind the router to IFACE's IPv4 address; default: 127.0.0.1
#   --host ADDR         bind to ADDR instead; 0.0.0.0 (every interface): the printed URL then
#                       names this node's first address (hostname -I; the others on stderr)
#   --port PORT         the router's port; default 29900 (not 30000: that is SGLang's and
#                       launch/sglang_servers.sh's first worker port, and SGLang takes its NCCL
#                       port at random from 100 to 1000 above a worker's)
#   --prometheus-port PORT
#                       its metrics port (bound to the same address); default 29000
#   --policy P          routing policy; default manual: sticky by the X-SMG-Routing-Key header
#                       our client sends with each trajectory's route key, new keys to the
#                       worker with the fewest keys (--assignment-mode min_group), so every turn
#                       of a trajectory reaches the worker holding its prefix and trajectories
#                       spread over the workers. cache_aware (the router's default) matches
#                       prefixes on text, so token-only requests all go to one worker
#                       (docs/sglang_api.md §3.7)
#   --log-dir DIR       the router's log (DIR/router.log); default logs
#   --python PY         the Python with sglang-router installed; default python
#   --dry-run           print the command instead of running it (no prerequisite checks)
#
# A worker that dies is found by the router's health check (every 5 s, out after 2 failures)
# and its circuit breaker (after 3 failed requests); its keys move to the others, whose prefix
# caches then fill again. Anything after `--` is passed to the router as is.
#
# What the router does not do: forward /server_info and the weight-sync calls
# (/pause_generation, /update_weights_from_disk, /continue_generation; 0.3.2 answers 404). The
# trainer and the evaluator therefore take both: the workers' URLs in rollout.server_urls
# (launch/learner_node.sh --server-urls), where the weight sync and the context check go, and
# the printed URL in rollout.router_url (--router-url), where generation goes (docs/scaling.md,
# "Generation through sglang-router").
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/_common.sh"

usage="usage: $0 [--dry-run] [--interface IFACE | --host ADDR] [--port PORT] [--prometheus-port PORT] [--policy P] [--log-dir DIR] [--python PY] WORKER_URL... [-- ROUTER_FLAGS...]"
iface=""
host=""
port=29900
prom_port=29000
policy=manual
log_dir=logs
py=python
parse_args "$usage" mixed --interface=iface --host=host --port=port --prometheus-port=prom_port \
  --policy=policy --log-dir=log_dir --python=py -- "$@"
workers=()
for words in ${ARGS[@]+"${ARGS[@]}"}; do
  IFS=, read -r -a more <<<"$words"
  workers+=("${more[@]}")
done
[[ ${#workers[@]} -gt 0 ]] || die "no worker URL given; $usage"
[[ -z "$iface" || -z "$host" ]] || die "--interface and --host are exclusive"
check_urls worker "${workers[@]}"
host=$(bind_address "$py" "$iface" "$host")
url="http://$(url_host "$host"):$port"

if [[ "$DRY_RUN" != 1 ]]; then
  need_cmd curl "the readiness check polls the router's /readiness"
  need_cmd setsid "the router runs in its own session so that only it is stopped on exit"
  need_py_module "$py" sglang_router "pip install 'sglang-router>=0.3.2,<0.4' (the project's dev extra has it)"
  mkdir -p "$log_dir"
  install_cleanup
fi

policy_flags=(--policy "$policy")
[[ "$policy" != manual ]] || policy_flags+=(--assignment-mode min_group)
run_bg "$log_dir/router.log" "$py" -m sglang_router.launch_router --host "$host" --port "$port" \
  --worker-urls "${workers[@]}" "${policy_flags[@]}" \
  --prometheus-host "$host" --prometheus-port "$prom_port" \
  --health-check-interval-secs 5 --health-failure-threshold 2 --cb-failure-threshold 3 \
  --request-timeout-secs 3600 ${PASSTHROUGH[@]+"${PASSTHROUGH[@]}"}
if [[ "$DRY_RUN" == 1 ]]; then
  echo "$url"
  exit 0
fi
await "$LAST_PID" "$log_dir/router.log" 1800 \
  "the router (pid $LAST_PID) exited before $url/readiness answered; see $log_dir/router.log" \
  "$url/readiness did not answer within 1800 s (are the workers up?); see $log_dir/router.log" \
  curl -sf --max-time 5 "$url/readiness"
echo "$url"
wait_started
