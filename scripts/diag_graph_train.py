"""GPU diagnostic: where does the CUDA-graph training step part from the eager static step?

    python scripts/diag_graph_train.py

Trains the tiny set-up of tests/distill/test_training_static.py (its ``_cfg``, on EMT-labelled H2O/CH4/NH3)
for n = 1, 2, 3, 4, 6 and 12 steps in the modes cudagraph, static and plain (float64, CUDA) and prints the
largest weight difference and the parameter it is in, with EMA and clipping on and off, so a one-step
offset (a lost or doubled step), a frozen learning rate or EMA weight, or
mere rounding noise can be told apart.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "distill"))

from ase.build import molecule
from ase.calculators.emt import EMT
from ase.calculators.singlepoint import SinglePointCalculator
from test_training_static import _cfg  # the set-up under diagnosis (tests/distill is on sys.path above)

from mlff_distiller.distill import split_frames, train

DEVICE = sys.argv[1] if len(sys.argv) > 1 else "cuda"


def frames():
    import numpy as np

    rng = np.random.default_rng(0)
    out = []
    for name in ("H2O", "CH4", "NH3") * 8:
        a = molecule(name)
        a.positions += rng.normal(0, 0.05, a.positions.shape)
        a.calc = EMT()
        e, f = a.get_potential_energy(), a.get_forces()
        a.calc = SinglePointCalculator(a, energy=e, forces=f)
        out.append(a)
    return out


def cfg(mode, **kw):
    """The configuration of the test this script diagnoses, on ``DEVICE``, without validation in between."""
    return _cfg(mode, **{"device": DEVICE, "eval_every": 1000, **kw})


def maxdiff(a, b):
    sa, sb = a.model.state_dict(), b.model.state_dict()
    worst = max(sa, key=lambda k: float((sa[k] - sb[k]).abs().max()))
    return float((sa[worst] - sb[worst]).abs().max()), worst


def main():
    tr, va = split_frames(frames(), 0.2)
    short = len(sys.argv) > 2 and sys.argv[2] == "short"  # a ~1-minute version: torch kernels only
    steps = (1, 2, 3, 12) if short else (1, 2, 3, 4, 6, 12)
    cases = [("ema+clip", "torch", {}), ("no ema/clip", "torch", dict(ema_decay=0.0, grad_clip=0.0))]
    if not short:
        cases.insert(1, ("ema+clip", "triton", {}))
    for label, kernels, extra in cases:
        if True:
            for n in steps:
                kw = dict(max_steps=n, kernels=kernels, **extra)
                logs = []
                g = train(tr, va, cfg("cudagraph" if DEVICE == "cuda" else "static", **kw), log=logs.append)
                s = train(tr, va, cfg("static", **kw), log=lambda m: None)
                p = train(tr, va, cfg("plain", **kw), log=lambda m: None)
                s2 = train(tr, va, cfg("static", **kw), log=lambda m: None) if n == 12 else s
                gs, gsk = maxdiff(g, s)
                print(
                    f"{label:16s} {kernels:6s} n={n:2d} captures={g.captures} graph-static {gs:.2e} ({gsk}) "
                    f"static-plain {maxdiff(s, p)[0]:.2e} static-static {maxdiff(s, s2)[0]:.2e}",
                    flush=True,
                )
                if n == 12 and any("failed" in m for m in logs):
                    print("   ", [m for m in logs if "fail" in m])


if __name__ == "__main__":
    main()
