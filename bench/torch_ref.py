#!/usr/bin/env python3
"""torch_ref.py: the PyTorch reference for kiln's benchmarks, on the same GPU.

Times the `mlp` workload (docs/design.md) (784-512-512-10 ReLU MLP, batch 128, fp32, cross-entropy,
SGD with Nesterov momentum, random inputs of the real shapes) in two modes:
  eager  plain PyTorch, one Python step after another;
  best   torch.compile of the model and loss, with the whole step (forward, backward, optimizer)
         captured by hand in one CUDA graph and replayed.
Median ms per step over blocks of steps timed with CUDA events after a warm-up. One JSON line per
mode on stdout.
"""
import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F


def make(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True)
    x = torch.rand(128, 784, device="cuda") * 2 - 1
    y = torch.randint(0, 10, (128,), device="cuda")
    return model, opt, x, y


def time_blocks(run_block, steps, blocks):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(blocks):
        start.record()
        run_block(steps)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / steps)
    times.sort()
    return times


def eager(steps, blocks):
    model, opt, x, y = make()

    def block(n):
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()

    block(50)
    return time_blocks(block, steps, blocks)


def best(steps, blocks):
    model, opt, x, y = make()
    fwd = torch.compile(lambda a, b: F.cross_entropy(model(a), b), mode="default")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(5):
            opt.zero_grad(set_to_none=True)
            fwd(x, y).backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        loss = fwd(x, y)
        loss.backward()
        opt.step()

    def block(n):
        for _ in range(n):
            graph.replay()

    block(50)
    return time_blocks(block, steps, blocks)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--blocks", type=int, default=21)
    ap.add_argument("--modes", default="eager,best")
    args = ap.parse_args()
    for mode in args.modes.split(","):
        torch.cuda.reset_peak_memory_stats()
        t = {"eager": eager, "best": best}[mode](args.steps, args.blocks)
        print(json.dumps({
            "workload": "mlp", "framework": "pytorch " + torch.__version__, "mode": mode,
            "ms_per_step": round(t[len(t) // 2], 4), "ms_min": round(t[0], 4),
            "ms_max": round(t[-1], 4),
            "peak_mib": round(torch.cuda.max_memory_allocated() / 2**20, 2),
            "steps": args.steps * args.blocks}), flush=True)


if __name__ == "__main__":
    main()
