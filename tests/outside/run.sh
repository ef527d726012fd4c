#!/usr/bin/env bash
# Installs the kiln in build dir $1 into a fresh prefix, then configures, builds and runs
# tests/outside against it with CMake's find_package and, separately, with pkg-config.
set -euo pipefail
build="$1"
src="$(cd "$(dirname "$0")" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" >/dev/null
cmake -S "$src" -B "$work/build" -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
cmake --build "$work/build" >/dev/null
"$work/build/outside"
if command -v pkg-config >/dev/null; then
  export PKG_CONFIG_PATH="$work/prefix/lib/pkgconfig:$work/prefix/lib64/pkgconfig:${PKG_CONFIG_PATH:-}"
  # the installed prefix is a real path, not inside any sysroot pkg-config may be set up for
  flags="$(env -u PKG_CONFIG_SYSROOT_DIR pkg-config --cflags --libs kiln)"
  cc -std=c11 -o "$work/outside-pc" "$src/main.c" $flags
  "$work/outside-pc"
fi
