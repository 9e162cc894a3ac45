#!/usr/bin/env bash
# The pbox CLI against a real pboxd: every subcommand, exit codes, and errors.
set -u
PBOXD=$1
PBOX=$2
if [ "$(id -u)" -ne 0 ]; then
  # 77: ctest's skip (never a pass); the reason goes to make test's list of skips.
  echo "SKIP: pboxd needs root"
  [ -z "${BRAGG_SKIP_FILE:-}" ] || echo "cli_test.sh: pboxd needs root" >> "$BRAGG_SKIP_FILE"
  exit 77
fi
dir=$(mktemp -d /tmp/pbox-cli-XXXXXX)
"$PBOXD" --listen "unix://$dir/pbox.sock" --state-dir "$dir/state" --ready-file "$dir/ready" \
  --log-level warn &
agent=$!
cleanup() { kill -TERM $agent 2>/dev/null; wait $agent 2>/dev/null; rm -rf "$dir"; }
trap cleanup EXIT
for _ in $(seq 200); do [ -f "$dir/ready" ] && break; sleep 0.05; done
export PBOX_ENDPOINT="unix://$dir/pbox.sock"

passed=0
failed=0
check() {  # check NAME EXPECTED ACTUAL
  if [ "$2" == "$3" ]; then
    passed=$((passed + 1))
  else
    failed=$((failed + 1))
    echo "FAIL: $1: expected [$2], got [$3]"
  fi
}

# gVisor is listed where runsc is installed.
runtimes="native"
if command -v runsc > /dev/null || [ -x /usr/sbin/runsc ]; then runtimes="native, gvisor"; fi
check "info shows the runtime" "runtime:        native (available: $runtimes)" \
  "$("$PBOX" info | grep '^runtime')"
id=$("$PBOX" create --memory 128M --disk 64M --env GREETING=hello --label job=ci)
check "create prints an id" "sb-" "${id:0:3}"

out=$("$PBOX" exec "$id" -- sh -c 'echo $GREETING; echo oops >&2; exit 3' 2>"$dir/err")
check "exec exit code" "3" "$?"
check "exec stdout" "hello" "$out"
check "exec stderr" "oops" "$(cat "$dir/err")"
check "exec stdin" "piped" "$(echo piped | "$PBOX" exec -i "$id" -- cat)"
check "exec env and cwd" "1 /tmp" "$("$PBOX" exec -e X=1 -w /tmp "$id" -- sh -c 'echo $X $(pwd)')"

"$PBOX" exec --timeout 0.3 "$id" -- sleep 10 2>"$dir/err"
check "timeout exits 124" "124" "$?"
check "timeout message" "1" "$(grep -c 'timed out' "$dir/err")"
"$PBOX" exec "$id" -- python3 -c 'x = bytearray(1 << 30)' 2>"$dir/err"
check "OOM exits 137" "137" "$?"
check "OOM message" "1" "$(grep -c 'out of memory' "$dir/err")"
"$PBOX" exec "$id" -- no-such-program 2>"$dir/err"
check "missing program exits 127" "127" "$?"

head -c 3000000 /dev/urandom > "$dir/in.bin"
"$PBOX" cp "$dir/in.bin" "$id:/data/in.bin"
check "cp in" "0" "$?"
"$PBOX" cp "$id:/data/in.bin" "$dir/out.bin"
check "cp out" "0" "$?"
cmp -s "$dir/in.bin" "$dir/out.bin"
check "cp round trip is exact" "0" "$?"
echo "via stdin" | "$PBOX" cp - "$id:/data/s.txt"
check "cp from stdin, to stdout" "via stdin" "$("$PBOX" cp "$id:/data/s.txt" -)"
check "ls" "2" "$("$PBOX" ls "$id:/data" | wc -l)"
"$PBOX" cp "$id:/data/missing" "$dir/x" 2>"$dir/err"
check "cp of a missing file fails" "1" "$?"
"$PBOX" cp "$dir/in.bin" "$dir/other" 2>"$dir/err"
check "cp needs one sandbox side" "2" "$?"

check "ps lists it" "1" "$("$PBOX" ps | grep -c "$id")"
check "ps -q" "$id" "$("$PBOX" ps -q)"
"$PBOX" rm "$id"
check "rm" "0" "$?"
check "ps after rm" "" "$("$PBOX" ps -q)"
"$PBOX" rm "$id" 2>"$dir/err"
check "rm of a gone sandbox fails" "1" "$?"
"$PBOX" exec "$id" -- true 2>"$dir/err"
check "exec in a gone sandbox fails" "1" "$?"
check "its message" "1" "$(grep -c 'no sandbox' "$dir/err")"
"$PBOX" --endpoint unix:///nonexistent/pbox.sock info 2>"$dir/err"
check "no agent" "1" "$?"
check "no-agent hint" "1" "$(grep -c 'is pboxd running' "$dir/err")"
"$PBOX" create --memory 12Q 2>"$dir/err"
check "bad size is a usage error" "2" "$?"
"$PBOX" create --runtime bogus 2>"$dir/err"
check "unknown runtime refused (usage error)" "2" "$?"
check "unknown runtime named" "1" "$(grep -c 'unknown runtime' "$dir/err")"
rt=$("$PBOX" create --runtime native --memory 128M --disk 16M)
check "--runtime native creates" "sb-" "${rt:0:3}"
"$PBOX" rm "$rt"

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
