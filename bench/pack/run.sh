#!/usr/bin/env bash
# Runs the pack benchmark from an existing build and writes the "## pack" section of
# docs/benchmarks.md (other sections are kept), docs/data/pack.json (every run and the verdicts,
# bench/pack/report.py) and docs/img/pack_max_over_mean.png.
# Builds nothing.   usage: bench/pack/run.sh BUILD_DIR [--repeat N]
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: $0 BUILD_DIR [--repeat N]" >&2
  exit 2
fi
build=$1
shift
repeat=21
if [ "${1:-}" = "--repeat" ]; then
  repeat=$2
fi
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=$build/src/pack/pack_bench
if [ ! -x "$bin" ]; then
  echo "$bin not found: build the pack_bench target first" >&2
  exit 1
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# One core, as the target says: the planner is single-threaded anyway.
pin=()
if command -v taskset >/dev/null; then
  pin=(taskset -c 0)
fi
cmd=("${pin[@]}" "$bin" --repeat "$repeat" --csv "$tmp/pack.csv")
"${cmd[@]}" > "$tmp/table.md"
cat "$tmp/table.md"

tight_cmd=(env PYTHONPATH="$build/python" "${pin[@]}" /usr/bin/python3 bench/pack/tight.py --repeat "$repeat")
(cd "$root" && "${tight_cmd[@]}") > "$tmp/tight.md"
cat "$tmp/tight.md"

day=$(date -u +%Y-%m-%d)
/usr/bin/python3 "$root/bench/pack/report.py" "$tmp/pack.csv" --data "$root/docs/data/pack.json" \
  --date "$day" --command "bench/pack/run.sh $build --repeat $repeat" \
  --machine "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//' || true), $(nproc) cores" \
  > "$tmp/targets.md"
cat "$tmp/targets.md"

cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//' || true)
load=$(cut -d' ' -f1-3 /proc/loadavg)
plot_line=""
if /usr/bin/python3 -c 'import matplotlib' 2>/dev/null; then
  mkdir -p "$root/docs/img"
  /usr/bin/python3 "$root/bench/pack/plot.py" "$tmp/pack.csv" "$root/docs/img/pack_max_over_mean.png"
  plot_line='![max/mean rank cost and padding per method](img/pack_max_over_mean.png)'
fi

{
  echo "## pack"
  echo
  echo "Planning THD packing of synthetic RL trace lengths into DP ranks, every method side by"
  echo "side in one run. Lognormal: median 2048, sigma 1, clipped to 64..64K. Pareto: x_m 1024,"
  echo "alpha 1.5, clipped to 64..64K. Heavy-tail (the issue's mix): 98% lognormal (median 2048,"
  echo "sigma 1, clipped to 64..20K), 2% uniform in 20K..60K, shuffled. max/mean = costliest"
  echo "rank / mean rank cost under cost(s) = a*s + b*s^2 of a 4096-wide 32-layer model;"
  echo "LB = max(1, largest trace / mean)."
  echo "Padding counts every token added to align traces (FP8: 16) or rows (FP8 per row; BSHD)."
  echo
  echo "Command (from the repository root, after building the pack_bench target):"
  echo
  echo '```'
  echo "bench/pack/run.sh $build --repeat $repeat    # runs: ${cmd[*]/$tmp\/pack.csv/CSV}"
  echo '```'
  echo
  echo "Machine: ${cpu:-unknown CPU}, $(nproc) cores visible, load average $load at the time"
  echo "(shared machine: wall times include waiting for the CPU; the cpu column is this thread's"
  echo "CPU time). $repeat timed runs per row, the methods of a dataset taken in turn (a slow"
  echo "stretch of the machine falls on one run of several rows); median, p90 (nearest rank) and"
  echo "best. The 20 ms target is judged on every run by bench/verdict.py. Measured $day."
  echo
  cat "$tmp/table.md"
  echo
  echo "### pack targets (computed from this run)"
  echo
  cat "$tmp/targets.md"
  echo
  echo "Why the two alignments pad differently: with every trace padded to a multiple of 16 (the"
  echo "default, \`--fp8-align trace\`, as the issue's cu_seqlens_padded reads) it adds 7.5 tokens"
  echo "per trace on average, about 7.5 / mean length, and <= 0.2% needs a mean length >= 3.75k"
  echo "(these sets have means of about 3.4k, 2.8k and 4.0k). With FP8 aligned per packed row"
  echo "(\`--fp8-align row\`, the \"FP8 per row\" rows: traces padded to A = 1 here, each row to a"
  echo "multiple of 16, which is what FP8 GEMMs need; docs/pack.md) it is at most 15 tokens per"
  echo "row of up to 131,072. All methods pad alike at the same alignment, except BSHD."
  echo "Where the planning time goes (perf, heavy-tail 100k, 2026-12-02): LPT over ranks ~27% (its"
  echo "8-ary tree ~20%), building rows and cu_seqlens ~20%, the micro-batch split ~14%, checks,"
  echo "grouping and summary ~10%, radix sort ~5%, allocation and page faults the rest. Before"
  echo "2026-12-02 LPT's binary tree mispredicted a jump at most of its 9 levels, the per-rank split"
  echo "mispredicted its choice and gathered every rank's traces, refinement built its member lists"
  echo "before finding it had nothing to do, rows read three arrays per trace and divided by the"
  echo "alignment: CPU time per plan 12-14 ms, now 7-9 ms, same plans (interleaved runs of both"
  echo "builds at load 9-11 on 2 cores: heavy-tail medians 26-36 ms before, 18-22 ms after)."
  echo "Timings on this shared VM move by up to 2x from minute to minute with the other workers'"
  echo "load (the load average above): the median and p90 are of this run only."
  echo
  echo "A plan whose first micro-batch count fills the capacity to 99.95% (the same lognormal"
  echo "shape, 100,000 traces into 512 ranks, max_tokens chosen for it): the ranks balance at that"
  echo "count, then some rank's traces do not split into its micro-batches, and the planner"
  echo "balances the ranks again with one more micro-batch each, so such a plan takes a second pass."
  echo "Before 2026-12-01 it kept the first assignment (max/mean 1.033 at the row-aligned point) and"
  echo "its LPT skipped the same full ranks again for every trace (3.7 million skips, ~165 ms)."
  echo
  echo '```'
  echo "${tight_cmd[*]/$build\/python/$build/python}"
  echo '```'
  echo
  cat "$tmp/tight.md"
  echo
  if [ -n "$plot_line" ]; then
    echo "$plot_line"
    echo
  fi
} > "$tmp/section.md"

doc=$root/docs/benchmarks.md
if [ ! -f "$doc" ]; then
  printf '# Benchmarks\n\n' > "$doc"
fi
# Replace an existing "## pack" section (up to the next "## " heading) or append one.
/usr/bin/python3 - "$doc" "$tmp/section.md" <<'PY'
import re, sys
doc, sec = sys.argv[1], open(sys.argv[2]).read()
text = open(doc).read()
pat = re.compile(r"^## pack\n.*?(?=^## |\Z)", re.S | re.M)
if pat.search(text):
    text = pat.sub(lambda m: sec, text, count=1)
else:
    text = text.rstrip("\n") + "\n\n" + sec
open(doc, "w").write(text)
PY
echo "wrote the pack section of $doc" >&2
