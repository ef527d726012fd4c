#!/usr/bin/env python3
"""compare.py: runs kiln's benchmark and the PyTorch reference on this GPU and prints one table.

    python3 bench/compare.py [--build build] [--steps N] [--blocks N] [--workloads mlp,cnn,air]
    python3 bench/compare.py --workloads resnet18

The kiln side is build/profile_step --json, its three modes (unfused, fused, fused + graph; build
it first); the PyTorch side is bench/torch_ref.py. Both time each workload of docs/design.md
("Workloads") named by --workloads (mlp, cnn, air, resnet18; mlp, cnn and air by default, as
profile_step's "all": resnet18 takes much longer, torch.compile's first step most of all), each side
with its own default steps per block (100; 20 for air, 10 for resnet18) unless --steps is given.
images/s is the batch over the median step time. "first step ms" is kiln's first step (recording,
planning, NVRTC compiles or cache loads, the run, the graph's capture), on the host clock; a warm
kernel cache (KILN_CACHE_DIR) makes it shorter. Ratios are kiln's ms/step over PyTorch's for the
same workload (below 1: kiln is faster). --variant LABEL:VAR=VALUE[,VAR=VALUE...] adds, for each
workload, a row of kiln's graph mode run with those environment variables set, labelled "graph
LABEL" (python3 bench/compare.py --variant cp.async:KILN_CONV_TMA=0), to compare a switch in one run.
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def run(cmd, env=None):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--build", default="build")
    ap.add_argument("--steps", type=int, default=None,
                    help="steps per block (default: each workload's, 100; 20 for air, 10 for "
                         "resnet18)")
    ap.add_argument("--blocks", type=int, default=21)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--workloads", default="mlp,cnn,air",
                    help="comma-separated: mlp, cnn, air, resnet18 (default mlp,cnn,air)")
    ap.add_argument("--variant", action="append", default=[],
                    help="LABEL:VAR=VALUE[,VAR=VALUE...]: also kiln's graph mode with these set")
    args = ap.parse_args()
    variants = []
    for v in args.variant:
        label, _, assigns = v.partition(":")
        pairs = [a.split("=", 1) for a in assigns.split(",") if a]
        if not label or not pairs or any(len(p) != 2 or not p[0] for p in pairs):
            ap.error(f"--variant {v!r}: expected LABEL:VAR=VALUE[,VAR=VALUE...]")
        variants.append((label, dict(pairs)))
    workloads = args.workloads.split(",")
    common = ["--blocks", str(args.blocks)]
    if args.steps is not None:
        common += ["--steps", str(args.steps)]
    rows = []
    for workload in workloads:
        for mode in ("unfused", "fused", "graph"):
            rows += run([os.path.join(args.build, "profile_step"), "--json", "--workload",
                         workload, "--mode", mode] + common)
        for label, env in variants:
            for r in run([os.path.join(args.build, "profile_step"), "--json", "--workload",
                          workload, "--mode", "graph"] + common, env={**os.environ, **env}):
                r["mode"] = f"graph {label}"
                rows.append(r)
    torch_rows = []
    if not args.no_torch:
        try:
            torch_rows = run([sys.executable, os.path.join(HERE, "torch_ref.py"), "--workloads",
                              args.workloads] + common)
        except (subprocess.CalledProcessError, FileNotFoundError) as e:
            print(f"PyTorch reference failed: {e}", file=sys.stderr)
    ref = {(r["workload"], r["mode"]): r["ms_per_step"] for r in torch_rows}
    counts = {}  # the two sides must time the same model
    for r in rows + torch_rows:
        if "params" in r:
            counts.setdefault(r["workload"], set()).add(r["params"])
    for workload, n in counts.items():
        if len(n) > 1:
            print(f"warning: {workload}: kiln and PyTorch count {sorted(n)} parameters",
                  file=sys.stderr)
    print("| workload | framework | mode | ms/step (median) | images/s | kernels/step | peak MiB |"
          " first step ms | vs PyTorch eager | vs PyTorch best |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for workload in workloads:
        for r in [r for r in rows + torch_rows if r["workload"] == workload]:
            ratio = lambda m: (f"{r['ms_per_step'] / ref[workload, m]:.2f}x"
                               if (workload, m) in ref else "-")
            kern = f"{r['kernels_per_step']:.0f}" if "kernels_per_step" in r else "-"
            ips = f"{r['batch'] * 1000 / r['ms_per_step']:.0f}" if "batch" in r else "-"
            first = f"{r['first_step_ms']:.0f}" if "first_step_ms" in r else "-"
            print(f"| {r['workload']} | {r['framework']} | {r['mode']} | {r['ms_per_step']:.3f} |"
                  f" {ips} | {kern} | {r['peak_mib']:.1f} | {first} | {ratio('eager')} |"
                  f" {ratio('best')} |")


if __name__ == "__main__":
    main()
