"""The ZBL wall under a student (``ModelConfig.repulsion``): nothing changes inside the training envelope, below it
every path (autograd, the CPU's written-out backward, the padded step, the Triton ops, stress) gives the wall's
forces, and a relaxation that collapsed without it now ends where the chemistry is."""

import dataclasses
import warnings

import numpy as np
import pytest
import torch
from ase import Atoms
from ase.optimize import FIRE
from helpers import capture_spy, make_model, triclinic_cu
from mlff_distiller.kernels import triton_available, use_backend

from mlff_distiller import AtomsBatch, ForceEngine, StudentCalculator, load_model, predict_forces
from mlff_distiller.batching import NonFiniteOutputError
from mlff_distiller.domain import DomainEnvelope
from mlff_distiller.model import ModelConfig, StudentModel
from mlff_distiller.testing import finite_difference_stress

# The 448th structure of benchmarks/bench_batched_relax.py's rattled g2 set: singlet CH2 with one C-H at 0.74 Å.
# The shipped student pulls that H into the carbon under FIRE (0.74 -> 0.29 Å in three steps, then NaN forces).
CH2_RATTLED = Atoms(
    "CH2",
    positions=[
        [-0.0757015239, -0.1739489015, 0.0009573307],
        [0.0219244297, 0.752039822, -0.4722181042],
        [-0.1904672394, -0.8457248496, -0.2949100583],
    ],
)


def _walled(model: StudentModel, radius: float = 1.3) -> StudentModel:
    """``model`` with a wide wall on every pair of its species (so that test geometries feel it)."""
    s = model.species_list
    model.set_repulsion({(a, b): radius for i, a in enumerate(s) for b in s[i:]})
    return model


def _squeezed() -> list[Atoms]:
    """Two molecules with pairs inside the wall (0.45-1.2 Å) and outside it."""
    a = Atoms("CHNO", positions=[[0, 0, 0], [0.45, 0.1, 0.0], [0.3, 1.0, 0.2], [-0.8, -0.6, 0.9]])
    b = Atoms("OH2", positions=[[0, 0, 0], [0.6, 0.0, 0.1], [-0.3, 1.6, 0.0]])
    return [a, b]


def test_inside_the_envelope_nothing_changes():
    """The shipped student's wall lies below its training data's shortest pairs: on structures inside its envelope
    the energies and forces are those of the student without it, exactly."""
    from mlff_distiller.distill.seeds import g2_chno

    walled = load_model("builtin:chno-gfn2")
    assert walled.config.repulsion, "the shipped student carries its wall"
    bare = load_model("builtin:chno-gfn2")
    bare.set_repulsion(None)
    env = DomainEnvelope.of_model(walled)
    frames = []
    for k, a in enumerate(g2_chno()[:24]):
        a = a.copy()
        a.rattle(0.03, seed=k)
        assert not env.check(a)
        frames.append(a)
    for kw in (dict(precision="fp64"), dict(precision="fp32"), dict(precision="fp64", mode="cudagraph")):
        with pytest.warns(RuntimeWarning) if kw.get("mode") else _nothing():
            got = predict_forces(walled, frames, device="cpu", **kw)
            want = predict_forces(bare, frames, device="cpu", **kw)
        for g, w in zip(got, want, strict=True):
            assert g["energy"] == w["energy"]
            np.testing.assert_array_equal(g["forces"], w["forces"])


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_the_wall_adds_zbl_below_the_radius():
    """Below r_on only ZBL acts on a pair: the student's message for it is gated off, so an O-H dimer's energy is
    the two lone atoms' plus ZBL, and its forces are ZBL's, at any distance there; in the switching region the
    energy is continuous; a pair of elements without a radius is untouched."""
    from mlff_distiller.kernels.repulsion import zbl_energy

    model = make_model()
    frames = _squeezed()
    before = [r["energy"] for r in predict_forces(model, frames, device="cpu", precision="fp64")]
    model.set_repulsion({(1, 8): 0.95})
    after = [r["energy"] for r in predict_forces(model, frames, device="cpu", precision="fp64")]
    assert after[0] == before[0]  # its pairs: C-H, N-H, ... no O-H
    assert after[1] - before[1] > 1.0
    lone = sum(
        r["energy"]
        for r in predict_forces(model, [Atoms("O"), Atoms("H", positions=[[5, 5, 5]])], device="cpu", precision="fp64")
    )
    for r in (0.2, 0.45, 0.6):
        dimer = Atoms("OH", positions=[[0, 0, 0], [r, 0, 0]])
        got = predict_forces(model, [dimer], device="cpu", precision="fp64")[0]
        rt = torch.tensor(r, dtype=torch.float64, requires_grad=True)
        zbl = zbl_energy(rt, 1, 8)
        (dz,) = torch.autograd.grad(zbl, rt)
        assert got["energy"] == pytest.approx(lone + zbl.item(), rel=1e-12)
        np.testing.assert_allclose(got["forces"][1], [-dz.item(), 0, 0], rtol=1e-10)
    energies = []
    for r in np.linspace(0.55, 1.0, 46):  # through the switching region (0.633-0.95 Å) and out of it
        dimer = Atoms("OH", positions=[[0, 0, 0], [r, 0, 0]])
        energies.append(predict_forces(model, [dimer], device="cpu", precision="fp64")[0]["energy"])
    assert np.abs(np.diff(energies)).max() < 1.5  # no jump between 0.01 Å steps


