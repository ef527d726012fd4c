#!/usr/bin/env python3
"""conv_bench.py: every distinct convolution of the cnn, air and resnet18 workloads in PyTorch
(cuDNN), each product on its own: the forward (Y = X * W), the data gradient (dX) and the weight
gradient (dW), channels_last, in the workload's dtype (cnn: f32 with TF32 allowed, as PyTorch's
default for convolutions; air and resnet18: bf16). Prints microseconds, TFLOP/s (2 M N K of the
product, M the output pixels, N the output channels, K = kh kw Cin) and the share of the H200's
dense peak (989 TFLOP/s bf16, 494 TF32): the figures kiln's convolution engine is measured
against (docs/design.md, "Images"). Median of --reps launches timed with CUDA events after a
warm-up, on random data. --only PREFIX keeps the convolutions whose name starts with it.

A JSON line also says how many layers of the workload have the shape ("layers": ResNet-18's
stages repeat theirs) and, where kiln runs the layer as another product, the reduction kiln's
product has ("kiln_k": ResNet-18's 7x7 stride-2 stem over RGB runs as a 4x4 convolution over the
image's 2x2 blocks of 16 channels, KILN_CONV_S2D, K = 256); bench/conv_compare.py reads both.

Where kiln's kernel carries more than the product, a row "<product>_epi" times what PyTorch runs
for the same work (eager, as separate kernels; its TFLOP/s count the product's FLOPs only):
  dx_epi   air's middle layers, whose data gradient kernel applies batch norm to the layer's input
           again, GELU's derivative, and batch norm's two backward sums over the result: the cuDNN
           data gradient, then gelu_backward and batch_norm_backward_reduce on the layer's input
           image (PyTorch keeps GELU's input from the forward pass: no batch norm to apply again);
  fwd_epi  air's layers whose batch norm follows the convolution at once, whose forward kernel
           sums each channel's values and squares for its statistics: the cuDNN forward product,
           then batch_norm_stats on its output.

  python3 bench/conv_bench.py [--reps 200] [--json] [--only resnet18.]
"""
import argparse
import json
import sys

import torch

PEAK = {"bf16": 989.4, "tf32": 494.7}

