#!/usr/bin/env python3
"""torch_cnn_roundtrip.py: checks that kiln's mnist_cnn net and the same net in PyTorch agree,
with weights going both ways.

    KILN_TF32=0 build/mnist_cnn --epochs 1 --save-weights w.safetensors --dump-logits l.f32
    python3 bench/torch_cnn_roundtrip.py w.safetensors l.f32 [--exe build/mnist_cnn] [--data DIR]

or, to let it train one epoch itself first (with KILN_TF32=0):

    python3 bench/torch_cnn_roundtrip.py --exe build/mnist_cnn

1. kiln to PyTorch: loads kiln's weights file (mnist_cnn's default net; safetensors, PyTorch's
   names and layouts: conv weights (Cout, Cin, kh, kw)) into the equivalent torch.nn.Module (NCHW,
   flattened in PyTorch's order), runs the first 16 MNIST test images through it in evaluation
   mode and compares its logits with the (16, 10) little-endian f32 logits mnist_cnn wrote.
2. PyTorch to kiln: changes every weight a little (so that kiln's own file would not do), saves
   the module's state_dict with safetensors.torch.save_file, has `mnist_cnn --eval-only FILE
   --dump-logits OUT` load it, and compares kiln's logits with PyTorch's for that file.

TF32 is off on both sides (torch.backends flags here, KILN_TF32=0 for the mnist_cnn this script
runs; run mnist_cnn yourself with KILN_TF32=0 too). The test images are read here from the idx
files in --data (default $KILN_MNIST, else data/mnist) and normalised as mnist_cnn does. Logits
agree when every difference is within 1e-4 of the largest logit's magnitude (--tol).
Exit 0 when both directions agree, 2 when torch, numpy or safetensors is missing, 1 otherwise.
"""
import argparse
import gzip
import os
import struct
import subprocess
import sys
import tempfile

try:
    import numpy as np
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from safetensors.torch import load_file, save_file
except ImportError as e:
    print(f"missing: {e}")
    sys.exit(2)

HERE = os.path.dirname(os.path.abspath(__file__))
N_IMAGES = 16
MEAN, STD = 0.1307, 0.3081  # mnist_cnn's normalisation (pytorch/examples')


class MnistNet(nn.Module):
    """mnist_cnn's default net, pytorch/examples' MNIST net: logits, no final log_softmax."""

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


def read_idx_images(data_dir, count):
    """The first count images of t10k-images-idx3-ubyte[.gz] in data_dir, as (count, 28, 28) u8."""
    for name in ("t10k-images-idx3-ubyte", "t10k-images-idx3-ubyte.gz"):
        path = os.path.join(data_dir, name)
        if os.path.isfile(path):
            break
    else:
        raise SystemExit(f"no t10k-images-idx3-ubyte[.gz] in {data_dir} (pass --data DIR)")
    with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
        magic, n, rows, cols = struct.unpack(">IIII", f.read(16))
        if magic != 0x803 or rows != 28 or cols != 28 or n < count:
            raise SystemExit(f"{path}: not an idx file of at least {count} 28x28 images")
        raw = f.read(count * rows * cols)
    if len(raw) != count * rows * cols:
        raise SystemExit(f"{path}: truncated")
    return np.frombuffer(raw, dtype=np.uint8).reshape(count, rows, cols)


def normalise(images):
    """As kiln_dataset_from_mnist does, in f32: (pixel / 255 - mean) / std; (N, 1, 28, 28)."""
    x = images.astype(np.float32) / np.float32(255.0)
    x = (x - np.float32(MEAN)) / np.float32(STD)
    return torch.from_numpy(x.reshape(-1, 1, 28, 28).copy())


def read_logits(path):
    raw = np.fromfile(path, dtype="<f4")
    if raw.size != N_IMAGES * 10:
        raise SystemExit(f"{path}: {raw.size} f32 values, not {N_IMAGES} x 10 logits")
    return torch.from_numpy(raw.astype(np.float32).reshape(N_IMAGES, 10))


