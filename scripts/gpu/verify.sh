#!/usr/bin/env bash
# Device-side check of the staged binaries in .gpu/: the release test binaries that
# `cargo test --release --no-run` builds (the library's unit tests, liger_rs-*, and one per
# tests/*.rs), copied into .gpu/tests/ under their target names, and the candle ones built the
# same way with `--features candle` (they need the CUDA 13 libraries of the device's toolkit).
# Any of them may be stripped and compressed (name.gz or name.xz: xz -6 keeps every suite,
# candle's included, under the device tool's 64 MiB carry). Copy this script and the cuBLAS
# probe next to them, then run it with the device tool:
#   cp scripts/gpu/verify.sh scripts/gpu/cublas_sanitizer_probe.cu .gpu/
#   run(command="BUDGET=560 bash .gpu/verify.sh", carry=[".gpu"])
# Two phases, PHASES="tests sanitizer" unless set (e.g. PHASES=sanitizer alone):
# - tests: every binary with the full shapes and LIGER_RS_REQUIRE_GPU set to the number of
#   GPUs, so a test that skips for want of a GPU it has fails (tests that need two GPUs still
#   skip on one);
# - sanitizer: compute-sanitizer's memcheck, racecheck, initcheck and synccheck (TOOLS) over
#   every binary with the sanitizer-sized shapes (LIGER_RS_TEST_SHAPES=small: the > 2³²
#   element tests skip) and LIGER_RS_REQUIRE_GPU=1 on one visible GPU each: every (tool,
#   binary) pair is its own job, JOBS of them at once (default 8; the sanitizers are bound by
#   the host's CPUs, which the device machine has 16 of), racecheck's first as the longest,
#   the i-th job on GPU i mod the GPU count. A binary named in SPLIT ("name:shards ...",
#   default "candle:8") runs as that many jobs per tool, shard i taking every shards-th of its
#   tests from the i-th (`--exact` names): the candle suite, one binary of 71 tests, took
#   ~430 s under racecheck and ~560 s under initcheck as its separate suites, more than one
#   call's deadline for one process. SANITIZER names the compute-sanitizer to run (default the
#   one on PATH): 2026.4, unpacked from the nvidia-cuda-sanitizer-api 13.5 wheel, runs on the
#   device's driver 580 and finds no hazard inside cuBLAS's kernels, where CUDA 13.0's 2025.3
#   does (BENCHMARKS.md, "compute-sanitizer 2026.4"); both miss the stores of cuBLAS's bf16
#   GEMMs under initcheck, 2026.4 with `--check-tensor-ops yes` too (the probe's 262144
#   findings either way). racecheck checks every kernel, NVIDIA's own GEMM
#   kernels (`nvjet*`, run by candle's and the fused linear cross-entropy's cuBLAS calls)
#   included, and reports their hazards, which are not this crate's: with those kernels left
#   out (--kernel-name-exclude kns=nvjet) the sanitizer hung (the candle tests of decoder
#   blocks, candle-nn layers and cross-entropy past 500 s against 22 s, 43 s and ~120 s without) or failed ("failed
#   to handle a hardware exception" in cross_entropy's fused linear tests, which pass under it
#   without the option; H100, CUDA 13). Under racecheck, hardening runs without
#   `gpu_release_scratch_from_another_thread_while_backwards_are_queued`: with it the process
#   deadlocks inside the sanitizer (every thread in a futex wait after 90 s, with the
#   stream-ordered pool and with synchronous frees alike; the test passes without racecheck and
#   under the other three tools; BENCHMARKS.md, the sanitizer table's footnote 4).
# Each run prints "== <test|tool> <binary> rc=<rc> <seconds>s: <libtest's result, the
# sanitizer's summary, the skip summary>", then a failed run's first failure lines (the
# sanitizer's runs in tool order once all have finished) and where its findings are; every
# log is in $OUT. Before the suites, the sanitizer phase runs cublas_sanitizer_probe.cu (copy
# it beside this script) under initcheck and racecheck: cuBLAS alone, no liger-rs code. Every run
# stops at the deadline (BUDGET seconds from the start, default 540) and says so.
set -uo pipefail
cd "$(dirname "$0")"
out=${OUT:-/tmp/out}; mkdir -p "$out"
start=$(date +%s); deadline=$((start + ${BUDGET:-540}))
left() { echo $((deadline - $(date +%s))); }
phases=" ${PHASES:-tests sanitizer} "
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
for z in tests/*.gz tests/*.xz; do
  [ -f "$z" ] || continue
  case $z in *.gz) gunzip -f "$z" ;; *) xz -d -f "$z" ;; esac && chmod +x "${z%.*}"
done
report() { # what binary rc seconds log
  echo "== $1 $2 rc=$3 $4s: $(grep -E '^test result|ERROR SUMMARY|RACECHECK SUMMARY|^liger-rs: ' "$5" | tr '\n' ' ')"
  [ "$3" -eq 0 ] && return
  grep -E '^========= [A-Z]' "$5" | grep -v -E 'COMPUTE-SANITIZER|SUMMARY' | head -3
  # The printed findings by place: the kernel a race or a read is in, or the copy reading.
  local where
  where=$(grep -oE '^=========     at [A-Za-z0-9_]+|(between|and) [A-Za-z]+ access at [A-Za-z0-9_]+|on access by [A-Za-z]+ source' "$5" |
    sed -E 's/^.* (at|by) //' | sort | uniq -c | sort -rn | head -6 | awk '{printf " %s (%s)", $2, $1}')
  [ -n "$where" ] && echo "   where:$where"
  grep -A1 'panicked at' "$5" | grep -v -x -- '--' | head -4
}
if [[ $phases == *" tests "* ]]; then
  for t in tests/*; do
    n=$(basename "$t"); s=$(date +%s); l=$(left)
    [ "$l" -lt 15 ] && { echo "== test $n: no time left"; continue; }
    LIGER_RS_REQUIRE_GPU=$gpus timeout "$l" "$t" > "$out/test-$n.log" 2>&1; rc=$?
    report test "$n" "$rc" $(( $(date +%s) - s )) "$out/test-$n.log"
    grep -E '^SKIP' "$out/test-$n.log" | head -5
  done
fi
# One (tool, binary, shard) run on one GPU; its report goes to $out/report-<tool>-<job>.txt,
# its seconds to $out/secs-<tool>-<job> (job: the binary's name, with ".<shard>" when split).
san_one() {
  local tool=$1 gpu=$2 t=$3 shard=$4 shards=$5 n job s l rc
  n=$(basename "$t"); s=$(date +%s); l=$(left)
  job=$n; [ "$shards" -gt 1 ] && job=$n.$shard
  if [ "$l" -lt 15 ]; then
    echo "== $tool $job: no time left" > "$out/report-$tool-$job.txt"
    return
  fi
  local skip=() only=()
  [ "$tool" = racecheck ] && [[ $n == hardening* ]] &&
    skip=(--skip gpu_release_scratch_from_another_thread_while_backwards_are_queued)
  if [ "$shards" -gt 1 ]; then
    mapfile -t only < <("$t" --list --format terse | sed -n 's/: test$//p' |
      awk -v k="$shards" -v i="$shard" '(NR - 1) % k == i')
    only=(--exact "${only[@]}")
  fi
  CUDA_VISIBLE_DEVICES=$gpu LIGER_RS_TEST_SHAPES=small LIGER_RS_REQUIRE_GPU=1 timeout "$l" \
    "${SANITIZER:-compute-sanitizer}" --tool "$tool" --error-exitcode 97 "$t" --test-threads=1 \
    "${skip[@]}" "${only[@]}" > "$out/$tool-$job.log" 2>&1; rc=$?
  echo $(( $(date +%s) - s )) > "$out/secs-$tool-$job"
  report "$tool" "$job" "$rc" "$(cat "$out/secs-$tool-$job")" "$out/$tool-$job.log" \
    > "$out/report-$tool-$job.txt"
}
# The shard count of binary $1 from SPLIT (1 when not named).
shards_of() {
  local s
  for s in ${SPLIT:-candle:8}; do
    [ "${s%%:*}" = "$1" ] && { echo "${s#*:}"; return; }
  done
  echo 1
}
# The sanitizers on cuBLAS alone (cublas_sanitizer_probe.cu beside this script): whether
# initcheck sees a bf16 GEMM's stores and whether racecheck finds hazards inside NVIDIA's
# kernels, the two kinds of finding the candle suites' cuBLAS calls bring.
probe() {
  local p=cublas_sanitizer_probe
  if [ ! -f $p.cu ] || ! nvcc -O2 -arch=sm_90 -o "$out/$p" $p.cu -lcublas > "$out/$p-build.log" 2>&1; then
    echo "== probe: not run ($p.cu missing beside verify.sh, or nvcc failed: $out/$p-build.log)"
    return
  fi
  local run tool rest
  for run in "initcheck none bf16" "initcheck kernel bf16" "initcheck gemm bf16" \
    "initcheck gemm f32" "initcheck gemm bf16 64 64 8192" "racecheck gemm bf16 64 64 8192"; do
    tool=${run%% *}; rest=${run#* }
    "${SANITIZER:-compute-sanitizer}" --tool "$tool" --error-exitcode 97 "$out/$p" $rest \
      > "$out/$p.log" 2>&1
    report "$tool" "probe $rest" $? 0 "$out/$p.log" | grep -v '^========= '
    grep -E '^C written' "$out/$p.log"
  done
}
if [[ $phases == *" sanitizer "* ]]; then
  probe
  tools=${TOOLS:-racecheck initcheck memcheck synccheck}
  export out deadline SANITIZER
  export -f san_one report left
  # Within each tool the split binaries' shards go first: the longest jobs start first.
  i=0
  for tool in $tools; do
    for pass in split whole; do
      for t in tests/*; do
        k=$(shards_of "$(basename "$t")")
        [ "$pass" = split ] && [ "$k" -eq 1 ] && continue
        [ "$pass" = whole ] && [ "$k" -gt 1 ] && continue
        for ((j = 0; j < k; j++)); do
          echo "$tool $((i % gpus)) $t $j $k"
          i=$((i + 1))
        done
      done
    done
  done | xargs -P "${JOBS:-8}" -L 1 bash -c 'san_one "$@"' _
  for tool in $tools; do
    for t in tests/*; do
      n=$(basename "$t"); k=$(shards_of "$n")
      if [ "$k" -eq 1 ]; then
        cat "$out/report-$tool-$n.txt"
        continue
      fi
      for ((j = 0; j < k; j++)); do cat "$out/report-$tool-$n.$j.txt"; done
      # The suite's line: its shards' seconds added (the time one process would take) and
      # the longest shard, its tests passed and failed added.
      echo "== $tool $n: $k shards, $(cat "$out"/secs-"$tool"-"$n".* 2>/dev/null |
        awk '{t += $1; if ($1 > m) m = $1} END {printf "%d s in all, longest %d s", t, m}'): $(
        cat "$out"/report-"$tool"-"$n".*.txt | grep -oE '[0-9]+ passed; [0-9]+ failed' |
        awk '{p += $1; f += $3} END {printf "%d passed; %d failed", p, f}')"
    done
  done
fi
echo "== total $(( $(date +%s) - start ))s"
