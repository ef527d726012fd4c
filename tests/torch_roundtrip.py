#!/usr/bin/env python3
"""torch_roundtrip.py IN OUT: the PyTorch side of the checkpoint round-trip test.

Reads kiln's IN with safetensors.torch.load_file, checks the values kiln wrote (element i of each
tensor is i * 0.25 - 3, in its dtype), and writes OUT with safetensors.torch.save_file: each
tensor times two, in the same dtype, plus nothing else. Exit 0 on success, 2 when torch or
safetensors is missing (the test skips), 1 on a wrong value.
"""
import sys

try:
    import torch
    from safetensors.torch import load_file, save_file
except ImportError as e:
    print(f"missing: {e}")
    sys.exit(2)

tensors = load_file(sys.argv[1])
for name, t in sorted(tensors.items()):
    want = (torch.arange(t.numel(), dtype=torch.float64) * 0.25 - 3).to(t.dtype).reshape(t.shape)
    if not torch.equal(t, want):
        print(f"{name}: {t.dtype} {list(t.shape)} differs from what kiln should have written")
        sys.exit(1)
    print(f"{name}: {t.dtype} {list(t.shape)} ok")
save_file({k: (v * 2).contiguous() for k, v in tensors.items()}, sys.argv[2])
print(f"torch {torch.__version__}: read {len(tensors)} tensors, wrote {sys.argv[2]}")
