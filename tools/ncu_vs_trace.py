#!/usr/bin/env python3
"""ncu_vs_trace.py TRACE.json NCU.csv STEPS : a kiln timeline trace's per-kernel times beside
Nsight Compute's gpu__time_duration for the same kernels (ncu --csv --metrics
gpu__time_duration.sum, over a window of exactly STEPS whole steps' kernels: any STEPS*K
consecutive launches of a K-kernel periodic step hold each kernel STEPS times). Generated
kernels (k_*) are matched by name; library kernels (cuBLAS) are compared as one total.
Standard library only."""
import csv, statistics, sys
from collections import defaultdict

from trace_summary import device_steps

UNIT = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3,
        "second": 1e6, "s": 1e6}

def trace_rows(path):
    _, records = device_steps(path)
    steps = {s: [e for e in v if e["cat"] == "kernel"] for s, v in records.items() if s >= 0}
    steps = {s: v for s, v in steps.items() if v}
    per = defaultdict(list)
    for s, evs in steps.items():
        for e in evs:
            per[e["name"] if e["name"].startswith("k_") else "(library kernels)"].append(e["dur"])
    n = len(steps)
    k = statistics.median(len(v) for v in steps.values())
    spans = [max(e["ts"] + e["dur"] for e in v) - min(e["ts"] for e in v) for v in steps.values()]
    return per, n, k, statistics.median(spans)

def ncu_rows(path):
    lines = [l for l in open(path) if l.startswith('"')]
    per = defaultdict(list)
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        v = float(r["Metric Value"].replace(",", "")) * UNIT.get(r.get("Metric Unit", "ns"), 1e-3)
        name = r["Kernel Name"].split("(")[0].strip()
        per[name if name.startswith("k_") else "(library kernels)"].append(v)
    return per

def main():
    tpath, npath, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    tr, n, k, span = trace_rows(tpath)
    nc = ncu_rows(npath)
    print(f"{tpath}: {n} steps, {k:.0f} kernels/step, median span {span:.1f} us")
    print(f"{'kernel':52s} {'n/step':>6s} {'trace us':>9s} {'ncu us':>9s} {'ratio':>6s}")
    tt = tn = 0.0
    bad = []
    for name in sorted(tr, key=lambda x: -sum(tr[x])):
        a = sum(tr[name]) / n
        b = sum(nc.get(name, [])) / steps if name in nc else float("nan")
        tt += a
        tn += 0 if b != b else b
        ratio = a / b if b == b and b > 0 else float("nan")
        if not (0.9 <= ratio <= 1.1):
            bad.append(name)
        print(f"{name[:52]:52s} {len(tr[name]) / n:6.1f} {a:9.2f} {b:9.2f} {ratio:6.3f}")
    for name in nc:
        if name not in tr:
            print(f"only in ncu: {name} ({len(nc[name])} launches)")
    print(f"sum per step: trace {tt:.1f} us, ncu {tn:.1f} us, ratio {tt / tn if tn else float('nan'):.3f}; "
          f"{len(bad)} kernels outside 10%")

if __name__ == "__main__":
    main()
