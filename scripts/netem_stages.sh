#!/usr/bin/env bash
# Pipeline stages behind a real (emulated) network: one network namespace per stage, all joined by
# veth links to a bridge in a private "switch" namespace, with `tc netem delay` on every stage's
# link, then one `torchrun ... -m mtp.pipeline` per namespace (node rank = stage).
#
# When to use which delay:
#   --link-delay-ms D (mtp pipeline / the benchmark): a sleep inside the transport before every
#     message. No privileges, exact and cheap; models pure latency, not bandwidth or TCP effects.
#   this script: the kernel delays every packet (data, TCP ACKs, the rendezvous store's traffic), so
#     TCP windows, retransmits and jitter behave as on a real link. Needs root (CAP_NET_ADMIN) and
#     the sch_netem kernel module. Use it to check that the in-transport delay predicts reality.
#
# Everything stays on this machine: a private 10.77.0.0/24 subnet, no route out, nothing in the
# root namespace is touched; the namespaces (and with them the veths and the bridge) are deleted
# on exit, Ctrl-C included.
#
# usage: sudo scripts/netem_stages.sh [-s STAGES] [-d DELAY_MS] [-j JITTER_MS] [-p PYTHON] -- ARGS...
#   ARGS go to `python -m mtp.pipeline` (the prompt, --strategy, --max-new-tokens, --json, ...).
#   Stage 0's output is printed; the other stages log to $LOGDIR (default: a temp dir).
# example: sudo scripts/netem_stages.sh -s 4 -d 5 -- "What is 12+30?" --strategy conf_adapt:0.9
set -euo pipefail

STAGES=2
DELAY_MS=5
JITTER_MS=0
PYTHON=${PYTHON:-python}
PORT=29577
PREFIX=mtpst
while getopts "s:d:j:p:h" opt; do
  case $opt in
    s) STAGES=$OPTARG ;;
    d) DELAY_MS=$OPTARG ;;
    j) JITTER_MS=$OPTARG ;;
    p) PYTHON=$OPTARG ;;
    h) sed -n '2,24p' "$0"; exit 0 ;;
    *) echo "netem_stages.sh: bad option (see -h)" >&2; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[ "${1:-}" = "--" ] && shift

die() { echo "netem_stages.sh: error: $*" >&2; exit 2; }
[ "$(id -u)" = 0 ] || die "needs root (network namespaces and tc); or use --link-delay-ms without root"
command -v ip >/dev/null && command -v tc >/dev/null || die "needs iproute2 (ip, tc)"
[[ $STAGES =~ ^[1-9][0-9]?$ ]] || die "-s STAGES must be 1..99"
[[ $DELAY_MS =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "-d DELAY_MS must be a number"
[[ $JITTER_MS =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "-j JITTER_MS must be a number"
LOGDIR=${LOGDIR:-$(mktemp -d -t mtp-netem-XXXXXX)}
SW=${PREFIX}_sw
PIDS=()

cleanup() {
  for pid in "${PIDS[@]:-}"; do [ -n "$pid" ] && kill "$pid" 2>/dev/null || true; done
  for ((i = 0; i < STAGES; i++)); do ip netns del "${PREFIX}_$i" 2>/dev/null || true; done
  ip netns del "$SW" 2>/dev/null || true
}
trap cleanup EXIT INT TERM

ip netns list | grep -q "^${SW}\b" && die "namespace $SW exists (another run, or a crashed one: ip netns del $SW)"
ip netns add "$SW"
ip -n "$SW" link add br0 type bridge
ip -n "$SW" link set br0 up
for ((i = 0; i < STAGES; i++)); do
  ns=${PREFIX}_$i
  ip netns add "$ns"
  ip link add "${PREFIX}h$i" type veth peer name "${PREFIX}s$i"
  ip link set "${PREFIX}h$i" netns "$SW"
  ip link set "${PREFIX}s$i" netns "$ns"
  ip -n "$SW" link set "${PREFIX}h$i" master br0 up
  ip -n "$ns" addr add "10.77.0.$((i + 1))/24" dev "${PREFIX}s$i"
  ip -n "$ns" link set "${PREFIX}s$i" up
  ip -n "$ns" link set lo up
  if [ "$DELAY_MS" != 0 ] || [ "$JITTER_MS" != 0 ]; then
    jitter=""
    [ "$JITTER_MS" != 0 ] && jitter="${JITTER_MS}ms"
    # egress of each stage: every packet it sends waits DELAY_MS (one way, like --link-delay-ms)
    ip netns exec "$ns" tc qdisc add dev "${PREFIX}s$i" root netem delay "${DELAY_MS}ms" $jitter \
      || die "tc netem failed (kernel without sch_netem?); use --link-delay-ms instead"
  fi
done
echo "netem_stages.sh: $STAGES stages on 10.77.0.1..$STAGES, ${DELAY_MS} ms (+-${JITTER_MS}) per link; logs in $LOGDIR" >&2

launch() {  # stage i in its namespace, as node i of a static torchrun rendezvous hosted by node 0
  local i=$1
  # GLOO_SOCKET_IFNAME: gloo must advertise the stage's veth address, not the hostname's 127.0.0.1
  ip netns exec "${PREFIX}_$i" env OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" GLOO_SOCKET_IFNAME="${PREFIX}s$i" \
    "$PYTHON" -m torch.distributed.run \
    --nnodes "$STAGES" --nproc-per-node 1 --node-rank "$i" --master-addr 10.77.0.1 --master-port "$PORT" \
    -m mtp.pipeline "${@:2}"
}
for ((i = STAGES - 1; i >= 1; i--)); do
  launch "$i" "$@" >"$LOGDIR/stage$i.log" 2>&1 &
  PIDS+=($!)
done
set +e
launch 0 "$@" 2> >(grep -v "^W[0-9]* .*torch/distributed/run.py\|^\*\*\*\*\|OMP_NUM_THREADS" >&2)
rc=$?
for pid in "${PIDS[@]}"; do wait "$pid" || { [ "$rc" != 0 ] || rc=1; }; done
exit $rc
