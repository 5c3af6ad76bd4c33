"""The MD step queued behind the one in flight with its positions predicted on the device (``ForceEngine.chain_ahead``,
:mod:`mlff_distiller._md_chain`).

On the CPU the engine runs the padded Verlet path's zero-copy step with the stand-in capture (``fake_graphs``), as in
``test_launch_ahead.py``: a queued step runs at its "replay", in order, so every decision is tested here. What must
hold: a trajectory with chained steps is the trajectory without them, bit for bit (a kept step computed exactly what
the calculator would have launched); a chained step whose positions differ from the host's prediction is never taken;
steps are chained only behind a step the call takes. ``test_*_on_cuda`` runs the real captured chain.
"""

import numpy as np
import pytest
import torch
from ase import units
from ase.build import molecule
from ase.md.verlet import VelocityVerlet
from helpers import make_model
from mlff_distiller.kernels import triton_available, use_backend
from mlff_distiller.kernels.verlet_predict import verlet_predict

from mlff_distiller import ForceEngine, StudentCalculator
from mlff_distiller._md_chain import MDChain
from mlff_distiller.ase_compat import maxwell_boltzmann


def _calc(model, chain: bool, skin: float = 1.0) -> StudentCalculator:
    """A CPU calculator on the padded Verlet path's zero-copy step (what a CUDA calculator runs), float32."""
    calc = StudentCalculator(model, device="cpu", precision="fp32", skin=skin, check_domain=None)
    calc.engine = ForceEngine(model, device="cpu", precision="fp32", pad=True, neighbor_skin=skin)
    calc.engine.mode = "cudagraph"
    calc.engine.zero_copy = True
    calc.engine.speculative_verlet = True
    calc.engine.chain = chain
    return calc


def _run(model, chain: bool, steps: int = 40, skin: float = 1.0, temperature: float = 300.0, dt_fs: float = 0.5):
    atoms = molecule("C6H6")
    maxwell_boltzmann(atoms, temperature, rng=np.random.default_rng(4))
    calc = _calc(model, chain, skin)
    atoms.calc = calc
    dyn = VelocityVerlet(atoms, timestep=dt_fs * units.fs)
    energies = []
    dyn.attach(lambda: energies.append(atoms.get_potential_energy()), interval=1)
    dyn.run(steps)
    return atoms, calc, dyn, np.array(energies)


def _same(run_a, run_b) -> None:
    (a, _, _, e_a), (b, _, _, e_b) = run_a, run_b
    np.testing.assert_array_equal(a.positions, b.positions)
    np.testing.assert_array_equal(a.get_momenta(), b.get_momenta())
    np.testing.assert_array_equal(a.get_forces(), b.get_forces())
    np.testing.assert_array_equal(e_a, e_b)


@pytest.fixture(params=[True, False], ids=["kept", "host-predicted"])
def keep(request, monkeypatch):
    """Both ways of keeping a chained step as the launch ahead: without the host's prediction of its positions
    (``ForceEngine.keep_chained``: the next call compares its own positions with the device's) and with it."""
    monkeypatch.setattr(ForceEngine, "keep_chained_steps", request.param)
    return request.param


def test_a_chained_trajectory_is_the_trajectory_without(fake_graphs, keep):
    """Bit for bit the same trajectory; from the fourth calculation on (dt found, the chain captured) every step is
    a chained one, kept and taken: without the host's prediction where ``keep_chained_steps`` is on (the list of
    benzene is complete, never near a rebuild)."""
    model = make_model()
    on, off = _run(model, True), _run(model, False)
    _same(on, off)
    eng = on[1].engine
    assert eng.verlet.n_builds == 1  # (300 K, a 1 Å skin: the list is kept, so no rebuild drops a chained step)
    assert eng.n_ahead_taken == off[1].engine.n_ahead_taken and eng.n_ahead_missed == 0
    assert eng.n_chained >= 36 and eng.n_chain_adopted == eng.n_chained, (eng.n_chained, eng.n_chain_adopted)
    assert eng.n_chain_dropped == 0
    assert eng.n_chain_kept == (eng.n_chain_adopted if keep else 0)
    assert off[1].engine.n_chained == 0
    assert len(eng._md_chains) == 1


