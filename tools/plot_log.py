#!/usr/bin/env python3
"""plot_log.py LOG.jsonl OUT.svg [--title TEXT]: draws the curves of a kiln example's --log.

Left panel: the training loss logged every few steps, and the test loss after each epoch, against
the step. Right panel: the test accuracy after each epoch. Writes a self-contained SVG (no
plotting library needed).
"""
import argparse
import json
import math

W, H, PAD = 440, 300, 52


def ticks(lo, hi, n=5):
    span = hi - lo if hi > lo else 1.0
    raw = span / n
    mag = 10 ** math.floor(math.log10(raw))
    step = min((m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw), default=raw)
    first = math.ceil(lo / step) * step
    out, v = [], first
    while v <= hi + 1e-9 * span:
        out.append(round(v, 10))
        v += step
    return out


def panel(x0, title, series, xlabel, ylabel, fmt, legend_top=True):
    """series: list of (points, colour, label, dots); the legend sits top or bottom right."""
    xs = [p[0] for s in series for p in s[0]]
    ys = [p[1] for s in series for p in s[0]]
    xlo, xhi = min(xs), max(xs)
    ylo, yhi = min(ys), max(ys)
    if yhi == ylo:
        yhi = ylo + 1
    ylo, yhi = ylo - 0.05 * (yhi - ylo), yhi + 0.05 * (yhi - ylo)
    if xhi == xlo:
        xhi = xlo + 1
    sx = lambda x: x0 + PAD + (x - xlo) / (xhi - xlo) * (W - 1.5 * PAD)
    sy = lambda y: H - PAD + 10 - (y - ylo) / (yhi - ylo) * (H - 1.7 * PAD)
    out = [f'<text x="{x0 + W / 2}" y="22" text-anchor="middle" font-weight="bold">{title}</text>',
           f'<rect x="{sx(xlo)}" y="{sy(yhi)}" width="{sx(xhi) - sx(xlo)}" '
           f'height="{sy(ylo) - sy(yhi)}" fill="none" stroke="#444"/>']
    for t in ticks(ylo, yhi):
        out.append(f'<line x1="{sx(xlo)}" x2="{sx(xhi)}" y1="{sy(t)}" y2="{sy(t)}" stroke="#ddd"/>')
        out.append(f'<text x="{sx(xlo) - 6}" y="{sy(t) + 4}" text-anchor="end">{fmt(t)}</text>')
    for t in ticks(xlo, xhi):
        out.append(f'<text x="{sx(t)}" y="{sy(ylo) + 16}" text-anchor="middle">{t:g}</text>')
    out.append(f'<text x="{x0 + PAD + (W - 1.5 * PAD) / 2}" y="{H - 6}" '
               f'text-anchor="middle">{xlabel}</text>')
    out.append(f'<text x="{x0 + 14}" y="{H / 2}" text-anchor="middle" '
               f'transform="rotate(-90 {x0 + 14} {H / 2})">{ylabel}</text>')
    for i, (pts, colour, label, dots) in enumerate(series):
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="1.5"/>')
        if dots:
            out += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{colour}"/>'
                    for x, y in pts]
        ly = sy(yhi) + 16 + 16 * i if legend_top else sy(ylo) - 8 - 16 * (len(series) - 1 - i)
        out.append(f'<line x1="{sx(xhi) - 120}" x2="{sx(xhi) - 100}" y1="{ly - 4}" y2="{ly - 4}" '
                   f'stroke="{colour}" stroke-width="2"/>')
        out.append(f'<text x="{sx(xhi) - 95}" y="{ly}">{label}</text>')
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("log")
    ap.add_argument("out")
    ap.add_argument("--title", default="mnist_mlp")
    a = ap.parse_args()
    rows = [json.loads(line) for line in open(a.log) if line.strip().startswith("{")]
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    epochs = [r for r in rows if "test_accuracy" in r and "step" in r]
    if not train or not epochs:
        raise SystemExit(f"{a.log}: no training rows or no epoch rows")
    test = [(r["step"], r["test_loss"]) for r in epochs]
    acc = [(r["epoch"], 100 * r["test_accuracy"]) for r in epochs]
    best = max(acc, key=lambda p: p[1])
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * W}" height="{H}" '
           f'font-family="sans-serif" font-size="11">', '<rect width="100%" height="100%" fill="white"/>']
    svg += panel(0, f"{a.title}: loss", [(train, "#1f77b4", "train (every 25 steps)", False),
                                        (test, "#d62728", "test (per epoch)", True)],
                 "step", "cross-entropy", lambda v: f"{v:.2g}")
    svg += panel(W, f"test accuracy (best {best[1]:.2f}% at epoch {best[0]})",
                 [(acc, "#2ca02c", "test accuracy", True)], "epoch", "%", lambda v: f"{v:.2f}",
                 legend_top=False)
    svg.append("</svg>")
    with open(a.out, "w") as f:
        f.write("\n".join(svg) + "\n")


if __name__ == "__main__":
    main()
