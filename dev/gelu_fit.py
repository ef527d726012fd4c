#!/usr/bin/env python3
"""Fits the polynomial of the exact GELU's one-exponential tail (fusion/device/math.cuh).

    Phi(-a) = t * P(t) * exp(-a^2 / 2),  a = |x|,  t = 1 / (1 + K a)

(the form t P(t) exp(-a^2 / 2) / 2, with the 1/2 folded into P). P, of degree DEG, is fitted
by least squares in float64 to F(t) / t, F(t) = Phi(-a) exp(a^2 / 2), weighted by 1 / (F / t) so
that the error minimised is relative, on 4000 Chebyshev nodes of t in [1 / (1 + K A_MAX), 1], in the
Chebyshev basis (well conditioned), then converted to powers of t; for float32, from the highest
power down, each coefficient is rounded and the lower ones are fitted again.

Why not all of (0, 1]: beyond |x| = 14.43 exp(-x^2 / 2) is 0 in float32 (it is below half the
smallest subnormal), so P's values for |x| > A_MAX = 14.5 are never seen; and F is not analytic at
t = 0 (its expansion in 1 / a is only asymptotic), which costs degree 8 a factor of 15 (--lo 0).

Prints the coefficients as C literals (highest power first, Horner's order) and the maximum
relative error of Phi(-a) over a dense grid of a in [0, A_MAX], with the float64 coefficients and
with the float32 ones. Needs numpy (Debian: python3-numpy).

    python3 dev/gelu_fit.py [--deg 8] [--lo T]
"""
import argparse
import math

import numpy as np
from numpy.polynomial import Chebyshev, Polynomial

K = float(np.float32(0.35))  # t = 1 / (1 + K |x|), K as the kernel has it: 0.35f
A_MAX = 14.5  # the largest |x| whose exp(-x^2 / 2) is not 0 in float32 (14.43), rounded up


def f_over_t(t):
    """F(t) / t = Phi(-a) exp(a^2 / 2) / t in float64, a = (1 / t - 1) / K."""
    out = []
    for ti in np.atleast_1d(t):
        a = (1.0 / ti - 1.0) / K
        if a <= 20.0:
            f = 0.5 * math.erfc(a / math.sqrt(2.0)) * math.exp(0.5 * a * a)
        else:  # Laplace's continued fraction for Mills' ratio (exp underflows or overflows)
            r = 0.0
            for k in range(200, 0, -1):
                r = k / (a + r)
            f = 1.0 / (a + r) / math.sqrt(2.0 * math.pi)
        out.append(f / ti)
    return np.array(out)


def fit(deg, lo, n=4000):
    """P's coefficients, lowest power first, fitted on n Chebyshev nodes of t in [lo, 1]: the
    float64 fit, and the float32 one (from the highest power down, each coefficient is rounded
    to float32 and the lower ones are fitted again to what is left)."""
    j = np.arange(n)
    t = lo + (1.0 - lo) * 0.5 * (1.0 + np.cos(np.pi * (j + 0.5) / n))
    g = f_over_t(t)
    p32 = np.zeros(deg + 1)
    for k in range(deg, -1, -1):
        rest = g - np.polyval(p32[::-1], t)
        v = np.polynomial.chebyshev.chebvander((2.0 * t - 1.0 - lo) / (1.0 - lo), k) / g[:, None]
        c = np.linalg.lstsq(v, rest / g, rcond=None)[0]
        p = Chebyshev(c, domain=[lo, 1.0]).convert(kind=Polynomial).coef
        p64 = p if k == deg else p64
        p32[k] = np.float32(p[k])
    return p64, p32.astype(np.float32)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--deg", type=int, default=8)
    ap.add_argument("--lo", type=float, default=1.0 / (1.0 + K * A_MAX), help="fit t in [lo, 1]")
    args = ap.parse_args()
    p, p32 = fit(args.deg, args.lo)
    a = np.linspace(0.0, A_MAX, 100001)
    t = 1.0 / (1.0 + K * a)
    g = f_over_t(t)
    err64 = np.max(np.abs(np.polyval(p[::-1], t) / g - 1.0))
    err32 = np.max(np.abs(np.polyval(p32.astype(np.float64)[::-1], t) / g - 1.0))
    print(f"degree {args.deg}, t in [{args.lo:.4f}, 1], K = 0.35f = {K!r}")
    print(f"max relative error of Phi(-a), a in [0, {A_MAX}]: {err64:.2e} (float64 coefficients),"
          f" {err32:.2e} (float32)")
    print("P, highest power first:")
    for k in range(args.deg, -1, -1):
        print(f"  {np.format_float_positional(p32[k])}f  /* t^{k} */")


if __name__ == "__main__":
    main()