@pytest.mark.skipif(not triton_available("cpu"), reason="the Triton interpreter (TRITON_INTERPRET=1) is not on")
def test_the_chain_predicts_with_the_triton_kernel(fake_graphs, monkeypatch):
    """The chained steps' prediction through the Triton kernel (interpreted here; compiled without FMA contraction
    on the GPU) is taken every time, and the trajectory is the one without chains, bit for bit."""
    from mlff_distiller import _md_chain

    calls = []

    def triton_predict(*args):
        calls.append(1)
        with use_backend("triton"):
            verlet_predict(*args)

    monkeypatch.setattr(_md_chain, "verlet_predict", triton_predict)
    model = make_model()
    on, off = _run(model, True), _run(model, False)
    _same(on, off)
    eng = on[1].engine
    assert eng.n_chained >= 36 and eng.n_chain_adopted == eng.n_chained and eng.n_chain_dropped == 0
    assert len(calls) >= eng.n_chained


def test_rebuilds_drop_the_chained_step_and_keep_the_trajectory(fake_graphs, keep):
    """Hot benzene with a small skin rebuilds its list every few steps: a rebuild ahead drops the step chained on
    the old list (launched again on the new one), and the trajectory is still the one without chains. (Its atoms
    move ~0.06 Å a step against the rebuild distance of 0.15: always near a rebuild, so the host predicts.)"""
    model = make_model()
    on = _run(model, True, steps=40, skin=0.3, temperature=1500.0, dt_fs=1.0)
    off = _run(model, False, steps=40, skin=0.3, temperature=1500.0, dt_fs=1.0)
    _same(on, off)
    eng = on[1].engine
    assert eng.n_rebuilt_ahead > 5 and eng.n_chain_dropped > 5 and eng.n_chain_adopted > 5
    assert eng.n_chained == eng.n_chain_adopted + eng.n_chain_dropped


def test_chained_steps_are_kept_unpredicted_away_from_a_rebuild(fake_graphs, monkeypatch):
    """Benzene at 300 K with a 0.3 Å skin rebuilds every ~8 steps. Away from a rebuild the chained step is kept
    without the host's prediction (``keep_chained``), near one (``VerletNeighborList.near_rebuild``) the host
    predicts and rebuilds ahead: every rebuild after the first is made ahead and no launch is missed, as with the
    host's prediction every step (the same counts), and the trajectory is the one without chains, bit for bit."""
    from mlff_distiller.neighbors import verlet

    model = make_model()
    args = dict(steps=60, skin=0.3, temperature=300.0, dt_fs=0.5)
    tests, real = [], verlet._HostDisplacement.moved_far
    monkeypatch.setattr(verlet._HostDisplacement, "moved_far", lambda self, *a: tests.append(1) or real(self, *a))
    kept = _run(model, True, **args)
    # One displacement test per calculation after the first (chain_ahead tests; the same call's take keeps its yes).
    assert len(tests) == 60
    monkeypatch.setattr(verlet._HostDisplacement, "moved_far", real)
    monkeypatch.setattr(ForceEngine, "keep_chained_steps", False)
    predicted = _run(model, True, **args)
    _same(kept, _run(model, False, **args))
    _same(kept, predicted)
    a, b = kept[1].engine, predicted[1].engine
    assert a.verlet.n_builds > 5 and a.n_rebuilt_ahead == a.verlet.n_builds - 1 and a.n_ahead_missed == 0
    assert 10 <= a.n_chain_kept < a.n_chain_adopted and b.n_chain_kept == 0
    for name in ("n_rebuilt_ahead", "n_chained", "n_chain_adopted", "n_chain_dropped", "n_ahead_taken"):
        assert getattr(a, name) == getattr(b, name), name

    # Without the hint (never near), the rebuilds are found at the takes instead: the step taken there is thrown
    # away and run again on the rebuilt list (n_discarded), none rebuilt ahead.
    from mlff_distiller.neighbors.verlet import VerletNeighborList

    monkeypatch.setattr(ForceEngine, "keep_chained_steps", True)
    monkeypatch.setattr(VerletNeighborList, "near_rebuild", lambda self: False)
    blind = _run(model, True, **args)
    _same(blind, predicted)
    assert a.n_discarded == 0 and blind[1].engine.n_discarded == a.verlet.n_builds - 1
    assert blind[1].engine.n_rebuilt_ahead == 0 and blind[1].engine.n_chain_kept > a.n_chain_kept


