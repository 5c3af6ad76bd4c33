"""Probe: the chained MD step kept without the host's prediction (``ForceEngine.keep_chained_steps``) against the
host's prediction every step, on systems whose neighbour list rebuilds (water boxes) and on one whose list is
complete (benzene).

For each system and skin, velocity Verlet (0.5 fs, 300 K, the same seeded start) runs ``--steps`` steps through
``StudentCalculator`` twice in one process, keep on and off, alternating ``--rounds`` times. Reported per run: the
mean µs a step, the list's builds and those made ahead of the launch, the launches ahead taken and missed, the
chained steps queued / kept as the launch ahead / of those kept without the host's prediction / dropped, and the
largest difference of the final positions from the keep-off run's, beside that of a second keep-off run: on the
GPU the step's sums (atomics) are not bit-reproducible, so two runs of one trajectory part by float32 roundings
and chaos; keep on / off should part no more than off / off. (On the CPU's stand-in capture the tests hold the two
to the bit: tests/test_md_chain.py.)

    python benchmarks/probe_keep_chained.py --systems benzene,water192,water1500 --steps 400 --rounds 2

On a machine without CUDA the calculators run the CPU path (no launch ahead, no chain): the plumbing is checked,
and every counter reads zero.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mlff_distiller import ForceEngine, StudentCalculator, load_model
from mlff_distiller.ase_compat import maxwell_boltzmann


def system(name: str):
    if name == "benzene":
        from ase.build import molecule

        return molecule("C6H6")
    if name.startswith("water"):
        from bench_large import box

        return box(int(name[5:])).copy()
    raise ValueError(f"unknown system {name!r}: benzene or water<N>")


def run_once(model, name: str, steps: int, skin: float, keep: bool, device: str) -> dict:
    from ase import units
    from ase.md.verlet import VelocityVerlet

    atoms = system(name)
    maxwell_boltzmann(atoms, 300.0, rng=np.random.default_rng(11))
    old = ForceEngine.keep_chained_steps
    ForceEngine.keep_chained_steps = keep
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            calc = StudentCalculator(model, device=device, precision="fp32", skin=skin, check_domain=None)
        atoms.calc = calc
        dyn = VelocityVerlet(atoms, timestep=0.5 * units.fs)
        dyn.run(20)
        t0 = time.perf_counter()
        dyn.run(steps)
        us = (time.perf_counter() - t0) / steps * 1e6
    finally:
        ForceEngine.keep_chained_steps = old
    eng = calc.engine
    return dict(
        us=us,
        positions=atoms.positions.copy(),
        forces=atoms.get_forces().copy(),
        builds=eng.verlet.n_builds if eng.verlet is not None else 0,
        ahead=eng.n_rebuilt_ahead,
        taken=eng.n_ahead_taken,
        missed=eng.n_ahead_missed,
        chained=eng.n_chained,
        adopted=eng.n_chain_adopted,
        kept=eng.n_chain_kept,
        dropped=eng.n_chain_dropped,
        discarded=eng.n_discarded,
    )


def run(systems: list[str], steps: int, rounds: int, skins: list[float], model_name: str, device: str) -> list[str]:
    model = load_model(model_name)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    lines = [
        f"# probe_keep_chained.py: {name}, torch {torch.__version__}, {model_name}, fp32, {steps} steps a run",
        "",
        "| system | skin Å | round | keep | µs a step | builds (ahead) | taken / missed | chained / adopted / "
        "kept / dropped | discarded | max abs dx from keep off, Å |",
        "|---|---:|---:|---|---:|---|---|---|---:|---:|",
    ]
    for s in systems:
        for skin in skins:
            for k in range(rounds):
                # The order alternates by round (on first, then off first): the first run of a round read a few % slower
                # in device-bound rows whose code paths are the same both ways (stop 83, results/stop83_gpu/c/).
                order = (True, False, False) if k % 2 == 0 else (False, False, True)
                runs = [run_once(model, s, steps, skin, keep, device) for keep in order]
                on = runs[order.index(True)]
                off, again = (r for r, keep in zip(runs, order, strict=True) if not keep)
                for keep, r in (("on", on), ("off", off), ("off again", again)):
                    dx = float(np.abs(r["positions"] - off["positions"]).max())
                    lines.append(
                        f"| {s} | {skin:g} | {k + 1} | {keep} | {r['us']:.1f} | {r['builds']} ({r['ahead']}) | "
                        f"{r['taken']} / {r['missed']} | {r['chained']} / {r['adopted']} / {r['kept']} / "
                        f"{r['dropped']} | {r['discarded']} | {dx:.1e} |"
                    )
                    print(lines[-1], flush=True)
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--systems", default="benzene,water192,water1500")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--skins", default="1.0,0.3", help="Verlet skins (Å), comma-separated")
    p.add_argument("--model", default="builtin:chno-gfn2")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    args = p.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    skins = [float(x) for x in args.skins.split(",")]
    print("\n".join(run(args.systems.split(","), args.steps, args.rounds, skins, args.model, device)))


if __name__ == "__main__":
    main()
