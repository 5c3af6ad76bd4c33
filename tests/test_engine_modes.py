"""ForceEngine modes: eager / padded / torch.compile / CUDA graphs, precisions, OOM splitting, warm-up, cache.

CPU tests use the padded eager path and ``torch.compile(backend="aot_eager")`` (no C++ toolchain needed);
``@pytest.mark.gpu`` tests run the CUDA-graph and Inductor paths against the eager reference.
"""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from ase.build import molecule
from ase.md.verlet import VelocityVerlet
from helpers import assert_close_to, edge_sink_spy, make_model, silicon_cell
from helpers import random_molecules as _mols

from mlff_distiller import AtomsBatch, ForceEngine, StudentCalculator
from mlff_distiller.buckets import BucketLadder
from mlff_distiller.engine import AUTO_MAX_EDGES, configure_compile_cache, kernels_source_digest

gpu = pytest.mark.gpu


# ------------------------------------------------------------------------------------------------ CPU


def test_bad_mode_arguments(model):
    with pytest.raises(ValueError, match="unknown mode"):
        ForceEngine(model, device="cpu", mode="fast")
    with pytest.raises(ValueError, match="unknown compile_mode"):
        ForceEngine(model, device="cpu", mode="compile", compile_mode="turbo")
    with pytest.raises(ValueError, match="pad=False"):
        ForceEngine(model, device="cpu", mode="compile", compile_backend="aot_eager", pad=False)
    with pytest.raises(ValueError, match="BucketLadder"):
        ForceEngine(model, device="cpu", buckets=(16, 64))
    with pytest.raises(ValueError, match="memory_budget"):
        ForceEngine(model, device="cpu", memory_budget=0)
    with pytest.raises(ValueError, match="unknown precision"):
        ForceEngine(model, device="cpu", precision="int8")


def test_gpu_modes_fall_back_on_cpu_with_a_warning(model):
    for mode in ("cudagraph", "compile"):
        with pytest.warns(RuntimeWarning, match="padded eager path"):
            engine = ForceEngine(model, device="cpu", mode=mode)
        assert engine.mode == "padded-eager" and engine.pad
    assert ForceEngine(model, device="cpu", mode="auto").mode == "eager"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        StudentCalculator(model, device="cpu")  # the calculator's default "auto" is silent on a CPU


@pytest.fixture(scope="module")
def precision_case():
    model = make_model(seed=1)
    batch = AtomsBatch.from_atoms([molecule("C6H6"), molecule("CH3CH2OH"), molecule("H2O")])
    return model, batch, ForceEngine(model, device="cpu", precision="fp64").compute(batch)


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16", "fp16"])
def test_precisions_within_documented_tolerance_cpu(precision, precision_case):
    model, batch, ref = precision_case
    for pad in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a CPU without 16-bit matmuls falls back to fp32 (also within tol)
            engine = ForceEngine(model, device="cpu", precision=precision, pad=pad)
        out = engine.compute(batch)
        assert out["forces"].dtype == torch.float32  # forces and energies stay float32
        assert_close_to(out, ref, precision, 3)


def test_reduced_precision_leaves_the_users_model_alone(model):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ForceEngine(model, device="cpu", precision="bf16").compute(AtomsBatch.from_atoms(molecule("H2O")))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(isinstance(m, torch.nn.Linear) for m in model.modules() if "Linear" in type(m).__name__)


def test_compile_no_recompilation_per_batch_cpu(model):
    """One Dynamo compilation per bucket; batches that land in a warmed bucket never recompile. The kernel
    backend's memo starts empty, as in a fresh process (the first compile then traced its miss: a recompile)."""
    from mlff_distiller.kernels import _backend
    from torch._dynamo.utils import counters

    _backend._RESOLVED.clear()
    torch._dynamo.reset()
    counters.clear()
    ladder = BucketLadder(min_atoms=16, max_atoms=64, min_edges=128, max_edges=4096, growth=2.0)
    engine = ForceEngine(model, device="cpu", mode="compile", compile_backend="aot_eager", buckets=ladder)
    eager = ForceEngine(model, device="cpu")
    mols = _mols(8, seed=2, lo=3, hi=9)
    batches = [AtomsBatch.from_atoms([m]) for m in mols]
    engine.warmup(structures=[mols[0]])
    warmed = set(engine._graphs)
    graphs_after_warmup = counters["stats"]["unique_graphs"]
    assert graphs_after_warmup == len(warmed) >= 1
    for batch in batches:
        out = engine.compute(batch)
        assert_close_to(out, eager.compute(batch), "fp32", 1)
    new_buckets = set(engine._graphs) - warmed
    assert counters["stats"]["unique_graphs"] == graphs_after_warmup + len(new_buckets)
    assert len(new_buckets) <= 1  # 3-8 atoms, < 128 edges: one or two buckets in all