@pytest.mark.parametrize("backend", ["torch"] + (["triton"] if triton_available("cpu") else []))
def test_every_path_gives_the_walls_forces(backend):
    """Autograd (eager), the CPU's written-out backward and the padded step agree with finite differences."""
    model = _walled(make_model())
    frames = _squeezed()
    batch = AtomsBatch.from_atoms(frames)
    results = {}
    with use_backend(backend):
        modes = {
            "analytic": dict(mode="eager"),  # the CPU default: the backward written out
            "autograd": dict(mode="eager", analytic=False),  # the model's forward and autograd
            "padded": dict(mode="cudagraph"),
        }
        for name, kw in modes.items():
            with pytest.warns(RuntimeWarning) if name == "padded" else _nothing():
                engine = ForceEngine(model, device="cpu", precision="fp64", **kw)
            results[name] = engine.compute(batch)
            if backend == "torch":  # (the Triton kernels always take autograd)
                assert engine.n_analytic == (name == "analytic")
    ref = results["autograd"]
    assert ref["forces"].abs().max() > 10  # the wall, not the student's own forces
    for name, out in results.items():
        torch.testing.assert_close(out["energy"], ref["energy"], rtol=1e-12, atol=1e-10, msg=name)
        torch.testing.assert_close(out["forces"], ref["forces"], rtol=1e-10, atol=1e-9, msg=name)
    # Central differences of the energy.
    h = 1e-5
    pos = batch.positions.clone()
    engine = ForceEngine(model, device="cpu", precision="fp64", mode="eager")
    for atom in range(pos.shape[0]):
        for k in range(3):
            e = []
            for sign in (1, -1):
                p = pos.clone()
                p[atom, k] += sign * h
                e.append(engine.compute(dataclasses.replace(batch, positions=p))["energy"].sum().item())
            assert -(e[0] - e[1]) / (2 * h) == pytest.approx(ref["forces"][atom, k].item(), rel=1e-6, abs=1e-5)


def test_stress_with_the_wall():
    """A periodic cell whose Cu-Cu pairs sit inside the wall: σ against strain finite differences."""
    model = make_model()
    model.set_repulsion({(29, 29): 2.6})
    atoms = triclinic_cu().repeat((2, 1, 1))
    atoms.rattle(0.03, seed=2)
    bare = make_model()
    for pad in (False, True):
        engine = ForceEngine(model, device="cpu", precision="fp64", pad=pad)
        sigma = engine.compute(AtomsBatch.from_atoms(atoms), stress=True)["stress"][0].numpy()
        fd = finite_difference_stress(atoms, lambda fr, e=engine: e.compute(AtomsBatch.from_atoms(fr))["energy"])
        np.testing.assert_allclose(sigma, fd, atol=1e-8)
    plain = ForceEngine(bare, device="cpu", precision="fp64").compute(AtomsBatch.from_atoms(atoms), stress=True)
    assert np.abs(sigma - plain["stress"][0].numpy()).max() > 1e-3  # the wall is in it


