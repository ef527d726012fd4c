#!/usr/bin/env python3
"""torch_modules.py WEIGHTS INPUT OUT: the PyTorch side of test_gpu_modules.c.

Builds the same nn.Sequential as the test's kiln model, loads kiln's WEIGHTS (safetensors) into it
by name (the only keys kiln lacks may be batch norm's num_batches_tracked), runs it in eval mode
on INPUT (raw little-endian f32, (2, 8, 8, 3), channels last) and writes OUT.logits (raw f32
(2, 5)) and OUT.txt (print(model)). Exit 0 on success, 2 when torch or safetensors is missing
(the test skips), 1 when the weights do not fit the model.
"""
import sys

try:
    import numpy as np
    import torch
    from torch import nn
    from safetensors.torch import load_file
except ImportError as e:
    print(f"missing: {e}")
    sys.exit(2)

model = nn.Sequential()
features = nn.Sequential(
    nn.Conv2d(3, 8, 3, padding=1, bias=False),
    nn.BatchNorm2d(8),
    nn.ReLU(),
    nn.MaxPool2d(2),
)
model.add_module("features", features)
model.add_module("1", nn.Flatten())
model.add_module("head", nn.Linear(8 * 4 * 4, 5))

state = load_file(sys.argv[1])
result = model.load_state_dict(state, strict=False)
missing = [k for k in result.missing_keys if not k.endswith("num_batches_tracked")]
if missing or result.unexpected_keys:
    print(f"missing {missing}, unexpected {result.unexpected_keys}")
    sys.exit(1)
model.eval()
x = np.fromfile(sys.argv[2], dtype="<f4").reshape(2, 8, 8, 3)
with torch.no_grad():
    y = model(torch.from_numpy(x).permute(0, 3, 1, 2).contiguous())
y.numpy().astype("<f4").tofile(sys.argv[3] + ".logits")
with open(sys.argv[3] + ".txt", "w") as f:
    f.write(repr(model) + "\n")
print(f"torch {torch.__version__}: {len(state)} tensors loaded, logits written")
