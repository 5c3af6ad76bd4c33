"""Stop 36: which g2 replica blows up in 2,000 K Langevin (probe_hot_md.py), and how. Runs the probe's 2,000 K batch
with the wall in chunks of 10 steps keeping the last finite state; at the failure, names the replica and steps it
alone from that state (NVE, fp64 and fp32), printing per step its shortest pair, largest force and energy."""

import sys
import warnings

import numpy as np

warnings.simplefilter("ignore")
from mlff_distiller import BatchedMD, StudentCalculator, load_model  # noqa: E402
from mlff_distiller.batching import NonFiniteOutputError  # noqa: E402
from mlff_distiller.distill.seeds import g2_chno  # noqa: E402

wall = sys.argv[1] != "nowall" if len(sys.argv) > 1 else True
model = load_model("builtin:chno-gfn2")
if not wall:
    model.set_repulsion(None)
structures = [a for a in g2_chno() for _ in range(16)]
failure = None
for seed in range(int(sys.argv[2]) if len(sys.argv) > 2 else 1):
    md = BatchedMD(model, structures, temperature_K=2000.0, seed=seed, check_domain=500)
    saved = None
    try:
        while md.nsteps < 10000:
            saved = (md._batch.positions.clone(), md._momenta.clone(), md.nsteps)
            md.run(10)
    except NonFiniteOutputError as exc:
        failure = exc
        break
    print("seed", seed, "no failure in", md.nsteps, "steps", flush=True)
if failure is not None:
    exc = failure
    bad = exc.indices
    print("wall", wall, "failed at", md.nsteps, "replicas", bad, [structures[k].get_chemical_formula() for k in bad])
    pos, mom, step = saved
    ptr = md.ptr
    for k in bad[:2]:
        a = structures[k].copy()
        a.positions = pos[ptr[k] : ptr[k + 1]].cpu().numpy()
        a.set_momenta(mom[ptr[k] : ptr[k + 1]].cpu().numpy())
        d = a.get_all_distances()
        np.fill_diagonal(d, np.inf)
        print(
            " replica",
            k,
            a.get_chemical_formula(),
            "at step",
            step,
            "shortest pair",
            d.min().round(3),
            "KE/atom eV",
            round(a.get_kinetic_energy() / len(a), 3),
        )
        print(" symbols", a.get_chemical_symbols())
        print(" distances\n", np.round(d, 2))
        for precision in ("fp32", "fp64"):
            b = a.copy()
            b.set_momenta(a.get_momenta())
            b.calc = StudentCalculator(model, precision=precision)
            from ase.md.verlet import VelocityVerlet

            dyn = VelocityVerlet(b, timestep=0.5 * 0.09822694788464063)
            for s in range(12):
                try:
                    dyn.run(1)
                    dd = b.get_all_distances()
                    np.fill_diagonal(dd, np.inf)
                    i, j = np.unravel_index(dd.argmin(), dd.shape)
                    print(
                        "  ",
                        precision,
                        s,
                        "shortest",
                        dd.min().round(3),
                        b.get_chemical_symbols()[i] + b.get_chemical_symbols()[j],
                        "max |F|",
                        np.abs(b.get_forces()).max().round(2),
                        "E",
                        round(b.get_potential_energy(), 3),
                    )
                except Exception as e:
                    print("  ", precision, s, "error:", str(e)[:150])
                    break
