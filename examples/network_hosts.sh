#!/usr/bin/env bash
# Three agents on three network hosts, Redis on a fourth, over links of a chosen speed -- on one machine.
#
#   sudo examples/network_hosts.sh                 # 100mbit links, examples/three_agents.toml, prefix mode
#   sudo examples/network_hosts.sh 1gbit auto      # RATE (tc syntax, or "none": unshaped) and --mode
#
# Each "host" is a Linux network namespace with one interface, eth0, joined by a veth pair to a
# bridge in a "switch" namespace; `tc ... tbf` shapes every link both ways (netem is not needed).
# redis-server runs on host "store" (10.213.0.1, with a password: Redis refuses password-less
# clients from other hosts), the agents on h1..h3, each a `kvwire agent` process that meets the
# others only in the store. Needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN), `ip` and `tc`
# (apt-get install iproute2) and redis-server.
#
# Nothing leaves this machine: the 10.213.0.0/24 addresses exist only inside the namespaces, and
# nothing is added to the machine's own network namespace. Names carry this run's pid and a random
# suffix (kvwn<pid>-<hex>-<host>), so parallel runs never collide; everything is removed on exit
# (the trap below), and namespaces of earlier runs that were killed (their pid is gone) are removed
# at start. Set KVWIRE (default: `python -m kvwire`) to the command to run, e.g. KVWIRE=.venv/bin/kvwire.
set -euo pipefail
cd "$(dirname "$0")/.."

RATE=${1:-100mbit}
MODE=${2:-prefix}
PIPELINE=examples/three_agents.toml
AGENTS=(analyst fixer reviewer)
KVWIRE=${KVWIRE:-"${PYTHON:-python} -m kvwire"}
PATH="$PATH:/usr/sbin:/sbin"
for tool in ip tc redis-server; do
  command -v "$tool" >/dev/null || { echo "$tool is not installed (apt-get install iproute2 redis-server)" >&2; exit 1; }
done
[ "$(id -u)" = 0 ] || { echo "network namespaces need root: sudo $0 $*" >&2; exit 1; }

RUN="kvwn$$-$(printf '%04x' $((RANDOM % 65536)))"
HOSTS=(store h1 h2 h3)
work=$(mktemp -d)
password=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')

# remove namespaces of runs whose process is gone (a run killed with SIGKILL cannot clean up itself)
for ns in $(ip netns list | awk '{print $1}' | grep -E '^kvwn[0-9]+-[0-9a-f]{4}-[a-z0-9]+$' || true); do
  pid=${ns#kvwn}; pid=${pid%%-*}
  if [ ! -d "/proc/$pid" ]; then
    for p in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$p" 2>/dev/null || true; done
    ip netns del "$ns" 2>/dev/null && echo "removed $ns, left by a run that died" >&2 || true
  fi
done

cleanup() {
  for host in switch "${HOSTS[@]}"; do
    ns="$RUN-$host"
    ip netns list | grep -q "^$ns" || continue
    for p in $(ip netns pids "$ns" 2>/dev/null); do kill "$p" 2>/dev/null || true; done
    for _ in $(seq 50); do [ -z "$(ip netns pids "$ns" 2>/dev/null)" ] && break; sleep 0.1; done
    for p in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$p" 2>/dev/null || true; done
    ip netns del "$ns" 2>/dev/null || true
  done
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# the switch, then one host per namespace, each on its own port of the bridge
ip netns add "$RUN-switch"
ip -n "$RUN-switch" link set lo up
ip -n "$RUN-switch" link add br0 type bridge
ip -n "$RUN-switch" link set br0 up
for i in "${!HOSTS[@]}"; do
  host=${HOSTS[i]} ns="$RUN-${HOSTS[i]}"
  ip netns add "$ns"
  ip -n "$ns" link set lo up
  ip link add "p-$host" netns "$RUN-switch" type veth peer name eth0 netns "$ns"  # made inside: no name clash
  ip -n "$RUN-switch" link set "p-$host" master br0 up
  ip -n "$ns" addr add "10.213.0.$((i + 1))/24" dev eth0
  ip -n "$ns" link set eth0 up
  if [ "$RATE" != none ]; then  # both ways: the host's egress, and the switch port's egress towards it
    ip netns exec "$ns" tc qdisc add dev eth0 root tbf rate "$RATE" burst 512kb latency 50ms
    tc -n "$RUN-switch" qdisc add dev "p-$host" root tbf rate "$RATE" burst 512kb latency 50ms
  fi
done

ip netns exec "$RUN-store" redis-server --bind 10.213.0.1 --port 6379 --requirepass "$password" --save "" \
  --dir "$work" --logfile "$work/redis.log" --daemonize no &
for _ in $(seq 300); do grep -q "Ready to accept" "$work/redis.log" 2>/dev/null && break; sleep 0.1; done
grep -q "Ready to accept" "$work/redis.log" || { echo "redis-server did not start:" >&2; tail "$work/redis.log" >&2; exit 1; }

export KVWIRE_REDIS_PASSWORD=$password  # keeps the password off the agents' command lines
url="redis://10.213.0.1:6379/0"
session="net-$$-$RANDOM"
echo "== ${AGENTS[*]} on h1..h3, Redis on store (10.213.0.1), links $RATE, mode $MODE"
pids=()
started=$(date +%s.%N)  # timed whole, as a user sees it: from the processes' start (model loading included)
for (( i=${#AGENTS[@]}-1; i>=0; i-- )); do  # downstream first: they wait in the store
  ip netns exec "$RUN-h$((i + 1))" $KVWIRE agent "$PIPELINE" --name "${AGENTS[i]}" --session "$session" \
    --store "$url" --mode "$MODE" >"$work/${AGENTS[i]}.out" 2>"$work/${AGENTS[i]}.err" &
  pids[i]=$!
done
failed=0
for i in "${!AGENTS[@]}"; do
  if wait "${pids[i]}"; then
    # auto: each line ends with what the hop sent and why, and where each figure came from
    echo "h$((i + 1)): $(cat "$work/${AGENTS[i]}.out")"
  else failed=1; cat "$work/${AGENTS[i]}.err" >&2; fi
done
echo "wall: $(${PYTHON:-python} -c "import time; print(f'{time.time() - $started:.2f}')") s from the agents' start to the last exit"
echo "bytes through the store host's link: $(ip -n "$RUN-store" -s -j link show dev eth0 | \
  ${PYTHON:-python} -c 'import json,sys; s=json.load(sys.stdin)[0]["stats64"]; print(s["rx"]["bytes"] + s["tx"]["bytes"])')"
exit $failed
