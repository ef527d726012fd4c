#!/usr/bin/env python3
"""conv_compare.py: each convolution product of a workload in kiln beside cuDNN, from a kiln
timeline trace of the workload's step and conv_bench.py's JSON lines of the same shapes.

  build/profile_step --workload air --mode graph --trace DIR      # DIR/air_graph.json
  python3 bench/conv_bench.py --json > cudnn.jsonl
  python3 bench/conv_compare.py DIR/air_graph.json cudnn.jsonl [--prefix air.]

kiln's kernels are found by the trace nodes they cover (each kernel's "nodes" argument: a
product lists its operands' shapes), for a convolution of M = batch OH OW output pixels, K = kh kw
Cin window values and Cout channels:
  fwd  the product [M,K] x [K,Cout] (an implicit GEMM's group, or cuBLAS's), and an im2col kernel
       of its own that the next product reading its columns as [M,K] x ... is this one
  dx   the column gradient [M,Cout] x [Cout,K] (with the col2im that sums it, in an implicit
       kernel), and a col2im kernel of its own that writes the layer's input image (of the
       layer's kernel size, by its name)
  dw   the weight gradient [Cout,M] x [M,K], and an im2col kernel of its own that the next product
       reading [M,K] columns as its second operand is this one (KILN_CONV_RECOMPUTE=1)
The product's operands tell layers of one image shape apart (air's 15x15x64->64 and ->256); a
kernel's time per step is the median over the trace's steps; layers of one shape (air's two
7x7 256->256 convolutions, two rows; ResNet-18's stages, a row whose "layers" says how many)
share their kernels, whose time is split evenly between them. A row's "kiln_k" is the reduction
of the product kiln runs for the layer where it is another (ResNet-18's stem over 2x2 blocks);
its TFLOP/s count the layer's own. Prints microseconds a layer, TFLOP/s, the share of the H200's
dense peak and the ratio to cuDNN's time; for a product whose kernel in kiln carries more work
(batch norm's and GELU's, conv_bench.py's "<product>_epi" rows), PyTorch's time for the product
and that work and the ratio to it as well. Only the standard library.

  python3 bench/conv_compare.py DIR/resnet18_graph.json cudnn.jsonl --prefix resnet18.
"""
import argparse
import json
import re
import statistics
import sys

PEAK = {"bf16": 989.4, "tf32": 494.7}
SHAPE = re.compile(r"(\d+)x(\d+)x(\d+)->(\d+)x(\d+)x(\d+) (\d+)x(\d+) pad (\d+)")
STRIDE = re.compile(r" stride (\d+)")
NODE = re.compile(r"#(\d+) (\w+) \[([\d,]*)\][^\n]*?(?: from \[([\d,]*)\] \[([\d,]*)\])?$")


def dims_of(text):
    return tuple(int(x) for x in text.split(",") if x) if text is not None else None


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
            stride = STRIDE.search(r["shape"])
            r["dims"] = {"N": n, "H": h, "W": w, "Cin": cin, "OH": oh, "OW": ow, "Cout": cout,
                         "KH": kh, "KW": kw, "S": int(stride.group(1)) if stride else 1,
                         "M": n * oh * ow, "K": kh * kw * cin,
                         "kiln_K": r.get("kiln_k") or kh * kw * cin}
            r["layers"] = r.get("layers", 1)
            rows.append(r)
    return rows


def products(d):
    """The (operand, operand) shapes of a layer's three products in kiln, by product."""
    M, K, co = d["M"], d["kiln_K"], d["Cout"]
    return {"fwd": ((M, K), (K, co)), "dx": ((M, co), (co, K)), "dw": ((co, M), (M, K))}


def kernels(trace_path):
    """Each kernel of the trace: its name, step, start, duration (us) and nodes, each a dict of
    its id, op, shape and (for a product) its operands' shapes."""
    with open(trace_path) as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    out = []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") != "kernel":
            continue
        args = e.get("args", {})
        nodes = []
        for s in args.get("nodes", []):
            m = NODE.match(s)
            if m:
                nodes.append({"id": int(m.group(1)), "op": m.group(2), "shape": dims_of(m.group(3)),
                              "ab": (dims_of(m.group(4)), dims_of(m.group(5)))
                              if m.group(4) is not None else None})
        out.append({"name": e["name"], "step": args.get("step", -1), "ts": e["ts"],
                    "us": e["dur"], "nodes": nodes})
    out.sort(key=lambda k: (k["step"], k["ts"]))
    return out


