#!/usr/bin/env bash
# bench/imagefolder.sh BUILD [CIFAR_DIR] [OUT]: the image loader and ResNet-18 on a folder of
# 10,000 JPEGs of 224x224 (tools/make_imagefolder from CIFAR-10, default the sample in
# $KILN_CIFAR10_SAMPLE, each image ten times: mirrored and shifted copies), one epoch of
# examples/imagefolder (batch 128, bf16), printing training's and loading's images per second
# apart, then loading alone with 1, 4 and all decoding threads (--no-gpu: no step runs, so the
# loader's own speed shows). Logs go to OUT (default $OUT or /tmp/imagefolder-bench).
set -euo pipefail
build=${1:?usage: bench/imagefolder.sh BUILD [CIFAR_DIR] [OUT]}
cifar=${2:-${KILN_CIFAR10_SAMPLE:?set KILN_CIFAR10_SAMPLE or give CIFAR_DIR}}
out=${3:-${OUT:-/tmp/imagefolder-bench}}
mkdir -p "$out"
data=/tmp/kiln-imagefolder-10k
if [ ! -d "$data/train" ]; then
  "$build/make_imagefolder" "$cifar" "$data" --repeat 10 --val 1000
fi
echo "== training (GPU): ResNet-18, batch 128, 224x224, bf16, one epoch"
"$build/imagefolder" "$data" --epochs 1 --batch 128 --log "$out/imagefolder.jsonl" | tee "$out/train.txt"
for t in 1 4 all; do
  echo "== loading alone, $t decoding threads"
  threads=()
  [ "$t" = all ] || threads=(--threads "$t")
  "$build/imagefolder" "$data" --no-gpu --epochs 1 --batch 128 --width 8 "${threads[@]}" |
    grep '^epoch' | tee -a "$out/load.txt"
done
