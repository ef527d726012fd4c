#!/usr/bin/env python3
"""torch_ref.py: the PyTorch reference for kiln's benchmarks, on the same GPU.

Times the workloads of docs/design.md ("Workloads") with random inputs of the real shapes:
  mlp  784-512-512-10 ReLU MLP, batch 128, fp32, cross-entropy, SGD with Nesterov momentum;
  cnn  pytorch/examples' MNIST net (conv 1->32 3x3, ReLU, conv 32->64 3x3, ReLU, max pool 2,
       dropout 0.25, flatten, fc 9216->128, ReLU, dropout 0.5, fc 128->10), batch 128,
       channels_last, fp32, cross-entropy, Adam lr 1e-3 (as build/profile_step's cnn);
each in two modes:
  eager  plain PyTorch, one Python step after another;
  best   torch.compile of the model and loss, with the whole step (forward, backward, optimizer)
         captured by hand in one CUDA graph and replayed.
Median ms per step over blocks of steps timed with CUDA events after a warm-up. One JSON line per
workload and mode on stdout.
"""
import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F


class MnistNet(nn.Module):
    """pytorch/examples' MNIST net (the cnn workload); logits, without the final log_softmax."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv2(F.relu(self.conv1(x))))
        x = self.dropout1(F.max_pool2d(x, 2))
        x = F.relu(self.fc1(torch.flatten(x, 1)))
        return self.fc2(self.dropout2(x))


def make(workload="mlp", best=False, seed=0):
    torch.manual_seed(seed)
    if workload == "mlp":
        model = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                              nn.Linear(512, 10)).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True)
        x = torch.rand(128, 784, device="cuda") * 2 - 1
    else:
        # eager: PyTorch's defaults; best: cuDNN may pick its fastest algorithms
        torch.backends.cudnn.benchmark = best
        model = MnistNet().cuda().to(memory_format=torch.channels_last).train()
        # a step captured in a CUDA graph needs Adam's step counts on the device (capturable)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=best)
        x = (torch.rand(128, 1, 28, 28, device="cuda") * 2 - 1).to(
            memory_format=torch.channels_last)
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


def eager(workload, steps, blocks):
    model, opt, x, y = make(workload)

    def block(n):
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()

    block(50)
    return time_blocks(block, steps, blocks)


def best(workload, steps, blocks):
    model, opt, x, y = make(workload, best=True)
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
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--blocks", type=int, default=21)
    ap.add_argument("--modes", default="eager,best")
    ap.add_argument("--workloads", default="mlp,cnn")
    args = ap.parse_args()
    for workload in args.workloads.split(","):
        if workload not in ("mlp", "cnn"):
            ap.error(f"unknown workload {workload!r}: mlp or cnn")
        for mode in args.modes.split(","):
            torch.cuda.reset_peak_memory_stats()
            t = {"eager": eager, "best": best}[mode](workload, args.steps, args.blocks)
            print(json.dumps({
                "workload": workload, "framework": "pytorch " + torch.__version__, "mode": mode,
                "ms_per_step": round(t[len(t) // 2], 4), "ms_min": round(t[0], 4),
                "ms_max": round(t[-1], 4),
                "peak_mib": round(torch.cuda.max_memory_allocated() / 2**20, 2),
                "steps": args.steps * args.blocks}), flush=True)


if __name__ == "__main__":
    main()