def test_the_collapsing_relaxation_now_relaxes():
    """ASE's FIRE with the shipped student on the rattled CH2: without the wall the H falls into the carbon and the
    forces stop being finite; with it, the C-H bonds relax to ~1.10 Å like every other rattled CH2."""
    bare = load_model("builtin:chno-gfn2")
    bare.set_repulsion(None)
    atoms = CH2_RATTLED.copy()
    atoms.calc = StudentCalculator(bare, device="cpu")
    with pytest.raises(NonFiniteOutputError):
        FIRE(atoms, logfile=None).run(fmax=0.05, steps=100)

    atoms = CH2_RATTLED.copy()
    atoms.calc = StudentCalculator(load_model("builtin:chno-gfn2"), device="cpu")
    assert FIRE(atoms, logfile=None).run(fmax=0.05, steps=200)
    d = atoms.get_all_distances()
    assert d[0, 1] == pytest.approx(1.10, abs=0.02) and d[0, 2] == pytest.approx(1.10, abs=0.02)


def test_checkpoints_keep_the_wall(tmp_path):
    model = _walled(make_model(), radius=0.8)
    model.save(tmp_path / "walled.pt")
    again = load_model(tmp_path / "walled.pt")
    assert again.config.repulsion == model.config.repulsion
    torch.testing.assert_close(again.repulsion_table, model.repulsion_table)
    frames = _squeezed()
    a = predict_forces(model, frames, device="cpu", precision="fp64")
    b = predict_forces(again, frames, device="cpu", precision="fp64")
    assert [r["energy"] for r in a] == [r["energy"] for r in b]
    # A checkpoint written before the wall existed (no "repulsion" in its config) loads without one.
    payload = torch.load(tmp_path / "walled.pt", weights_only=True)
    del payload["config"]["repulsion"]
    torch.save(payload, tmp_path / "old.pt")
    old = load_model(tmp_path / "old.pt")
    assert old.config.repulsion is None and old.repulsion_table is None


def test_bad_repulsion_configs_are_named():
    with pytest.raises(ValueError, match=r"\(1, 9\).*species"):
        ModelConfig(species=[1, 6], repulsion=[[1, 9, 0.5]])
    with pytest.raises(ValueError, match="cutoff"):
        ModelConfig(species=[1, 6], cutoff=4.0, repulsion=[[1, 6, 4.5]])
    with pytest.raises(ValueError, match=r"\[\[Z_a, Z_b, r_off\]"):
        ModelConfig(species=[1, 6], repulsion=[[1, 6]])
    cfg = ModelConfig(species=[1, 6], repulsion=[[6, 1, 0.7], [1, 1, 0.5]])
    assert cfg.repulsion == [[1, 1, 0.5], [1, 6, 0.7]]


