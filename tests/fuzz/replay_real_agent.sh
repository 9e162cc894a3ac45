#!/usr/bin/env bash
# Replays the service fuzzer's seed corpus against a real pboxd (real sandboxes, processes,
# mounts and cgroups instead of the fake runtime): every scripted call must get an answer,
# and the agent must still serve, and exit cleanly on SIGTERM, afterwards.
#
#   replay_real_agent.sh PBOXD SERVICE_FUZZ CORPUS_DIR
set -euo pipefail

pboxd=$1
fuzz=$2
corpus=$3
if [ "$(id -u)" -ne 0 ]; then
  # 77: ctest's skip (never a pass); the reason goes to make test's list of skips.
  echo "replay_real_agent: needs root (namespaces, mounts, cgroups); skipped"
  [ -z "${BRAGG_SKIP_FILE:-}" ] ||
    echo "replay_real_agent.sh: needs root (namespaces, mounts, cgroups)" >> "$BRAGG_SKIP_FILE"
  exit 77
fi
root=$(mktemp -d /tmp/pbx-fz-XXXXXX)
agent=""
cleanup() {
  if [ -n "$agent" ] && kill -0 "$agent" 2>/dev/null; then
    kill -KILL "$agent" 2>/dev/null || true
    wait "$agent" 2>/dev/null || true
    # What the SIGKILLed agent left (sandboxes, mounts, its cgroup parent).
    "$pboxd" --reap --state-dir "$root/state" >/dev/null || true
  fi
  rm -rf "$root"
}
trap cleanup EXIT

"$pboxd" --listen "unix://$root/pbox.sock" --state-dir "$root/state" \
  --ready-file "$root/ready.json" --max-sandboxes 16 --log-level warn >"$root/pboxd.log" 2>&1 &
agent=$!
for _ in $(seq 1 600); do
  [ -f "$root/ready.json" ] && break
  if ! kill -0 "$agent" 2>/dev/null; then
    cat "$root/pboxd.log" >&2
    exit 1
  fi
  sleep 0.05
done
[ -f "$root/ready.json" ] || { echo "pboxd not ready" >&2; cat "$root/pboxd.log" >&2; exit 1; }

PBOX_FUZZ_ENDPOINT="unix://$root/pbox.sock" "$fuzz" --seconds 0 "$corpus"

if ! kill -0 "$agent" 2>/dev/null; then
  echo "pboxd died during the replay" >&2
  cat "$root/pboxd.log" >&2
  exit 1
fi
kill -TERM "$agent"
rc=0
wait "$agent" || rc=$?
agent=""
if [ "$rc" -ne 0 ]; then
  echo "pboxd exited with $rc after the replay" >&2
  cat "$root/pboxd.log" >&2
  exit 1
fi
echo "replay_real_agent: corpus replayed against pboxd; it served throughout and stopped cleanly"
