"""The padded Verlet path's zero-copy step (``ForceEngine.zero_copy``, ``VerletPaths._md_launch``): an MD step whose
positions are read from, and whose packed output is written to, host buffers by the captured step's own kernels.

On the CPU the buffers are plain tensors and the capture is a stand-in (``FakeRunner``: the step run at each
"replay"), so that the path's bookkeeping (when it captures, what a rebuild or a discarded speculative launch does,
several atom counts in one bucket, releases) is tested here against the eager engine; on CUDA the buffers are
page-locked and addressed by the kernels across the bus (``test_*_on_cuda``).
"""

import numpy as np
import pytest
import torch
from ase import units
from ase.build import molecule
from helpers import make_model, random_molecule, silicon_cell

from mlff_distiller import AtomsBatch, ForceEngine, StudentCalculator
from mlff_distiller import cudagraph as cudagraph_module
from mlff_distiller import engine_verlet as verlet_module
from mlff_distiller.ase_compat import maxwell_boltzmann
from mlff_distiller.cudagraph import HostBuffer, copy_bits, host_views_work


def _engine(model, zero_copy=True, **kw) -> ForceEngine:
    engine = ForceEngine(model, device="cpu", pad=True, precision="fp64", neighbor_skin=0.4, **kw)
    engine.mode = "cudagraph"  # what a CUDA engine resolves "cudagraph" to; its capture is the FakeRunner
    engine.zero_copy = zero_copy
    return engine


def _md(atoms, fast, ref, steps: int, check=None) -> int:
    """Velocity Verlet by hand through ``fast`` (host positions in, forces out), each step checked against ``ref``
    with a fresh list; returns the steps taken."""
    maxwell_boltzmann(atoms, 1200, rng=np.random.default_rng(5))
    dt = 2.0 * units.fs
    masses = atoms.get_masses()[:, None]

    def forces():
        batch = AtomsBatch.from_atoms(atoms, dtype=torch.float64)
        got = fast.compute(batch, as_numpy=True)
        want = ref.compute(batch, to_host=True)
        np.testing.assert_allclose(got["forces"], want["forces"].numpy(), rtol=0, atol=1e-10)
        np.testing.assert_allclose(got["energy"], want["energy"].numpy(), rtol=0, atol=1e-10)
        np.testing.assert_allclose(got["atomic_energies"], want["atomic_energies"].numpy(), rtol=0, atol=1e-10)
        if check is not None:
            check(got)
        return got["forces"]

    f = forces()
    for _ in range(steps):
        atoms.set_momenta(atoms.get_momenta() + 0.5 * dt * f)
        atoms.set_positions(atoms.positions + dt * atoms.get_momenta() / masses)
        f = forces()
        atoms.set_momenta(atoms.get_momenta() + 0.5 * dt * f)
    return steps + 1


@pytest.mark.parametrize("speculative", [False, True])
@pytest.mark.parametrize("system", ["benzene", "silicon"])
def test_zero_copy_md_matches_a_fresh_list_and_reads_its_own_buffer(model, fake_graphs, system, speculative):
    """MD through the zero-copy step equals the eager engine on a fresh list at every step, across rebuilds (and the
    speculative launches they discard); each result is the content of the step's own output buffer; one capture,
    and the bucket's plain graph is never captured."""
    atoms = molecule("C6H6") if system == "benzene" else silicon_cell(rattle=0.05)
    fast = _engine(model)
    fast.speculative_verlet = speculative
    ref = ForceEngine(model, device="cpu", precision="fp64", mode="eager")

    def from_buffer(got):  # the packed output (float64: one entry per energy slot, then atomic energies, forces)
        (md,) = fast._md_runners.values()
        a = fast.last_bucket.atoms
        np.testing.assert_array_equal(md.packed.array[2 * a : 2 * a + got["forces"].size], got["forces"].ravel())

    calls = _md(atoms, fast, ref, 40, check=from_buffer)
    v = fast.verlet
    assert v.n_calls == calls and 2 <= v.n_builds < calls, v
    assert fast.n_discarded == (v.n_builds - 1 if speculative else 0)
    assert len(fake_graphs) == 1 and not fast._runners  # only the zero-copy step was captured
    assert list(fast._md_runners) == [(fast.last_bucket, len(atoms))]
    assert fast.captured_buckets == [fast.last_bucket]


