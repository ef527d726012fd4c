#!/usr/bin/env bash
# bench/ab_steps.sh BUILD REPEATS WORKLOAD... -- SETTING...: the graph-mode step of each workload
# (profile_step --json: the median of its timed blocks) under each setting (environment
# assignments, space-separated in one argument; "" for the defaults), the settings interleaved
# REPEATS times so that a drift of the GPU's clocks falls on all of them alike; then a line a
# workload and setting: the median of the repeats' ms/step, their range, and the ratio to the
# first setting's median.
#   bench/ab_steps.sh build-gpu 3 air resnet18 -- '' KILN_CONV_HOIST=4 'KILN_CONV_HOIST=4 KILN_CONV_PREFETCH=1'
# A word @DIR in a setting runs DIR/profile_step instead of BUILD's: another revision built beside
# this one, for a change no switch turns off. Here: git archive REV > bench/.old.tar (carried);
# there: mkdir /tmp/old && tar -xf bench/.old.tar -C /tmp/old && cmake -S /tmp/old -B /tmp/old/b
# -G Ninja && cmake --build /tmp/old/b --target profile_step, then
#   bench/ab_steps.sh build-gpu 3 air resnet18 -- '' @/tmp/old/b
set -u
build=${1:?usage: bench/ab_steps.sh BUILD REPEATS WORKLOAD... -- SETTING...}
reps=${2:?repeats}
shift 2
workloads=()
while [ $# -gt 0 ] && [ "$1" != -- ]; do workloads+=("$1"); shift; done
[ $# -gt 0 ] || { echo "bench/ab_steps.sh: no -- before the settings" >&2; exit 2; }
shift
settings=("$@")
[ ${#settings[@]} -gt 0 ] || settings=("")
declare -A ms
for ((r = 0; r < reps; r++)); do
  for w in "${workloads[@]}"; do
    for s in "${!settings[@]}"; do
      bin=$build vars=()
      for word in ${settings[$s]}; do
        case $word in @*) bin=${word#@} ;; *) vars+=("$word") ;; esac
      done
      v=$(env "${vars[@]}" timeout 120 "$bin/profile_step" --workload "$w" --mode graph --json |
        grep -o '"ms_per_step": *[0-9.]*' | grep -o '[0-9.]*$')
      ms[$w,$s]="${ms[$w,$s]:-} ${v:-nan}"
    done
  done
done
for w in "${workloads[@]}"; do
  base=""
  for s in "${!settings[@]}"; do
    read -r med lo hi < <(tr ' ' '\n' <<< "${ms[$w,$s]}" | grep -v '^$' | sort -g |
      awk '{v[NR] = $1} END {m = NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2;
           print m, v[1], v[NR]}')
    [ -n "$base" ] || base=$med
    printf '%-9s %-55s %8.4f ms  [%s .. %s]  %.3fx\n' "$w" "${settings[$s]:-default}" "$med" "$lo" \
      "$hi" "$(awk -v a="$med" -v b="$base" 'BEGIN {print a / b}')"
  done
done
