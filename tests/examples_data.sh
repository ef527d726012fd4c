#!/usr/bin/env bash
# examples_data.sh BUILD: the MNIST examples find their data and say what stops them, on any
# machine. Run from a folder without data/mnist and with KILN_MNIST unset, mnist_mlp and
# mnist_cnn find the copy in the source tree: they get past the data (to "no usable GPU" without
# a GPU, to loading the missing weights file given to --eval-only with one). Given a folder
# without the files, they say so first, naming it. Every message ends with its newline.
set -euo pipefail
build="$(cd "$1" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir "$work/empty"
cd "$work"
fail() {
  echo "examples_data: $1"
  exit 1
}
# Runs an example (its name, then its arguments) with KILN_MNIST unset; sets rc, err (stderr).
run() {
  rc=0
  env -u KILN_MNIST "$build/$1" "${@:2}" >"$work/out" 2>"$work/err" || rc=$?
  err="$(cat "$work/err")"
  echo "$1 ${*:2}: exit $rc: $err"
  [ -s "$work/err" ] || fail "$1 printed no error"
  [ "$(tail -c 1 "$work/err" | od -An -tx1 | tr -d ' ')" = 0a ] || fail "$1: no newline after its message"
}
for ex in mnist_mlp mnist_cnn; do
  run "$ex" --eval-only "$work/none.safetensors"
  [ "$rc" -eq 1 ] || fail "$ex exited with $rc, not 1"
  case "$err" in
  *"reading the data set"*) fail "$ex did not find the source tree's data/mnist" ;;
  "$ex: no usable GPU: "* | "$ex: loading the weights: "*) ;;
  *) fail "$ex: unexpected message" ;;
  esac
  run "$ex" "$work/empty"
  [ "$rc" -eq 1 ] || fail "$ex exited with $rc, not 1"
  case "$err" in
  "$ex: reading the data set: kiln_mnist_read: $work/empty/train-images-idx3-ubyte"*) ;;
  *) fail "$ex: the missing data set is not what it reports" ;;
  esac
done