def test_zero_copy_waits_for_capture_after(model, fake_graphs):
    """A bucket's first ``capture_after`` calls run the plain step eagerly (counted as before); the next one
    captures the zero-copy step, and the results never change."""
    atoms = molecule("CH4")
    fast = _engine(model, capture_after=2)
    ref = ForceEngine(model, device="cpu", precision="fp64", mode="eager")
    counts = []

    def count(_got):
        counts.append(len(fast._md_runners))

    _md(atoms, fast, ref, 4, check=count)
    assert counts == [0, 0, 1, 1, 1] and len(fake_graphs) == 1 and not fast._runners


def test_zero_copy_off_takes_the_plain_graph(model, fake_graphs):
    fast = _engine(model, zero_copy=False)
    ref = ForceEngine(model, device="cpu", precision="fp64", mode="eager")
    _md(molecule("C6H6"), fast, ref, 3)
    assert not fast._md_runners and list(fast._runners) == [fast.last_bucket] and len(fake_graphs) == 1


def test_zero_copy_default_is_cuda_only(model, fake_graphs):
    """``zero_copy=None`` (the default) is on for CUDA engines only: a CPU engine in graph mode keeps the copies."""
    fast = _engine(model, zero_copy=None)
    ref = ForceEngine(model, device="cpu", precision="fp64", mode="eager")
    _md(molecule("H2O"), fast, ref, 2)
    assert not fast._md_runners and fast._runners


def test_atom_counts_sharing_a_bucket_get_their_own_step_and_release_drops_them(model, fake_graphs):
    """Systems of different atom counts in one bucket each get their own zero-copy step (their buffers' shapes
    differ); a system of the same count reuses it (its list rebuilt); ``release_captures`` drops them."""
    fast = _engine(model)
    ref = ForceEngine(model, device="cpu", precision="fp64", mode="eager")
    systems = [molecule("CH4"), molecule("H2O"), molecule("CH4"), random_molecule(5, np.random.default_rng(3))]
    for atoms in systems:
        batch = AtomsBatch.from_atoms(atoms, dtype=torch.float64)
        got, want = fast.compute(batch, to_host=True), ref.compute(batch, to_host=True)
        for k in ("energy", "forces", "atomic_energies"):
            np.testing.assert_allclose(got[k].numpy(), want[k].numpy(), rtol=0, atol=1e-10, err_msg=k)
    keys = list(fast._md_runners)
    assert sorted(n for _, n in keys) == [3, 5] and len({b for b, _ in keys}) == 1, keys
    assert fast.verlet.n_builds == 4 and len(fake_graphs) == 2
    assert fast.release_captures() == 2 and not fast._md_runners and fast.captured_buckets == []


def test_a_bucket_holds_a_bounded_number_of_zero_copy_steps(model, fake_graphs, monkeypatch):
    """Beyond ``ZERO_COPY_COUNTS_PER_BUCKET`` atom counts in one bucket, further counts take the bucket's plain graph
    (one for all of them): the captured pools stay bounded; every result stays right."""
    monkeypatch.setattr(verlet_module, "ZERO_COPY_COUNTS_PER_BUCKET", 2)
    fast = _engine(model)
    ref = ForceEngine(model, device="cpu", precision="fp64", mode="eager")
    for name in ("CH4", "H2O", "NH3", "C2H2", "CH4"):
        batch = AtomsBatch.from_atoms(molecule(name), dtype=torch.float64)
        got, want = fast.compute(batch, to_host=True), ref.compute(batch, to_host=True)
        np.testing.assert_allclose(got["forces"].numpy(), want["forces"].numpy(), rtol=0, atol=1e-10, err_msg=name)
    assert sorted(n for _, n in fast._md_runners) == [3, 5]  # CH4 and H2O; NH3 and C2H2 (4 atoms) the plain graph
    assert list(fast._runners) == [fast.last_bucket] and len(fake_graphs) == 3


