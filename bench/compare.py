#!/usr/bin/env python3
"""compare.py: runs kiln's benchmark and the PyTorch reference on this GPU and prints one table.

    python3 bench/compare.py [--build build] [--steps N] [--blocks N] [--workloads mlp,cnn,air]

The kiln side is build/profile_step --json, its three modes (unfused, fused, fused + graph; build
it first); the PyTorch side is bench/torch_ref.py. Both time each workload of docs/design.md
("Workloads") named by --workloads (mlp, cnn and air by default), each side with its own default
steps per block (100; 20 for air) unless --steps is given. Ratios are kiln's ms/step over
PyTorch's for the same workload (below 1: kiln is faster).
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
                    help="steps per block (default: each workload's, 100; 20 for air)")
    ap.add_argument("--blocks", type=int, default=21)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--workloads", default="mlp,cnn,air")
    args = ap.parse_args()
    workloads = args.workloads.split(",")
    common = ["--blocks", str(args.blocks)]
    if args.steps is not None:
        common += ["--steps", str(args.steps)]
    rows = []
    for workload in workloads:
        for mode in ("unfused", "fused", "graph"):
            rows += run([os.path.join(args.build, "profile_step"), "--json", "--workload",
                         workload, "--mode", mode] + common)
    torch_rows = []
    if not args.no_torch:
        try:
            torch_rows = run([sys.executable, os.path.join(HERE, "torch_ref.py"), "--workloads",
                              args.workloads] + common)
        except (subprocess.CalledProcessError, FileNotFoundError) as e:
            print(f"PyTorch reference failed: {e}", file=sys.stderr)
    ref = {(r["workload"], r["mode"]): r["ms_per_step"] for r in torch_rows}
    print("| workload | framework | mode | ms/step (median) | kernels/step | peak MiB |"
          " vs PyTorch eager | vs PyTorch best |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for workload in workloads:
        for r in [r for r in rows + torch_rows if r["workload"] == workload]:
            ratio = lambda m: (f"{r['ms_per_step'] / ref[workload, m]:.2f}x"
                               if (workload, m) in ref else "-")
            kern = f"{r['kernels_per_step']:.0f}" if "kernels_per_step" in r else "-"
            print(f"| {r['workload']} | {r['framework']} | {r['mode']} | {r['ms_per_step']:.3f} |"
                  f" {kern} | {r['peak_mib']:.1f} | {ratio('eager')} | {ratio('best')} |")


if __name__ == "__main__":
    main()
