#!/usr/bin/env python3
"""stem_gemm.py: does cuBLAS run ResNet-18's stem products faster when their reduction K is a
multiple of 8? kiln runs the stem (7x7 stride 2 padding 3, 3 -> 64 channels, batch 128 of 224x224
bf16 images) as im2col and two cuBLAS products with K = 7 * 7 * 3 = 147, whose rows are 294 bytes,
not a multiple of 16: on the H100 (2026-12-05, in the step) the forward product took 260 us and
the weight gradient 550 us for 30 GFLOP each. This times the same products through PyTorch (which
calls cuBLAS) with K = 147, with K = 147 read from rows of 152 (a view: what padded columns would
give), and with K = 152 and 160 (padded with zeros, filters too), beside cuDNN's convolution of the
same shape. Median of --reps launches timed with CUDA events after a warm-up, on random data.

  python3 bench/stem_gemm.py [--reps 50]
"""
import argparse

import torch

M, CO = 128 * 112 * 112, 64  # output pixels, output channels


def timed(fn, reps):
    """Median microseconds of fn over reps launches, each timed alone after a warm-up."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1000.0)
    return sorted(times)[len(times) // 2]


def row(name, us, k):
    flops = 2.0 * M * CO * k
    print(f"| {name} | {us:.1f} | {flops / (us * 1e-6) / 1e12:.1f} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=50)
    reps = ap.parse_args().reps
    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    print(f"{torch.cuda.get_device_name()}, PyTorch {torch.__version__}\n")
    print("| product | us | TFLOP/s (of K = 147's work for the padded ones) |")
    print("| --- | --- | --- |")
    dy = torch.randn(M, CO, device=dev, dtype=bf)
    for k, ld in ((147, 147), (147, 152), (152, 152), (160, 160)):
        cols = torch.randn(M, ld, device=dev, dtype=bf)[:, :k]
        wk = torch.randn(CO, k, device=dev, dtype=bf)
        what = f"K = {k}" + (f", rows of {ld}" if ld != k else "")
        row(f"forward cols (M, K) wk^T, {what}", timed(lambda: cols @ wk.t(), reps), 147)
        row(f"weight gradient dY^T cols, {what}", timed(lambda: dy.t() @ cols, reps), 147)
        del cols, wk
    x = torch.randn(128, 3, 224, 224, device=dev, dtype=bf).to(memory_format=torch.channels_last)
    w = torch.randn(CO, 3, 7, 7, device=dev, dtype=bf).to(memory_format=torch.channels_last)
    gy = torch.randn(128, CO, 112, 112, device=dev, dtype=bf).to(memory_format=torch.channels_last)
    conv = torch.nn.functional.conv2d
    row("cuDNN forward (conv2d)", timed(lambda: conv(x, w, stride=2, padding=3), reps), 147)
    wgrad = torch.nn.grad.conv2d_weight
    row("cuDNN weight gradient", timed(lambda: wgrad(x, w.shape, gy, stride=2, padding=3), reps), 147)


if __name__ == "__main__":
    main()
