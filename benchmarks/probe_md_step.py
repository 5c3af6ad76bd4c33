"""Where one ASE MD step of a small molecule goes on the GPU host (issue 5's "≤ 0.20 ms per MD step" target).

Times, in one run on one benzene (the shipped student ``builtin:chno-gfn2``, fp32, ``StudentCalculator`` mode
"auto" = the captured step with a Verlet-skin list), median µs over many repetitions:

* ``ase floor``: velocity Verlet with an ASE ``Calculator`` that only hands back stored forces (ASE's integrator
  plus its Calculator base class's per-call work: the atoms' copy and compare);
* ``ase's integrator alone``: the same with a bare object that returns stored forces (no Calculator base class);
* ``md``: velocity Verlet through ``StudentCalculator`` (wall clock per step); then with the calculator's copy of
  the atoms made while the device computes (``store_while_running``, shipped since stop 46) and before the launch,
  twice; with check_state's "no change" read from the stored copy's bytes (``snapshot_check``, stop 47) and by
  the general comparison, twice; then with the speculative launch
  (``ForceEngine.speculative_verlet``: the step launched before the displacement test) off and on, twice; then
  with the zero-copy step (``ForceEngine.zero_copy``, stop 66: the positions read and the output written in host
  memory by the captured step's own kernels) off and on, twice; with the next step launched ahead
  (``StudentCalculator.launch_ahead``, stop 66: its positions predicted at the end of a calculation) off and on,
  twice (the later rows run without it);
* ``md, no model``: the same with the copies, the engine's padded step replaced by a zero output buffer (host
  work, both copies and the Verlet test: everything but the GPU step; with zero forces the atoms fly
  ballistically and the list is rebuilt only every few dozen steps, which the median leaves out);
* ``replay + sync``: the captured step alone, ``replay()`` then ``torch.cuda.synchronize()``;
* ``launch``: how long ``replay()`` takes to return (the CPU cost of the graph launch);
* ``engine device path``: what the engine does per MD step around the replay: positions into the page-locked
  staging buffer, one host-to-device copy into the static positions, the replay, one blocking device-to-host
  copy of the packed output into page-locked memory;
* ``copies in the graph``: the same three transfers with both copies captured in one graph with the step (the
  page-locked buffers' addresses are fixed), so a step is a host write, one launch, one stream sync and a read;
  checked to give the same forces as the engine path;
* a 192-atom water box random-walking ~0.01 Å per call, ``get_forces`` with the speculative launch off and on.

    python benchmarks/probe_md_step.py --out benchmarks/results [--name probe_md_step_h100]
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
from harness import wall_us, write_lines

from mlff_distiller import StudentCalculator, load_model
from mlff_distiller.cudagraph import GraphRunner
from mlff_distiller.engine_padded import unpack


def _md_us(atoms, calc, steps: int) -> tuple[float, float]:
    from ase import units
    from ase.md.verlet import VelocityVerlet

    atoms.calc = calc
    dyn = VelocityVerlet(atoms, timestep=0.5 * units.fs)
    dyn.run(100)
    stamps: list[float] = []
    dyn.attach(lambda: stamps.append(time.perf_counter()), interval=1)
    dyn.run(steps)
    t = np.diff(stamps) * 1e6
    return float(np.median(t)), float(np.percentile(t, 20))


def _water_walk(steps: int) -> list[tuple[str, float, float]]:
    """``StudentCalculator.get_forces`` on a 192-atom water box whose atoms random-walk ~0.01 Å per call (an MD
    step's motion; the water student's architecture with random weights, which real MD would not survive), with
    the speculative launch off and on, alternating."""
    from systems import water_box

    from mlff_distiller import StudentModel

    torch.manual_seed(0)
    model = StudentModel(species=[1, 8], hidden=128, layers=3, n_rbf=20, cutoff=5.0)
    atoms = water_box(192, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calc = StudentCalculator(model, device="cuda")
    atoms.calc = calc
    rng = np.random.default_rng(0)

    def one():
        atoms.positions = atoms.positions + rng.normal(0, 0.01, atoms.positions.shape)
        atoms.get_forces()

    rows = []
    for rnd in (1, 2):
        for spec in (False, True):
            calc.engine.speculative_verlet = spec
            label = f"192-atom water random walk, get_forces, speculative {'on' if spec else 'off'} (round {rnd})"
            rows.append((label, *wall_us(one, steps)))
    return rows


def stored_calculator(forces):
    """An ASE ``Calculator`` that hands back ``forces`` (and energy 0) for any atoms: ASE's integrator plus its
    Calculator base class's per-call work (the atoms' copy and compare), the floor under any calculator."""
    from ase.calculators.calculator import Calculator, all_changes

    class Stored(Calculator):
        implemented_properties = ("energy", "forces")

        def calculate(self, atoms=None, properties=("energy",), system_changes=all_changes):
            super().calculate(atoms, properties, system_changes)
            self.results = {"energy": 0.0, "forces": forces.copy()}

    return Stored()


def _benzene():
    from ase.build import molecule

    from mlff_distiller.ase_compat import maxwell_boltzmann

    atoms = molecule("C6H6")
    maxwell_boltzmann(atoms, 300, rng=np.random.default_rng(0))
    return atoms


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--name", default="probe_md_step_h100")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--model", default="builtin:chno-gfn2", help="the student (builtin:chno-gfn2-small: 64 x 3)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_md_step: needs CUDA")
        return
    import triton

    model = load_model(args.model)
    rows: list[tuple[str, float, float]] = []

    class Bare:  # not an ASE Calculator: what ASE's velocity Verlet costs by itself
        def __init__(self, forces):
            self.forces = forces

        def get_forces(self, atoms):
            return self.forces.copy()

        def get_potential_energy(self, atoms=None, force_consistent=False):
            return 0.0

    atoms = _benzene()
    forces = np.zeros((len(atoms), 3))
    rows.append(("ase floor (stored forces, ASE's Calculator)", *_md_us(atoms, stored_calculator(forces), args.steps)))
    rows.append(
        (
            "ase's integrator alone (a bare object returning stored forces)",
            *_md_us(_benzene(), Bare(forces), args.steps),
        )
    )

    atoms = _benzene()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calc = StudentCalculator(model, device="cuda")
    rows.append(("md (StudentCalculator, mode auto)", *_md_us(atoms, calc, args.steps)))
    calc.launch_ahead = False  # the next rows time the step's other parts as before stop 66's launch ahead
    for rnd in (1, 2):  # the calculator's copy of the atoms made while the device computes (shipped) or before
        for during in (True, False):
            StudentCalculator.store_while_running = during
            label = f"md, atoms stored {'during the step' if during else 'before the launch'} (round {rnd})"
            rows.append((label, *_md_us(atoms, calc, args.steps)))
    StudentCalculator.store_while_running = True
    for rnd in (1, 2):  # check_state's "no change" from the stored copy's bytes (shipped since stop 47) or not
        for snap in (True, False):
            StudentCalculator.snapshot_check = snap
            label = f"md, unchanged atoms by {'the stored bytes' if snap else 'the general comparison'} (round {rnd})"
            rows.append((label, *_md_us(atoms, calc, args.steps)))
    StudentCalculator.snapshot_check = True
    eng = calc.engine
    for rnd in (1, 2):  # the speculative launch (the step before the displacement test) off and on, alternating
        for spec in (False, True):
            eng.speculative_verlet = spec
            label = f"md, speculative launch {'on' if spec else 'off'} (round {rnd})"
            rows.append((label, *_md_us(atoms, calc, args.steps)))
    eng.speculative_verlet = None
    for rnd in (1, 2):  # the zero-copy step (shipped since stop 66) against the copies, alternating
        for zero in (False, True):
            eng.zero_copy = zero
            label = f"md, zero-copy step {'on' if zero else 'off (the copies)'} (round {rnd})"
            rows.append((label, *_md_us(atoms, calc, args.steps)))
    eng.zero_copy = None
    for rnd in (1, 2):  # the next velocity-Verlet step launched ahead (stop 66) off and on, alternating
        for ahead in (False, True):
            calc.launch_ahead = ahead
            taken = eng.n_ahead_taken
            label = f"md, next step launched ahead {'on' if ahead else 'off'} (round {rnd})"
            rows.append((label, *_md_us(atoms, calc, args.steps)))
            if ahead:
                got = f"{eng.n_ahead_taken - taken} taken, {eng.n_ahead_missed} missed so far"
                got += f", {eng.verlet.n_builds} list builds"
                rows.append((f"  (launches ahead in that run: {got})", 0.0, 0.0))
    calc.launch_ahead = False  # the rows below time the parts of a step without it
    eng.zero_copy = False  # ... and the bucket's plain graph with the copies
    fill = eng._verlet_fill
    bucket, graph, static_pos, staging = fill.bucket, fill.graph, fill.positions, fill.staging
    eng._run(bucket, graph, capture=True)
    runner = eng._runners[bucket]
    n = len(atoms)

    real_run = eng._run
    zeros = torch.zeros_like(runner.outputs)  # zero energies and forces: the atoms fly ballistically (rare rebuilds)
    eng._run = lambda b, g, stress=False: zeros
    rows.append(("md, no model (host work, copies, Verlet test)", *_md_us(atoms, calc, args.steps)))
    eng._run = real_run

    def replay_sync():
        runner.replay()
        torch.cuda.synchronize()

    rows.append(("replay + sync", *wall_us(replay_sync, args.steps)))
    launch = np.empty(args.steps)
    for i in range(args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner.replay()
        launch[i] = time.perf_counter() - t0
    torch.cuda.synchronize()
    rows.append(("launch (replay() returns)", float(np.median(launch) * 1e6), float(np.percentile(launch, 20) * 1e6)))

    pos = atoms.positions.astype(np.float32)
    host_out = eng._host_out[(bucket, False)]

    def engine_path():
        staging.copy_(torch.from_numpy(pos))
        static_pos.copy_(staging, non_blocking=True)
        packed = runner.replay()
        host_out.copy_(packed)
        return unpack(host_out.numpy(), bucket.atoms, n, 1)["forces"].copy()

    rows.append(("engine device path (H2D, replay, blocking D2H)", *wall_us(engine_path, args.steps)))
    want = engine_path()

    pin_in = torch.empty((n, 3), dtype=torch.float32, pin_memory=True)
    pin_out = torch.empty_like(host_out, pin_memory=True)

    def step_with_copies(*inputs):
        inputs[1][:n].copy_(pin_in, non_blocking=True)
        out = eng._step(*inputs)
        pin_out.copy_(out, non_blocking=True)
        return out

    pin_in.copy_(torch.from_numpy(pos))
    with torch.no_grad():
        whole = GraphRunner(step_with_copies, graph)
    pin_in_np, pin_out_np = pin_in.numpy(), pin_out.numpy()
    stream = torch.cuda.current_stream()

    def in_graph():
        np.copyto(pin_in_np, pos)
        whole.replay()
        stream.synchronize()
        return unpack(pin_out_np, bucket.atoms, n, 1)["forces"].copy()

    rows.append(("copies in the graph (host write, launch, stream sync, read)", *wall_us(in_graph, args.steps)))
    got = in_graph()
    diff = float(np.abs(got - want).max())

    rows += _water_walk(args.steps)
    lines = [
        "# probe_md_step.py: one benzene MD step on the GPU host, piece by piece",
        "",
        f"{torch.cuda.get_device_name()} · torch {torch.__version__} · triton {triton.__version__} · bucket "
        f"{bucket} · {args.model} · {args.steps} repetitions each",
        "",
        "| what | median µs | p20 µs |",
        "|---|---:|---:|",
        *(f"| {name} | {med:.1f} | {p20:.1f} |" for name, med, p20 in rows),
        "",
        f"copies in the graph vs the engine path: max |ΔF| = {diff:.3e} eV/Å",
    ]
    write_lines(lines, args.out, args.name)


if __name__ == "__main__":
    main()