def _rows_equal(got, want, atoms_list, rtol=0.0):
    """Two predict() results: the same rows in input order, bit for bit (``rtol`` 0: the CPU, deterministic) or
    within ``rtol`` (CUDA: its float32 sums of atomics vary from run to run in the last bits)."""
    assert len(got) == len(want) == len(atoms_list)
    for a, b, atoms in zip(want, got, atoms_list, strict=True):
        assert b["forces"].shape == (len(atoms), 3) and b.keys() == a.keys()
        assert a["energy"] == pytest.approx(b["energy"], rel=rtol, abs=0.0)
        for key in ("forces", "energies", "stress"):
            if key in a:
                np.testing.assert_allclose(b[key], a[key], rtol=rtol, atol=rtol * 1e-2)


@pytest.mark.parametrize("pad", [False, True])
def test_pipelined_predict_equals_the_sequential_loop(model, pad):
    """The host/device pipeline (forced on here; on CUDA it is the default) gives the sequential loop's rows, in
    input order, over several batches of different sizes, periodic ones with stress included."""
    mols = _mols(11, seed=21)
    engine = ForceEngine(model, device="cpu", precision="fp64", pad=pad)
    for kw in ({"batch_size": 3}, {"atom_budget": 25}, {"batch_size": 100}):
        want = engine.predict(mols, pipeline=False, **kw)
        _rows_equal(engine.predict(mols, pipeline=True, **kw), want, mols)
    cells = [silicon_cell(), mols[0], silicon_cell()]
    cells[2].rattle(0.05, seed=3)
    want = engine.predict(cells, batch_size=2, stress=True, pipeline=False)
    assert "stress" in want[0] and "stress" not in want[1]
    _rows_equal(engine.predict(cells, batch_size=2, stress=True, pipeline=True), want, cells)


def test_warmup(model):
    engine = ForceEngine(model, device="cpu", pad=True)
    times = engine.warmup(buckets=[(5, 20), (40, 900)], structures=[[molecule("C6H6"), molecule("C6H6")]])
    assert len(times) == 3 and all(t > 0 for t in times.values())
    assert set(times) == set(engine._graphs)
    with pytest.raises(ValueError, match="no bucket"):
        engine.warmup(buckets=[(10**7, 1)])
    with pytest.raises(ValueError, match="padded mode"):
        ForceEngine(model, device="cpu").warmup(buckets=[(5, 20)])


def test_configure_compile_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    path = configure_compile_cache(tmp_path / "cache")
    assert path.is_dir()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"].startswith(str(path))
    assert os.environ["TRITON_CACHE_DIR"].startswith(str(path))
    # Inductor's directory is keyed by our kernels' source (a changed kernel must not load old compiled code).
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"].endswith(f"kernels-{kernels_source_digest()[:16]}")


def test_configure_compile_cache_replaces_the_directories_inductor_set_itself(tmp_path, monkeypatch):
    """Inductor writes TORCHINDUCTOR_CACHE_DIR (and TRITON_CACHE_DIR) into os.environ on its first compile, and a
    child process inherits them: the engine's cache_dir must still take effect after that."""
    from torch._inductor.runtime import cache_dir_utils

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setattr(cache_dir_utils, "default_cache_dir", lambda: str(tmp_path / "inductor_default"))
    cache_dir_utils.cache_dir()  # what Inductor's first compile does
    monkeypatch.setenv("TRITON_CACHE_DIR", cache_dir_utils.triton_cache_dir(0))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor_default")
    path = configure_compile_cache(tmp_path / "mine")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"].startswith(str(path) + os.sep)
    assert os.environ["TRITON_CACHE_DIR"] == str(path / "triton")
    assert cache_dir_utils.cache_dir().startswith(str(path) + os.sep)  # Inductor now reads ours


