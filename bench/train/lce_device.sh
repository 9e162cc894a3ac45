#!/bin/sh
# lce_device.sh [BUILD_DIR]: on a machine with an NVIDIA GPU, builds and runs the CUDA fused linear
# cross-entropy's test (against the CPU op) and its time/memory benchmark. Writes
# lce_cuda_test.txt, lce_cuda_bench.json and lce_cuda_bench.txt into $OUT (default: the build
# directory). Exit: the test's status (77: no GPU visible, reported as a skip), else the bench's.
set -eu
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build-lce-device}
out=${OUT:-$build}
mkdir -p "$out"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ ! -f "$build/build.ninja" ]; then
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS:-90}"
fi
ninja -C "$build" train_kernels_cuda_test train_lce_cuda_bench
status=0
"$build/src/train/kernels/train_kernels_cuda_test" >"$out/lce_cuda_test.txt" 2>&1 || status=$?
cat "$out/lce_cuda_test.txt"
if [ "$status" -eq 77 ]; then
  exit 77
fi
"$build/bench/train/train_lce_cuda_bench" ${LCE_BENCH_ARGS:-} \
  >"$out/lce_cuda_bench.json" 2>"$out/lce_cuda_bench.txt" || [ "$status" -ne 0 ] || status=1
cat "$out/lce_cuda_bench.txt"
exit "$status"
