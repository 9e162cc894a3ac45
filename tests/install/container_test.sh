#!/usr/bin/env bash
# The container image of Bragg's services (scripts/build-image, deploy/container/Containerfile),
# built with podman (--runtime runc) from this build, then run:
#   - every program in it starts (--help) and no library is missing (ldd inside the image);
#   - the image holds the programs and the licence files, and nothing of the build tree;
#   - bragg-gateway in the container (host network) proxies /generate to a bragg-sim-worker
#     on the host, and stops on SIGTERM (podman stop) within its grace period.
# Usage: container_test.sh SOURCE_DIR BUILD_DIR SIM_WORKER PYTHON
set -euo pipefail
src=$(cd "$1" && pwd)
build=$(cd "$2" && pwd)
sim_worker=$3
python=$4
if [ "$(id -u)" -ne 0 ]; then
  echo "SKIP: podman build and mmdebstrap need root here"
  [ -z "${BRAGG_SKIP_FILE:-}" ] ||
    echo "container_test.sh: podman build and mmdebstrap need root here" >> "$BRAGG_SKIP_FILE"
  exit 77
fi
fail() { echo "FAIL: $*" >&2; exit 1; }
work=$(mktemp -d /tmp/bragg-container-XXXXXX)
tag=localhost/bragg-test:$(head -c4 /dev/urandom | od -An -tx1 | tr -d ' \n')
name=bragg-gw-$$
worker=""
cleanup() {
  podman rm -f "$name" > /dev/null 2>&1 || true
  podman rmi -f "$tag" > /dev/null 2>&1 || true
  if [ -n "$worker" ]; then kill "$worker" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT
# podman's packaged defaults ask runc for an open-files limit past what this kind of host
# grants (hard limit 20,000 here) and for systemd's cgroup manager, which needs systemd as
# PID 1: this run's own containers.conf drops both (as bench/peers/podman_peer.py does).
export CONTAINERS_CONF=$work/containers.conf
printf '%s\n' '[containers]' 'default_ulimits = []' '[engine]' 'runtime = "runc"' \
  'cgroup_manager = "cgroupfs"' 'events_logger = "file"' > "$CONTAINERS_CONF"
run() { podman run --rm --network none "$tag" "$@"; }

echo "== scripts/build-image"
"$src/scripts/build-image" --build "$build" --tag "$tag" | tail -1 | grep -qx "$tag" ||
  fail "build-image did not print the tag"

echo "== the programs in the image"
for p in pboxd pbox pbox-fusion bragg-gateway bragg-pack bragg-reshard; do
  run "$p" --help > "$work/help.txt" 2>&1 || { cat "$work/help.txt"; fail "$p --help"; }
done
[ "$(run sh -c 'ls /opt/bragg/bin | tr "\n" " "')" = \
  "bragg-gateway bragg-pack bragg-reshard pbox pbox-fusion pbox-init pboxd " ] || fail "unexpected programs"
missing=$(run sh -c 'for b in /opt/bragg/bin/*; do ldd "$b" 2>&1 | grep "not found"; done' || true)
[ -z "$missing" ] || fail "libraries missing in the image: $missing"
run test -f /opt/bragg/share/doc/bragg/LICENSE || fail "no LICENSE in the image"
# Outputs are read whole before they are searched: `podman run ... | grep -q` lets grep close the
# pipe at the first match, and podman then fails writing the rest ("broken pipe").
named=$(run sh -c "grep -rl '$build' /opt/bragg/share 2>/dev/null" || true)
[ -z "$named" ] || fail "the image names the build tree: $named"
help=$(run pboxd --help 2>&1) || fail "pboxd --help failed: $help"
grep -q "pbox sandbox agent" <<< "$help" || fail "pboxd --help does not describe pboxd"

echo "== bragg-gateway in the container in front of a worker on the host"
out=$work/worker.out
"$sim_worker" --listen 127.0.0.1:0 > "$out" 2>/dev/null &
worker=$!
for _ in $(seq 100); do grep -q "^listening on" "$out" && break; sleep 0.05; done
wurl=$(awk '/^listening on/ { print $3; exit }' "$out")
[ -n "$wurl" ] || fail "bragg-sim-worker did not start"
port=$("$python" -c '
import socket
s = socket.socket()
s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])')
podman run -d --name "$name" --network host "$tag" \
  bragg-gateway --listen "127.0.0.1:$port" --worker "$wurl" > /dev/null
gateway_failed() { podman logs "$name" | tail -20; fail "/generate through the gateway"; }
"$python" - "$port" <<'PY' || gateway_failed
import json, sys, time, urllib.request
url = f"http://127.0.0.1:{sys.argv[1]}/generate"
body = json.dumps({"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 5},
                   "rid": "container-test"}).encode()
deadline = time.monotonic() + 30
while True:
    try:
        req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            out = json.load(r)
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.2)
assert len(out["output_ids"]) == 5, out
PY
start=$(date +%s)
podman stop -t 20 "$name" > /dev/null
[ $(( $(date +%s) - start )) -lt 15 ] || fail "the gateway did not stop on SIGTERM"
[ "$(podman inspect -f '{{.State.ExitCode}}' "$name")" = 0 ] ||
  fail "the gateway exited $(podman inspect -f '{{.State.ExitCode}}' "$name") on SIGTERM"
echo "PASS"