def test_configure_compile_cache_in_a_fresh_process_imports_no_inductor(tmp_path):
    """A process that sets the cache up but never compiles pays no Inductor import; one that compiles later still
    gets the FX-graph and AOTAutograd caches switched on."""
    code = (
        "import sys, torch; from mlff_distiller.engine import configure_compile_cache; "
        f"configure_compile_cache({str(tmp_path / 'c')!r}); "
        "print('inductor' if 'torch._inductor' in sys.modules else 'no inductor'); "
        "import torch._inductor.config as ic, torch._functorch.config as fc; "
        "print(ic.fx_graph_cache, fc.enable_autograd_cache)"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHINDUCTOR_")}
    env.update(TORCHINDUCTOR_FX_GRAPH_CACHE="0", TORCHINDUCTOR_AUTOGRAD_CACHE="0")  # switched on all the same
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=True)
    assert out.stdout.split("\n")[-3:-1] == ["no inductor", "True True"], out.stdout + out.stderr


def test_seeded_scalar_is_the_vector_jacobian_product():
    """``_Seeded``: autograd.grad of its scalar equals autograd.grad with ``grad_outputs=seed``, bit for bit."""
    from mlff_distiller.engine_padded import _Seeded

    x = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    energy = torch.stack([(x[:3] ** 2).sum(), x[3:].sin().sum(), x.prod()])
    seed = torch.tensor([-1.0, -1.0, 0.0], dtype=torch.float64)
    (want,) = torch.autograd.grad(energy, x, grad_outputs=seed, retain_graph=True)
    (got,) = torch.autograd.grad(_Seeded.apply(energy, seed), x)
    assert torch.equal(got, want)


def test_seeded_grad_is_the_vector_jacobian_product():
    """``_seeded_grad`` (the padded steps' vector-Jacobian product, straight into autograd's engine) equals
    autograd.grad with ``grad_outputs=seed`` bit for bit, for one input and two; a seed of another shape raises."""
    from mlff_distiller import engine_padded

    assert engine_padded._engine_run_backward is not None  # the path the steps take on every supported torch
    x = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    y = torch.randn(3, dtype=torch.float64, requires_grad=True)

    def energy():
        return torch.stack([(x[:3] ** 2).sum() * y[0], x[3:].sin().sum() + y[1], x.prod() * y[2]])

    seed = torch.tensor([-1.0, -1.0, 0.0], dtype=torch.float64)
    want = torch.autograd.grad(energy(), (x, y), grad_outputs=seed)
    got = engine_padded._seeded_grad(energy(), seed, (x, y))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    (got_x,) = engine_padded._seeded_grad(energy(), seed, (x,))
    assert torch.equal(got_x, want[0])
    with pytest.raises(RuntimeError):
        engine_padded._seeded_grad(energy(), seed[:2], (x,))


