"""The MD step's phase timers (benchmarks/probe_md_phases.py): they time what they wrap, leave the results unchanged
and restore every method they wrapped, inherited or not."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from ase.build import molecule

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import probe_md_phases

from mlff_distiller import ForceEngine, StudentCalculator


def test_timers_wrap_count_and_restore(model):
    before = {(m, c, a): None for m, c, a in probe_md_phases.PIECES}
    own_compute = "compute" in vars(ForceEngine)
    inherited = "_verlet_list" in vars(ForceEngine)
    originals = (StudentCalculator.calculate, ForceEngine.compute, ForceEngine._verlet_list)
    atoms = molecule("H2O")
    atoms.calc = StudentCalculator(model, device="cpu")
    reference = atoms.get_forces().copy()
    timers = probe_md_phases.Timers()
    timers.install()
    try:
        atoms.positions[0, 0] += 0.01
        moved = atoms.get_forces().copy()
        atoms.positions[0, 0] -= 0.01
        again = atoms.get_forces().copy()
    finally:
        timers.remove()
    assert len(before) == len(timers.ns)
    assert timers.calls["StudentCalculator.calculate"] == 2 and timers.calls["ForceEngine.compute"] == 2
    assert timers.ns["StudentCalculator.calculate"] >= timers.ns["ForceEngine.compute"] > 0
    np.testing.assert_allclose(again, reference, rtol=1e-6, atol=1e-7)
    assert not np.allclose(moved, reference)
    assert (StudentCalculator.calculate, ForceEngine.compute, ForceEngine._verlet_list) == originals
    assert ("compute" in vars(ForceEngine)) == own_compute and ("_verlet_list" in vars(ForceEngine)) == inherited
    timers.reset()
    assert set(timers.ns.values()) == {0} and set(timers.calls.values()) == {0}


def test_probe_runs_on_cpu():
    lines = probe_md_phases.run(3, "builtin:chno-gfn2-small", "cpu", rounds=1)
    text = "\n".join(lines)
    assert "| StudentCalculator.calculate |" in text and "| ASE: step minus calculate |" in text
    row = next(line for line in lines if line.startswith("| ForceEngine.compute |"))
    assert float(row.split("|")[2]) > 0 and float(row.split("|")[3]) == 1.0
    assert sum("| 1 | off |" in line or "| 1 | on |" in line for line in lines) == 2
    assert StudentCalculator.reuse_ahead is True


def test_the_cpu_host_probe_takes_every_launch_and_restores_the_runner():
    """probe_md_host_cpu: the CPU stand-in of the GPU path's MD step takes every launch ahead, builds the list once,
    and leaves the engine's GraphRunner as it was."""
    import probe_md_host_cpu

    from mlff_distiller import engine_padded

    real = engine_padded.GraphRunner
    lines = probe_md_host_cpu.main(["--steps", "20", "--rounds", "2", "--profile", "--top", "5", "--ab-express", "2"])
    assert engine_padded.GraphRunner is real
    assert "missed 0; list builds 1" in lines[1] and "MD step, host only: min" in lines[1]
    taken = int(lines[1].split("taken ")[1].split(",")[0])
    assert taken >= 100
    assert sum(line.startswith("| ") for line in lines) == 1 + 5 + 1 + 2  # the profile's and the pairs' tables
    pairs = [line for line in lines if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert len(pairs) == 2 and all(float(p.split("|")[4]) > 0 for p in pairs)
    assert "median on / off" in lines[-1]


def test_the_phases_probe_switches_the_express_take():
    """--ab-switch express_take alternates ForceEngine.express_take (a class attribute) and restores it."""
    lines = probe_md_phases.run(3, "builtin:chno-gfn2-small", "cpu", rounds=1, switch="express_take")
    assert sum("| 1 | off |" in line or "| 1 | on |" in line for line in lines) == 2
    assert "| round | express_take |" in "\n".join(lines)
    assert ForceEngine.express_take is True


def test_the_phases_probe_switches_the_chains_prediction_kernel():
    """--ab-switch device_kernel alternates MDChain.device_kernel (the chains captured again) and restores it."""
    from mlff_distiller._md_chain import MDChain

    lines = probe_md_phases.run(3, "builtin:chno-gfn2-small", "cpu", rounds=1, switch="device_kernel")
    assert sum("| 1 | off |" in line or "| 1 | on |" in line for line in lines) == 2
    assert "| round | device_kernel |" in "\n".join(lines)
    assert MDChain.device_kernel is True


def test_the_phases_probe_switches_the_kept_chained_steps():
    """--ab-switch keep_chained_steps alternates ForceEngine.keep_chained_steps and restores it."""
    lines = probe_md_phases.run(3, "builtin:chno-gfn2-small", "cpu", rounds=1, switch="keep_chained_steps")
    assert sum("| 1 | off |" in line or "| 1 | on |" in line for line in lines) == 2
    assert "| round | keep_chained_steps |" in "\n".join(lines)
    assert ForceEngine.keep_chained_steps is True


def test_the_cpu_host_probe_runs_the_chained_regime_and_restores_the_chain():
    """probe_md_host_cpu --chain: the chained steps with a stored model output and the positions predicted in NumPy
    (ASE's arithmetic): every chained step after the first is kept unpredicted and taken, none dropped, and MDChain
    is put back as it was."""
    import probe_md_host_cpu

    from mlff_distiller import engine_padded
    from mlff_distiller._md_chain import MDChain

    real = (engine_padded.GraphRunner, MDChain.__init__, MDChain._chained)
    lines = probe_md_host_cpu.main(["--steps", "20", "--rounds", "2", "--chain"])
    assert (engine_padded.GraphRunner, MDChain.__init__, MDChain._chained) == real
    assert "missed 0; list builds 1" in lines[1] and "dropped 0" in lines[1]
    chained = int(lines[1].split("chained ")[1].split(",")[0])
    kept = int(lines[1].split("kept unpredicted ")[1].split(",")[0])
    assert chained >= 100 and kept == chained
