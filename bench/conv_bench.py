#!/usr/bin/env python3
"""conv_bench.py: every distinct convolution of the cnn and air workloads in PyTorch (cuDNN),
each product on its own: the forward (Y = X * W), the data gradient (dX) and the weight gradient
(dW), channels_last, in the workload's dtype (cnn: f32 with TF32 allowed, as PyTorch's default
for convolutions; air: bf16). Prints microseconds, TFLOP/s (2 M N K of the product, M the output
pixels, N the output channels, K = kh kw Cin) and the share of the H200's dense peak (989 TFLOP/s
bf16, 494 TF32): the figures kiln's convolution engine is measured against (docs/design.md,
"Images"). Median of --reps launches timed with CUDA events after a warm-up, on random data.

  python3 bench/conv_bench.py [--reps 200] [--json]
"""
import argparse
import json

import torch

PEAK = {"bf16": 989.4, "tf32": 494.7}

# name, batch, H, W, Cin, Cout, kernel, padding, dtype, which products the workload runs
SHAPES = [
    ("cnn.conv1", 128, 28, 28, 1, 32, 3, 0, "tf32", ("fwd", "dw")),
    ("cnn.conv2", 128, 26, 26, 32, 64, 3, 0, "tf32", ("fwd", "dx", "dw")),
    ("air.whiten", 1024, 32, 32, 3, 24, 2, 0, "bf16", ("fwd",)),
    ("air.block1.conv1", 1024, 31, 31, 24, 64, 3, 1, "bf16", ("fwd", "dx", "dw")),
    ("air.block1.conv2", 1024, 15, 15, 64, 64, 3, 1, "bf16", ("fwd", "dx", "dw")),
    ("air.block2.conv1", 1024, 15, 15, 64, 256, 3, 1, "bf16", ("fwd", "dx", "dw")),
    ("air.block2.conv2", 1024, 7, 7, 256, 256, 3, 1, "bf16", ("fwd", "dx", "dw")),
    ("air.block3.conv1", 1024, 7, 7, 256, 256, 3, 1, "bf16", ("fwd", "dx", "dw")),
    ("air.block3.conv2", 1024, 3, 3, 256, 256, 3, 1, "bf16", ("fwd", "dx", "dw")),
]


def timed(fn, reps):
    """Median milliseconds of fn over reps launches, each timed alone after a warm-up."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(start, end):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in zip(start, end))
    return times[len(times) // 2]


def bench(shape, reps):
    name, n, h, w, cin, cout, k, pad, dt, products = shape
    dtype = torch.bfloat16 if dt == "bf16" else torch.float32
    dev = torch.device("cuda")
    x = torch.randn(n, cin, h, w, device=dev, dtype=dtype).to(memory_format=torch.channels_last)
    wt = torch.randn(cout, cin, k, k, device=dev, dtype=dtype).to(memory_format=torch.channels_last)
    wt *= (cin * k * k) ** -0.5
    y = torch.nn.functional.conv2d(x, wt, padding=pad)
    oh, ow = y.shape[2], y.shape[3]
    dy = torch.randn_like(y)
    flops = 2.0 * n * oh * ow * cout * k * k * cin
    conv_bwd = torch.ops.aten.convolution_backward
    run = {
        "fwd": lambda: torch.nn.functional.conv2d(x, wt, padding=pad),
        "dx": lambda: conv_bwd(dy, x, wt, None, (1, 1), (pad, pad), (1, 1), False, (0, 0), 1,
                               (True, False, False)),
        "dw": lambda: conv_bwd(dy, x, wt, None, (1, 1), (pad, pad), (1, 1), False, (0, 0), 1,
                               (False, True, False)),
    }
    rows = []
    for p in products:
        ms = timed(run[p], reps)
        tflops = flops / (ms * 1e-3) / 1e12
        rows.append({"conv": name, "product": p, "dtype": dt, "batch": n,
                     "shape": f"{h}x{w}x{cin}->{oh}x{ow}x{cout} {k}x{k} pad {pad}",
                     "us": ms * 1e3, "tflops": tflops, "peak_pct": 100 * tflops / PEAK[dt]})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cuda.matmul.allow_tf32 = True
    rows = [r for s in SHAPES for r in bench(s, args.reps)]
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return
    print(f"PyTorch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"{torch.cuda.get_device_name()}; median of {args.reps} launches\n")
    print("| conv | shape (batch) | product | dtype | us | TFLOP/s | % of peak |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['conv']} | {r['shape']} ({r['batch']}) | {r['product']} | {r['dtype']} | "
              f"{r['us']:.1f} | {r['tflops']:.1f} | {r['peak_pct']:.1f} |")


if __name__ == "__main__":
    main()