def test_zero_copy_is_skipped_for_stress_exact_pairs_and_device_positions(model, fake_graphs):
    """The stress step, float64 pair vectors (coordinates past PRECISE_PAIRS_FROM in a float32 engine) and
    positions already on the device take the usual path: same results, no zero-copy step."""
    atoms = silicon_cell(rattle=0.05)
    fast = _engine(model)
    batch = AtomsBatch.from_atoms(atoms, dtype=torch.float64)
    out = fast.compute(batch, stress=True, to_host=True)
    assert not fast._md_runners and "stress" in out
    assert not fast._zero_copy_for(batch, to_host=False, stress=False, exact=False)
    assert not fast._zero_copy_for(batch, to_host=True, stress=False, exact=True)
    batch32 = AtomsBatch.from_atoms(atoms, dtype=torch.float32)  # another dtype than the engine's
    assert not fast._zero_copy_for(batch32, to_host=True, stress=False, exact=False)
    assert fast._zero_copy_for(batch, to_host=True, stress=False, exact=False)


def test_an_engine_whose_device_cannot_read_the_buffers_keeps_the_copies(model, fake_graphs, monkeypatch):
    """Where the round trip through a host buffer fails (a device without unified addressing), the engine keeps the
    copies: no zero-copy step, the same results."""

    def broken(*args, **kw):
        raise RuntimeError("no device view")

    monkeypatch.setattr(cudagraph_module.HostBuffer, "__init__", broken)
    fast = _engine(model)
    ref = ForceEngine(model, device="cpu", precision="fp64", mode="eager")
    _md(molecule("H2O"), fast, ref, 2)
    assert fast._zero_copy_works is False and not fast._md_runners and fast._runners


def test_copy_bits_keeps_every_bit():
    """Float32 and float64 entries move bit for bit (NaN payloads, negative zero, the packed output's float64
    energies as float32 word pairs); other widths take ``copy_``."""
    words = np.array([0x7FC00001, 0xFFFFFFFF, 0x80000000, 0x7F800000, 0x3F800000], dtype=np.uint32)
    src = torch.from_numpy(words.view(np.float32).copy())
    dst = torch.zeros_like(src)
    copy_bits(src, dst)
    assert (dst.numpy().view(np.uint32) == words).all()
    e = torch.tensor([-1234.5678901234567, float("nan")], dtype=torch.float64)
    packed = torch.zeros(4, dtype=torch.float32)
    copy_bits(e.view(torch.float32), packed)
    assert packed.view(torch.float64)[0].item() == e[0].item()
    half = torch.tensor([1.5, -0.0], dtype=torch.float16)
    out = torch.ones_like(half)
    copy_bits(half, out)
    assert torch.equal(out.view(torch.int16), half.view(torch.int16))


def test_host_buffer_on_the_cpu_is_its_own_view():
    buf = HostBuffer((4, 3), torch.float32, torch.device("cpu"))
    assert buf.view is buf.host and buf.array.shape == (4, 3) and not buf.array.any()
    assert host_views_work(torch.device("cpu"))


