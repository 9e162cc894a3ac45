#!/usr/bin/env bash
# Interleaved timing of bragg-reshard copy variants (and optionally the torch reference) on one
# checkpoint: wall time, user + sys CPU seconds and peak RSS from /usr/bin/time, medians over
# ROUNDS rounds; every round runs each variant once, in the order given, with the checkpoint's
# page cache dropped (posix_fadvise DONTNEED; a no-op for a checkpoint on tmpfs) before each.
# Usage: bench/reshard/copy_ab.sh CKPT_DIR OUT_DIR ROUNDS VARIANT...
#   VARIANT: NAME=BIN (BIN's default copy), NAME=BIN:METHOD (--copy-method METHOD), or ref (the
#   torch reference converter, reference_convert.py, writing its .pt to OUT_DIR).
# CKPT_DIR comes from make_ckpt.py (with CKPT_DIR-hf-config beside it); OUT_DIR's file system is
# where the output goes (/dev/shm: tmpfs). THREADS, MEM_BUDGET, MODEL as in run.sh.
set -euo pipefail
ck=${1:?checkpoint dir}
out=${2:?output dir}
rounds=${3:?rounds}
shift 3
here=$(cd "$(dirname "$0")" && pwd)
py=/usr/bin/python3
threads=${THREADS:-2}
budget=${MEM_BUDGET:-1GiB}
model=${MODEL:-llama}

. "$here/common.sh"

mkdir -p "$out"
for v in "$@"; do :>"$out/t-${v%%=*}.txt"; done
for i in $(seq "$rounds"); do
  line="round $i:"
  for v in "$@"; do
    name=${v%%=*}
    rm -rf "$out/conv" "$out/ref.pt"
    evict "$ck"
    if [ "$v" = ref ]; then
      /usr/bin/time -f "%e %U %S %M" -o "$out/time.txt" $py "$here/reference_convert.py" "$ck" \
        "$ck-hf-config" "$out/ref.pt" "$model" >/dev/null 2>"$out/conv.log" ||
        { cat "$out/conv.log" >&2; exit 1; }
    else
      spec=${v#*=}
      bin=${spec%%:*}
      method=()
      [ "$spec" != "$bin" ] && method=(--copy-method "${spec#*:}")
      /usr/bin/time -f "%e %U %S %M" -o "$out/time.txt" "$bin" convert --src "$ck" \
        --dst "$out/conv" --model "$model" --hf-config-dir "$ck-hf-config" --threads "$threads" \
        --mem-budget "$budget" "${method[@]}" >/dev/null 2>"$out/conv.log" ||
        { cat "$out/conv.log" >&2; exit 1; }
    fi
    read -r el us sy rss <"$out/time.txt"
    echo "$el $us $sy $rss" >>"$out/t-$name.txt"
    line="$line $name ${el}s (cpu $(awk -v u="$us" -v s="$sy" 'BEGIN{printf "%.2f", u+s}')s) |"
  done
  rm -rf "$out/conv" "$out/ref.pt"
  echo "$line load $(cut -d' ' -f1 /proc/loadavg)"
done
for v in "$@"; do
  name=${v%%=*}
  f="$out/t-$name.txt"
  echo "median $name: wall $(cut -d' ' -f1 "$f" | median) s (min $(cut -d' ' -f1 "$f" | sort -n | head -1)," \
    "max $(cut -d' ' -f1 "$f" | sort -n | tail -1)), user $(cut -d' ' -f2 "$f" | median) s," \
    "sys $(cut -d' ' -f3 "$f" | median) s, user+sys $(awk '{print $2+$3}' "$f" | median) s," \
    "peak RSS $(cut -d' ' -f4 "$f" | median | awk '{printf "%.0f", $1/1024}') MiB"
done
