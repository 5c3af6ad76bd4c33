"""The first layer's φ(s) from a per-species table (``StudentModel.first_phi_table``): the same energies and forces
as the MLP on every atom, made again when a weight changes, never used where a weight is being trained."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import make_model, random_molecule
from mlff_distiller.kernels import triton_available

from mlff_distiller import AtomsBatch, ForceEngine
from mlff_distiller.model import StudentModel, analytic


def _batch(seed: int = 0, dtype=torch.float64) -> AtomsBatch:
    rng = np.random.default_rng(seed)
    return AtomsBatch.from_atoms([random_molecule(k, rng) for k in (1, 3, 7, 11)], dtype=dtype)


def _graph(model, batch):
    from mlff_distiller.neighbors import neighbor_list

    nl = neighbor_list(batch.positions, batch.cell, batch.pbc, batch.batch, batch.ptr, model.cutoff, "brute")
    return nl.edge_index, nl.shift_vectors


def _energy_forces(model, batch, table: bool):
    """Energies and autograd forces of ``model.forward`` with the species table on or off (weights frozen)."""
    edge_index, shifts = _graph(model, batch)
    old = StudentModel.species_table
    StudentModel.species_table = table
    try:
        pos = batch.positions.clone().requires_grad_(True)
        out = model(batch.numbers, pos, edge_index, shifts, batch.batch, batch.num_structures)
        (grad,) = torch.autograd.grad(out["energy"].sum(), pos)
    finally:
        StudentModel.species_table = old
    return out["energy"].detach(), -grad


def _frozen(model):
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _table_calls(model, monkeypatch) -> list:
    """Records each time the MLP runs on the atoms of the first layer (its first Linear's forward or the MLP call)."""
    from mlff_distiller.model import painn

    calls = []
    real = painn._mlp_call
    first = model.interactions[0].phi

    def spy(mlp, x, residual=False):
        if mlp is first:
            calls.append(x.shape[0])
        return real(mlp, x, residual)

    monkeypatch.setattr(painn, "_mlp_call", spy)
    return calls


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_table_gives_the_mlps_energies_and_forces(backend, monkeypatch):
    """float64 on the CPU (Triton under the interpreter): the table replaces the first layer's MLP (which then
    does not run on the atoms), and energies and forces equal those of the MLP to rounding."""
    if backend == "triton" and not triton_available("cpu"):
        pytest.skip("needs the Triton interpreter (TRITON_INTERPRET=1)")
    monkeypatch.setenv("MLFF_DISTILLER_KERNELS", backend)
    model = _frozen(make_model(seed=3).double())
    batch = _batch()
    calls = _table_calls(model, monkeypatch)
    e_table, f_table = _energy_forces(model, batch, table=True)
    assert calls == []
    e_mlp, f_mlp = _energy_forces(model, batch, table=False)
    assert calls == [batch.num_atoms]
    torch.testing.assert_close(e_table, e_mlp, rtol=0, atol=1e-12)
    torch.testing.assert_close(f_table, f_mlp, rtol=0, atol=1e-12)
    assert float(f_mlp.abs().max()) > 1e-3  # not a comparison of zeros


def test_the_table_is_made_again_when_a_weight_changes():
    model = _frozen(make_model(seed=5).double())
    batch = _batch(1)
    first = model.first_phi_table()
    assert first is not None and model.first_phi_table() is first  # made once
    _energy_forces(model, batch, table=True)
    for w in (model.interactions[0].phi[2].weight, model.embedding.weight, model.interactions[0].phi[0].bias):
        with torch.no_grad():
            w.mul_(1.25).add_(0.01)
        e_table, f_table = _energy_forces(model, batch, table=True)
        e_mlp, f_mlp = _energy_forces(model, batch, table=False)
        torch.testing.assert_close(e_table, e_mlp, rtol=0, atol=1e-12)
        torch.testing.assert_close(f_table, f_mlp, rtol=0, atol=1e-12)
    assert model.first_phi_table() is first  # refreshed in place: a captured graph's address stays valid


def test_training_runs_the_mlp_and_reaches_its_weights():
    """Weights that require grad under grad mode: no table, and the first layer's φ weights get their gradient."""
    model = make_model(seed=2).double()
    assert model.first_phi_table() is None
    batch = _batch(2)
    edge_index, shifts = _graph(model, batch)
    out = model(batch.numbers, batch.positions, edge_index, shifts, batch.batch, batch.num_structures)
    out["energy"].sum().backward()
    for p in (model.interactions[0].phi[0].weight, model.interactions[0].phi[2].weight, model.embedding.weight):
        assert p.grad is not None and float(p.grad.abs().max()) > 0
    with torch.no_grad():  # evaluation without gradients may use it
        assert model.first_phi_table() is not None


def test_the_table_leaves_no_trace_of_tf32():
    """The table is the MLP in float64, rounded once: a float32 model's table is float64's rounded to float32."""
    model = _frozen(make_model(seed=7))
    table = model.first_phi_table()
    wide = _frozen(make_model(seed=7).double()).first_phi_table()
    assert table.dtype == torch.float32 and table.shape == (len(model.species_list), 3 * model.config.hidden)
    assert torch.equal(table, wide.float())


def test_the_cpu_steps_written_out_backward_with_and_without_the_table():
    """The analytic CPU step (which also skips the first layer's dE/dφ) in float64: the same energies and
    gradients with the table as with the MLP, and as the autograd path."""
    model = _frozen(make_model(seed=9).double())
    batch = _batch(3)
    edge_index, shifts = _graph(model, batch)
    args = (batch.numbers, batch.positions, edge_index, shifts, batch.batch, batch.num_structures)
    with_table = analytic.energy_and_gradients(model, *args)
    StudentModel.species_table = False
    try:
        without = analytic.energy_and_gradients(model, *args)
    finally:
        StudentModel.species_table = True
    for a, b in zip(with_table, without, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    engine = ForceEngine(model, device="cpu", precision="fp64", analytic=False)
    want = engine.compute(batch, to_host=True)
    torch.testing.assert_close(-with_table[2], want["forces"], rtol=0, atol=1e-11)
    torch.testing.assert_close(with_table[0], want["energy"], rtol=0, atol=1e-11)


@pytest.mark.parametrize("moments", [False, True])
def test_species_inputs_kernel_gives_the_torch_ops_energies_and_forces(moments, monkeypatch):
    """float64 under the interpreter, frozen weights: the first inputs from kernels.species_inputs (one kernel;
    with the first φ rows only where the first layer does not run from the radial moments) give the energies and
    forces of the torch ops bit for bit; with weights that require grad the torch ops run."""
    from mlff_distiller.kernels import species_moments as sm

    from mlff_distiller import kernels

    if not triton_available("cpu"):
        pytest.skip("needs the Triton interpreter (TRITON_INTERPRET=1)")
    monkeypatch.setenv("MLFF_DISTILLER_KERNELS", "triton")
    monkeypatch.setitem(sm._CONFIG, "model_min_degree", 0 if moments else 10**9)
    model = _frozen(make_model(seed=4).double())
    batch = _batch(4)
    calls = []
    real = kernels.species_inputs
    monkeypatch.setattr(kernels, "species_inputs", lambda *a: calls.append(a[3] is not None) or real(*a))
    e_fused, f_fused = _energy_forces(model, batch, table=True)
    assert calls == [not moments]  # φ rows asked for only without the moments
    monkeypatch.setattr(StudentModel, "species_inputs_fused", False)
    e_ops, f_ops = _energy_forces(model, batch, table=True)
    assert calls == [not moments]
    assert torch.equal(e_fused, e_ops) and torch.equal(f_fused, f_ops)
    assert float(f_ops.abs().max()) > 1e-3
    monkeypatch.setattr(StudentModel, "species_inputs_fused", True)
    for p in model.parameters():
        p.requires_grad_(True)
    _energy_forces(model, batch, table=True)
    assert calls == [not moments]  # training: the torch ops