@pytest.mark.gpu
def test_host_buffers_round_trip_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    dev = torch.device("cuda")
    assert host_views_work(dev)
    buf = HostBuffer((5, 3), torch.float32, dev)
    assert buf.view.is_cuda and buf.host.is_pinned() and buf.view.data_ptr() == buf.host.data_ptr()


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp32", "fp64"])
def test_calculator_md_takes_the_zero_copy_step_on_cuda(precision):
    """ASE MD through StudentCalculator on CUDA (mode auto: graphs) takes the zero-copy step and gives the forces
    of the same calculator with the copies (``zero_copy=False``), step for step, across rebuilds."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from ase.md.verlet import VelocityVerlet

    model = make_model()
    atoms = molecule("C6H6")
    maxwell_boltzmann(atoms, 1500, rng=np.random.default_rng(1))
    calc = StudentCalculator(model, device="cuda", precision=precision, skin=0.3)
    ref = StudentCalculator(model, device="cuda", precision=precision, skin=0.3)
    ref.engine.zero_copy = False
    atoms.calc = calc
    tol = 1e-9 if precision == "fp64" else 1e-4
    seen = []

    def check():
        other = atoms.copy()
        other.calc = ref
        np.testing.assert_allclose(atoms.get_forces(), other.get_forces(), rtol=0, atol=tol)
        seen.append(atoms.get_potential_energy())

    dyn = VelocityVerlet(atoms, timestep=1.0 * units.fs)
    dyn.attach(check, interval=1)
    dyn.run(60)
    eng = calc.engine
    assert eng.mode == "cudagraph" and eng._zero_copy_works is True
    assert eng._md_runners and not eng._runners, (eng._md_runners, eng._runners)
    # (the copies' runners: the dense step's where the student is small enough, stop 69)
    assert (ref.engine._runners or any(ref.engine._dense_runners.values())) and not ref.engine._md_runners
    # every rebuild after the first either threw a speculative step away, or (fp32, launched ahead) was made ahead
    builds = eng.verlet.n_builds
    assert builds >= 2 and eng.n_discarded + eng.n_rebuilt_ahead == builds - 1, (builds, eng.n_discarded)
    assert eng.n_rebuilt_ahead == (builds - 1 if precision == "fp32" else 0)
    assert np.isfinite(seen).all()


def test_the_current_stream_wait_reads_the_current_stream_each_time(monkeypatch):
    """``synchronize_current_stream`` waits on whatever stream is current at the call (read each time, as
    ``torch.cuda.current_stream`` reads it), keeps one ``Stream`` object per stream (at most ``STREAMS_KEPT``), and
    without the binding or a device index goes through ``current_stream``. The CUDA calls are stand-ins here."""
    cudagraph = cudagraph_module
    current = [(3, 0, 1)]
    made, waited = [], []

    class FakeStream:
        def __init__(self, stream_id, device_index, device_type):
            made.append((stream_id, device_index, device_type))
            self.key = (stream_id, device_index, device_type)

        def synchronize(self):
            waited.append(self.key)

    monkeypatch.setattr(torch._C, "_cuda_getCurrentStream", lambda index: current[0], raising=False)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(cudagraph, "_STREAMS", {})
    monkeypatch.setattr(cudagraph, "STREAMS_KEPT", 2)
    dev = torch.device("cuda", 0)
    cudagraph.synchronize_current_stream(dev)
    cudagraph.synchronize_current_stream(dev)
    current[0] = [5, 0, 1]  # (a list: keyed as a tuple)
    cudagraph.synchronize_current_stream(dev)
    assert waited == [(3, 0, 1), (3, 0, 1), (5, 0, 1)] and made == [(3, 0, 1), (5, 0, 1)]
    current[0] = (7, 0, 1)
    cudagraph.synchronize_current_stream(dev)  # a third stream: the kept ones are dropped first
    assert list(cudagraph._STREAMS) == [(7, 0, 1)] and waited[-1] == (7, 0, 1)
    assert cudagraph.current_stream_cached(dev) is cudagraph._STREAMS[(7, 0, 1)]  # (the chain's event records there)
    slow = []
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: slow.append(device) or FakeStream(9, 0, 1))
    cudagraph.synchronize_current_stream(torch.device("cuda"))  # no index: the plain way
    monkeypatch.delattr(torch._C, "_cuda_getCurrentStream")
    cudagraph.synchronize_current_stream(dev)  # no binding: the plain way
    assert slow == [torch.device("cuda"), dev] and waited[-2:] == [(9, 0, 1), (9, 0, 1)]


@pytest.mark.gpu
def test_the_current_stream_wait_on_cuda():
    """On CUDA: the wait is on the stream current at the call, inside a ``torch.cuda.stream`` context too (work queued
    there is done when it returns), and the kept object is the current stream."""
    cudagraph = cudagraph_module
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    dev = torch.device("cuda", torch.cuda.current_device())
    side = torch.cuda.Stream(dev)
    x = torch.randn(4096, 4096, device=dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        y = x @ x
        cudagraph.synchronize_current_stream(dev)
        assert side.query()
        key = tuple(torch._C._cuda_getCurrentStream(dev.index))
        assert cudagraph._STREAMS[key] == torch.cuda.current_stream(dev)
    cudagraph.synchronize_current_stream(dev)
    assert torch.cuda.current_stream(dev).query() and y.shape == (4096, 4096)
