"""Where the host's time goes in one ASE MD step of benzene through ``StudentCalculator``, by manual timers (issue 5's
"≤ 0.20 ms per MD step"). Stop 77's cProfile of the step (``probe_md_profile.py``) spread the time thinly and its
attributions did not add up on the GPU host, so this probe wraps a fixed list of the step's pieces in
``perf_counter_ns`` timers instead: each piece's inclusive µs a step (mean over the timed steps), its calls a step,
and the step's wall clock with and without the timers (their own cost). ASE's share is the step minus
``StudentCalculator.calculate``. The host's speed (``harness.host_work_us``) is read before and after, since the GPU
host runs in a fast and a slow phase (stop 77).

    python benchmarks/probe_md_phases.py --steps 3000 > md_phases.txt

On a machine without CUDA the same pieces are timed on the CPU path (no launch ahead, no captured step): the timers'
plumbing is then what is checked, not the GPU host's split.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import host_work_us
from probe_md_step import _benzene

# (module, class or None, attribute): the pieces timed, in the order they are printed. A class attribute is wrapped
# on the class (every instance); a module function is wrapped in each module named beside it that imported it.
PIECES = (
    ("mlff_distiller.calculator", "StudentCalculator", "calculate"),
    ("mlff_distiller.calculator", "StudentCalculator", "_batch"),
    ("mlff_distiller.calculator", "StudentCalculator", "_store_atoms"),
    ("mlff_distiller.calculator", "StudentCalculator", "_launch_ahead"),
    ("mlff_distiller.calculator", "StudentCalculator", "_verlet_next"),
    ("mlff_distiller.calculator", "StudentCalculator", "_moved"),
    ("mlff_distiller.calculator", "StudentCalculator", "_check_domain"),
    ("mlff_distiller.engine", "ForceEngine", "compute"),
    ("mlff_distiller.engine", "ForceEngine", "_check_species"),
    ("mlff_distiller.engine", "ForceEngine", "_exact_float64_batch"),
    ("mlff_distiller.engine", "ForceEngine", "_compute_padded_verlet"),
    ("mlff_distiller.engine", "ForceEngine", "_zero_copy_for"),
    ("mlff_distiller.engine", "ForceEngine", "_take_ahead"),
    ("mlff_distiller.engine", "ForceEngine", "_take_launched"),
    ("mlff_distiller.engine", "ForceEngine", "_md_launch"),
    ("mlff_distiller.engine", "ForceEngine", "_verlet_list"),
    ("mlff_distiller.engine", "ForceEngine", "launch_ahead"),
    ("mlff_distiller.engine", "ForceEngine", "_overlap"),
    ("mlff_distiller.cudagraph", "GraphRunner", "replay"),
    ("torch.cuda", "Stream", "synchronize"),
    ("mlff_distiller.engine_verlet", None, "unpack"),
    # finer: what launch_ahead and the Verlet path check around the launch; the calculator's side of ASE's requests
    ("mlff_distiller.engine", "ForceEngine", "_speculates"),
    ("mlff_distiller.engine", "ForceEngine", "_dense_of"),
    ("mlff_distiller.engine", "ForceEngine", "_verlet_list_order"),
    ("mlff_distiller.engine_verlet", None, "_verlet_args"),
    ("mlff_distiller.neighbors.verlet", "VerletNeighborList", "needs_rebuild"),
    ("mlff_distiller.neighbors.verlet", "VerletNeighborList", "same_inputs"),
    ("mlff_distiller.neighbors.verlet", "_HostDisplacement", "moved_far"),
    ("torch.cuda", None, "current_stream"),
    ("mlff_distiller.calculator", "StudentCalculator", "_chain_ahead"),
    ("mlff_distiller.engine", "ForceEngine", "chain_ahead"),
    ("mlff_distiller.engine", "ForceEngine", "keep_chained"),
    ("mlff_distiller.engine", "ForceEngine", "_launch_takeable"),
    ("mlff_distiller._md_chain", "MDChain", "queue"),
    ("mlff_distiller.engine", "ForceEngine", "_wait"),
    ("mlff_distiller.calculator", "StudentCalculator", "get_property"),
    ("mlff_distiller.calculator", "StudentCalculator", "check_state"),
)


class Timers:
    """Inclusive ns and call counts per piece; ``install`` wraps, ``remove`` restores."""

    def __init__(self) -> None:
        self.ns: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self._undo: list[tuple[object, str, object]] = []

    def _wrap(self, name: str, fn):
        ns, calls, clock = self.ns, self.calls, time.perf_counter_ns
        ns[name], calls[name] = 0, 0

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                ns[name] += clock() - t0
                calls[name] += 1

        return timed

    def install(self, pieces=PIECES) -> None:
        for mod_name, cls_name, attr in pieces:
            owner = importlib.import_module(mod_name)
            if cls_name is not None:
                owner = getattr(owner, cls_name)
            # (an inherited method is wrapped on the class named, and deleted from it again on remove)
            own = attr in vars(owner)
            fn = getattr(owner, attr)
            name = f"{cls_name}.{attr}" if cls_name else attr
            self._undo.append((owner, attr, fn if own else None))
            setattr(owner, attr, self._wrap(name, fn))

    def remove(self) -> None:
        for owner, attr, fn in reversed(self._undo):
            if fn is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, fn)
        self._undo.clear()

    def reset(self) -> None:
        for k in self.ns:
            self.ns[k] = self.calls[k] = 0


def _mean_step_us(dyn, steps: int) -> float:
    t0 = time.perf_counter()
    dyn.run(steps)
    return (time.perf_counter() - t0) / steps * 1e6


# The switches --ab-switch alternates: class attributes, on by default, of the calculator or of its engine.
AB_SWITCHES = {
    "reuse_ahead": "calculator",
    "express_take": "engine",
    "chain": "engine",
    "keep_chained_steps": "engine",
    "device_kernel": "chain",
}


def ab_rows(dyn, steps: int, rounds: int, switch: str = "reuse_ahead") -> list[str]:
    """The class switch ``switch`` (``StudentCalculator.reuse_ahead``, ``ForceEngine.express_take``,
    ``ForceEngine.chain``, ``ForceEngine.keep_chained_steps`` or ``MDChain.device_kernel``: the chains captured
    again) off and on,
    alternating for ``rounds`` rounds of ``steps`` steps each: the mean µs a step of each, with the host's speed
    before the round."""
    from mlff_distiller._md_chain import MDChain

    calc = dyn.atoms.calc
    owner = {"calculator": type(calc), "engine": type(calc.engine), "chain": MDChain}[AB_SWITCHES[switch]]
    lines = ["", f"| round | {switch} | host work µs | mean µs a step |", "|---|---|---:|---:|"]
    try:
        for k in range(rounds):
            for on in (False, True):
                setattr(owner, switch, on)
                if owner is MDChain:
                    calc.engine._md_chains.clear()  # captured again, with the switch as set, in the warm-up steps
                dyn.run(20)
                host = host_work_us(200)
                lines.append(f"| {k + 1} | {'on' if on else 'off'} | {host:.1f} | {_mean_step_us(dyn, steps):.1f} |")
    finally:
        setattr(owner, switch, True)
    return lines


def run(steps: int, model: str, device: str, rounds: int = 0, switch: str = "reuse_ahead") -> list[str]:
    from ase import units
    from ase.md.verlet import VelocityVerlet

    from mlff_distiller import StudentCalculator, load_model

    atoms = _benzene()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        atoms.calc = StudentCalculator(load_model(model), device=device, precision="fp32")
    dyn = VelocityVerlet(atoms, timestep=0.5 * units.fs)
    dyn.run(min(300, steps))
    before = host_work_us()
    plain = _mean_step_us(dyn, steps)
    timers = Timers()
    timers.install()
    try:
        dyn.run(min(100, steps))
        timers.reset()
        t0 = time.perf_counter()
        dyn.run(steps)
        timed = (time.perf_counter() - t0) / steps * 1e6
    finally:
        timers.remove()
    after_plain = _mean_step_us(dyn, steps)
    after = host_work_us()
    eng = atoms.calc.engine
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    lines = [
        f"# {name}, torch {torch.__version__}; benzene, {model}, fp32, {steps} steps a row",
        f"# host work µs (harness.host_work_us): {before:.1f} before, {after:.1f} after",
        f"# mean µs a step without timers: {plain:.1f} before, {after_plain:.1f} after; with timers: {timed:.1f}",
        f"# launches ahead taken {eng.n_ahead_taken}, missed {eng.n_ahead_missed}; list builds {eng.verlet.n_builds}",
        "",
        "| piece (inclusive) | µs a step | calls a step |",
        "|---|---:|---:|",
    ]
    calc_us = timers.ns["StudentCalculator.calculate"] / steps / 1e3
    lines.append(f"| step (wall, timed) | {timed:.1f} | 1 |")
    lines.append(f"| ASE: step minus calculate | {timed - calc_us:.1f} | |")
    for key, ns in timers.ns.items():
        lines.append(f"| {key} | {ns / steps / 1e3:.1f} | {timers.calls[key] / steps:.2f} |")
    if rounds:
        lines += ab_rows(dyn, steps, rounds, switch)
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--model", default="builtin:chno-gfn2-small")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--ab-rounds", type=int, default=0, help="then --ab-switch off / on, alternating")
    p.add_argument("--ab-switch", choices=sorted(AB_SWITCHES), default="reuse_ahead")
    args = p.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    print("\n".join(run(args.steps, args.model, device, args.ab_rounds, args.ab_switch)))


if __name__ == "__main__":
    main()
