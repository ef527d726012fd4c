#!/bin/sh
# check_layers.sh SRC: the include rules between kiln's folders (docs/design.md, "Layers").
#   core/ includes nothing of the other folders but fusion/engine.h, the engine's one header;
#   fusion/engine.h includes nothing of kiln's but kiln.h;
#   core/internal.h and core/util.h include no CUDA header (CUDA checks: core/cuda_check.h);
#   the host-only files (errors, utilities, metadata, readers, safetensors) include no CUDA;
#   nn/, optim/ and autograd/ do not include each other's internals, io/ or fusion/;
#   data/ does not include fusion/.
# Prints each breach and fails if there is one.
set -u
src=${1:-.}
cd "$src" || exit 2
fail=0
breach() {
  echo "layers: $1"
  fail=1
}
incl() { # the quoted includes of a file
  sed -n 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"\([^"]*\)".*/\1/p' "$1"
}
cuda_incl() { # its CUDA includes
  grep -nE '^[[:space:]]*#[[:space:]]*include[[:space:]]*[<"](cuda|cublas|nvrtc|nvtx)' "$1"
}

for f in core/*.c core/*.h; do
  for i in $(incl "$f"); do
    case "$i" in
    ../fusion/engine.h) ;;
    ../*) breach "$f includes $i (core/ sees only fusion/engine.h)" ;;
    esac
  done
done
for i in $(incl fusion/engine.h); do
  [ "$i" = kiln.h ] || breach "fusion/engine.h includes $i"
done
for f in core/internal.h core/util.h core/error.c core/util.c core/meta.c data/mnist.c \
  data/readers.h io/safetensors.c io/safetensors.h; do
  cuda_incl "$f" >/dev/null && breach "$f includes a CUDA header: $(cuda_incl "$f")"
  for i in $(incl "$f"); do
    case "$i" in
    *cuda_check.h) breach "$f (host-only) includes $i" ;;
    esac
  done
done
for d in nn optim autograd; do
  for f in $d/*.c $d/*.h; do
    [ -e "$f" ] || continue
    for i in $(incl "$f"); do
      case "$i" in
      ../core/*) ;;
      ../*) breach "$f includes $i ($d/ sees core/ only)" ;;
      esac
    done
  done
done
for f in data/*.c data/*.h; do
  for i in $(incl "$f"); do
    case "$i" in
    ../fusion/*) breach "$f includes $i" ;;
    esac
  done
done
[ $fail = 0 ] && echo "layers: ok"
exit $fail
