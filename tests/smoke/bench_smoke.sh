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
# The bare baselines, once each, before the scenarios; every queue scenario and pingpong
# has its ratio to them (x_bare > 0).
for baseline in bare_futex bare_seqpacket bare_stream; do
  line=$(grep "\"scenario\":\"$baseline\",\"strategy\":\"-\"" <<<"$out" || true)
  [[ $(grep -c . <<<"$line") == 1 && -n $line ]] || { echo "FAIL: $baseline printed no line or several"; fail=1; continue; }
  grep -q "\"completed\":$count," <<<"$line" || { echo "FAIL: $baseline did not complete $count"; fail=1; }
done
if grep '"scenario":"\(queue_fresh\|queue_preshared\|pingpong\|retain\)"' <<<"$out" | grep -q '"x_bare":0.00,'; then
  echo "FAIL: a scenario has no x_bare ratio"; fail=1
fi
[[ $fail == 0 ]] && echo "bench smoke: every scenario completed with both strategies"
exit $fail
