#!/usr/bin/env python3
"""torch_bn_roundtrip.py DIR: the PyTorch side of the conv + batch-norm weights test
(tests/test_gpu_layers.c).

DIR holds what kiln wrote: kiln.safetensors (a Conv2d "conv" 3->4 3x3 padding 1 and a
BatchNorm2d "bn" of 4 channels, with PyTorch's names: conv.weight (4, 3, 3, 3), conv.bias,
bn.weight, bn.bias, bn.running_mean, bn.running_var), x.f32 (2, 5, 5, 3) NHWC and y.f32, kiln's
output in evaluation mode (2, 5, 5, 4) NHWC. This loads the file into torch modules with
strict=True (every name and shape must match; num_batches_tracked is PyTorch's own), checks the
output, then changes every tensor (running statistics too, and num_batches_tracked, an I64),
saves the state_dict as torch.safetensors and writes the new evaluation output as y_torch.f32
for kiln to load and compare. Exit 0 on success, 2 when torch, numpy or safetensors is missing,
1 on a mismatch.
"""
import os
import sys

try:
    import numpy as np
    import torch
    from safetensors.torch import load_file, save_file
except ImportError as e:
    print(f"missing: {e}")
    sys.exit(2)

torch.backends.cudnn.allow_tf32 = False
torch.backends.cuda.matmul.allow_tf32 = False
d = sys.argv[1]
model = torch.nn.Module()
model.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
model.bn = torch.nn.BatchNorm2d(4)
state = load_file(os.path.join(d, "kiln.safetensors"))
print("kiln wrote:", ", ".join(f"{k} {tuple(v.shape)}" for k, v in sorted(state.items())))
model.load_state_dict(state, strict=True)
model.eval()


def forward(x):  # x NHWC -> NHWC
    with torch.no_grad():
        y = model.bn(model.conv(torch.from_numpy(x).permute(0, 3, 1, 2)))
    return y.permute(0, 2, 3, 1).contiguous().numpy()


x = np.fromfile(os.path.join(d, "x.f32"), dtype="<f4").reshape(2, 5, 5, 3)
y_kiln = np.fromfile(os.path.join(d, "y.f32"), dtype="<f4").reshape(2, 5, 5, 4)
y = forward(x)
err = np.abs(y - y_kiln).max() / max(np.abs(y).max(), 1e-30)
print(f"kiln -> torch: evaluation outputs differ by {err:.3g} of the largest")
if not err <= 1e-5:
    sys.exit(1)
with torch.no_grad():
    for name, t in model.state_dict().items():
        if t.dtype == torch.int64:
            t += 7  # num_batches_tracked: kiln accepts and ignores it
        elif "running_var" in name:
            t.mul_(1.5).add_(0.25)
        else:
            t.mul_(-0.75).add_(0.125)
sd = {k: v.contiguous() for k, v in model.state_dict().items()}
save_file(sd, os.path.join(d, "torch.safetensors"))
forward(x).astype("<f4").tofile(os.path.join(d, "y_torch.f32"))
print(f"torch {torch.__version__}: saved", ", ".join(f"{k} {v.dtype}" for k, v in sorted(sd.items())))