# name, batch, H, W, Cin, Cout, kernel, padding, dtype, which products the workload runs, and
# optionally a dict of: stride (1), layers (1), kiln_k (None), epi (the products whose kernel in
# kiln carries more work, "<product>_epi" above)
FDW = ("fwd", "dx", "dw")
DX_EPI, BOTH_EPI = {"epi": ("dx",)}, {"epi": ("fwd", "dx")}
SHAPES = [
    ("cnn.conv1", 128, 28, 28, 1, 32, 3, 0, "tf32", ("fwd", "dw")),
    ("cnn.conv2", 128, 26, 26, 32, 64, 3, 0, "tf32", ("fwd", "dx", "dw")),
    ("air.whiten", 1024, 32, 32, 3, 24, 2, 0, "bf16", ("fwd",)),
    ("air.block1.conv1", 1024, 31, 31, 24, 64, 3, 1, "bf16", ("fwd", "dx", "dw")),
    ("air.block1.conv2", 1024, 15, 15, 64, 64, 3, 1, "bf16", ("fwd", "dx", "dw"), BOTH_EPI),
    ("air.block2.conv1", 1024, 15, 15, 64, 256, 3, 1, "bf16", ("fwd", "dx", "dw"), DX_EPI),
    ("air.block2.conv2", 1024, 7, 7, 256, 256, 3, 1, "bf16", ("fwd", "dx", "dw"), BOTH_EPI),
    ("air.block3.conv1", 1024, 7, 7, 256, 256, 3, 1, "bf16", ("fwd", "dx", "dw"), DX_EPI),
    ("air.block3.conv2", 1024, 3, 3, 256, 256, 3, 1, "bf16", ("fwd", "dx", "dw"), BOTH_EPI),
    ("resnet18.stem", 128, 224, 224, 3, 64, 7, 3, "bf16", ("fwd", "dw"),
     {"stride": 2, "kiln_k": 256}),
    ("resnet18.layer1", 128, 56, 56, 64, 64, 3, 1, "bf16", FDW, {"layers": 4}),
    ("resnet18.layer2.down3x3", 128, 56, 56, 64, 128, 3, 1, "bf16", FDW, {"stride": 2}),
    ("resnet18.layer2.shortcut", 128, 56, 56, 64, 128, 1, 0, "bf16", FDW, {"stride": 2}),
    ("resnet18.layer2", 128, 28, 28, 128, 128, 3, 1, "bf16", FDW, {"layers": 3}),
    ("resnet18.layer3.down3x3", 128, 28, 28, 128, 256, 3, 1, "bf16", FDW, {"stride": 2}),
    ("resnet18.layer3.shortcut", 128, 28, 28, 128, 256, 1, 0, "bf16", FDW, {"stride": 2}),
    ("resnet18.layer3", 128, 14, 14, 256, 256, 3, 1, "bf16", FDW, {"layers": 3}),
    ("resnet18.layer4.down3x3", 128, 14, 14, 256, 512, 3, 1, "bf16", FDW, {"stride": 2}),
    ("resnet18.layer4.shortcut", 128, 14, 14, 256, 512, 1, 0, "bf16", FDW, {"stride": 2}),
    ("resnet18.layer4", 128, 7, 7, 512, 512, 3, 1, "bf16", FDW, {"layers": 3}),
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
    name, n, h, w, cin, cout, k, pad, dt, products = shape[:10]
    extra = shape[10] if len(shape) > 10 else {}
    s = extra.get("stride", 1)
    dtype = torch.bfloat16 if dt == "bf16" else torch.float32
    dev = torch.device("cuda")
    x = torch.randn(n, cin, h, w, device=dev, dtype=dtype).to(memory_format=torch.channels_last)
    wt = torch.randn(cout, cin, k, k, device=dev, dtype=dtype).to(memory_format=torch.channels_last)
    wt *= (cin * k * k) ** -0.5
    y = torch.nn.functional.conv2d(x, wt, stride=s, padding=pad)
    oh, ow = y.shape[2], y.shape[3]
    dy = torch.randn_like(y)
    flops = 2.0 * n * oh * ow * cout * k * k * cin
    conv_bwd = torch.ops.aten.convolution_backward
    run = {
        "fwd": lambda: torch.nn.functional.conv2d(x, wt, stride=s, padding=pad),
        "dx": lambda: conv_bwd(dy, x, wt, None, (s, s), (pad, pad), (1, 1), False, (0, 0), 1,
                               (True, False, False)),
        "dw": lambda: conv_bwd(dy, x, wt, None, (s, s), (pad, pad), (1, 1), False, (0, 0), 1,
                               (False, True, False)),
    }
    epi = extra.get("epi", ())
    products = tuple(products) + tuple(p + "_epi" for p in epi)
    if "dx" in epi:
        xin = torch.randn_like(x)  # batch norm's input (the layer before's output)
        act = torch.randn_like(x)  # GELU's input, kept by the forward pass
        c32 = dict(device=dev, dtype=torch.float32)
        mean, invstd = torch.randn(cin, **c32), torch.rand(cin, **c32) + 0.5
        weight = torch.rand(cin, **c32) + 0.5

        def dx_epi():
            g = run["dx"]()[0]
            g = torch.ops.aten.gelu_backward(g, act)
            return torch.batch_norm_backward_reduce(g, xin, mean, invstd, weight, True, True, True)

        run["dx_epi"] = dx_epi
    if "fwd" in epi:
        run["fwd_epi"] = lambda: torch.batch_norm_stats(run["fwd"](), 1e-5)
    rows = []
    for p in products:
        try:
            ms = timed(run[p], reps)
        except RuntimeError as e:  # an op this PyTorch lacks for these dtypes: the row is left out
            if not p.endswith("_epi"):
                raise
            print(f"conv_bench: {name} {p} left out: {e}", file=sys.stderr)
            continue
        tflops = flops / (ms * 1e-3) / 1e12
        rows.append({"conv": name, "product": p, "dtype": dt, "batch": n,
                     "shape": f"{h}x{w}x{cin}->{oh}x{ow}x{cout} {k}x{k} pad {pad}"
                              + (f" stride {s}" if s != 1 else ""),
                     "layers": extra.get("layers", 1), "kiln_k": extra.get("kiln_k"),
                     "us": ms * 1e3, "tflops": tflops, "peak_pct": 100 * tflops / PEAK[dt]})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--only", default="", help="the convolutions whose name starts with it")
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cuda.matmul.allow_tf32 = True
    rows = [r for s in SHAPES if s[0].startswith(args.only) for r in bench(s, args.reps)]
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return
    print(f"PyTorch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"{torch.cuda.get_device_name()}; median of {args.reps} launches\n")
    print("| conv | shape (batch) | layers | product | dtype | us | TFLOP/s | % of peak |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['conv']} | {r['shape']} ({r['batch']}) | {r['layers']} | {r['product']} | "
              f"{r['dtype']} | {r['us']:.1f} | {r['tflops']:.1f} | {r['peak_pct']:.1f} |")


if __name__ == "__main__":
    main()
