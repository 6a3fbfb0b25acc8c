# Shared by the launch scripts (sourced, never run): dry runs, prerequisite checks, and starting
# processes so that the script stops exactly those on exit.
#
# Why by pid and process group: `pkill -f sglang.launch_server` would also kill every other
# user's SGLang server on a shared node. Each process a script starts runs in its own session
# (setsid: its pid is its process-group id), so the exit trap can stop that process and the
# children it spawned (SGLang's scheduler and detokenizer) and nothing else.
#
# A script sets DRY_RUN=1 for --dry-run: `run_bg` and `run_fg` then print each command line
# (`+ ` and the quoted argv, then the log redirection if any) on stdout instead of running it,
# and the prerequisite checks are skipped (run without --dry-run on the node to check it).

DRY_RUN=${DRY_RUN:-0}
STARTED_PIDS=()
STOP_GRACE_S=${STOP_GRACE_S:-20}

die() {
  echo "$(basename "$0"): $*" >&2
  exit 2
}

# The command line as it would be typed: a word of only safe characters as is, any other in
# single quotes (the rule of Python's shlex.quote), so the line can be pasted into a shell.
quote_word() {
  if [[ -n "$1" && "$1" =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then
    printf '%s' "$1"
  else
    printf "'%s'" "${1//\'/\'\"\'\"\'}"
  fi
}

quote_cmd() {
  local out="" word
  for word in "$@"; do
    out+="$(quote_word "$word") "
  done
  printf '%s' "${out% }"
}

# run_bg LOG CMD...: start CMD in its own session with stdout+stderr to LOG; its pid is
# appended to STARTED_PIDS (and left in LAST_PID). In a dry run: print the line only.
# LOG "-" keeps the script's own stdout and stderr (a trainer's progress bars).
run_bg() {
  local log=$1 line
  shift
  line="+ $(quote_cmd "$@")"
  [[ "$log" == - ]] || line+=" >$(quote_word "$log") 2>&1"
  if [[ "$DRY_RUN" == 1 ]]; then
    echo "$line"
    LAST_PID=
    return 0
  fi
  echo "$line" >&2
  if [[ "$log" == - ]]; then
    setsid "$@" </dev/null &
  else
    setsid "$@" >"$log" 2>&1 </dev/null &
  fi
  LAST_PID=$!
  STARTED_PIDS+=("$LAST_PID")
}

# Stop what this script started: SIGTERM to each process group, SIGKILL after STOP_GRACE_S.
stop_started() {
  local pid alive deadline
  [[ ${#STARTED_PIDS[@]} -gt 0 ]] || return 0
  for pid in "${STARTED_PIDS[@]}"; do
    kill -TERM -- "-$pid" 2>/dev/null || true
  done
  deadline=$((SECONDS + STOP_GRACE_S))
  while ((SECONDS < deadline)); do
    alive=0
    for pid in "${STARTED_PIDS[@]}"; do
      kill -0 -- "-$pid" 2>/dev/null && alive=1
    done
    ((alive)) || break
    sleep 0.2
  done
  for pid in "${STARTED_PIDS[@]}"; do
    if kill -0 -- "-$pid" 2>/dev/null; then
      echo "$(basename "$0"): process group $pid did not stop within ${STOP_GRACE_S} s: SIGKILL" >&2
      kill -KILL -- "-$pid" 2>/dev/null || true
    fi
  done
  STARTED_PIDS=()
}

# Installed by every script that starts processes.
install_cleanup() {
  trap 'stop_started' EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
}

# ----------------------------------------------------------------------------- prerequisites

need_cmd() {  # need_cmd NAME WHY
  command -v "$1" >/dev/null 2>&1 || die "prerequisite: '$1' is not on PATH ($2)"
}

need_py_module() {  # need_py_module PYTHON MODULE INSTALL_HINT
  local py=$1 mod=$2 hint=$3
  command -v "$py" >/dev/null 2>&1 || die "prerequisite: python '$py' not found (pass --python PATH)"
  "$py" -c "import $mod" >/dev/null 2>&1 \
    || die "prerequisite: python package '$mod' is not importable by $py ($hint)"
}

need_readable_dir() {  # need_readable_dir DIR WHAT
  [[ -d "$1" ]] || die "prerequisite: $2 '$1' does not exist (or is not a directory)"
  [[ -r "$1" && -x "$1" ]] || die "prerequisite: $2 '$1' is not readable"
}

need_writable_dir() {  # need_writable_dir DIR WHAT: really writes (root passes permission bits anyway)
  local probe
  [[ -d "$1" ]] || die "prerequisite: $2 '$1' does not exist (or is not a directory)"
  probe=$(mktemp -p "$1" .cleaner_jax-write-check.XXXXXX 2>/dev/null) \
    || die "prerequisite: $2 '$1' is not writable (a file could not be created there)"
  rm -f -- "$probe"
}

# iface_addr PYTHON IFACE: the IPv4 address of a network interface (SIOCGIFADDR), or die
# naming the interfaces there are.
iface_addr() {
  local py=$1 iface=$2 addr
  [[ -e "/sys/class/net/$iface" ]] \
    || die "prerequisite: network interface '$iface' not found (this node has: $(cd /sys/class/net && echo *))"
  addr=$("$py" -c '
import fcntl, socket, struct, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
print(socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", sys.argv[1][:15].encode()))[20:24]))
' "$iface" 2>/dev/null) || die "prerequisite: network interface '$iface' has no IPv4 address"
  echo "$addr"
}

# wait_healthy URL PID TIMEOUT_S LOG: until URL/health answers 200; dies if PID exits first
# (showing the end of LOG) or the time runs out.
wait_healthy() {
  local url=$1 pid=$2 timeout_s=$3 log=$4 deadline=$((SECONDS + $3))
  while ((SECONDS < deadline)); do
    if curl -sf --max-time 5 "$url/health" >/dev/null 2>&1; then
      return 0
    fi
    if [[ -n "$pid" ]] && ! kill -0 "$pid" 2>/dev/null; then
      echo "--- last lines of $log:" >&2
      tail -n 30 "$log" >&2 || true
      die "$url: the process (pid $pid) exited before /health answered"
    fi
    sleep 1
  done
  die "$url did not answer /health within $timeout_s s; see $log"
}

# wait_started: wait for every started process; returns the worst exit status. A process
# that exits is reported; the others keep running (the trainer's client copes with a lost
# server, and `stop_started` stops the rest on exit).
wait_started() {
  local worst=0 rc pid
  for pid in "${STARTED_PIDS[@]}"; do
    rc=0
    wait "$pid" || rc=$?
    if ((rc != 0)); then
      echo "$(basename "$0"): pid $pid exited with status $rc" >&2
      ((rc > worst)) && worst=$rc
    fi
  done
  return "$worst"
}
