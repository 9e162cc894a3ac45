#!/usr/bin/env bash
# bragg-reshard benchmark: synthetic llama-shaped torch_dist checkpoints of the sizes given (GB),
# conversion throughput beside the disk's sequential read bandwidth (O_DIRECT dd, same run), peak
# RSS from /usr/bin/time -v beside the model size, and time beside the torch reference converter.
# The disk is also timed reading the checkpoint and writing as many bytes at once (both dd's
# together): the least time any conversion can take when reads and writes share the device.
# Page cache of the checkpoint files is dropped (posix_fadvise DONTNEED) before every timed read.
# Usage: bench/reshard/run.sh BUILD_DIR WORK_DIR [SIZES_GB...]   (default sizes: 1 4)
# MODEL=deepseek_v3 benchmarks a DeepSeek-V3-shaped MoE checkpoint instead of llama.
set -euo pipefail
build=${1:?build dir}
work=${2:?work dir}
shift 2
sizes=("$@")
[ $# -eq 0 ] && sizes=(1 4)
here=$(cd "$(dirname "$0")" && pwd)
bin=$build/src/reshard/bragg-reshard
py=/usr/bin/python3
threads=${THREADS:-2}
budget=${MEM_BUDGET:-1GiB}
model=${MODEL:-llama}

. "$here/common.sh"

field() { grep -F "$1" "$2" | awk -F': ' '{print $2}'; }
secs() { awk -F: '{ if (NF==3) print $1*3600+$2*60+$3; else print $1*60+$2 }' <<<"$1"; }

echo "| model | files | disk read (O_DIRECT) | disk write (fsync) | read + write at once | bragg-reshard | throughput | % of disk read | % of disk write | % of read + write at once | peak RSS (budget $budget) | torch reference | reference RSS | speedup |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
for gb in "${sizes[@]}"; do
  ck=$work/ck-$model-$gb
  [ -f "$ck/.metadata" ] || $py "$here/make_ckpt.py" --gb "$gb" --out "$ck" --model "$model" \
    >/dev/null 2>&1
  bytes=$(du -sb "$ck" | cut -f1)
  evict "$ck"
  t0=$(date +%s.%N)
  for f in "$ck"/*.distcp; do dd if="$f" of=/dev/null bs=64M iflag=direct status=none; done
  t1=$(date +%s.%N)
  disk=$(awk -v b="$bytes" -v a="$t0" -v c="$t1" 'BEGIN{printf "%.2f", b/1e9/(c-a)}')
  # The conversion writes as many bytes as it reads: the disk's write bandwidth bounds it too.
  t0=$(date +%s.%N)
  dd if=/dev/zero of="$work/ddtest" bs=64M count=$(( (bytes + 67108863) / 67108864 )) conv=fsync \
    status=none
  t1=$(date +%s.%N)
  rm -f "$work/ddtest"
  wdisk=$(awk -v b="$bytes" -v a="$t0" -v c="$t1" 'BEGIN{printf "%.2f", b/1e9/(c-a)}')
  evict "$ck"
  t0=$(date +%s.%N)
  for f in "$ck"/*.distcp; do dd if="$f" of=/dev/null bs=64M iflag=direct status=none; done &
  dd if=/dev/zero of="$work/ddtest" bs=64M count=$(( (bytes + 67108863) / 67108864 )) conv=fsync \
    status=none
  wait
  t1=$(date +%s.%N)
  rm -f "$work/ddtest"
  both=$(awk -v a="$t0" -v c="$t1" 'BEGIN{printf "%.2f", c-a}')
  rm -rf "$work/out-$gb"
  evict "$ck"
  /usr/bin/time -v "$bin" convert --src "$ck" --dst "$work/out-$gb" --model "$model" \
    --hf-config-dir "$ck-hf-config" --threads "$threads" --mem-budget "$budget" \
    >/dev/null 2>"$work/time-$gb.txt"
  el=$(secs "$(field 'Elapsed (wall clock)' "$work/time-$gb.txt")")
  rss=$(field 'Maximum resident set size' "$work/time-$gb.txt")
  tput=$(awk -v b="$bytes" -v e="$el" 'BEGIN{printf "%.2f", b/1e9/e}')
  pct=$(awk -v t="$tput" -v d="$disk" 'BEGIN{printf "%.0f", 100*t/d}')
  wpct=$(awk -v t="$tput" -v d="$wdisk" 'BEGIN{printf "%.0f", 100*t/d}')
  bpct=$(awk -v b="$both" -v e="$el" 'BEGIN{printf "%.0f", 100*b/e}')
  rm -rf "$work/out-$gb"
  ref="skipped"; refrss="-"; speed="-"
  if [ "${SKIP_REFERENCE:-0}" != 1 ]; then
    evict "$ck"
    /usr/bin/time -v $py "$here/reference_convert.py" "$ck" "$ck-hf-config" "$work/ref-$gb.pt" \
      "$model" >/dev/null 2>"$work/reftime-$gb.txt"
    rel=$(secs "$(field 'Elapsed (wall clock)' "$work/reftime-$gb.txt")")
    refrss=$(awk -v k="$(field 'Maximum resident set size' "$work/reftime-$gb.txt")" 'BEGIN{printf "%.0f MiB", k/1024}')
    ref=$(printf "%.1f s" "$rel")
    speed=$(awk -v r="$rel" -v e="$el" 'BEGIN{printf "%.1fx", r/e}')
    rm -f "$work/ref-$gb.pt"
  fi
  printf "| %.2f GB | %d | %s GB/s | %s GB/s | %s s | %.2f s | %s GB/s | %s%% | %s%% | %s%% | %.0f MiB | %s | %s | %s |\n" \
    "$(awk -v b="$bytes" 'BEGIN{print b/1e9}')" "$(ls "$ck"/*.distcp | wc -l)" "$disk" "$wdisk" \
    "$both" "$el" "$tput" "$pct" "$wpct" "$bpct" "$(awk -v k="$rss" 'BEGIN{print k/1024}')" \
    "$ref" "$refrss" "$speed"
done
