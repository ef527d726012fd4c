#!/usr/bin/env python3
"""torch_ref.py: the PyTorch reference for kiln's benchmarks, on the same GPU.

Times the workloads of docs/design.md ("Workloads") with random inputs of the real shapes:
  mlp  784-512-512-10 ReLU MLP, batch 128, fp32, cross-entropy, SGD with Nesterov momentum;
  cnn  pytorch/examples' MNIST net (conv 1->32 3x3, ReLU, conv 32->64 3x3, ReLU, max pool 2,
       dropout 0.25, flatten, fc 9216->128, ReLU, dropout 0.5, fc 128->10), batch 128,
       channels_last, fp32, cross-entropy, Adam lr 1e-3 (as build/profile_step's cnn);
  air  airbench94's net (as build/profile_step's air and examples/cifar10): conv 2x2 3->24
       without bias, frozen (random here, no whitening), GELU; three groups of widths 64/256/256,
       each conv 3x3 -> max pool 2 -> batch norm -> GELU -> conv 3x3 -> batch norm -> GELU (no
       conv biases; batch norm momentum 0.4, eps 1e-12, weight frozen); max pool 3 (global on the
       3x3 map), linear 256->10 without bias, x 1/9; batch 1024, channels_last, forward and loss
       under bf16 autocast, cross-entropy with label smoothing 0.2 summed over the batch, SGD
       with Nesterov momentum 0.85 at airbench94's rates for batch 1024 (batch norm's biases at
       64x the rate and 1/64 the weight decay), the frozen parameters left out;
  resnet18  torchvision's ResNet-18 in plain torch.nn (as build/profile_step's resnet18; no
       torchvision needed): conv 7x7/2 3->64 without bias, batch norm, ReLU, max pool 3x3/2 pad 1;
       four stages of two BasicBlocks of widths 64/128/256/512 (a 1x1/2 conv and batch norm on the
       shortcut of the first block of stages 2-4); global average pool, linear 512->1000;
       11,689,512 parameters (checked); torchvision's init; batch 128 of 224x224, channels_last,
       forward and loss under bf16 autocast, cross-entropy (mean) on random labels in [0, 1000),
       SGD with momentum 0.9 (not Nesterov), lr 0.05, weight decay 5e-5 on every parameter;
each in two modes:
  eager  plain PyTorch, one Python step after another;
  best   torch.compile of the model and loss, with the whole step (forward, backward, optimizer)
         captured by hand in one CUDA graph and replayed.
Median ms per step over blocks of steps (--steps, 100 by default, 20 for air, 10 for resnet18;
--blocks, 21) timed with CUDA events after a warm-up. One JSON line per workload and mode on stdout,
with the batch and the parameter count (model.parameters(), buffers left out).
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


# air: airbench94's hyperparameters, as examples/cifar10.c has them
AIR_BATCH = 1024
AIR_LR = 11.5  # per 1024 examples
AIR_MOMENTUM = 0.85  # Nesterov
AIR_WEIGHT_DECAY = 0.0153  # per 1024 examples
AIR_BIAS_SCALER = 64  # batch norm's biases: rate x64, weight decay / 64
AIR_LABEL_SMOOTHING = 0.2


def air_norm(width):
    """airbench94's batch norm: torch momentum 0.4, eps 1e-12, only the bias trained."""
    norm = nn.BatchNorm2d(width, momentum=0.4, eps=1e-12)
    norm.weight.requires_grad_(False)
    return norm


class AirNet(nn.Module):
    """airbench94's net (the air workload), with a random frozen first conv in place of the
    whitening filters."""

    def __init__(self, widths=(64, 256, 256)):
        super().__init__()
        self.whiten = nn.Conv2d(3, 24, 2, bias=False)
        self.whiten.weight.requires_grad_(False)
        layers, cin = [nn.GELU()], 24
        for w in widths:
            layers += [nn.Conv2d(cin, w, 3, padding=1, bias=False), nn.MaxPool2d(2), air_norm(w),
                       nn.GELU(), nn.Conv2d(w, w, 3, padding=1, bias=False), air_norm(w),
                       nn.GELU()]
            cin = w
        self.body = nn.Sequential(*layers)
        self.pool = nn.MaxPool2d(3)  # the 3x3 map to 1x1: the global max
        self.head = nn.Linear(widths[-1], 10, bias=False)

    def forward(self, x):
        x = self.pool(self.body(self.whiten(x)))
        return self.head(torch.flatten(x, 1)) * (1 / 9)


