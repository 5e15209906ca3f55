#!/usr/bin/env bash
# Every public header (include/shmtensor/*.h; internal/ holds what they need but users do not
# include) is reachable from shmtensor.h, the header the README tells users to include, and
# compiles on its own. Usage: umbrella_check.sh SOURCE_DIR CXX
set -euo pipefail
src=$1
cxx=$2
inc="$src/include"
deps=$(echo '#include <shmtensor/shmtensor.h>' | "$cxx" -std=c++20 -I"$inc" -x c++ -M -)
fail=0
count=0
for h in "$inc"/shmtensor/*.h; do
  count=$((count + 1))
  [[ $(basename "$h") == shmtensor.h ]] && continue
  if ! grep -q "$h" <<<"$deps"; then
    echo "FAIL: $h is a public header but shmtensor.h does not include it"
    fail=1
  fi
done
# Self-contained: each header compiles as the first and only include.
if ! printf '%s\n' "$inc"/shmtensor/*.h | xargs -P2 -I{} sh -c \
    'echo "#include \"{}\"" | "$0" -std=c++20 -I"$1" -x c++ -fsyntax-only - || { echo "FAIL: {} does not compile on its own"; exit 1; }' \
    "$cxx" "$inc"; then
  fail=1
fi
[[ $fail == 0 ]] && echo "OK: $count public headers, every one reachable from shmtensor.h and self-contained"
exit $fail