def test_radii_from_the_envelope():
    env = DomainEnvelope(5.0, {(1, 1): 0.62, (1, 6): 0.82}, {1: 4, 6: 4}, 10)
    radii = env.repulsion_radii([6, 1, 8])
    assert radii[(1, 1)] == pytest.approx(0.9 * 0.62) and radii[(1, 6)] == pytest.approx(0.9 * 0.82)
    from ase.data import covalent_radii

    assert radii[(6, 8)] == pytest.approx(0.9 * 0.7 * (covalent_radii[6] + covalent_radii[8]))  # never seen
    assert set(radii) == {(1, 1), (1, 6), (1, 8), (6, 6), (6, 8), (8, 8)}


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["eager", "cudagraph", "compile"])
def test_gpu_paths_give_the_walls_forces(mode):
    """On CUDA (the Triton ops, captured and compiled steps), fp64 and fp32, against the CPU's fp64 forces; and on
    structures inside the wall-free region, the same results with and without the wall."""
    from helpers import benzene

    model = _walled(make_model())
    frames = [*_squeezed(), benzene()]
    frames[2].positions[0] *= 0.8  # a C pressed towards its neighbours
    ref = predict_forces(model, frames, device="cpu", precision="fp64")
    assert max(np.abs(r["forces"]).max() for r in ref) > 10
    for precision, rtol, atol in (("fp64", 1e-9, 1e-8), ("fp32", 1e-4, 2e-3)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = predict_forces(model, frames, device="cuda", precision=precision, mode=mode)
        for g, w in zip(got, ref, strict=True):
            assert g["energy"] == pytest.approx(w["energy"], rel=rtol, abs=atol)
            np.testing.assert_allclose(g["forces"], w["forces"], rtol=rtol, atol=atol * 10)
    walled = load_model("builtin:chno-gfn2")
    bare = load_model("builtin:chno-gfn2")
    bare.set_repulsion(None)
    inside = [benzene()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a = predict_forces(walled, inside, device="cuda", mode=mode)
        b = predict_forces(bare, inside, device="cuda", mode=mode)
    # (not bit for bit: the edge backward's float32 atomics sum in a different order from run to run)
    assert a[0]["energy"] == pytest.approx(b[0]["energy"], rel=1e-6)
    np.testing.assert_allclose(a[0]["forces"], b[0]["forces"], rtol=1e-5, atol=1e-5)


def test_moving_the_student_keeps_or_remakes_its_table():
    """``.to()`` that changes nothing keeps the table (an engine may have captured it); a new dtype remakes it from
    the config, without the float32 table's rounding."""
    from mlff_distiller.kernels import repulsion_table

    model = _walled(make_model(), radius=0.7)
    table = model.repulsion_table
    model.to("cpu")
    assert model.repulsion_table is table
    model.double()
    want = repulsion_table(model.species_list, {(a, b): 0.7 for a, b, _ in model.config.repulsion}, torch.float64)
    assert model.repulsion_table.dtype == torch.float64 and torch.equal(model.repulsion_table, want)
    assert not torch.equal(table.double(), want)  # the float32 table, cast, would differ


@pytest.mark.gpu
def test_stop48_switches_on_cuda(monkeypatch):
    """On CUDA, captured fp32 steps of the wall's squeezed molecules with the two stop-48 switches that shipped (the
    forward's zeros for the forces, ``edge_features._OPTIONS["zero_in_forward"]``; the moments' backward into the
    edge-gradient sink, ``species_moments._CONFIG["into_sink"]``, with the first layer on the moments here at any
    degree) on and off: the sink's path runs inside the capture where on, and the energies and forces equal those
    with both off and the CPU's fp64 ones. (The wall inside the readout, the packed output written in place and the
    repulsion's PDL, tested here until stop 49, gained nothing on the GPU and were dropped:
    benchmarks/results/stop49_gpu/wall_packed_pdl_dropped.diff.)"""
    import importlib

    ef = importlib.import_module("mlff_distiller.kernels.edge_features")
    sm = importlib.import_module("mlff_distiller.kernels.species_moments")
    model = _walled(make_model())
    frames = _squeezed()
    ref = predict_forces(model, frames, device="cpu", precision="fp64")
    monkeypatch.setitem(sm._CONFIG, "model_min_degree", 0)
    into = capture_spy(monkeypatch, "mlff_distiller.kernels.species_moments", "_moments_grads_into")
    got = {}
    for on in (False, True):
        for config, key in ((ef._OPTIONS, "zero_in_forward"), (sm._CONFIG, "into_sink")):
            monkeypatch.setitem(config, key, on)
        into.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got[on] = predict_forces(model, frames, device="cuda", precision="fp32", mode="cudagraph")
        assert (True in into) == on, (on, into)
    for a, b, w in zip(got[True], got[False], ref, strict=True):
        assert a["energy"] == pytest.approx(b["energy"], rel=1e-6, abs=1e-5)
        np.testing.assert_allclose(a["forces"], b["forces"], rtol=1e-5, atol=1e-4)
        assert a["energy"] == pytest.approx(w["energy"], rel=1e-4, abs=2e-3)
        np.testing.assert_allclose(a["forces"], w["forces"], rtol=1e-4, atol=2e-2)
