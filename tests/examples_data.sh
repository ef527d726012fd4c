#!/usr/bin/env bash
# examples_data.sh BUILD: the examples find their data and say what stops them, on any machine.
# Run from a folder without data/mnist and with KILN_MNIST unset, mnist_mlp and mnist_cnn find
# the copy in the source tree: they get past the data (to "no usable GPU" without a GPU, to
# loading the missing weights file given to --eval-only with one). Given a folder without the
# files, they say so first, naming it. cifar10 says so without a folder or with an empty one and,
# where $KILN_CIFAR10_SAMPLE names the CIFAR-10 sample, gets past it, decoding it into its cache
# and then reading the cache, and decoding it again when the cache is corrupted; both recipes
# (muon, the default, and sgd) get as far with --save, --help names the default, and a recipe's
# unknown name is a usage error. Every message ends with its newline.
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
# Runs an example (its name, then its arguments) with KILN_MNIST and KILN_CIFAR10 unset; sets rc,
# err (stderr).
run() {
  rc=0
  env -u KILN_MNIST -u KILN_CIFAR10 "$build/$1" "${@:2}" >"$work/out" 2>"$work/err" || rc=$?
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

run cifar10 --eval-only "$work/none.safetensors"
[ "$rc" -eq 1 ] || fail "cifar10 exited with $rc, not 1"
case "$err" in
"cifar10: no data set: name the folder"*"or set KILN_CIFAR10") ;;
*) fail "cifar10: unexpected message without a data folder" ;;
esac
run cifar10 "$work/empty" --no-cache
[ "$rc" -eq 1 ] || fail "cifar10 exited with $rc, not 1"
case "$err" in
"cifar10: reading the data set: kiln_cifar10_read: $work/empty/data_batch_1.bin (or .bin.gz, .bin.xz): cannot open"*) ;;
*) fail "cifar10: the missing data set is not what it reports" ;;
esac
if [ -n "${KILN_CIFAR10_SAMPLE:-}" ]; then
  # past the data, to the GPU (or, with one, to the missing weights file)
  past_data() {
    [ "$rc" -eq 1 ] || fail "cifar10 exited with $rc, not 1"
    case "$err" in
    "cifar10: no usable GPU: "* | "cifar10: loading the weights: "*) ;;
    *) fail "cifar10: unexpected message with the sample" ;;
    esac
    grep -q "only 1 of the 5 training batches" "$work/out" || fail "cifar10 did not say the sample is partial"
  }
  run cifar10 "$KILN_CIFAR10_SAMPLE" --cache "$work/cache" --eval-only "$work/none.safetensors"
  past_data
  [ "$(grep -c "images decoded from" "$work/out")" = 2 ] || fail "cifar10 did not decode both splits"
  [ "$(grep -c "; cached in $work/cache/" "$work/out")" = 2 ] || fail "cifar10 did not cache both splits"
  run cifar10 "$KILN_CIFAR10_SAMPLE" --cache "$work/cache" --eval-only "$work/none.safetensors"
  past_data
  [ "$(grep -c "images from the cache $work/cache/" "$work/out")" = 2 ] || fail "cifar10 did not read its cache"
  # a flipped byte in the training images: the cache is not used, and is written anew
  cached="$(ls "$work"/cache/cifar10-train-*.cache)"
  printf '\377' | dd of="$cached" bs=1 seek=100000 conv=notrunc status=none
  run cifar10 "$KILN_CIFAR10_SAMPLE" --cache "$work/cache" --eval-only "$work/none.safetensors"
  past_data
  grep -q "not using the cache $cached: its checksum does not match" "$work/out" || fail "cifar10 used a corrupted cache"
  grep -q "1000 train images decoded from" "$work/out" || fail "cifar10 did not decode the training set again"
  grep -q "1000 test images from the cache" "$work/out" || fail "cifar10 did not keep the test cache"
  # a truncated one
  truncate -s 5000 "$cached"
  run cifar10 "$KILN_CIFAR10_SAMPLE" --cache "$work/cache" --eval-only "$work/none.safetensors"
  past_data
  grep -q "not using the cache $cached: 5000 bytes for 1000 images" "$work/out" || fail "cifar10 used a truncated cache"
  # both recipes (airbench94_muon's the default), their batch the sample's 1000 images at most;
  # with --save (muon's checkpoints hold three optimizers; without a GPU, the flags only)
  for recipe in muon sgd; do
    run cifar10 "$KILN_CIFAR10_SAMPLE" --cache "$work/cache" --recipe $recipe --batch 500 \
      --save "$work/ckpt.safetensors" --eval-only "$work/none.safetensors"
    past_data
  done
  "$build/cifar10" --help | grep -q "muon (airbench94_muon's, the default)" ||
    fail "cifar10 --help: not the default recipe"
  run cifar10 --recipe adam
  [ "$rc" -eq 2 ] || fail "cifar10 --recipe adam exited with $rc, not 2"
else
  echo "examples_data: KILN_CIFAR10_SAMPLE is not set: cifar10 on the sample not run"
fi