def compare(what, kiln_logits, torch_logits, tol):
    """Prints how kiln's and PyTorch's logits differ; True when within tol of the logits' scale."""
    k, t = kiln_logits.double(), torch_logits.double().cpu()
    scale = t.abs().max().item()
    diff = (k - t).abs().max().item()
    rel = diff / max(scale, 1e-30)
    same_class = int((k.argmax(1) == t.argmax(1)).sum())
    ok = rel <= tol and bool(torch.isfinite(k).all())
    print(f"{what}: {N_IMAGES} images x 10 logits, largest |logit| {scale:.4f}, largest "
          f"difference {diff:.3e} ({rel:.2e} of it; tolerance {tol:g}), same class for "
          f"{same_class}/{N_IMAGES}: {'ok' if ok else 'MISMATCH'}")
    if not ok:
        print(f"  kiln   {k[0].tolist()}\n  torch  {t[0].tolist()}")
    return ok


def run_kiln(cmd):
    env = dict(os.environ, KILN_TF32="0")
    print("running: KILN_TF32=0 " + " ".join(cmd), flush=True)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.stdout.write(out.stdout[-4000:])
        sys.stdout.write(out.stderr[-4000:])
        raise SystemExit(f"mnist_cnn exited with {out.returncode}")
    for line in out.stdout.splitlines():
        if "test accuracy" in line:
            print("  " + line)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("weights", nargs="?", help="mnist_cnn --save-weights file")
    ap.add_argument("logits", nargs="?", help="mnist_cnn --dump-logits file (same run)")
    ap.add_argument("--exe", default=os.path.join(HERE, "..", "build", "mnist_cnn"),
                    help="the mnist_cnn binary (default build/mnist_cnn)")
    ap.add_argument("--data", default=os.environ.get("KILN_MNIST") or "data/mnist",
                    help="MNIST idx directory (default $KILN_MNIST, else data/mnist)")
    ap.add_argument("--tol", type=float, default=1e-4)
    args = ap.parse_args()
    if (args.weights is None) != (args.logits is None):
        ap.error("give both WEIGHTS and LOGITS, or neither")

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = "cuda" if torch.cuda.is_available() else "cpu"
    exe_found = os.path.isfile(args.exe) and os.access(args.exe, os.X_OK)
    data = os.path.abspath(args.data)
    x = normalise(read_idx_images(data, N_IMAGES)).to(device)  # (16, 1, 28, 28)

    with tempfile.TemporaryDirectory(prefix="kiln_cnn_roundtrip_") as tmp:
        weights, logits = args.weights, args.logits
        if weights is None:
            if not exe_found:
                raise SystemExit(f"no mnist_cnn at {args.exe}: build it or pass --exe")
            weights, logits = os.path.join(tmp, "kiln.safetensors"), os.path.join(tmp, "kiln.f32")
            run_kiln([args.exe, data, "--epochs", "1", "--save-weights", weights,
                      "--dump-logits", logits])

        # 1. kiln's weights in PyTorch
        state = load_file(weights)
        print(f"{weights}: " + ", ".join(f"{k} {tuple(v.shape)} {str(v.dtype)[6:]}"
                                          for k, v in sorted(state.items())))
        net = MnistNet()
        net.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
        net = net.to(device).eval()
        with torch.no_grad():
            want = net(x)
        ok = compare("kiln -> torch", read_logits(logits), want, args.tol)

        # 2. PyTorch's (changed) weights in kiln
        if not exe_found:
            print(f"no mnist_cnn at {args.exe}: the torch -> kiln direction needs it (--exe)")
            return 1
        with torch.no_grad():
            for name, p in net.named_parameters():
                i = torch.arange(p.numel(), device=p.device, dtype=torch.float32).reshape(p.shape)
                p.mul_(1 + 0.05 * torch.sin(i + len(name)))
            want = net(x)
        torch_file = os.path.join(tmp, "torch.safetensors")
        save_file({k: v.detach().cpu().contiguous() for k, v in net.state_dict().items()},
                  torch_file)
        print(f"saved the changed state_dict with safetensors.torch.save_file: {torch_file}")
        back = os.path.join(tmp, "back.f32")
        run_kiln([args.exe, data, "--eval-only", torch_file, "--dump-logits", back])
        ok = compare("torch -> kiln", read_logits(back), want, args.tol) and ok
    print(f"torch {torch.__version__} on {device}: " + ("both directions agree" if ok else
                                                       "MISMATCH (was mnist_cnn run with "
                                                       "KILN_TF32=0?)"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
