#!/bin/sh
# check_layers.sh SRC [BUILD]: the rules between kiln's folders (docs/design.md, "Layers").
#
# Includes. Every quoted #include of every library file is resolved to the file it names (beside
# the including file, else in include/ or core/, the library's include path) and must lie in a
# folder that the including folder may see (every folder sees include/):
#   core      core
#   prof      prof, core
#   dist      dist, core
#   runtime   runtime, core, of fusion only fusion/engine.h (the engine's one header), of prof
#             only prof/prof.h (the timeline recorder's one header), and of dist only dist/dist.h
#   autograd  autograd, core
#   fusion    fusion, core, of prof only prof/prof.h, and of dist only dist/dist.h
#   nn        nn, core
#   optim     optim, core
#   io        io, core, optim/optim.h
#   data      data, core
# fusion/engine.h includes nothing of kiln's but kiln.h; core/internal.h, core/util.h and the
# host-only files (errors, utilities, metadata, the MNIST and CIFAR-10 byte-level readers,
# safetensors, the timeline's JSON and report, and all of dist/) include no CUDA header and not
# core/cuda_check.h.
#
# prof/ (timeline traces) sits beside core/, under both fusion/ and runtime/: it hears of
# launches from the executor and of steps from the runtime, so neither of them can be its home,
# and it needs nothing of either (they describe their launches to it in plain C). dist/ (several
# GPUs: NCCL loaded at run time, the launchers' environment, the rendezvous, the gradient
# buckets' plan) sits there too: runtime/ will make the communicator on a context's device and
# fusion/ launch the all-reduces inside the step graphs, and dist/ needs neither.
#
# Calls (given BUILD, a build folder where the library is built). nm reads the library's objects
# (BUILD/CMakeFiles/kiln.dir and kiln_host.dir); every undefined symbol of an object that another
# object of the library defines is a call (or a use) from the first one's folder to the second
# one's, and must be to the folder itself or to one it may call:
#   core      -
#   prof      core
#   dist      core
#   fusion    core, prof, dist
#   runtime   core, fusion, prof, dist
#   autograd  core, runtime
#   nn        core, autograd, runtime
#   optim     core, nn, autograd, runtime
#   io        core, nn, optim, runtime
#   data      core, runtime
# The embedded device files (the generated kiln_device_files.c) are fusion's alone. Objects whose
# source is no longer in SRC (left in the build folder) are skipped. NM names another nm.
#
# Prints each breach and fails if there is one; prints "layers: ok" otherwise.
set -u
src=${1:-.}
build=${2:-}
case $build in
'' | /*) ;;
*) build=$(pwd)/$build ;;
esac
cd "$src" || exit 2
fail=0
breach() {
  echo "layers: $1"
  fail=1
}

# ---------------------------------------------------------------- includes

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
  core:core/*) return 0 ;;
  prof:prof/* | prof:core/*) return 0 ;;
  dist:dist/* | dist:core/*) return 0 ;;
  runtime:runtime/* | runtime:core/* | runtime:fusion/engine.h | runtime:prof/prof.h) return 0 ;;
  runtime:dist/dist.h) return 0 ;;
  autograd:autograd/* | autograd:core/*) return 0 ;;
  fusion:fusion/* | fusion:core/* | fusion:prof/prof.h | fusion:dist/dist.h) return 0 ;;
  nn:nn/* | nn:core/*) return 0 ;;
  optim:optim/* | optim:core/*) return 0 ;;
  io:io/* | io:core/* | io:optim/optim.h) return 0 ;;
  data:data/* | data:core/*) return 0 ;;
  esac
  return 1
}
for d in core prof dist runtime autograd fusion nn optim io data; do
  [ -d "$d" ] || continue
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
  data/cifar10_bytes.c data/readers.h io/safetensors.c io/safetensors.h prof/timeline.h \
  prof/timeline.c prof/report.c $(find dist -name '*.c' -o -name '*.h' 2>/dev/null); do
  if grep -nE '^[[:space:]]*#[[:space:]]*include[[:space:]]*[<"](cuda|cublas|nvrtc|nvtx)' "$f" >/dev/null ||
    grep -nE '^[[:space:]]*#[[:space:]]*include[[:space:]]*".*cuda_check.h"' "$f" >/dev/null; then
    breach "$f (host-only) includes a CUDA header"
  fi
done

# ---------------------------------------------------------------- calls

# "OBJECT NAME" per object of the library, OBJECT relative to BUILD/CMakeFiles and NAME the
# object as the breaches name it: its source's path with .o (core/ctx.c.o; any folder a generator
# puts before the source's path, such as a configuration's, left out), or kiln_device_files.c.o.
objects() {
  (cd "$build/CMakeFiles" 2>/dev/null && find kiln.dir kiln_host.dir -type f -name '*.o' 2>/dev/null) |
    sort | while read -r o; do
      r=${o#*.dir/}
      while [ ! -f "${r%.o}" ] && [ "${r#*/}" != "$r" ]; do r=${r#*/}; done
      if [ -f "${r%.o}" ]; then
        echo "$o $r"
      elif [ "${o##*/}" = kiln_device_files.c.o ]; then
        echo "$o kiln_device_files.c.o"
      fi
    done
}