def test_a_padded_step_in_a_fresh_process_imports_no_sympy():
    """The padded step's vector-Jacobian product goes without ``grad_outputs``, whose shape check imports sympy
    (0.8-1.2 s of a first result on the H100 host)."""
    code = (
        "import sys, warnings, torch; from ase.build import molecule; "
        "from mlff_distiller import AtomsBatch, ForceEngine, StudentModel; warnings.simplefilter('ignore'); "
        "e = ForceEngine(StudentModel(species=[1, 6], hidden=16, layers=2, n_rbf=8), device='cpu', mode='cudagraph'); "
        "e.compute(AtomsBatch.from_atoms(molecule('C6H6')), to_host=True); "
        "print('sympy' in sys.modules, e.last_bucket is not None)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False True", out.stdout + out.stderr


def test_kernels_source_digest_follows_every_kernel_file(tmp_path):
    import mlff_distiller.kernels as kernels

    src = sorted(Path(kernels.__file__).parent.glob("*.py"))
    assert {"message_passing.py", "_mp_kernels.py", "_triton_utils.py"} <= {f.name for f in src}
    copies = []
    for f in src:
        (tmp_path / f.name).write_bytes(f.read_bytes())
        copies.append(tmp_path / f.name)
    assert kernels_source_digest(copies) == kernels_source_digest()
    with open(tmp_path / "_mp_kernels.py", "a") as fh:
        fh.write("\n# a changed kernel file\n")
    assert kernels_source_digest(copies) != kernels_source_digest()
    assert kernels_source_digest(reversed(copies)) == kernels_source_digest(copies)  # order of the files: none


def test_calculator_md_reuses_topology_and_matches_eager(model):
    """MD through the padded path (same atoms every step) equals the eager calculator step by step."""
    atoms = molecule("C6H6")
    atoms.rattle(0.05, seed=1)
    with pytest.warns(RuntimeWarning):
        calc = StudentCalculator(model, device="cpu", precision="fp64", mode="cudagraph")
    ref = StudentCalculator(model, device="cpu", precision="fp64", mode="eager")
    atoms.calc = calc
    dyn = VelocityVerlet(atoms, timestep=1.0)
    for _ in range(4):
        dyn.run(1)
        f = atoms.get_forces()
        check = atoms.copy()
        check.calc = ref
        np.testing.assert_allclose(f, check.get_forces(), atol=1e-10)
        assert atoms.get_potential_energy() == pytest.approx(check.get_potential_energy(), abs=1e-10)
    assert len(calc.engine._graphs) <= 2


# ------------------------------------------------------------------------------------------------ GPU


def _gpu_batches():
    return [
        [molecule("H2")],
        [molecule("C6H6")],
        [molecule("H2O"), molecule("CH4"), molecule("C6H6")],
        _mols(40, seed=11, lo=2, hi=20),
        [silicon_cell()],
    ]


@gpu
@pytest.mark.parametrize("compile_mode", [None, "default"])
def test_cuda_graph_equals_eager(model, compile_mode):
    eager = ForceEngine(model, device="cuda", precision="fp32")
    engine = ForceEngine(model, device="cuda", precision="fp32", mode="cudagraph", compile_mode=compile_mode)
    cases = _gpu_batches() if compile_mode is None else _gpu_batches()[:3]  # compiling costs ~10 s a bucket
    for _ in range(2):  # the second round replays the captured graphs
        for mols in cases:
            batch = AtomsBatch.from_atoms(mols)
            out, ref = engine.compute(batch), eager.compute(batch)
            for key in ("energy", "atomic_energies", "forces"):
                scale = ref[key].abs().max().clamp_min(1e-3)
                assert (out[key] - ref[key]).abs().max() / scale <= 1e-5, key
    assert engine.captured_buckets and len(engine.captured_buckets) == len(engine._graphs)


@gpu
@pytest.mark.parametrize("stress", [False, True])
def test_captured_steps_sum_the_edge_gradients_on_a_second_stream(model, stress, monkeypatch):
    """Inside the captured step every layer's edge kernel adds its ∂rbf, ∂u into a sink on a second stream
    (kernels.defer_edge_grads), joined once before the geometry's backward: replays on new positions give the eager
    step's energies, forces and stress (one stream, no sink), and the sink was used by each layer's backward."""
    import importlib

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from systems import water_box

    calls = edge_sink_spy(monkeypatch)
    # The eager reference on the plain path (its inference steps otherwise sum into a sink on one stream, which
    # would feed the spy outside the captures).
    monkeypatch.setitem(
        importlib.import_module("mlff_distiller.kernels.message_passing")._CONFIG, "edge_sink_one_stream", False
    )
    # The first layer on the message kernel, so that every layer's backward goes through the sink (the moments'
    # first layer with the sink is tests/test_first_layer_moments.py's).
    monkeypatch.setitem(
        importlib.import_module("mlff_distiller.kernels.species_moments")._CONFIG, "model_min_edges", None
    )
    # The shipped width on a 192-atom water box: kernels long enough that an input of the second stream's kernels
    # left unheld was overwritten in time (autograd's in-place sum into the next layer's g_v: ΔF 2.7e-4 eV/Å).
    water = make_model(seed=3, species=[1, 8], hidden=128, layers=3, n_rbf=20, cutoff=5.0)
    runs = [
        (model, [[molecule("C6H6")], _mols(40, seed=11, lo=2, hi=20), [silicon_cell()]]),
        (water, [[water_box(192, seed=0)]]),
    ]
    for net, cases in runs:
        eager = ForceEngine(net, device="cuda", precision="fp32")
        # dense_small=False: benzene on the 32-wide model would take the dense step (no edge kernels, so no sink;
        # since stop 69), and this test is about the model's captured step in every bucket.
        engine = ForceEngine(net, device="cuda", precision="fp32", mode="cudagraph", dense_small=False)
        before = len(calls)
        for rnd in range(3):  # capture, then replays on rattled positions
            for mols in cases:
                mols = [m.copy() for m in mols]
                for m in mols:
                    m.rattle(0.02 * rnd, seed=rnd)
                batch = AtomsBatch.from_atoms(mols)
                out, ref = engine.compute(batch, stress=stress), eager.compute(batch, stress=stress)
                for key in ("energy", "forces", *(["stress"] if stress else [])):
                    scale = ref[key].abs().max().clamp_min(1e-3)
                    assert (out[key] - ref[key]).abs().max() / scale <= 1e-5, key
        layers = len(net.interactions)  # each layer's backward in each capture (one per bucket and step kind)
        used = calls[before:]
        assert len(used) >= layers * len(engine._graphs) and len(used) % layers == 0 and all(used), used


@gpu
def test_cuda_graph_outputs_survive_the_next_replay(model):
    engine = ForceEngine(model, device="cuda", mode="cudagraph")
    a = engine.compute(AtomsBatch.from_atoms(molecule("C6H6")))
    keep = a["forces"].clone()
    moved = molecule("C6H6")
    moved.rattle(0.1, seed=3)
    b = engine.compute(AtomsBatch.from_atoms(moved))
    assert torch.equal(a["forces"], keep) and not torch.equal(a["forces"], b["forces"])


@gpu
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16", "fp16"])
def test_precisions_within_documented_tolerance_gpu(precision):
    model = make_model(seed=1)
    batch = AtomsBatch.from_atoms([*_mols(30, seed=4, lo=3, hi=20), silicon_cell()])
    ref = ForceEngine(model, device="cuda", precision="fp64").compute(batch)
    for mode in ("eager", "cudagraph"):
        out = ForceEngine(model, device="cuda", precision=precision, mode=mode).compute(batch)
        assert_close_to(out, ref, precision, batch.num_structures)


@gpu
@pytest.mark.parametrize("compile_mode", ["default", "reduce-overhead", "max-autotune"])
def test_compile_no_recompilation_gpu(model, compile_mode):
    """As the CPU test: the kernel backend's memo starts empty, as in a fresh process (in stop 26's first GPU run
    of this test with few tests before it, the memo's miss traced in the warm-up recompiled at the next batch).
    max-autotune (issue 5's third mode) added at stop 39, not yet run on a GPU: its first compile benchmarks GEMM
    and Triton choices, ~150 s on the H100 by the benchmark's estimate."""
    from mlff_distiller.kernels import _backend
    from torch._dynamo.utils import counters

    _backend._RESOLVED.clear()
    torch._dynamo.reset()
    counters.clear()
    engine = ForceEngine(model, device="cuda", mode="compile", compile_mode=compile_mode)
    eager = ForceEngine(model, device="cuda")
    mols = _mols(10, seed=2, lo=8, hi=12)
    engine.warmup(structures=[mols[0]])
    warmed, n0 = set(engine._graphs), counters["stats"]["unique_graphs"]
    for m in mols:
        batch = AtomsBatch.from_atoms([m])
        assert_close_to(engine.compute(batch), eager.compute(batch), "fp32", 1)
    assert counters["stats"]["unique_graphs"] == n0 + len(set(engine._graphs) - warmed)
    assert len(engine._graphs) <= 2


@gpu
def test_calculator_md_on_cuda_replays_graphs(model):
    atoms = molecule("C6H6")
    atoms.calc = StudentCalculator(model, device="cuda")
    assert atoms.calc.engine.mode == "cudagraph"
    ref = StudentCalculator(model, device="cuda", mode="eager")
    dyn = VelocityVerlet(atoms, timestep=0.5)
    for _ in range(5):
        dyn.run(2)
        check = atoms.copy()
        check.calc = ref
        np.testing.assert_allclose(atoms.get_forces(), check.get_forces(), atol=1e-5)
    assert 1 <= len(atoms.calc.engine.captured_buckets) <= 2
    eng = atoms.calc.engine
    assert eng._verlet_fill is not None  # the skin list stays in the static buffers between steps
    assert 1 <= eng.verlet.n_builds < eng.verlet.n_calls


@gpu
@pytest.mark.parametrize("mode", ["eager", "cudagraph"])
def test_pipelined_predict_on_cuda(model, mode):
    """On CUDA the pipeline is the default: its rows (copied back asynchronously through page-locked memory while
    the next batch is launched) equal the sequential loop's, over batches large enough that the copy of one
    overlaps the next step, and small ones that take the host-filled buckets (rows equal to float32 rounding: the
    device's atomic sums differ in the last bits between any two runs)."""
    engine = ForceEngine(model, device="cuda", mode=mode)
    for mols, bs in ((_mols(300, seed=31), 64), (_mols(40, seed=32), 3)):
        want = engine.predict(mols, batch_size=bs, pipeline=False)
        got = engine.predict(mols, batch_size=bs)
        _rows_equal(got, want, mols, rtol=1e-5)


def test_the_default_pipeline_needs_more_than_one_batch(model, monkeypatch):
    """``pipeline=None`` asks :func:`~mlff_distiller.batching.pipelined` with the call's number of batches: on CUDA
    the pipeline runs for more than one batch only (one has nothing to overlap; its page-locked outputs cost ~0.6 ms
    of a small molecule's call). The default's rows equal the sequential loop's either way."""
    from mlff_distiller import batching

    assert batching.pipelined(torch.device("cuda"), 2) and not batching.pipelined(torch.device("cuda"), 1)
    assert not batching.pipelined(torch.device("cpu"), 5)
    asked, launched = [], []
    real_launch = batching._launch
    monkeypatch.setattr(batching, "pipelined", lambda device, n: asked.append(n) or n > 1)  # CUDA's rule
    monkeypatch.setattr(batching, "_launch", lambda *a: launched.append(1) or real_launch(*a))
    engine = ForceEngine(model, device="cpu", precision="fp64")
    mols = _mols(7, seed=41)
    want = engine.predict(mols, batch_size=3, pipeline=False)
    assert not launched
    _rows_equal(engine.predict(mols, batch_size=3), want, mols)
    assert asked == [3] and len(launched) == 3  # three batches: pipelined
    want = engine.predict(mols, batch_size=7, pipeline=False)  # one batch (its sums, to the last bit)
    _rows_equal(engine.predict(mols, batch_size=7), want, mols)
    assert asked == [3, 1] and len(launched) == 3  # one batch: the sequential loop
    _rows_equal(engine.predict(mols, batch_size=7, pipeline=True), want, mols)
    assert asked == [3, 1] and len(launched) == 4  # asked for: pipelined all the same


@gpu
def test_one_batch_on_cuda_is_not_pipelined(model, monkeypatch):
    """On CUDA the default pipelines a call of several batches and not a call of one (the same rows)."""
    from mlff_distiller import batching

    launched = []
    real_launch = batching._launch
    monkeypatch.setattr(batching, "_launch", lambda *a: launched.append(1) or real_launch(*a))
    engine = ForceEngine(model, device="cuda")
    mols = _mols(6, seed=42)
    want = engine.predict(mols, batch_size=2, pipeline=False)
    _rows_equal(engine.predict(mols, batch_size=2), want, mols, rtol=1e-5)
    assert len(launched) == 3
    _rows_equal(engine.predict(mols[:2], batch_size=2), want[:2], mols[:2], rtol=1e-5)
    assert len(launched) == 3


def test_auto_mode_ladder_stops_at_auto_max_edges():
    """Mode "auto" pads only batches of up to ~auto_max_edges(width) edges (larger ones run eager: the captured
    pools' memory): edges x width up to AUTO_MAX_EDGE_FEATURES, never below AUTO_MAX_EDGES nor above
    AUTO_MAX_EDGES_CAP; an explicit padded mode keeps the full default ladder; a ladder the caller gives is used as
    is."""
    from mlff_distiller.engine import AUTO_MAX_EDGE_FEATURES, AUTO_MAX_EDGES_CAP, auto_max_edges

    assert auto_max_edges(128) == AUTO_MAX_EDGE_FEATURES // 128 == AUTO_MAX_EDGES_CAP == 2**21
    assert auto_max_edges(64) == AUTO_MAX_EDGES_CAP and auto_max_edges(None) == auto_max_edges(128)
    assert auto_max_edges(256) == 2**20 and auto_max_edges(16) == AUTO_MAX_EDGES_CAP
    assert auto_max_edges(1024) == AUTO_MAX_EDGES
    for hidden in (16, 64, 128, 256):
        model = make_model(hidden=hidden)
        most = auto_max_edges(hidden)
        auto = ForceEngine(model, device="cpu", mode="auto")
        assert auto.buckets.select(100, most) is not None, hidden
        assert auto.buckets.select(100, int(most * 1.3)) is None, hidden
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # cudagraph on a CPU: padded eager, with a warning
        graph = ForceEngine(make_model(hidden=256), device="cpu", mode="cudagraph")
    assert graph.buckets.select(100, 2 * AUTO_MAX_EDGES) is not None
    mine = BucketLadder(max_edges=1024)
    assert ForceEngine(model, device="cpu", mode="auto", buckets=mine).buckets is mine


def test_small_atoms_rung_only_where_the_triton_gemms_run(monkeypatch):
    """The default ladder's 32-atom rung (SMALL_ATOMS_RUNG) is for CUDA engines on the Triton GEMMs: a CPU engine,
    and on a GPU a float64 engine, a torch.compile'd one and the torch kernel backend (cuBLAS, whose 16-row fp32
    kernels were pathological) keep the plain ladder from 64 atoms. The rule is checked on the CPU by letting the
    engine believe its device is CUDA (the ladder is chosen before anything touches the device)."""
    from mlff_distiller import engine as engine_mod
    from mlff_distiller.engine import SMALL_ATOMS_RUNG

    model = make_model()
    assert ForceEngine(model, device="cpu").buckets.small_atoms == ()
    monkeypatch.setattr(engine_mod, "BucketLadder", lambda **kw: kw)  # records the default ladder's arguments
    seen = {}

    def ladder_of(mode="cudagraph", compile_mode=None, dtype=torch.float32, backend="triton"):
        eng = ForceEngine.__new__(ForceEngine)
        eng.device, eng.mode, eng.compile_mode, eng.dtype = torch.device("cuda", 0), mode, compile_mode, dtype
        with monkeypatch.context() as m:
            m.setattr(engine_mod.kernels, "resolve_backend", lambda device: backend)
            return engine_mod._default_ladder(eng, requested_mode=mode)

    seen["fp32"] = ladder_of()
    seen["auto"] = ladder_of(mode="auto")
    seen["fp64"] = ladder_of(dtype=torch.float64)
    seen["compiled"] = ladder_of(compile_mode="default")
    seen["torch kernels"] = ladder_of(backend="torch")
    assert seen["fp32"] == {"small_atoms": (SMALL_ATOMS_RUNG,)}
    assert seen["auto"] == {"small_atoms": (SMALL_ATOMS_RUNG,), "max_edges": engine_mod.auto_max_edges(None)}
    assert all(seen[k] == {} for k in ("fp64", "compiled", "torch kernels")), seen


@gpu
def test_cuda_engine_puts_one_molecule_in_the_small_rung(model):
    """On the GPU the default engine's ladder has the 32-atom rung, and benzene's captured step there gives the
    eager unpadded step's energy and forces."""
    from mlff_distiller.engine import SMALL_ATOMS_RUNG

    engine = ForceEngine(model, device="cuda", mode="cudagraph")
    assert engine.buckets.small_atoms == (SMALL_ATOMS_RUNG,)
    eager = ForceEngine(model, device="cuda", mode="eager")
    batch = AtomsBatch.from_atoms([molecule("C6H6")])
    for _ in range(3):  # eager, capture, replay
        out = engine.compute(batch)
    assert engine.last_bucket.atoms == SMALL_ATOMS_RUNG
    ref = eager.compute(batch)
    for key in ("energy", "forces"):
        scale = ref[key].abs().max().clamp_min(1e-3)
        assert (out[key] - ref[key]).abs().max() / scale <= 1e-5, key
