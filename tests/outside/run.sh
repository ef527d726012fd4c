#!/usr/bin/env bash
# Builds and runs tests/outside against the kiln in build dir $1 four ways: installed into a fresh
# prefix, with CMake's find_package and, separately, with pkg-config; then against the build
# folder itself, uninstalled, both ways (its kilnConfig.cmake reads the targets exported there;
# its kiln.pc names the build's library and the source's include/).
set -euo pipefail
build="$(cd "$1" && pwd)"
src="$(cd "$(dirname "$0")" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cmake --install "$build" --prefix "$work/prefix" >/dev/null
cmake -S "$src" -B "$work/build" -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
cmake --build "$work/build" >/dev/null
"$work/build/outside"
# find_package against the build folder: kiln_DIR must be it (not the installed copy)
cmake -S "$src" -B "$work/build-tree" -DCMAKE_PREFIX_PATH="$build" >/dev/null
found="$(sed -n 's/^kiln_DIR:PATH=//p' "$work/build-tree/CMakeCache.txt")"
[ "$(cd "$found" && pwd)" = "$build" ] || { echo "find_package found $found, not $build"; exit 1; }
cmake --build "$work/build-tree" >/dev/null
"$work/build-tree/outside"
if command -v pkg-config >/dev/null; then
  # the installed prefix is a real path, not inside any sysroot pkg-config may be set up for
  flags="$(env -u PKG_CONFIG_SYSROOT_DIR \
    PKG_CONFIG_PATH="$work/prefix/lib/pkgconfig:$work/prefix/lib64/pkgconfig:${PKG_CONFIG_PATH:-}" \
    pkg-config --cflags --libs kiln)"
  cc -std=c11 -o "$work/outside-pc" "$src/main.c" $flags
  "$work/outside-pc"
  flags="$(env -u PKG_CONFIG_SYSROOT_DIR PKG_CONFIG_PATH="$build:${PKG_CONFIG_PATH:-}" \
    pkg-config --cflags --libs kiln)"
  case "$flags" in
  *"$work"*) echo "pkg-config on the build folder gave the installed copy: $flags"; exit 1 ;;
  esac
  cc -std=c11 -o "$work/outside-pc-tree" "$src/main.c" $flags
  "$work/outside-pc-tree"
fi
