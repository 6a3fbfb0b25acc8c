# Shared by the launch scripts (sourced, never run): dry runs, prerequisite checks, and starting
# processes so that the script stops exactly those on exit.
#
# Why by pid and process group: `pkill -f sglang.launch_server` would also kill every other
# user's SGLang server on a shared node. Each process a script starts runs in its own session
# (setsid: its pid is its process-group id), so the exit trap can stop that process and the
# children it spawned (SGLang's scheduler and detokenizer) and nothing else.
#
# `parse_args` sets DRY_RUN=1 for --dry-run: `run_bg` then prints each command line (`+ ` and
# the quoted argv, then the log redirection if any) on stdout instead of running it, and the
# scripts skip their prerequisite checks (run without --dry-run on the node to check it).

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

# ----------------------------------------------------------------------------- arguments

# parse_args USAGE MODE SPEC... -- WORD...: the option loop of every script, so that a script
# lists only its own options and what its other words are. Common to all: --dry-run (DRY_RUN=1),
# -h/--help (USAGE on stdout, exit 0), and any other --word is an unknown option (exit 2).
#   SPEC --name=VAR          an option with a value: VAR is set to the next word; a missing or
#                            empty one exits 1 with USAGE (bash's own ${2:?} message)
#   SPEC --name+ARRAY=WORD   a switch: WORD is appended to the script's array ARRAY, once per use
#   MODE leading             the first other word ends the options: it and every word after it
#                            up to a `--` are ARGS, the words after that `--` are PASSTHROUGH (a
#                            `--` before the first of them is an unknown option); check_args
#                            then refuses the words the script cannot place
#   MODE mixed               other words are ARGS wherever they stand, and the words after `--`
#                            are PASSTHROUGH (for the program the script starts)
# Sets the arrays ARGS and PASSTHROUGH.
parse_args() {
  local _usage=$1 _mode=$2 _spec _specs=() _rest
  shift 2
  while [[ "$1" != -- ]]; do
    _specs+=("$1")
    shift
  done
  shift
  ARGS=()
  PASSTHROUGH=()
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --dry-run) DRY_RUN=1; shift; continue ;;
      -h|--help) echo "$_usage"; exit 0 ;;
      --) if [[ "$_mode" == mixed ]]; then shift; PASSTHROUGH=("$@"); return 0; fi ;;
      --*) ;;
      *)
        if [[ "$_mode" == leading ]]; then
          while [[ $# -gt 0 && "$1" != -- ]]; do ARGS+=("$1"); shift; done
          [[ $# -eq 0 ]] || { shift; PASSTHROUGH=("$@"); }
          return 0
        fi
        ARGS+=("$1"); shift; continue ;;
    esac
    for _spec in ${_specs[@]+"${_specs[@]}"}; do
      if [[ "$_spec" == "$1="* ]]; then
        printf -v "${_spec#*=}" '%s' "${2:?$_usage}"
        shift 2
        continue 2
      elif [[ "$_spec" == "$1+"* ]]; then
        _rest=${_spec#*+}
        eval "${_rest%%=*}+=(\"\${_rest#*=}\")"  # the array a script named in its own SPEC
        shift
        continue 2
      fi
    done
    die "unknown option $1; $_usage"
  done
}

# check_args USAGE NAMES [PASS]: after parse_args' leading mode, die naming the first word the
# script cannot place: an option among the arguments (the script's own go before the first
# argument), an argument past the positional ones NAMES lists (e.g. "MODEL_DIR NUM_GPUS"), or,
# without PASS, any word after `--`. PASS names the program the words after `--` go to.
check_args() {
  local usage=$1 names=$2 pass=${3:-} max w hint=""
  read -r -a max <<<"$names"
  [[ -z "$pass" ]] || hint=", flags for $pass after '--'"
  for w in ${ARGS[@]+"${ARGS[@]}"}; do
    [[ "$w" != -?* ]] || die "option '$w' among the arguments: this script's options go before ${max[0]}$hint; $usage"
  done
  if [[ ${#ARGS[@]} -gt ${#max[@]} ]]; then
    die "unexpected argument '${ARGS[${#max[@]}]}': the arguments are $names$hint; $usage"
  fi
  if [[ -z "$pass" && ${#PASSTHROUGH[@]} -gt 0 ]]; then
    die "unexpected argument '${PASSTHROUGH[0]}' after '--': this script passes no flags through; $usage"
  fi
}

# check_urls WHAT URL...: every URL is http(s)://HOST:PORT (no path), or die naming the first
# that is not (WHAT: whose URLs they are, as the message says).
check_urls() {
  local what=$1 u
  shift
  for u in "$@"; do
    [[ "$u" =~ ^https?://[^/]+$ ]] || die "$what URL '$u' is not of the form http://HOST:PORT"
  done
}

# bind_address PYTHON IFACE HOST: the address a server binds (--interface IFACE | --host HOST):
# IFACE's IPv4 address when IFACE is given, else HOST, else 127.0.0.1 (this node only).
bind_address() {
  if [[ -n "$2" ]]; then
    iface_addr "$1" "$2"
  else
    echo "${3:-127.0.0.1}"
  fi
}

# url_host HOST: the host to put in the URL that other nodes use for a server bound to HOST:
# HOST itself, but for a bind to every interface (0.0.0.0, ::), which no node can connect to,
# this node's first address from `hostname -I` (its name if that lists none), said on stderr
# with the others, since the first need not be the one the other nodes reach.
url_host() {
  local host=$1 addrs=() addr
  case "$host" in
    0.0.0.0|::|'[::]') ;;
    *) echo "$host"; return 0 ;;
  esac
  read -r -a addrs <<<"$(hostname -I 2>/dev/null || true)"
  if [[ ${#addrs[@]} -gt 0 ]]; then
    addr=${addrs[0]}
  else
    addr=$(hostname 2>/dev/null) && [[ -n "$addr" ]] \
      || die "--host $host binds every interface, and this node's address could not be found for the URL (hostname -I lists none): pass --interface IFACE or --host with one of this node's addresses"
    addrs=("$addr")
  fi
  [[ "$addr" != *:* ]] || addr="[$addr]"
  echo "$(basename "$0"): --host $host binds every interface; the URL names this node as $addr, the first of its addresses (${addrs[*]}): if the other nodes reach it by another, use that one (or --interface IFACE)" >&2
  echo "$addr"
}

# ----------------------------------------------------------------------------- processes

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

# await PID LOG TIMEOUT_S EXITED TIMED_OUT CHECK...: run CHECK (output discarded) every second
# until it succeeds. Dies with EXITED, after the last lines of LOG, when PID (if not empty) exits
# first, and with TIMED_OUT when TIMEOUT_S seconds pass first (empty: no limit; 0: before the
# first check), so that a start-up that failed is reported at once, with its log, and a hung one
# in the end.
await() {
  local pid=$1 log=$2 timeout_s=$3 exited=$4 timed_out=$5 deadline=
  shift 5
  [[ -z "$timeout_s" ]] || deadline=$((SECONDS + $timeout_s))
  while [[ -z "$deadline" ]] || ((SECONDS < deadline)); do
    if "$@" >/dev/null 2>&1; then
      return 0
    fi
    if [[ -n "$pid" ]] && ! kill -0 "$pid" 2>/dev/null; then
      echo "--- last lines of $log:" >&2
      tail -n 30 "$log" >&2 || true
      die "$exited"
    fi
    sleep 1
  done
  die "$timed_out"
}

# wait_healthy URL PID TIMEOUT_S LOG: until URL/health answers 200; dies if PID exits first
# (showing the end of LOG) or the time runs out.
wait_healthy() {
  local url=$1 pid=$2 timeout_s=$3 log=$4
  await "$pid" "$log" "$timeout_s" "$url: the process (pid $pid) exited before /health answered" \
    "$url did not answer /health within $timeout_s s; see $log" curl -sf --max-time 5 "$url/health"
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
