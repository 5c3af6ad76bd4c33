"""The host's side of an ASE MD step through ``StudentCalculator``, on the CPU: no device needed.

On the GPU host the benzene MD step is host-bound (the 49 µs dense step is launched ahead and overlaps the host's
work: stop 77, stop 78's ``probe_md_phases.py``), so its time is that of the integrator, the calculator and the
engine's bookkeeping. This probe runs the same CUDA-path code on the CPU: the engine on the padded Verlet path's
zero-copy step with a stand-in capture whose "replay" hands back one stored step's output (the forces then stay
those of the first step; a time step of 0.02 fs keeps the atoms near where they started, so the list is built once
and every launch ahead is taken). What is left is the host work of the GPU path without the GPU. The development
CPU runs it at about the GPU host's fast phase (``harness.host_work_us`` 41-46 µs here, 40-50 there).

    python benchmarks/probe_md_host_cpu.py [--steps 2000] [--rounds 5] [--profile]

Prints the min and median µs a step over the rounds, the launches ahead taken, and with ``--profile`` the top
functions by their own time under cProfile (calls a step, own µs, cumulative µs). Stop 78: 66.8-70.3 µs a step
(min of 5) at the start of the stop, 52.9-56.4 at its end.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import host_work_us


class StoredRunner:
    """A stand-in for :class:`~mlff_distiller.cudagraph.GraphRunner`: the first replay runs the step, every later
    one returns that output (the device's share of a step taken out)."""

    def __init__(self, fn, graph) -> None:
        self.fn, self.graph, self.out = fn, graph, None

    def replay(self):
        if self.out is None:
            self.out = self.fn(*self.graph.inputs())
        return self.out


class ChainRunner:
    """The stand-in for the chained steps' captures (``--chain``): every replay runs the step, whose model part
    (:func:`_stored_step`) hands back one stored output while the device's prediction of the positions runs."""

    def __init__(self, fn, graph) -> None:
        self.fn, self.graph = fn, graph

    def replay(self):
        return self.fn(*self.graph.inputs())


def _stored_step(step):
    """``step`` run once; every later call returns (a copy of) that first output: the model's share taken out."""
    kept = []

    def stored(*inputs):
        if not kept:
            kept.append(step(*inputs))
        return kept[0].clone()

    return stored


def _chain_stand_in():
    """Patch :class:`~mlff_distiller._md_chain.MDChain` so that its captures are :class:`ChainRunner` replays of a
    stored model output (:func:`_stored_step`) behind the device's prediction of the positions made in NumPy (ASE's
    arithmetic, as ``verlet_predict``: the same bits; torch's CPU ops for it cost ~350 µs a step here, a captured
    kernel on the GPU): the chained MD regime (``ForceEngine.chain_ahead``, ``keep_chained``) on the CPU, its host
    work as on the GPU host. Returns the undo."""
    from mlff_distiller import _md_chain, engine_padded
    from mlff_distiller.cudagraph import copy_bits

    real_init = _md_chain.MDChain.__init__

    def chained(self, k, positions, packed, static, step):
        n, stored = self.n, _stored_step(step)
        prev = packed[1 - k].array[self.rows].reshape(-1, 3)[:n]
        consts, x, p, out = self.consts.array, self.x[k].array, self.p[k].array, positions[k].array

        def chained_step(*inputs):
            kick = prev.astype(np.float64) * consts[0]
            pn = p + kick
            pn += kick
            np.subtract(x + (pn * consts[1]) / consts[5:].reshape(n, 1), consts[2:5], out=out, casting="unsafe")
            static.copy_(torch.from_numpy(out))
            result = stored(*inputs)
            copy_bits(result, packed[k].view)
            return result

        return chained_step

    def init(self, engine, md, fill, n, step):
        runner, engine_padded.GraphRunner = engine_padded.GraphRunner, ChainRunner
        try:
            real_init(self, engine, md, fill, n, step)
        finally:
            engine_padded.GraphRunner = runner

    real_chained = _md_chain.MDChain._chained
    _md_chain.MDChain._chained, _md_chain.MDChain.__init__ = chained, init

    def undo():
        _md_chain.MDChain._chained, _md_chain.MDChain.__init__ = real_chained, real_init

    return undo


def setup(model: str = "builtin:chno-gfn2-small", warm: int = 70, chain: bool = False):
    """``(dyn, calc)``: velocity Verlet of benzene through a CPU calculator on the zero-copy Verlet path, with
    :class:`StoredRunner` captures, after ``warm`` steps (captured, launches ahead taken). ``chain``: the chained
    steps on (:func:`_chain_stand_in`, which the caller has applied)."""
    from ase import units
    from ase.build import molecule
    from ase.md.verlet import VelocityVerlet

    from mlff_distiller import ForceEngine, StudentCalculator, engine_padded, load_model
    from mlff_distiller.ase_compat import maxwell_boltzmann

    student = load_model(model)
    atoms = molecule("C6H6")
    maxwell_boltzmann(atoms, 300, rng=np.random.default_rng(2))
    calc = StudentCalculator(student, device="cpu", precision="fp32", check_domain=None)
    calc.engine = ForceEngine(student, device="cpu", precision="fp32", pad=True, neighbor_skin=1.0)
    calc.engine.mode, calc.engine.zero_copy, calc.engine.speculative_verlet = "cudagraph", True, True
    # Chained steps (ForceEngine.chain_ahead) only with --chain: a plain stored output cannot stand in for a step
    # that predicts its own positions (they would stay the first ones, and every chained step would be dropped);
    # _chain_stand_in runs the prediction around a stored model output.
    calc.engine.chain = chain
    engine_padded.GraphRunner, real = StoredRunner, engine_padded.GraphRunner
    try:
        atoms.calc = calc
        dyn = VelocityVerlet(atoms, timestep=0.02 * units.fs)
        dyn.run(warm)
    finally:
        engine_padded.GraphRunner = real
    return dyn, calc


def step_us(dyn, steps: int, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        dyn.run(steps)
        out.append((time.perf_counter() - t0) / steps * 1e6)
    return out


def ab_express_rows(dyn, steps: int, rounds: int) -> list[str]:
    """``ForceEngine.express_take`` off and on, alternating for ``rounds`` pairs of ``steps`` steps (the development
    CPU's speed drifts, so the pairs are compared, not the rounds' overall spread): each pair's µs a step and their
    ratio, then the median ratio."""
    eng = dyn.atoms.calc.engine
    lines = ["", "| pair | express_take off µs | on µs | on / off |", "|---|---:|---:|---:|"]
    ratios = []
    try:
        for k in range(rounds):
            pair = []
            for on in (False, True):
                eng.express_take = on
                dyn.run(20)
                pair.append(step_us(dyn, steps, 1)[0])
            ratios.append(pair[1] / pair[0])
            lines.append(f"| {k + 1} | {pair[0]:.1f} | {pair[1]:.1f} | {ratios[-1]:.3f} |")
    finally:
        del eng.express_take  # (the instance attribute set above: the class's default again)
    lines.append(
        f"\nmedian on / off {float(np.median(ratios)):.3f}; on faster in {sum(r < 1 for r in ratios)} of {rounds}"
    )
    return lines


def profile_rows(dyn, steps: int, top: int) -> list[str]:
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    dyn.run(steps)
    prof.disable()
    rows = []
    for (path, line, name), (_, calls, own, cum, _) in pstats.Stats(prof).stats.items():
        rows.append((calls / steps, own / steps * 1e6, cum / steps * 1e6, f"{Path(path).name}:{line}:{name}"))
    rows.sort(key=lambda r: -r[1])
    lines = ["", "| function | calls a step | own µs | cumulative µs |", "|---|---:|---:|---:|"]
    lines += [f"| {r[3]} | {r[0]:.2f} | {r[1]:.2f} | {r[2]:.2f} |" for r in rows[:top]]
    lines.append(f"\n{sum(r[0] for r in rows):.0f} Python-level calls a step (under the profiler)")
    return lines


def main(argv: list[str] | None = None) -> list[str]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--model", default="builtin:chno-gfn2-small")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--ab-express", type=int, default=0, help="then this many pairs of express_take off / on")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--chain", action="store_true", help="the chained MD regime (the 128 x 3 student's on the GPU)")
    args = p.parse_args(argv)
    from mlff_distiller import engine_padded

    # The stand-in stays for the whole run: a long one (some 14,000 steps) rebuilds its list, and a new bucket's
    # capture then takes a StoredRunner too.
    engine_padded.GraphRunner, real = StoredRunner, engine_padded.GraphRunner
    undo = _chain_stand_in() if args.chain else (lambda: None)
    try:
        dyn, calc = setup(args.model, chain=args.chain)
        host = host_work_us()
        times = step_us(dyn, args.steps, args.rounds)
        eng = calc.engine
        lines = [
            f"host work µs (harness.host_work_us): {host:.1f}",
            f"MD step, host only: min {min(times):.1f} µs, median {float(np.median(times)):.1f} µs over "
            f"{args.rounds} rounds of {args.steps} steps; launches ahead taken {eng.n_ahead_taken}, missed "
            f"{eng.n_ahead_missed}; list builds {eng.verlet.n_builds}; chained {eng.n_chained}, kept unpredicted "
            f"{eng.n_chain_kept}, dropped {eng.n_chain_dropped}",
        ]
        if args.profile:
            lines += profile_rows(dyn, args.steps, args.top)
        if args.ab_express:
            lines += ab_express_rows(dyn, args.steps, args.ab_express)
    finally:
        engine_padded.GraphRunner = real
        undo()
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
