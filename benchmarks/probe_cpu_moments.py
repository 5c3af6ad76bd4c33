"""The CPU step (``model/analytic.py``) on periodic water with its first layer from species-resolved radial moments
against the message path, alternating in one process (development CPU, 2 threads): ``ForceEngine.compute`` medians
of 7 calls, three rounds. The water student's architecture (2 species, 128 x 3, 20 RBF, 5 Å), random weights.

    python benchmarks/probe_cpu_moments.py
"""

import sys
import time

import numpy as np
import torch

sys.path.insert(0, "benchmarks")
from mlff_distiller.kernels import species_moments as sm
from systems import water_box

from mlff_distiller import AtomsBatch, ForceEngine, StudentModel

torch.manual_seed(0)
m = StudentModel(species=[1, 8], hidden=128, layers=3, n_rbf=20, cutoff=5.0)
for n_at in (192, 648):
    b = AtomsBatch.from_atoms([water_box(n_at, seed=0)])
    eng = ForceEngine(m, device="cpu")
    res = {}
    for _round in range(3):
        for deg in (16, None):
            sm._CONFIG["model_min_degree"] = deg
            for _ in range(2):
                eng.compute(b)
            ts = []
            for _ in range(7):
                t = time.perf_counter()
                eng.compute(b)
                ts.append(time.perf_counter() - t)
            res.setdefault(deg, []).append(np.median(ts) * 1e3)
    print(
        n_at,
        "atoms: moments (16 edges per atom) ms",
        [round(float(x), 1) for x in res[16]],
        "message path ms",
        [round(float(x), 1) for x in res[None]],
    )
