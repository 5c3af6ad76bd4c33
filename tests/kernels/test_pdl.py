"""Programmatic dependent launch (PDL): when the kernels get it, and that it changes no result.

Every Triton kernel of the step (but the pair repulsion's two, kernels/repulsion.py) takes a ``PDL`` constexpr and
starts with ``pdl_prologue`` (wait for the previous grid, then release the next); ``pdl_args`` decides per launch. Off
on the CPU interpreter, under torch.compile's tracing and with ``MLFF_DISTILLER_PDL=0``; on for CUDA tensors on sm90+.
On the GPU the energy + forces step with PDL on must agree with the step with it off as closely as two runs with it off
agree with each other (the forces' scatter to the atoms uses atomics, so run-to-run differences of a few ulp are normal;
a kernel that read its input before the previous grid had written it would differ by far more).
"""

import os
import subprocess
import sys

import pytest
import torch
from mlff_distiller.kernels import _triton_utils
from mlff_distiller.kernels._triton_utils import pdl_args, pdl_enabled

from mlff_distiller import AtomsBatch, ForceEngine, StudentModel


def test_off_on_the_cpu():
    assert pdl_args(torch.zeros(3)) == {"PDL": False}
    with pdl_enabled(True):
        assert pdl_args(torch.zeros(3, dtype=torch.float64)) == {"PDL": False}


def test_context_restores():
    before = _triton_utils._PDL["on"]
    with pdl_enabled(not before):
        assert _triton_utils._PDL["on"] is (not before)
        with pdl_enabled(before):
            assert _triton_utils._PDL["on"] is before
        assert _triton_utils._PDL["on"] is (not before)
    assert _triton_utils._PDL["on"] is before


@pytest.mark.parametrize(("value", "on"), [(None, True), ("1", True), ("", True), ("0", False), (" 0 ", False)])
def test_environment_value(value, on):
    assert _triton_utils._pdl_from_env(value) is on


def test_environment_variable_is_read_at_import():
    env = {**os.environ, "MLFF_DISTILLER_PDL": "0"}
    code = "from mlff_distiller.kernels import _triton_utils as t; print(t._PDL['on'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.gpu
def test_on_for_cuda_tensors_on_sm90():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x = torch.zeros(3, device="cuda")
    sm90 = torch.cuda.get_device_capability()[0] >= 9
    with pdl_enabled(True):
        assert pdl_args(x) == ({"PDL": True, "launch_pdl": True} if sm90 else {"PDL": False})
    with pdl_enabled(False):
        assert pdl_args(x) == {"PDL": False}


@pytest.mark.gpu
def test_off_while_compiling(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pdl_enabled(True):
        assert pdl_args(torch.zeros(3, device="cuda")) == {"PDL": False}


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["cudagraph", "eager"])
def test_step_with_pdl_equals_without(mode):
    """Benzene, a batch of small molecules and a periodic water box: energies and forces with PDL on equal those
    with PDL off bitwise, captured (cudagraph) and eager."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from ase.build import molecule
    from ase.collections import g2

    torch.manual_seed(0)
    species = sorted({int(z) for a in g2 for z in a.numbers})
    model = StudentModel(species=species)
    water = molecule("H2O")
    water.set_cell([3.1, 3.1, 3.1])
    water.center()
    box = water.repeat((4, 4, 4))  # 192 atoms, periodic
    box.positions += torch.rand(len(box), 3, dtype=torch.float64).numpy() * 0.3
    box.pbc = True
    cases = [[molecule("C6H6")], [list(g2)[k % len(g2)] for k in range(64)], [box]]
    for atoms in cases:
        res = []
        for on in (False, False, True):
            with pdl_enabled(on):
                engine = ForceEngine(model, device="cuda", precision="fp32", mode=mode)
                batch = AtomsBatch.from_atoms(atoms, dtype=engine.dtype)
                engine.compute(batch)
                res.append(engine.compute(batch, to_host=True))
        off, off2, on = res
        assert torch.isfinite(off["forces"]).all() and torch.isfinite(on["forces"]).all()
        for key in ("energy", "forces"):
            noise = (off2[key] - off[key]).abs().max().item()
            scale = off[key].abs().max().item()
            diff = (on[key] - off[key]).abs().max().item()
            msg = f"{key}: PDL on vs off {diff:.3e}, off vs off {noise:.3e}"
            assert diff <= 4 * noise + 1e-6 * max(1.0, scale), msg
