#!/usr/bin/env bash
# bench/cifar10_tta.sh BUILD [SEEDS] [DATA_DIR]: time to accuracy on CIFAR-10, as airbench
# reports it: examples/cifar10 trained SEEDS times (default 10) with each recipe (sgd: airbench94's,
# muon: airbench94_muon's), printing every seed's test accuracy with TTA and training time, and per
# recipe the median accuracy, how many seeds reached 92.3% (airbench's bar on this project's
# JPEG-decoded data; 94.0% on the original files) and the median warm time. DATA_DIR defaults to
# $KILN_CIFAR10 (the full data set: ../shared/gpu/cifar-chunks brings it to the GPU machine).
# JSON lines go to $OUT (or /tmp)/cifar10_<recipe>.jsonl.
set -euo pipefail
build=${1:?usage: bench/cifar10_tta.sh BUILD [SEEDS] [DATA_DIR]}
seeds=${2:-10}
data=${3:-${KILN_CIFAR10:?set KILN_CIFAR10 or give DATA_DIR}}
out=${OUT:-/tmp}
for recipe in sgd muon; do
  log="$out/cifar10_$recipe.jsonl"
  rm -f "$log"
  echo "== --recipe $recipe, $seeds seeds"
  "$build/cifar10" "$data" --recipe "$recipe" --seeds "$seeds" --log "$log" | grep -E '^(seed|final|peak)'
done
