#!/usr/bin/env bash
# readme_example.sh SRC BUILD CUDA_LIBDIR: keeps the README's examples true. Takes the C programs in
# the fenced blocks after the README's markers "<!-- readme_example: train.c -->" and
# "<!-- readme_example: cnn.c -->" and the plain cc line after "<!-- readme_example: cc -->", and
# in a scratch folder laid out as the README assumes (kiln's include/, build/ and data/ beside
# train.c) runs that line unchanged but for the CUDA library folder, which is CMake's
# (CUDA_LIBDIR), and for cnn.c with its names; then compiles each program once more with strict
# warnings. On a GPU it runs them: train.c must reach 95% test accuracy, cnn.c 97%; without one
# (the program's first error is kiln_ctx_new's) the test is skipped (exit 77).
set -euo pipefail
src="$(cd "$1" && pwd)"
build="$(cd "$2" && pwd)"
cudalib="$3"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# The lines of the fenced block that follows the marker line $1 in the README.
block() {
  awk -v marker="$1" '
    index($0, marker) { found = 1; next }
    found && !inside && /^```/ { inside = 1; next }
    inside && /^```/ { exit }
    inside { print }' "$src/README.md"
}
block '<!-- readme_example: train.c -->' >"$work/train.c"
block '<!-- readme_example: cnn.c -->' >"$work/cnn.c"
line="$(block '<!-- readme_example: cc -->' | grep '^cc ' | head -n 1 || true)"
[ -s "$work/train.c" ] && [ -s "$work/cnn.c" ] ||
  { echo "readme_example: no C block after a marker in README.md"; exit 1; }
[ -n "$line" ] || { echo "readme_example: no cc line after its marker in README.md"; exit 1; }
ln -s "$src/include" "$work/include"
ln -s "$build" "$work/build"
ln -s "$src/data" "$work/data"
cd "$work"
line="${line//\/usr\/local\/cuda\/lib64/$cudalib}"
echo "$line"
bash -c "$line"
[ -x train ] || { echo "readme_example: the cc line made no ./train"; exit 1; }
cc -std=c11 -Wall -Wextra -Werror -fsyntax-only -Iinclude train.c
cnn_line="${line//train/cnn}"
echo "$cnn_line"
bash -c "$cnn_line"
[ -x cnn ] || { echo "readme_example: the cc line made no ./cnn"; exit 1; }
cc -std=c11 -Wall -Wextra -Werror -fsyntax-only -Iinclude cnn.c
# run PROGRAM MIN_ACCURACY
run() {
  local status=0
  "./$1" >"$1.txt" 2>&1 || status=$?
  cat "$1.txt"
  if [ "$status" -ne 0 ] && grep -q '^kiln_ctx_new: ' "$1.txt"; then
    echo "readme_example: compiled and linked; not run: no usable GPU"
    exit 77
  fi
  [ "$status" -eq 0 ] || { echo "readme_example: ./$1 exited with $status"; exit 1; }
  local acc
  acc="$(sed -n 's/^test accuracy \([0-9.]*\)%$/\1/p' "$1.txt")"
  [ -n "$acc" ] || { echo "readme_example: ./$1 printed no test accuracy line"; exit 1; }
  awk -v a="$acc" -v m="$2" 'BEGIN { exit !(a >= m) }' ||
    { echo "readme_example: ./$1: accuracy $acc% < $2%"; exit 1; }
  echo "readme_example: ./$1: test accuracy $acc%"
}
run train 95
run cnn 97
