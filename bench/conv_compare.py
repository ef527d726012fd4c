#!/usr/bin/env python3
"""conv_compare.py: each convolution product of a workload in kiln beside cuDNN, from a kiln
timeline trace of the workload's step and conv_bench.py's JSON lines of the same shapes.

  build/profile_step --workload air --mode graph --trace DIR      # DIR/air_graph.json
  python3 bench/conv_bench.py --json > cudnn.jsonl
  python3 bench/conv_compare.py DIR/air_graph.json cudnn.jsonl [--prefix air.]

kiln's kernels are found by the trace nodes they cover (each kernel's "nodes" argument), for a
convolution of M = batch OH OW output pixels, K = kh kw Cin window values and Cout channels:
  fwd  the product's output [M,Cout] (an implicit GEMM's group, or cuBLAS's), and the im2col
       [N,OH,OW,K] that feeds it when it runs as a kernel of its own
  dx   the column gradient [M,K] and the col2im [N,H,W,Cin] that sums it (one implicit kernel, or
       two)
  dw   the weight gradient [Cout,K]
A kernel's time per step is the median over the trace's steps; two layers of one shape (air's
7x7 256->256 convolutions) share their kernels, whose time is split evenly between them. Prints
microseconds, TFLOP/s, the share of the H200's dense peak and the ratio to cuDNN's time. Only the
standard library.
"""
import argparse
import json
import re
import statistics
import sys

PEAK = {"bf16": 989.4, "tf32": 494.7}
SHAPE = re.compile(r"(\d+)x(\d+)x(\d+)->(\d+)x(\d+)x(\d+) (\d+)x(\d+) pad (\d+)")
NODE = re.compile(r"#\d+ (\w+) \[([\d,]*)\]")


def layers(cudnn_path, prefix):
    """conv_bench.py's rows by (conv, product), with the layer's dims."""
    rows = []
    with open(cudnn_path) as f:
        for line in f:
            line = line.strip()
            if not line.startswith("{"):
                continue
            r = json.loads(line)
            if not r["conv"].startswith(prefix):
                continue
            m = SHAPE.match(r["shape"])
            if not m:
                sys.exit(f"conv_compare: cannot read the shape '{r['shape']}' of {r['conv']}")
            h, w, cin, oh, ow, cout, kh, kw, _ = map(int, m.groups())
            n = r["batch"]
            r["dims"] = {"N": n, "H": h, "W": w, "Cin": cin, "OH": oh, "OW": ow, "Cout": cout,
                         "M": n * oh * ow, "K": kh * kw * cin}
            rows.append(r)
    return rows


def wanted(d, product):
    """The (op, shape) pairs whose kernels make up product of a layer of dims d."""
    M, K, N = d["M"], d["K"], d["N"]
    if product == "fwd":
        return {("matmul", (M, d["Cout"])), ("im2col", (N, d["OH"], d["OW"], K))}
    if product == "dx":
        return {("matmul", (M, K)), ("col2im", (N, d["H"], d["W"], d["Cin"]))}
    return {("matmul", (d["Cout"], K))}


def kernels(trace_path):
    """Each kernel of the trace: its name, step, duration (us) and (op, shape) nodes."""
    with open(trace_path) as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    out = []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") != "kernel":
            continue
        args = e.get("args", {})
        nodes = set()
        for s in args.get("nodes", []):
            m = NODE.match(s)
            if m:
                nodes.add((m.group(1), tuple(int(x) for x in m.group(2).split(",") if x)))
        out.append({"name": e["name"], "step": args.get("step", -1), "us": e["dur"],
                    "nodes": nodes})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", help="kiln's timeline trace of the workload's step (JSON)")
    ap.add_argument("cudnn", help="conv_bench.py --json's output")
    ap.add_argument("--prefix", default="air.", help="the workload's convolutions (air., cnn.)")
    args = ap.parse_args()
    rows = layers(args.cudnn, args.prefix)
    ks = kernels(args.trace)
    steps = sorted({k["step"] for k in ks if k["step"] >= 0}) or [-1]
    # the layers of each (product, node set): kernels shared by layers of one shape
    sharing = {}
    for r in rows:
        key = (r["product"], frozenset(wanted(r["dims"], r["product"])))
        sharing[key] = sharing.get(key, 0) + 1
    print(f"{args.trace}: {len(steps)} steps; cuDNN from {args.cudnn}\n")
    print("| conv | product | kiln us | kiln TFLOP/s | % of peak | kiln kernels | cuDNN us | "
          "kiln / cuDNN |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        want = wanted(r["dims"], r["product"])
        share = sharing[(r["product"], frozenset(want))]
        mine = [k for k in ks if k["nodes"] & want]
        per_step = [sum(k["us"] for k in mine if k["step"] == s) / share for s in steps]
        us = statistics.median(per_step) if mine else float("nan")
        d = r["dims"]
        flops = 2.0 * d["M"] * d["Cout"] * d["K"]
        tflops = flops / (us * 1e-6) / 1e12 if mine and us > 0 else float("nan")
        names = sorted({k["name"] for k in mine})
        shown = ", ".join(n if len(n) <= 40 else n[:37] + "..." for n in names) or "none found"
        print(f"| {r['conv']} | {r['product']} | {us:.1f} | {tflops:.1f} | "
              f"{100 * tflops / PEAK[r['dtype']]:.1f} | {shown} | {r['us']:.1f} | "
              f"{us / r['us']:.2f} |")


if __name__ == "__main__":
    main()