# Reads `nm -P -A -g` lines of the objects named in $LAYERS_OBJECTS and prints one line per call
# that breaks the table above.
calls_awk='
function folder(name, k) {
  k = index(name, "/")
  return k ? substr(name, 1, k - 1) : name
}
function may_call(a, b, list, n, j) {
  if (!(a in may)) return 0
  n = split(may[a], list, " ")
  for (j = 1; j <= n; j++)
    if (list[j] == b) return 1
  return 0
}
BEGIN {
  n = split(ENVIRON["LAYERS_OBJECTS"], lines, "\n")
  for (j = 1; j <= n; j++)
    if (split(lines[j], w, " ") == 2) name[w[1]] = w[2]
  may["core"] = ""
  may["prof"] = "core"
  may["dist"] = "core"
  may["fusion"] = "core prof dist"
  may["runtime"] = "core fusion prof dist"
  may["autograd"] = "core runtime"
  may["nn"] = "core autograd runtime"
  may["optim"] = "core nn autograd runtime"
  may["io"] = "core nn optim runtime"
  may["data"] = "core runtime"
}
{
  o = $1
  sub(/:$/, "", o)
  if (!(o in name)) next
  if ($3 == "U" || $3 == "w" || $3 == "v") {
    nu++
    user[nu] = name[o]
    sym[nu] = $2
  } else if (!($2 in def)) {
    def[$2] = name[o]
    code[$2] = $3 ~ /^[TtWi]$/
  }
}
END {
  for (j = 1; j <= nu; j++) {
    s = sym[j]
    if (!(s in def)) continue # CUDA, the C library, ...
    a = folder(user[j])
    b = folder(def[s])
    if (a == b) continue
    what = user[j] (code[s] ? " calls " : " uses ") s ", defined in " def[s]
    if (b == "kiln_device_files.c.o") {
      if (a != "fusion") print "layers: " what " (only fusion/ may use the embedded device files)"
    } else if (!(a in may)) {
      print "layers: " what " (" a "/ is in no row of the layer table)"
    } else if (!may_call(a, b)) {
      print "layers: " what " (" a "/ may not call " b "/)"
    }
  }
}'

if [ -n "$build" ]; then
  list=$(objects)
  objs=$(printf '%s\n' "$list" | cut -d' ' -f1) # split below: their paths hold no blanks
  # shellcheck disable=SC2086
  if [ -z "$list" ]; then
    breach "no object files of the library under $build/CMakeFiles (kiln.dir, kiln_host.dir): build it first"
  elif ! syms=$(cd "$build/CMakeFiles" && ${NM:-nm} -P -A -g $objs); then
    breach "${NM:-nm} could not read the objects under $build/CMakeFiles"
  else
    out=$(printf '%s\n' "$syms" | LAYERS_OBJECTS=$list awk "$calls_awk" | sort -u)
    if [ -n "$out" ]; then
      printf '%s\n' "$out"
      fail=1
    fi
  fi
fi

[ $fail = 0 ] && echo "layers: ok"
exit $fail
