"""How rounding a stored second moment stochastically biases AdamW's update: a model of the compact
state's second moment, in numpy, with no optimizer.

Each step, AdamW's second moment moves by a thousandth of itself (beta2 = 0.999), far less than the
gap between two codes of an 8-bit format. Rounded stochastically, the stored value is right on
average, but it walks around the exact one: each step adds rounding noise, and beta2 keeps it for
about a thousand steps. The update divides by the square root of the stored value, and the mean of
``1 / sqrt`` of a noisy value is larger than ``1 / sqrt`` of its mean, so the update comes out
larger than the exact moments' on average.

The model: one block of ``--elements`` gradients, each drawn from a normal distribution whose
standard deviation is spread log-uniformly over ``--spread`` binades. The exact second moment is
kept beside the stored one, which is rounded (to nearest or stochastically) at every step to a grid
of small floats relative to the block's largest value, as the compact format stores it (a positive
value never rounds to 0). Printed, for each grid: the mean of ``sqrt(v_exact / v_stored)`` over
the elements and the steps after ``--burn`` (the update's size against the exact moments', for the
same first moment), and the root mean square of its logarithm (the noise).

    python bench/second_moment_noise.py

The grids: ``v e5m3`` is the compact format's second moment (5 exponent bits, 3 mantissa bits);
``v e4m4`` the same byte with one more mantissa bit and 16 binades; ``sqrt(v) ...`` store the
square root of the second moment instead. This is a model: it leaves out the first moment, the
learning rate and the training it feeds back into.
"""

from __future__ import annotations

import argparse

import numpy as np


def grid(mant_bits: int, exp_bits: int) -> np.ndarray:
    """The values of an unsigned 8-bit small float whose largest code is 1, with 0 (no
    subnormals)."""
    vals = {0.0}
    for e in range(1, 2**exp_bits):
        for m in range(2**mant_bits):
            vals.add((1 + m / 2**mant_bits) * 2.0 ** (e - 2**exp_bits))
    v = np.array(sorted(vals))
    return v / v.max()


def round_to(values: np.ndarray, codes: np.ndarray, rng: np.random.Generator, stochastic: bool) -> np.ndarray:
    """``values`` (each in [0, 1]) rounded to ``codes``: stochastically or to nearest; a positive
    value never to 0."""
    i = np.searchsorted(codes, values, side="left").clip(1, len(codes) - 1)
    lo, hi = codes[i - 1], codes[i]
    frac = np.where(hi > lo, (values - lo) / (hi - lo), 0.0)
    up = rng.random(values.shape) < frac if stochastic else frac >= 0.5
    out = np.where(up, hi, lo)
    return np.where((out == 0) & (values > 0), codes[1], out)


def simulate(
    codes: np.ndarray, a: argparse.Namespace, stochastic: bool, store_sqrt: bool
) -> tuple[float, float]:
    """Mean and RMS log of ``sqrt(v_exact / v_stored)`` after ``a.burn`` steps."""
    rng = np.random.default_rng(a.seed)
    sigma = 2.0 ** rng.uniform(-a.spread, 0, a.elements)
    exact = sigma**2
    stored = exact.copy()
    ratios = []
    for t in range(a.steps):
        g2 = (rng.standard_normal(a.elements) * sigma) ** 2
        exact = a.beta2 * exact + (1 - a.beta2) * g2
        x = a.beta2 * stored + (1 - a.beta2) * g2
        if store_sqrt:
            s = np.sqrt(x)
            scale = s.max()
            stored = (round_to(s / scale, codes, rng, stochastic) * scale) ** 2
        else:
            scale = x.max()
            stored = round_to(x / scale, codes, rng, stochastic) * scale
        if t >= a.burn:
            ratios.append(np.sqrt(exact / stored))
    r = np.array(ratios)
    return float(r.mean()), float(np.sqrt((np.log(r) ** 2).mean()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--elements", type=int, default=256, help="elements of the block")
    ap.add_argument("--spread", type=float, default=4.0, help="binades the gradients' scales spread over")
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--burn", type=int, default=1000, help="steps left out of the means")
    ap.add_argument("--beta2", type=float, default=0.999)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print("grid            rounding     update vs exact   rms log")
    for name, codes, store_sqrt in (
        ("v e5m3", grid(3, 5), False),
        ("v e4m4", grid(4, 4), False),
        ("sqrt(v) e5m3", grid(3, 5), True),
        ("sqrt(v) e4m4", grid(4, 4), True),
    ):
        for stochastic in (True, False):
            mean, rms = simulate(codes, a, stochastic, store_sqrt)
            rounding = "stochastic" if stochastic else "nearest"
            print(f"{name:15} {rounding:12} {mean:15.4f} {rms:9.3f}")


if __name__ == "__main__":
    main()
