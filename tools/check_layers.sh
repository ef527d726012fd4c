#!/bin/sh
# check_layers.sh SRC: the include rules between kiln's folders (docs/design.md, "Layers"). Every
# quoted #include of every library file is resolved to the file it names (beside the including
# file, else in include/ or core/, the library's include path) and must lie in a folder that the
# including folder may see:
#   core      core, include, and of fusion only fusion/engine.h (the engine's one header)
#   autograd  core, include
#   fusion    fusion, core, include
#   nn        nn, core, include
#   optim     optim, core, include
#   io        io, core, include, optim/optim.h
#   data      data, core, include
# fusion/engine.h includes nothing of kiln's but kiln.h; core/internal.h, core/util.h and the
# host-only files (errors, utilities, metadata, the MNIST and CIFAR-10 byte-level readers,
# safetensors) include no CUDA header and not core/cuda_check.h. Prints each breach and fails if
# there is one.
set -u
src=${1:-.}
cd "$src" || exit 2
fail=0
breach() {
  echo "layers: $1"
  fail=1
}
# The repository-relative path a quoted include of file f names, or "?" when none exists.
resolve() {
  f=$1 inc=$2
  for base in "$(dirname "$f")" include core; do
    p=$(realpath -m --relative-to=. "$base/$inc")
    [ -e "$p" ] && { echo "$p"; return; }
  done
  echo "?"
}
allowed() { # allowed FOLDER TARGET
  case "$1:$2" in
  *:include/*) return 0 ;;
  core:core/* | core:fusion/engine.h) return 0 ;;
  autograd:core/*) return 0 ;;
  fusion:fusion/* | fusion:core/*) return 0 ;;
  nn:nn/* | nn:core/*) return 0 ;;
  optim:optim/* | optim:core/*) return 0 ;;
  io:io/* | io:core/* | io:optim/optim.h) return 0 ;;
  data:data/* | data:core/*) return 0 ;;
  esac
  return 1
}
for d in core autograd fusion nn optim io data; do
  for f in $(find $d -name '*.c' -o -name '*.h' -o -name '*.def' -o -name '*.cuh'); do
    for inc in $(sed -n 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"\([^"]*\)".*/\1/p' "$f"); do
      t=$(resolve "$f" "$inc")
      if [ "$t" = "?" ]; then
        breach "$f includes \"$inc\", which is no file of the tree"
      elif ! allowed "$d" "$t"; then
        breach "$f includes $t ($d/ may not see it)"
      fi
    done
  done
done
for inc in $(sed -n 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"\([^"]*\)".*/\1/p' fusion/engine.h); do
  [ "$inc" = kiln.h ] || breach "fusion/engine.h includes $inc (it may include only kiln.h)"
done
for f in core/internal.h core/util.h core/error.c core/util.c core/meta.c data/mnist.c \
  data/cifar10_bytes.c data/readers.h io/safetensors.c io/safetensors.h; do
  if grep -nE '^[[:space:]]*#[[:space:]]*include[[:space:]]*[<"](cuda|cublas|nvrtc|nvtx)' "$f" >/dev/null ||
    grep -nE '^[[:space:]]*#[[:space:]]*include[[:space:]]*".*cuda_check.h"' "$f" >/dev/null; then
    breach "$f (host-only) includes a CUDA header"
  fi
done
[ $fail = 0 ] && echo "layers: ok"
exit $fail
