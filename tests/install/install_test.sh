#!/usr/bin/env bash
# `cmake --install` into a fresh prefix, then Bragg used from there alone, as a user would:
#   1. the layout: every program in PREFIX/bin runs (--help), pbox-init sits beside pboxd, the
#      Python packages and the CMake package config are where cmake/BraggInstall.cmake says;
#   2. pboxd.service names this prefix's pboxd and passes `systemd-analyze verify`;
#      nothing installed names the source or build tree (text files, ELF RUNPATHs);
#   3. an outside project (tests/install/consumer, copied out of the checkout) finds the
#      libraries with find_package(Bragg), compiles every installed header and links;
#   4. the Python packages import from PREFIX, not from the checkout, and pack's Python suite
#      passes against them;
#   5. as root: the installed pboxd (finding the installed pbox-init) serves the consumer's
#      sandbox and the installed pbox Python client, then stops cleanly on SIGTERM.
# Usage: install_test.sh SOURCE_DIR BUILD_DIR PYTHON
set -euo pipefail
src=$(cd "$1" && pwd)
build=$(cd "$2" && pwd)
python=$3

work=$(mktemp -d /tmp/bragg-install-XXXXXX)
agent=""
cleanup() {
  if [ -n "$agent" ]; then
    kill -TERM "$agent" 2>/dev/null || true
    wait "$agent" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT
prefix=$work/prefix
fail() { echo "FAIL: $*" >&2; exit 1; }

echo "== cmake --install $build --prefix $prefix"
cmake --install "$build" --prefix "$prefix" > "$work/install.log" ||
  { cat "$work/install.log"; fail "install"; }

echo "== layout"
for prog in pboxd pbox-init pbox pbox-fusion pbox-slurm bragg-gateway bragg-engine bragg-train \
            bragg-rl bragg-reshard bragg-pack; do
  [ -x "$prefix/bin/$prog" ] || fail "bin/$prog is not installed"
  [ "$prog" != pbox-init ] || continue  # the agent's init, run by pboxd only: no --help
  "$prefix/bin/$prog" --help > "$work/help.txt" 2>&1 ||
    { cat "$work/help.txt"; fail "$prog --help"; }
done
for f in lib/cmake/Bragg/BraggConfig.cmake lib/cmake/Bragg/BraggConfigVersion.cmake \
         lib/cmake/Bragg/BraggTargets.cmake include/bragg/pbox/client/client.h \
         include/bragg/bragg/pbox/v1/pbox.grpc.pb.h share/bragg/proto/bragg/pbox/v1/pbox.proto \
         share/doc/bragg/LICENSE lib/bragg/python/pbox/_proto/pbox_pb2.py \
         lib/bragg/python/bragg_gateway/__init__.py lib/bragg/python/bragg_rl/__init__.py \
         lib/bragg/python/bragg_reshard/ray.py; do
  [ -f "$prefix/$f" ] || fail "$f is not installed"
done
ls "$prefix"/lib/bragg/python/bragg_pack/_core*.so > /dev/null || fail "bragg_pack's extension"
ls "$prefix"/lib/bragg/python/bragg_train/_core*.so > /dev/null || fail "bragg_train's extension"
if find "$prefix" -name __pycache__ -o -name '*.pyc' | grep -q .; then
  fail "bytecode caches were installed"
fi

echo "== the systemd unit: this prefix's paths, and systemd-analyze finds nothing to say"
unit=$prefix/lib/systemd/system/pboxd.service
grep -q "^ExecStart=$prefix/bin/pboxd " "$unit" ||
  fail "pboxd.service does not run $prefix/bin/pboxd"
# systemd-analyze: scripts/deps/install.txt. An unknown key is only a warning (exit 0): any
# output at all fails the check.
if ! systemd-analyze verify "$unit" > "$work/verify.txt" 2>&1 || [ -s "$work/verify.txt" ]; then
  cat "$work/verify.txt"; fail "systemd-analyze verify pboxd.service"
fi

# The rootless user unit (docs/security.md "Rootless"), verified as a user manager would load it.
user_unit=$prefix/lib/systemd/user/pboxd.service
grep -q "^ExecStart=$prefix/bin/pboxd " "$user_unit" ||
  fail "the user unit pboxd.service does not run $prefix/bin/pboxd"
mkdir -m 700 "$work/xdg-run"
if ! XDG_RUNTIME_DIR=$work/xdg-run systemd-analyze --user verify "$user_unit" \
    > "$work/verify-user.txt" 2>&1 || [ -s "$work/verify-user.txt" ]; then
  cat "$work/verify-user.txt"; fail "systemd-analyze --user verify pboxd.service"
fi

echo "== nothing installed names the checkout or the build tree"
if grep -rIl -e "$src" -e "$build" "$prefix" > "$work/refs.txt"; then
  cat "$work/refs.txt"; fail "installed files name the source or build tree"
fi
while IFS= read -r -d '' f; do
  if readelf -d "$f" 2>/dev/null | grep -E 'R(UN)?PATH' | grep -q -e "$src" -e "$build"; then
    fail "$f has a RUNPATH into the build tree"
  fi
done < <(find "$prefix" -type f \( -perm -u+x -o -name '*.so' \) -print0)

echo "== an outside project: find_package(Bragg)"
cp -r "$src/tests/install/consumer" "$work/consumer"
{
  echo "// Every installed header, each on its own line: all must compile from the prefix alone."
  (cd "$prefix/include/bragg" && find . -name '*.h' | sed 's|^\./||' | sort) |
    while read -r h; do echo "#include \"$h\""; done
} > "$work/consumer/all_headers.cc"
[ "$(grep -c '#include' "$work/consumer/all_headers.cc")" -ge 20 ] ||
  fail "too few headers installed"
generator=()
command -v ninja > /dev/null && generator=(-G Ninja)
cmake -S "$work/consumer" -B "$work/consumer-build" "${generator[@]}" \
  -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release > "$work/consumer.log" 2>&1 ||
  { cat "$work/consumer.log"; fail "configuring the outside project"; }
cmake --build "$work/consumer-build" > "$work/consumer.log" 2>&1 ||
  { cat "$work/consumer.log"; fail "building the outside project"; }
# It compiled against the installed headers, not the checkout's.
if grep -rh -e "-I$src" -e "-isystem $src" "$work/consumer-build" 2>/dev/null | grep -q .; then
  fail "the outside project was compiled with the checkout's include paths"
fi
[ "$("$work/consumer-build/bragg_consumer")" = ok ] || fail "bragg_consumer (pack only)"

echo "== Python from the prefix"
pyenv=(env -u PYTHONPATH PYTHONPATH="$prefix/lib/bragg/python" PYTHONDONTWRITEBYTECODE=1)
where=$(cd "$work" && "${pyenv[@]}" "$python" -c '
import bragg_gateway, bragg_pack, bragg_reshard.ray, bragg_rl, bragg_train, pbox
for m in (bragg_gateway, bragg_pack, bragg_reshard, bragg_rl, bragg_train, pbox):
    print(m.__file__)
')
while read -r f; do
  case "$f" in "$prefix"/*) ;; *) fail "a package imported from $f, outside the prefix" ;; esac
done <<< "$where"
# tests/support holds only the pytest plugin that reports skips to ctest: no package of Bragg's.
(cd "$work" && "${pyenv[@]}" PYTHONPATH="$prefix/lib/bragg/python:$src/tests/support" \
  BRAGG_PACK_CLI="$prefix/bin/bragg-pack" "$python" -m pytest -q -p no:cacheprovider \
  "$src/tests/pack") || fail "tests/pack against the prefix"

if [ "$(id -u)" -ne 0 ]; then
  echo "SKIP: the installed pboxd needs root (everything before this passed)"
  [ -z "${BRAGG_SKIP_FILE:-}" ] ||
    echo "install_test.sh: the installed pboxd needs root" >> "$BRAGG_SKIP_FILE"
  exit 77
fi

echo "== the installed pboxd, from the consumer and from Python"
"$prefix/bin/pboxd" --listen "unix://$work/pbox.sock" --state-dir "$work/state" \
  --ready-file "$work/ready" --log-level warn > "$work/pboxd.log" 2>&1 &
agent=$!
for _ in $(seq 300); do [ -f "$work/ready" ] && break; sleep 0.05; done
[ -f "$work/ready" ] || { cat "$work/pboxd.log"; fail "the installed pboxd did not start"; }
[ "$("$work/consumer-build/bragg_consumer" "unix://$work/pbox.sock")" = ok ] ||
  fail "bragg_consumer against the installed pboxd"
out=$(cd "$work" && "${pyenv[@]}" "$python" -c '
import sys, pbox
with pbox.Client(sys.argv[1]) as c, c.session() as s:
    print(s.create().run(["echo", "installed"]).stdout.decode().strip())
' "unix://$work/pbox.sock")
[ "$out" = installed ] || fail "the installed pbox client: got '$out'"
kill -TERM "$agent"
rc=0
wait "$agent" || rc=$?
agent=""
[ "$rc" -eq 0 ] || { cat "$work/pboxd.log"; fail "the installed pboxd exited $rc on SIGTERM"; }
echo "PASS"
