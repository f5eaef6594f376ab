#!/usr/bin/env bash
# Run examples/three_agents.toml as three `kvwire agent` processes, first through Redis, then
# through file:///dev/shm, and print each agent's result. The agents are started downstream
# first: the fixer and the reviewer wait in the store for their upstream handoff.
#
#   examples/three_processes.sh                          # a throw-away redis-server on a free loopback port
#   examples/three_processes.sh redis://10.0.0.5:6379/0  # an existing server (agents may be on other hosts)
#
# Set KVWIRE (default: `python -m kvwire`) to the command to run, e.g. KVWIRE=.venv/bin/kvwire.
# On a small machine whose cores the agents share, OMP_NUM_THREADS=1 keeps their threads from contending.
set -euo pipefail
cd "$(dirname "$0")/.."

KVWIRE=${KVWIRE:-"${PYTHON:-python} -m kvwire"}
PIPELINE=examples/three_agents.toml
AGENTS=(analyst fixer reviewer)
work=$(mktemp -d)
redis_pid=""
shm="/dev/shm/kvwire-example-$$"

cleanup() {
  if [ -n "$redis_pid" ]; then kill "$redis_pid" 2>/dev/null || true; wait "$redis_pid" 2>/dev/null || true; fi
  rm -rf "$work" "$shm"
}
trap cleanup EXIT

# run_agents STORE_URL: one process per agent, downstream ones first; wait for all, print their results
run_agents() {
  local url=$1 session="example-$$-$RANDOM" pids=() failed=0
  echo "== ${AGENTS[*]} through $url (session $session)"
  for (( i=${#AGENTS[@]}-1; i>=0; i-- )); do
    $KVWIRE agent "$PIPELINE" --name "${AGENTS[i]}" --session "$session" --store "$url" \
      >"$work/${AGENTS[i]}.out" 2>"$work/${AGENTS[i]}.err" &
    pids[i]=$!
  done
  for i in "${!AGENTS[@]}"; do
    if wait "${pids[i]}"; then cat "$work/${AGENTS[i]}.out"; else failed=1; cat "$work/${AGENTS[i]}.err" >&2; fi
  done
  return $failed
}

if [ $# -ge 1 ]; then
  redis_url=$1
else
  command -v redis-server >/dev/null || { echo "redis-server is not installed (apt-get install redis-server)" >&2; exit 1; }
  port=$(${PYTHON:-python} -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  redis-server --bind 127.0.0.1 --port "$port" --save "" --dir "$work" --logfile "$work/redis.log" &
  redis_pid=$!
  # ready when it accepts connections (the agents would also retry while it starts)
  for _ in $(seq 200); do (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.05; done
  redis_url="redis://127.0.0.1:$port/0"
fi

run_agents "$redis_url"
run_agents "file://$shm"
