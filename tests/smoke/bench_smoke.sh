#!/usr/bin/env bash
# Runs every `shmtensor bench` scenario with both strategies at a small size and checks the
# JSON lines: each scenario × strategy appears once, completed everything, and reports no
# error. Speed is not checked (benchmarks are never assertions). Usage: bench_smoke.sh TOOL
set -euo pipefail
tool=$1
count=2000
samples=500
out=$("$tool" bench queue_fresh queue_preshared pingpong retain dataloader \
        --count "$count" --samples "$samples" --json)
echo "$out"
fail=0
for strategy in file_descriptor file_system; do
  for scenario in queue_fresh queue_preshared pingpong retain dataloader; do
    want=$count
    [[ $scenario == dataloader ]] && want=$samples
    lines=$(grep -c "\"scenario\":\"$scenario\",\"strategy\":\"$strategy\"" <<<"$out" || true)
    line=$(grep "\"scenario\":\"$scenario\",\"strategy\":\"$strategy\"" <<<"$out" || true)
    if [[ $lines != 1 ]]; then
      echo "FAIL: $scenario/$strategy printed $lines lines, want 1"; fail=1; continue
    fi
    grep -q "\"completed\":$want," <<<"$line" ||
      { echo "FAIL: $scenario/$strategy did not complete $want"; fail=1; }
    grep -q '"error":""' <<<"$line" || { echo "FAIL: $scenario/$strategy reported an error"; fail=1; }
  done
done
[[ $fail == 0 ]] && echo "bench smoke: every scenario completed with both strategies"
exit $fail