def air_optimizer(model, batch=AIR_BATCH):
    """SGD at airbench94's rates: kilostep = 1024 (1 + 1 / (1 - momentum)), lr = LR / kilostep,
    weight decay = (WEIGHT_DECAY batch / kilostep) / lr; batch norm's biases in a group of their own, the
    frozen parameters in none."""
    kilostep = 1024 * (1 + 1 / (1 - AIR_MOMENTUM))
    lr = AIR_LR / kilostep
    wd = AIR_WEIGHT_DECAY * batch / kilostep / lr  # torch's L2 decay: the step's decay over lr
    biases = [m.bias for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    rest = [p for p in model.parameters()
            if p.requires_grad and all(p is not b for b in biases)]
    groups = [dict(params=biases, lr=lr * AIR_BIAS_SCALER, weight_decay=wd / AIR_BIAS_SCALER),
              dict(params=rest, lr=lr, weight_decay=wd)]
    return torch.optim.SGD(groups, lr=lr, momentum=AIR_MOMENTUM, nesterov=True)


# resnet18: torchvision's ResNet-18 and the reference recipe's SGD (lr 0.1 per 256 images)
RN_BATCH = 128
RN_CLASSES = 1000
RN_PARAMS = 11_689_512  # sum(p.numel() for p in torchvision.models.resnet18().parameters())
RN_LR = 0.05
RN_MOMENTUM = 0.9
RN_WEIGHT_DECAY = 5e-5


class BasicBlock(nn.Module):
    """torchvision's BasicBlock: conv 3x3 (stride s) -> BN -> ReLU -> conv 3x3 -> BN, plus the
    input (through conv 1x1/s -> BN where the shape changes), then ReLU."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        return F.relu(out + identity)


class ResNet18(nn.Module):
    """torchvision.models.resnet18() (the resnet18 workload), with torchvision's names and init."""

    def __init__(self, widths=(64, 128, 256, 512), classes=RN_CLASSES):
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin = widths[0]
        for k, w in enumerate(widths):
            stride = 1 if k == 0 else 2
            setattr(self, f"layer{k + 1}",
                    nn.Sequential(BasicBlock(cin, w, stride), BasicBlock(w, w, 1)))
            cin = w
        self.fc = nn.Linear(cin, classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def loss_fn(workload, model):
    """The step's loss of (x, y): air's and resnet18's forward and loss in a bf16 autocast
    region."""
    if workload == "resnet18":
        def resnet_loss(a, b):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return F.cross_entropy(model(a), b)
        return resnet_loss
    if workload != "air":
        return lambda a, b: F.cross_entropy(model(a), b)

    def air_loss(a, b):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return F.cross_entropy(model(a), b, label_smoothing=AIR_LABEL_SMOOTHING,
                                   reduction="sum")
    return air_loss


def make(workload="mlp", best=False, seed=0):
    torch.manual_seed(seed)
    if workload == "mlp":
        model = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                              nn.Linear(512, 10)).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True)
        x = torch.rand(128, 784, device="cuda") * 2 - 1
    elif workload == "cnn":
        # eager: PyTorch's defaults; best: cuDNN may pick its fastest algorithms
        torch.backends.cudnn.benchmark = best
        model = MnistNet().cuda().to(memory_format=torch.channels_last).train()
        # a step captured in a CUDA graph needs Adam's step counts on the device (capturable)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=best)
        x = (torch.rand(128, 1, 28, 28, device="cuda") * 2 - 1).to(
            memory_format=torch.channels_last)
    elif workload == "air":
        # as the cnn: PyTorch's defaults in eager, cuDNN's fastest algorithms in best
        torch.backends.cudnn.benchmark = best
        model = AirNet().cuda().to(memory_format=torch.channels_last).train()
        opt = air_optimizer(model)  # SGD keeps no step count: nothing to make capturable
        x = (torch.rand(AIR_BATCH, 3, 32, 32, device="cuda") * 2 - 1).to(
            memory_format=torch.channels_last)
    else:
        # as the cnn and air: PyTorch's defaults in eager, cuDNN's fastest algorithms in best
        torch.backends.cudnn.benchmark = best
        model = ResNet18().cuda().to(memory_format=torch.channels_last).train()
        n = sum(p.numel() for p in model.parameters())
        assert n == RN_PARAMS, f"resnet18 has {n} parameters, not torchvision's {RN_PARAMS}"
        opt = torch.optim.SGD(model.parameters(), lr=RN_LR, momentum=RN_MOMENTUM,
                              weight_decay=RN_WEIGHT_DECAY)
        x = (torch.rand(RN_BATCH, 3, 224, 224, device="cuda") * 2 - 1).to(
            memory_format=torch.channels_last)
    classes = RN_CLASSES if workload == "resnet18" else 10
    y = torch.randint(0, classes, (BATCH[workload],), device="cuda")
    return model, opt, x, y


BATCH = {"mlp": 128, "cnn": 128, "air": AIR_BATCH, "resnet18": RN_BATCH}
DEFAULT_STEPS = {"mlp": 100, "cnn": 100, "air": 20, "resnet18": 10}  # per block


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
    params = sum(p.numel() for p in model.parameters())
    step_loss = loss_fn(workload, model)

    def block(n):
        for _ in range(n):
            opt.zero_grad(set_to_none=True)
            loss = step_loss(x, y)
            loss.backward()
            opt.step()

    block(50)
    return time_blocks(block, steps, blocks), params


def best(workload, steps, blocks):
    model, opt, x, y = make(workload, best=True)
    params = sum(p.numel() for p in model.parameters())
    fwd = torch.compile(loss_fn(workload, model), mode="default")
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
    return time_blocks(block, steps, blocks), params


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=None,
                    help="steps per block (default 100; 20 for air, 10 for resnet18)")
    ap.add_argument("--blocks", type=int, default=21)
    ap.add_argument("--modes", default="eager,best")
    ap.add_argument("--workloads", default="mlp,cnn,air",
                    help="comma-separated: mlp, cnn, air, resnet18 (default mlp,cnn,air)")
    args = ap.parse_args()
    for workload in args.workloads.split(","):
        if workload not in BATCH:
            ap.error(f"unknown workload {workload!r}: mlp, cnn, air or resnet18")
        steps = args.steps if args.steps is not None else DEFAULT_STEPS[workload]
        for mode in args.modes.split(","):
            torch.cuda.reset_peak_memory_stats()
            t, params = {"eager": eager, "best": best}[mode](workload, steps, args.blocks)
            print(json.dumps({
                "workload": workload, "framework": "pytorch " + torch.__version__, "mode": mode,
                "ms_per_step": round(t[len(t) // 2], 4), "ms_min": round(t[0], 4),
                "ms_max": round(t[-1], 4),
                "peak_mib": round(torch.cuda.max_memory_allocated() / 2**20, 2),
                "steps": steps * args.blocks, "batch": BATCH[workload],
                "params": params}), flush=True)


if __name__ == "__main__":
    main()