def test_a_chained_call_asks_whether_its_step_is_takeable_once(fake_graphs, monkeypatch, keep):
    """``chain_ahead`` tests that the call's step launched ahead is takeable, and keeps the answer by identities,
    versions and counters (``_takeable_key``): the same call's take does not test again, and the trajectory is the
    one without chains. A key that differs in anything (here: the positions written in place after chain_ahead)
    sends the take through the full test."""
    import sys

    from mlff_distiller import engine_verlet

    model = make_model()
    callers, real = [], ForceEngine._launch_takeable

    def counted(self, batch):
        callers.append(sys._getframe(1).f_code.co_name)
        return real(self, batch)

    monkeypatch.setattr(ForceEngine, "_launch_takeable", counted)
    on = _run(model, True)
    asked = list(callers)
    eng = on[1].engine
    _same(on, _run(model, False))
    assert eng.n_chained >= 36 and eng.n_chain_dropped == 0 and eng.n_ahead_missed == 0
    # chain_ahead's tests (one per chained call); the takes test only the steps that no chain_ahead tested (the
    # calls before the chain is captured).
    assert asked.count("chain_ahead") >= eng.n_chained
    assert asked.count("_take_launched") <= eng.n_ahead_taken - eng.n_chained, asked.count("_take_launched")

    batch = on[1]._last_batch
    key = eng._takeable_key(batch)
    assert engine_verlet._same_key(key, eng._takeable_key(batch))
    batch.positions.add_(0.0)  # an in-place write: a new version, the same tensor
    assert not engine_verlet._same_key(key, eng._takeable_key(batch))
    assert not engine_verlet._same_key(key, eng._takeable_key(batch, eng._n_computes + 1))


def test_a_chained_step_on_other_positions_is_never_taken(fake_graphs, monkeypatch, keep):
    """A device prediction that differs from the host's (here: the chain's time step 1 % off; one ulp off moves no
    float32 coordinate) makes the chained step read other positions: it is dropped and a fresh step computed, so
    the trajectory is still the one without chains. Without the byte compare the trajectory differs (the mutation
    check below)."""
    model = make_model()
    real = MDChain.set_consts

    def off(self, dt, origin, masses, busy):
        return real(self, dt * 1.01, origin, masses, busy)

    monkeypatch.setattr(MDChain, "set_consts", off)
    on, off = _run(model, True), _run(model, False)
    _same(on, off)
    eng = on[1].engine
    # Every chained step dropped: a kept one is missed at its take (then the step chained behind it, on its forces,
    # is dropped too, and the calculation after launches on the host's prediction as without chains).
    assert eng.n_chained >= 30 and eng.n_chain_dropped == eng.n_chained and eng.n_chain_adopted > 15
    assert eng.n_ahead_missed == eng.n_chain_adopted, (eng.n_ahead_missed, eng.n_chain_adopted)
    assert eng.n_ahead_taken < off[1].engine.n_ahead_taken

    # The mutation check: a take that trusted the chained step's positions returns its results.
    from mlff_distiller import engine_verlet

    monkeypatch.setattr(engine_verlet.VerletPaths, "_take_ahead", _trusting_take_ahead)
    monkeypatch.setattr(engine_verlet.VerletPaths, "_launch_takeable", lambda self, batch: True)
    bad = _run(model, True)
    assert not np.array_equal(bad[0].positions, off[0].positions)


def _trusting_take_ahead(self, fill, batch):
    ahead, self._ahead = self._ahead, None
    return None if ahead is None else ahead[0]


