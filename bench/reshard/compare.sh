#!/usr/bin/env bash
# Interleaved timing of two bragg-reshard builds on one checkpoint, for disks too noisy to
# compare single runs. Each round drops the checkpoint's page cache before every timed step and
# times: the disk reading the checkpoint (dd iflag=direct) and writing as many bytes (dd
# conv=fsync) at once, then BIN_A, then BIN_B converting it. Prints every round and the medians.
# Usage: bench/reshard/compare.sh BIN_A BIN_B CKPT_DIR OUT_DIR [ROUNDS]   (default 6 rounds)
# CKPT_DIR comes from make_ckpt.py (with CKPT_DIR-hf-config beside it); OUT_DIR may be on
# another file system (/dev/shm: the read side alone). THREADS, MEM_BUDGET, MODEL as in run.sh.
set -euo pipefail
a=${1:?BIN_A}
b=${2:?BIN_B}
ck=${3:?checkpoint dir}
out=${4:?output dir}
rounds=${5:-6}
py=/usr/bin/python3
threads=${THREADS:-2}
budget=${MEM_BUDGET:-1GiB}
model=${MODEL:-llama}
bytes=$(du -sb "$ck" | cut -f1)

. "$(dirname "$0")/common.sh"
now() { date +%s.%N; }
el() { awk -v a="$1" -v b="$2" 'BEGIN{printf "%.2f", b-a}'; }
convert() {
  rm -rf "$out/conv"
  evict "$ck"
  local t0
  t0=$(now)
  "$1" convert --src "$ck" --dst "$out/conv" --model "$model" --hf-config-dir "$ck-hf-config" \
    --threads "$threads" --mem-budget "$budget" >/dev/null 2>"$out/conv.log" ||
    { cat "$out/conv.log" >&2; exit 1; }
  el "$t0" "$(now)"
  rm -rf "$out/conv"
}

mkdir -p "$out"
: >"$out/both.txt"; : >"$out/a.txt"; : >"$out/b.txt"
for i in $(seq "$rounds"); do
  evict "$ck"
  t0=$(now)
  for f in "$ck"/*.distcp; do dd if="$f" of=/dev/null bs=64M iflag=direct status=none; done &
  dd if=/dev/zero of="$out/ddtest" bs=64M count=$(( (bytes + 67108863) / 67108864 )) conv=fsync \
    status=none
  wait
  both=$(el "$t0" "$(now)")
  rm -f "$out/ddtest"
  ta=$(convert "$a")
  tb=$(convert "$b")
  echo "$both" >>"$out/both.txt"; echo "$ta" >>"$out/a.txt"; echo "$tb" >>"$out/b.txt"
  echo "round $i: read + write at once ${both} s | A ${ta} s | B ${tb} s | load $(cut -d' ' -f1 /proc/loadavg)"
done
echo "median: read + write at once $(median <"$out/both.txt") s | A $(median <"$out/a.txt") s | B $(median <"$out/b.txt") s"
