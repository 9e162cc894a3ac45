#!/bin/sh
# run_with_peers.sh PEER_PYTHON ARGS...: runs PEER_PYTHON ARGS (the Python peer environment, CMake's
# BRAGG_PEER_PYTHON), or reports a skip to ctest (77, with its reason in $BRAGG_SKIP_FILE) when that
# environment was never made. One that exists but is broken fails the test instead.
py=$1
shift
if [ ! -x "$py" ]; then
  reason="no Python peer environment at $py (torch, transformers): run scripts/install-deps"
  echo "SKIP: $reason"
  [ -z "${BRAGG_SKIP_FILE:-}" ] || echo "tests/engine: $reason" >> "$BRAGG_SKIP_FILE"
  exit 77
fi
exec "$py" "$@"
