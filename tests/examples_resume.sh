#!/usr/bin/env bash
# examples_resume.sh BUILD: examples/cifar10's checkpoints of the default recipe (airbench94_muon's:
# three optimizers in one file, kiln_checkpoint_save_optims) on the CIFAR-10 sample, on a GPU.
# Two epochs with --save; then --resume of that last checkpoint with the same flags: it loads
# (weights, batch norm's statistics, the three optimizers' state, RNG), trains no further epoch and
# evaluates the same weights: the same test accuracy, plain and with TTA, to the printed digit.
# Resuming it under --recipe sgd is refused, naming the recipe. Skipped (exit 77) without
# $KILN_CIFAR10_SAMPLE or without a GPU.
set -euo pipefail
build="$(cd "$1" && pwd)"
[ -n "${KILN_CIFAR10_SAMPLE:-}" ] || { echo "examples_resume: KILN_CIFAR10_SAMPLE is not set"; exit 77; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
fail() {
  echo "examples_resume: $1"
  exit 1
}
flags=(--batch 500 --epochs 2 --no-cache)
rc=0
"$build/cifar10" "$KILN_CIFAR10_SAMPLE" "${flags[@]}" --save "$work/c.safetensors" \
  >"$work/a" 2>&1 || rc=$?
if [ "$rc" -ne 0 ] && grep -q "no usable GPU" "$work/a"; then
  echo "examples_resume: no GPU: $(tail -n 1 "$work/a")"
  exit 77
fi
cat "$work/a"
[ "$rc" -eq 0 ] || fail "the training run exited with $rc"
grep -q "^saved $work/c.safetensors" "$work/a" || fail "no checkpoint saved"
"$build/cifar10" "$KILN_CIFAR10_SAMPLE" "${flags[@]}" --resume "$work/c.safetensors" >"$work/b" 2>&1 ||
  { cat "$work/b"; fail "the resumed run failed"; }
cat "$work/b"
grep -q "^resumed $work/c.safetensors: epoch 2 done" "$work/b" || fail "not resumed after epoch 2"
# "final: test accuracy X%, with TTA Y%; training ..."
acc() { grep '^final' "$1" | sed 's/;.*//'; }
[ -n "$(acc "$work/a")" ] || fail "no final accuracy printed"
[ "$(acc "$work/a")" = "$(acc "$work/b")" ] ||
  fail "resumed: '$(acc "$work/b")', trained: '$(acc "$work/a")'"
rc=0
"$build/cifar10" "$KILN_CIFAR10_SAMPLE" "${flags[@]}" --recipe sgd \
  --resume "$work/c.safetensors" >"$work/s" 2>&1 || rc=$?
[ "$rc" -eq 1 ] || fail "--recipe sgd resumed the muon recipe's checkpoint (exit $rc)"
grep -q "not written by this recipe (--recipe sgd)" "$work/s" || fail "$(cat "$work/s")"
echo "examples_resume: ok"
