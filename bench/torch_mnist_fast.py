#!/usr/bin/env python3
"""torch_mnist_fast.py: DESIGN.md's fast MNIST recipe in PyTorch eager, timed as
`mnist_cnn --recipe fast` times it, for the comparison in the same run.

    python3 bench/torch_mnist_fast.py [--data DIR] [--seeds N] [--label-smoothing F]

The recipe (the same as kiln's): conv 1->24 5x5, max pool 2, ReLU, conv 24->32 3x3, max pool 2,
ReLU, fc 800->256, ReLU, fc 256->10; Adam lr 1e-2, betas 0.7/0.9, OneCycleLR over the epoch's
steps (pct_start 0.3, div_factor 25, final_div_factor 1e4, no momentum cycling: kiln's one-cycle
keeps beta1), batch 256 with the last partial batch dropped, one epoch, the whole data set on the
GPU, normalised by 0.1307/0.3081. The time is the training loop's, synchronised, without data
loading or evaluation; one untimed run first warms cuDNN and the allocator. Prints one line per
seed, then the median, and a JSON line for scripts.
"""
import argparse
import gzip
import json
import os
import statistics
import struct
import sys
import time

try:
    import numpy as np
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
except ImportError as e:
    print(f"missing: {e}")
    sys.exit(2)


def read_idx(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    magic, = struct.unpack(">I", data[:4])
    ndim = magic & 0xFF
    dims = struct.unpack(">" + "I" * ndim, data[4:4 + 4 * ndim])
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def load(data_dir, split):
    def find(name):
        for cand in (name, name + ".gz"):
            p = os.path.join(data_dir, cand)
            if os.path.exists(p):
                return p
        raise FileNotFoundError(os.path.join(data_dir, name))
    x = read_idx(find(f"{split}-images-idx3-ubyte"))
    y = read_idx(find(f"{split}-labels-idx1-ubyte"))
    x = (torch.tensor(x, dtype=torch.float32, device="cuda") / 255.0 - 0.1307) / 0.3081
    return x.unsqueeze(1), torch.tensor(y, dtype=torch.int64, device="cuda")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 24, 5)
        self.conv2 = nn.Conv2d(24, 32, 3)
        self.fc1 = nn.Linear(800, 256)
        self.fc2 = nn.Linear(256, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def run(seed, train, test, ls, batch=256):
    torch.manual_seed(seed)
    model = Net().cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.7, 0.9))
    xtr, ytr = train
    steps = xtr.shape[0] // batch
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=steps,
                                                cycle_momentum=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    perm = torch.randperm(xtr.shape[0], device="cuda")
    for s in range(steps):
        idx = perm[s * batch:(s + 1) * batch]
        loss = F.cross_entropy(model(xtr[idx]), ytr[idx], label_smoothing=ls)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    model.eval()
    correct = 0
    with torch.no_grad():
        for i in range(0, test[0].shape[0], 1000):
            correct += (model(test[0][i:i + 1000]).argmax(1) == test[1][i:i + 1000]).sum().item()
    return 100.0 * correct / test[0].shape[0], seconds


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--data", default=os.environ.get("KILN_MNIST") or "data/mnist")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--label-smoothing", type=float, default=0.0)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("torch_mnist_fast: no CUDA device")
        sys.exit(2)
    train, test = load(args.data, "train"), load(args.data, "t10k")
    run(1000, train, test, args.label_smoothing)  # warm-up, untimed
    accs, secs = [], []
    for seed in range(args.seeds):
        acc, s = run(seed, train, test, args.label_smoothing)
        accs.append(acc)
        secs.append(s)
        print(f"seed {seed}: test accuracy {acc:.2f}% | training {s:.3f} s")
    hit = sum(a >= 99.0 for a in accs)
    print(f"PyTorch {torch.__version__} eager, fast recipe: median of {args.seeds} seeds: test "
          f"accuracy {statistics.median(accs):.2f}% ({hit} of {args.seeds} at 99.00% or more); "
          f"training {statistics.median(secs):.3f} s")
    print(json.dumps({"recipe": "fast", "framework": "pytorch", "mode": "eager",
                      "median_accuracy": statistics.median(accs),
                      "median_seconds": statistics.median(secs)}))


if __name__ == "__main__":
    main()
