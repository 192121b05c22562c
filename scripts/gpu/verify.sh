#!/usr/bin/env bash
# Device-side check of everything staged by ../shared/gpu/stage: the GPU test suites, then
# compute-sanitizer memcheck + initcheck and racecheck + synccheck, split over GPUs 0 and 1
# (one GPU: both halves on it, one after the other). Copy it next to the staged binaries:
#   cp scripts/gpu/verify.sh .gpu/   then, with the device tool (nvidia-h200-x2 for the
#   two-GPU tests):   run(command="BUDGET=540 bash .gpu/verify.sh", carry=[".gpu"])
# A candle test binary built with `--features candle` may be staged as tests/candle.gz (it
# needs the CUDA 13 libraries of the device's toolkit). Every step stops at the deadline
# (BUDGET seconds from the start) and says so. Sanitizer runs skip the > 2³¹-element tests
# (8 GiB buffers) and the two-GPU test.
set -uo pipefail
cd "$(dirname "$0")"
out=${OUT:-/tmp/out}; mkdir -p "$out"
start=$(date +%s); deadline=$((start + ${BUDGET:-540}))
left() { echo $((deadline - $(date +%s))); }
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
if [ -f tests/candle.gz ]; then gunzip -f tests/candle.gz && chmod +x tests/candle; fi
for t in tests/*; do
  n=$(basename "$t"); s=$(date +%s)
  timeout "$(left)" "$t" > "$out/test-$n.log" 2>&1; rc=$?
  echo "== test $n rc=$rc $(( $(date +%s) - s ))s: $(grep -E '^test result' "$out/test-$n.log" | tr '\n' ' ')"
  grep -E "SKIP|FAILED|panicked" "$out/test-$n.log" | head -5
done
san() { # gpu tool...
  local gpu=$1; shift
  for tool in "$@"; do for t in tests/*; do
    n=$(basename "$t"); case $n in liger_rs*) continue;; esac
    s=$(date +%s); l=$(left); [ "$l" -lt 15 ] && { echo "== $tool $n: no time left"; continue; }
    CUDA_VISIBLE_DEVICES=$gpu timeout "$l" compute-sanitizer --tool "$tool" --error-exitcode 97 "$t" \
      --test-threads=1 --skip beyond_2_pow --skip two_devices > "$out/$tool-$n.log" 2>&1; rc=$?
    echo "== $tool $n rc=$rc $(( $(date +%s) - s ))s: $(grep -E '^test result|ERROR SUMMARY|RACECHECK SUMMARY' "$out/$tool-$n.log" | tr '\n' ' ')"
  done; done
}
if [ "$gpus" -ge 2 ]; then
  san 0 memcheck initcheck > "$out/san0.txt" 2>&1 &
  san 1 racecheck synccheck > "$out/san1.txt" 2>&1 &
  wait
else
  san 0 memcheck initcheck > "$out/san0.txt" 2>&1
  san 0 racecheck synccheck > "$out/san1.txt" 2>&1
fi
cat "$out/san0.txt" "$out/san1.txt"
echo "== total $(( $(date +%s) - start ))s"