def product_of(k):
    """The operand shapes of the product a kernel runs, or None."""
    for n in k["nodes"]:
        if n["op"] == "matmul" and n["ab"]:
            return n["ab"]
    return None


def col2im_owner(k, rows):
    """For a col2im kernel of its own, the data gradient product of the layer whose input image
    it writes, of the kernel size and stride in its name (k_col2im_..._3x3_s2_...: a stage's 3x3
    and 1x1 downsamples read the same image, and so does the stage before's 3x3), or None."""
    size = re.search(r"_(\d+)x(\d+)_s(\d+)_", k["name"])
    for r in rows:
        d = r["dims"]
        if (k["nodes"][0]["shape"] == (d["N"], d["H"], d["W"], d["Cin"]) and size and
                tuple(map(int, size.groups())) == (d["KH"], d["KW"], d["S"])):
            return products(d)["dx"]
    return None


def attribute(ks, rows):
    """Each kernel's product operands: its own, or for an im2col kernel of its own the next
    product that reads [M,K] columns, for a col2im kernel of its own the data gradient of the
    layer whose image it writes (col2im_owner), else the last product before it (in the same
    step: in a replayed graph a weight gradient may start between a data gradient and its
    col2im)."""
    for i, k in enumerate(ks):
        k["owner"] = product_of(k)
        if k["owner"] or not k["nodes"]:
            continue
        op = k["nodes"][0]["op"]
        if op == "im2col":
            n, oh, ow, kk = k["nodes"][0]["shape"]
            cols = (n * oh * ow, kk)
            for later in ks[i + 1:]:
                ab = product_of(later)
                if later["step"] != k["step"]:
                    break
                if ab and cols in ab:
                    k["owner"] = ab
                    break
        elif op == "col2im":
            k["owner"] = col2im_owner(k, rows)
            if k["owner"]:
                continue
            for earlier in reversed(ks[:i]):
                ab = product_of(earlier)
                if earlier["step"] != k["step"]:
                    break
                if ab:
                    k["owner"] = ab
                    break


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", help="kiln's timeline trace of the workload's step (JSON)")
    ap.add_argument("cudnn", help="conv_bench.py --json's output")
    ap.add_argument("--prefix", default="air.", help="the workload's convolutions (air., cnn.)")
    args = ap.parse_args()
    rows = layers(args.cudnn, args.prefix)
    epi = {(r["conv"], r["product"][:-4]): r["us"] for r in rows if r["product"].endswith("_epi")}
    rows = [r for r in rows if not r["product"].endswith("_epi")]
    ks = kernels(args.trace)
    attribute(ks, rows)
    steps = sorted({k["step"] for k in ks if k["step"] >= 0}) or [-1]
    # the layers of each product's operands: kernels shared by layers of one shape
    sharing = {}
    for r in rows:
        key = products(r["dims"])[r["product"]]
        sharing[key] = sharing.get(key, 0) + r["layers"]
    print(f"{args.trace}: {len(steps)} steps; cuDNN from {args.cudnn}\n")
    print("| conv | layers | product | kiln us | kiln TFLOP/s | % of peak | kiln kernels | "
          "cuDNN us | kiln / cuDNN | cuDNN + epilogue us | kiln / that |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        want = products(r["dims"])[r["product"]]
        share = sharing[want]
        mine = [k for k in ks if k["owner"] == want]
        per_step = [sum(k["us"] for k in mine if k["step"] == s) / share for s in steps]
        us = statistics.median(per_step) if mine else float("nan")
        d = r["dims"]
        flops = 2.0 * d["M"] * d["Cout"] * d["K"]
        tflops = flops / (us * 1e-6) / 1e12 if mine and us > 0 else float("nan")
        names = sorted({k["name"] for k in mine})
        shown = ", ".join(n if len(n) <= 40 else n[:37] + "..." for n in names) or "none found"
        with_epi = epi.get((r["conv"], r["product"]))
        more = f"{with_epi:.1f} | {us / with_epi:.2f}" if with_epi else "- | -"
        print(f"| {r['conv']} | {r['layers']} | {r['product']} | {us:.1f} | {tflops:.1f} | "
              f"{100 * tflops / PEAK[r['dtype']]:.1f} | {shown} | {r['us']:.1f} | "
              f"{us / r['us']:.2f} | {more} |")


if __name__ == "__main__":
    main()
