#!/usr/bin/env bash
# readme_example.sh SRC BUILD CUDA_LIBDIR: keeps the README's example true. Takes the C program in
# the fenced block after the README's marker "<!-- readme_example: train.c -->" and the plain cc
# line after "<!-- readme_example: cc -->", and in a scratch folder laid out as the README
# assumes (kiln's include/, build/ and data/ beside train.c) runs that line unchanged but for the
# CUDA library folder, which is CMake's (CUDA_LIBDIR); then compiles the program once more with
# strict warnings. On a GPU it runs the program, which must reach 95% test accuracy; without one
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
line="$(block '<!-- readme_example: cc -->' | grep '^cc ' | head -n 1 || true)"
[ -s "$work/train.c" ] || { echo "readme_example: no C block after its marker in README.md"; exit 1; }
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
status=0
./train >out.txt 2>&1 || status=$?
cat out.txt
if [ "$status" -ne 0 ] && grep -q '^kiln_ctx_new: ' out.txt; then
  echo "readme_example: compiled and linked; not run: no usable GPU"
  exit 77
fi
[ "$status" -eq 0 ] || { echo "readme_example: ./train exited with $status"; exit 1; }
acc="$(sed -n 's/^test accuracy \([0-9.]*\)%$/\1/p' out.txt)"
[ -n "$acc" ] || { echo "readme_example: no test accuracy line"; exit 1; }
awk -v a="$acc" 'BEGIN { exit !(a >= 95) }' || { echo "readme_example: accuracy $acc% < 95%"; exit 1; }
echo "readme_example: test accuracy $acc%"
