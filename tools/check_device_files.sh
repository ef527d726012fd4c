#!/bin/sh
# check_device_files.sh SRC NVCC CC ARCH: every device file (fusion/device/*.cuh) compiles on its
# own with nvcc, and the ones the host includes (defs, kargs, philox) compile as C.
set -u
src=$1 nvcc=$2 cc=$3 arch=$4
tmp=$(mktemp -d) || exit 2
trap 'rm -rf "$tmp"' EXIT
fail=0
for f in "$src"/fusion/device/*.cuh; do
  if ! "$nvcc" -std=c++17 -arch=sm_"$arch" -diag-suppress 177 -x cu -c "$f" -o "$tmp/out.o"; then
    echo "device_files: nvcc could not compile $f"
    fail=1
  fi
done
for f in defs kargs philox; do
  printf '#include "%s/fusion/device/%s.cuh"\n' "$src" "$f" >"$tmp/$f.c"
  if ! "$cc" -std=c11 -Wall -Wextra -Werror -c "$tmp/$f.c" -o "$tmp/$f.o"; then
    echo "device_files: $f.cuh does not compile as C"
    fail=1
  fi
done
[ $fail = 0 ] && echo "device_files: ok"
exit $fail