def test_chains_only_behind_a_step_the_call_takes(fake_graphs, keep):
    """No chained step before a launch ahead is taken with its time step found; the first call that takes one
    captures the chain and queues nothing; each call after queues one. A changed time step misses one launch and
    the chain resumes with the new step: with the host's prediction, the call that misses queues no chained step
    (its positions are not the predicted ones); kept without it, that call queues one before its take finds the
    miss, and drops it after (two drops: the step missed and the one queued behind it). None with the express take
    or the switch off."""
    model = make_model()
    _, calc, dyn, _ = _run(model, True, steps=1)
    eng = calc.engine
    assert eng.n_chained == 0 and not eng._md_chains and eng.n_ahead_taken == 0
    dyn.run(1)  # the third calculation takes the launch ahead made with the time step read at the second
    assert eng.n_chained == 0 and len(eng._md_chains) == 1 and eng.n_ahead_taken == 1
    dyn.run(4)
    assert eng.n_chained == eng.n_chain_adopted == 4 and eng.n_ahead_taken == 5
    assert eng.n_chain_kept == (4 if keep else 0)
    dyn.dt = 0.7 * units.fs
    dyn.run(1)
    assert eng.n_ahead_missed == 1 and eng.n_chained == (5 if keep else 4)
    dyn.run(4)
    assert eng.n_chain_adopted == 8 and eng.n_chained == (9 if keep else 8) and eng.n_ahead_missed == 1
    assert eng.n_chain_dropped == (2 if keep else 0)
    chain = next(iter(eng._md_chains.values()))
    assert chain.consts.array[1] == dyn.dt  # rewritten while no chained step was in flight
    chained = eng.n_chained
    eng.express_take = False
    dyn.run(3)
    assert eng.n_chained == chained
    eng.express_take, eng.chain = True, False
    dyn.run(3)
    assert eng.n_chained == chained


def test_nothing_is_chained_where_the_host_predicts_other_motion(fake_graphs):
    """Followed Langevin (its noise is the host's to draw) takes its launches ahead but chains nothing; a float64
    engine makes no launches ahead at all."""
    from ase.constraints import FixCom
    from ase.md.langevin import Langevin

    model = make_model()
    atoms = molecule("C6H6")
    maxwell_boltzmann(atoms, 300, rng=np.random.default_rng(4))
    atoms.set_constraint(FixCom())
    calc = _calc(model, True)
    atoms.calc = calc
    dyn = Langevin(atoms, 0.5 * units.fs, temperature_K=300, friction=0.05, rng=np.random.default_rng(7), fixcm=False)
    calc.follow(dyn)
    dyn.run(15)
    assert calc.engine.n_ahead_taken >= 12 and calc.engine.n_chained == 0 and not calc.engine._md_chains

    atoms = molecule("C6H6")
    maxwell_boltzmann(atoms, 300, rng=np.random.default_rng(4))
    calc = StudentCalculator(model, device="cpu", precision="fp64", skin=1.0, check_domain=None)
    calc.engine = ForceEngine(model, device="cpu", precision="fp64", pad=True, neighbor_skin=1.0)
    calc.engine.mode, calc.engine.zero_copy, calc.engine.speculative_verlet = "cudagraph", True, True
    atoms.calc = calc
    VelocityVerlet(atoms, timestep=0.5 * units.fs).run(10)
    assert calc.engine.n_chained == 0 and calc.engine.n_ahead_taken == 0


def test_release_captures_drops_the_chains(fake_graphs):
    model = make_model()
    _, calc, dyn, _ = _run(model, True, steps=6)
    eng = calc.engine
    assert len(eng._md_chains) == 1
    eng.release_captures()
    assert not eng._md_chains and not eng._md_runners
    dyn.run(8)  # captured again, chained again
    assert len(eng._md_chains) == 1 and eng.n_chain_adopted >= 3


def test_a_chain_that_cannot_be_captured_leaves_md_as_it_was(fake_graphs, monkeypatch):
    """Out of memory while capturing the two chained steps: the engine goes on without chains (its switch off), and
    the trajectory is the one without them."""
    from mlff_distiller import _md_chain

    def no_memory(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (a stand-in)")

    monkeypatch.setattr(_md_chain.MDChain, "__init__", no_memory)
    model = make_model()
    on, off = _run(model, True, steps=12), _run(model, False, steps=12)
    _same(on, off)
    eng = on[1].engine
    assert eng.chain is False and not eng._md_chains and eng.n_chained == 0
    assert eng.n_ahead_taken == off[1].engine.n_ahead_taken


def _cuda_md(chain: bool, hidden: int = 128, steps: int = 200):
    atoms = molecule("C6H6")
    maxwell_boltzmann(atoms, 300, rng=np.random.default_rng(2))
    calc = StudentCalculator(make_model(hidden=hidden), device="cuda", skin=1.0, check_domain=None)
    calc.engine.chain = chain
    atoms.calc = calc
    VelocityVerlet(atoms, timestep=0.5 * units.fs).run(steps)
    return atoms, calc.engine


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_chained_steps_on_cuda():
    """On CUDA (captured steps, zero-copy buffers, an event per queued step): the device's predictions equal the
    host's bit for bit (every chained step kept and taken), and the trajectory equals the one without chains to the
    float32 steps' sums (1e-5 Å after 200 steps). 128 features: the model's captured step (no dense step)."""
    a_on, eng = _cuda_md(True)
    a_off, eng_off = _cuda_md(False)
    assert eng.mode == "cudagraph" and eng._md_chains and not next(iter(eng._md_runners.values())).dense
    assert eng.n_chained >= 190 and eng.n_chain_adopted == eng.n_chained and eng.n_chain_dropped == 0, (
        eng.n_chained,
        eng.n_chain_adopted,
        eng.n_chain_dropped,
    )
    assert eng.n_ahead_missed == 0 and eng_off.n_chained == 0
    np.testing.assert_allclose(a_on.positions, a_off.positions, rtol=0, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_no_chain_behind_the_dense_step_on_cuda():
    """A 32-wide student's benzene runs the dense step, whose MD step is host-bound: nothing is chained there."""
    _, eng = _cuda_md(True, hidden=32, steps=50)
    assert next(iter(eng._md_runners.values())).dense
    assert eng.n_chained == 0 and not eng._md_chains and eng.n_ahead_taken >= 45


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_kept_chained_steps_where_the_list_rebuilds_on_cuda():
    """27 waters (periodic, 14 Å) with a 0.5 Å skin rebuild their list every few steps (22 builds in 150 steps on
    the CPU's stand-in): away from a rebuild the chained step is kept without the host's prediction, near one the
    host predicts and rebuilds ahead. Every launch is taken, none thrown away, every rebuild after the first made
    ahead, and velocity Verlet keeps the total energy (a sanity bound: the byte compare is the guarantee)."""
    from test_exact_pairs import water_box

    from mlff_distiller import load_model

    atoms = water_box()
    maxwell_boltzmann(atoms, 300, rng=np.random.default_rng(3))
    calc = StudentCalculator(load_model("builtin:chno-gfn2"), device="cuda", skin=0.5, check_domain=None)
    atoms.calc = calc
    dyn = VelocityVerlet(atoms, timestep=0.5 * units.fs)
    dyn.run(5)
    e0 = atoms.get_total_energy()
    dyn.run(150)
    eng = calc.engine
    assert eng._md_chains and not next(iter(eng._md_runners.values())).dense
    assert eng.verlet.n_builds > 3 and eng.n_rebuilt_ahead == eng.verlet.n_builds - 1
    assert eng.n_ahead_missed == 0 and eng.n_discarded == 0
    assert 10 <= eng.n_chain_kept < eng.n_chain_adopted, (eng.n_chain_kept, eng.n_chain_adopted)
    # (the CPU's stand-in, same start: within 0.13 eV over these steps, the rattled box settling)
    assert abs(atoms.get_total_energy() - e0) < 0.3, (atoms.get_total_energy(), e0)
