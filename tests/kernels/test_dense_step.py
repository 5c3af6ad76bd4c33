"""kernels/dense_step.py: a small molecule's energy + forces in six launches, one program per atom.

Oracles: the model's own forward and autograd in float64 (``dense_step_reference``: the edge list built from all pairs
within the cutoff) and finite differences of the dense step's own energy; on the CPU under the interpreter, on CUDA
when present.
"""

import pytest
import torch
from mlff_distiller.kernels import dense_step as ds

from mlff_distiller.model.painn import StudentModel

WALL = [[1, 6, 1.2], [6, 6, 1.5], [1, 1, 0.9], [6, 8, 1.3]]


def _model(dtype=torch.float64, seed=0, **kw):
    torch.manual_seed(seed)
    config = dict(hidden=32, layers=3, n_rbf=20, cutoff=5.0, repulsion=WALL) | kw
    model = StudentModel(**config).to(dtype)
    with torch.no_grad():
        model.atomic_scale.uniform_(0.5, 1.5)
        model.atomic_shift.uniform_(-2.0, 2.0)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def _molecules(sizes, np_=16, dtype=torch.float64, seed=0, spread=1.6):
    gen = torch.Generator().manual_seed(seed)
    pos = torch.zeros((len(sizes), np_, 3), dtype=torch.float64)
    idx = torch.full((len(sizes), np_), -1, dtype=torch.int32)
    for b, n in enumerate(sizes):
        pos[b, :n] = torch.randn(n, 3, generator=gen, dtype=torch.float64) * spread
        idx[b, :n] = torch.randint(0, 4, (n,), generator=gen, dtype=torch.int32)
    return pos.to(dtype), idx


def _close(got, want, rtol, atol=0.0):
    torch.testing.assert_close(got.double().cpu(), want.double().cpu(), rtol=rtol, atol=atol)


@pytest.mark.parametrize(
    ("wall", "options"),
    [
        (WALL, {}),
        (WALL, {"split": False, "geometry": False}),
        (None, {"split": False}),
        (WALL, {"geometry": False, "fan": False, "early": False}),
        (WALL, {"rows": False}),
        (WALL, {"rows": (False, True), "fan": True}),
    ],
    ids=["defaults", "unsplit", "no wall", "stop 70", "columns", "fan both"],
)
def test_float64_equals_the_models_autograd(triton_device, wall, options):
    """Molecules of 16, 12, 7, 2 and 1 atoms (padding programs, a lone atom) with a pair inside the ZBL wall and
    pairs beyond the cutoff: energies, atomic energies and forces to float64 rounding, for the launch options (the
    defaults and others; on the interpreter ``early`` orders nothing, so its overlap is the CUDA tests'). Without a
    wall the step takes a table of radius 0; ``split`` gives each backward's two parts their own programs; ``rows``
    (forward, backward) sums the node products along the rows of the weights' transposes (the default) or along the
    columns; ``geometry`` keeps the first forward's pair geometry for the other launches; ``fan`` gives each launch's
    tail programs of their own (the forward's by default, both here), the backward's in three parts whose V share
    the next launch adds."""
    model = _model(repulsion=wall)
    pos, idx = _molecules([16, 12, 7, 2, 1], spread=2.2)
    pos[1, 1] = pos[1, 0] + torch.tensor([0.85, 0.1, 0.0], dtype=torch.float64)  # inside a wall
    idx[1, :2] = torch.tensor([0, 1], dtype=torch.int32)  # H and C: the (1, 6) wall at 1.2 Å
    d = torch.cdist(pos[0, :16], pos[0, :16])
    assert (d > model.cutoff).any(), "the test wants pairs beyond the cutoff"
    er, ar, fr = ds.dense_step_reference(model, pos, idx)
    step = ds.DenseStep(model, torch.float64, triton_device, **options)
    e, a, f = step(pos.to(triton_device), idx.to(triton_device))
    _close(e, er, rtol=1e-12)
    _close(a, ar, rtol=1e-12, atol=1e-12)
    _close(f, fr, rtol=1e-10, atol=1e-11)
    assert a.cpu()[idx < 0].eq(0).all() and f.cpu()[idx < 0].eq(0).all()
    assert f[4].abs().max() == 0  # a lone atom: no force


def test_32_slots_and_repeated_calls(triton_device):
    """A molecule of 23 atoms in 32 slots beside one of 5; a second call on other positions through the same kept
    scratch gives that call's own results (nothing stale: the kept geometry is the first forward's of each call)."""
    model = _model(seed=1)
    step = ds.DenseStep(model, torch.float64, triton_device)
    for seed in (1, 2):
        pos, idx = _molecules([23, 5], np_=32, seed=seed, spread=1.8)
        er, ar, fr = ds.dense_step_reference(model, pos, idx)
        e, a, f = step(pos.to(triton_device), idx.to(triton_device))
        _close(e, er, rtol=1e-12)
        _close(a, ar, rtol=1e-12, atol=1e-12)
        _close(f, fr, rtol=1e-10, atol=1e-11)
    assert len(step._scratch) == 1


def test_64_slots(triton_device):
    """A molecule of 40 atoms in 64 slots (the forward without fan: 256 programs would not fit one an SM) against
    autograd in float64."""
    model = _model(seed=2)
    pos, idx = _molecules([40], np_=64, seed=2, spread=2.0)
    er, ar, fr = ds.dense_step_reference(model, pos, idx)
    step = ds.DenseStep(model, torch.float64, triton_device)
    assert not step.plan(1, 64, False)[0][2]["FAN"]
    e, a, f = step(pos.to(triton_device), idx.to(triton_device))
    _close(e, er, rtol=1e-12)
    _close(a, ar, rtol=1e-12, atol=1e-12)
    _close(f, fr, rtol=1e-10, atol=1e-11)


def test_the_engines_launch_zeros_what_it_does_not_write(triton_device):
    """``from_numbers`` as the engine calls it: the step of structure 0 of padded buffers of A = 32 slots (a
    molecule of 9 atoms in 16 slots, then another structure), written into views of one packed output ``[W + A +
    3A]`` that starts as NaN; the first launch zeros the other structures' energies and the slots beyond 16, so the
    engine needs no fill (float64 against autograd for the molecule)."""
    model = _model(seed=4)
    pos16, idx16 = _molecules([9], seed=4, spread=1.7)
    er, ar, fr = ds.dense_step_reference(model, pos16, idx16)
    a, np_ = 32, 16
    species = torch.as_tensor(model.config.species)
    pos = torch.randn(a, 3, dtype=torch.float64) * 3.0
    pos[:np_] = pos16[0]
    numbers = torch.full((a,), 1, dtype=torch.int64)
    numbers[:9] = species[idx16[0, :9].long()]
    batch = torch.ones(a, dtype=torch.int64)  # slots 9-31: structure 1 (not structure 0's atoms)
    batch[:9] = 0
    step = ds.DenseStep(model, torch.float64, triton_device)
    w = a  # float64: one element an energy
    out = torch.full((w + 4 * a,), float("nan"), dtype=torch.float64, device=triton_device)
    views = (out[:w][:1], out[w : w + a][:np_].view(1, np_), out[w + a :].view(a, 3)[:np_].view(1, np_, 3))
    zero = (out, ((1, w), (w + np_, w + a), (w + a + 3 * np_, w + 4 * a)))
    dev = triton_device
    step.from_numbers(pos.to(dev), numbers.to(dev), batch.to(dev), np_, views, zero)
    out = out.cpu()
    assert not out.isnan().any()
    assert out[1:w].eq(0).all() and out[w + np_ : w + a].eq(0).all() and out[w + a + 3 * np_ :].eq(0).all()
    _close(out[:1], er, rtol=1e-12)
    _close(out[w : w + np_], ar[0], rtol=1e-12, atol=1e-12)
    _close(out[w + a : w + a + 3 * np_].view(np_, 3), fr[0], rtol=1e-10, atol=1e-11)
    with pytest.raises(ValueError, match="zero"):
        step.from_numbers(pos.to(dev), numbers.to(dev), batch.to(dev), np_, views, (out.float(), zero[1]))


def test_the_ablation_instrument_leaves_out_what_it_names():
    """``ablate`` (a probe's timing instrument): 1 leaves the split backwards' feature programs out, 2 their geometry
    programs; each changes the forces (its results are wrong), the energy stays the forward's. What the left-out
    programs would have written is then read from the scratch as it was: filled with NaN here first, since a fresh
    scratch may reuse the previous step's memory and hold its very values (CI saw ablate 2 give the full forces once,
    stop 74)."""
    model = _model(seed=6, layers=2)
    pos, idx = _molecules([6], seed=6, spread=1.4)
    e, _, f = ds.DenseStep(model, torch.float64)(pos, idx)
    for ablate in (1, 2):
        step = ds.DenseStep(model, torch.float64, ablate=ablate)
        for buf in step.scratch(*pos.shape[:2]):
            buf.fill_(float("nan"))
        e2, _, f2 = step(pos, idx)
        assert e2 == e and not torch.allclose(f2, f), ablate


def test_forces_are_minus_the_energys_finite_differences(triton_device):
    """(Without fan, which the interpreter runs four times slower a forward: the algebra is the same, and the float64
    tests compare fan against autograd.)"""
    model = _model(seed=3)
    pos, idx = _molecules([9], seed=3, spread=1.3)
    pos, idx = pos.to(triton_device), idx.to(triton_device)
    step = ds.DenseStep(model, torch.float64, triton_device, fan=False)
    _, _, f = step(pos, idx)
    h = 1e-5
    for atom, k in [(0, 0), (3, 1), (8, 2)]:
        plus, minus = pos.clone(), pos.clone()
        plus[0, atom, k] += h
        minus[0, atom, k] -= h
        fd = -(step(plus, idx)[0] - step(minus, idx)[0]) / (2 * h)
        assert abs(float(fd) - float(f[0, atom, k])) < 1e-6 * max(1.0, abs(float(fd)))


def test_shipped_student_on_benzene_in_float32(triton_device):
    """The 64 x 3 student shipped with the package in float32 against its float64 copy's autograd."""
    from ase.build import molecule

    from mlff_distiller import load_model

    m32, m64 = load_model("builtin:chno-gfn2-small"), load_model("builtin:chno-gfn2-small").double()
    for m in (m32, m64):
        for p in m.parameters():
            p.requires_grad_(False)
    at = molecule("C6H6")
    pos = torch.zeros((1, 16, 3), dtype=torch.float64)
    idx = torch.full((1, 16), -1, dtype=torch.int32)
    pos[0, :12] = torch.as_tensor(at.positions)
    zi = {z: k for k, z in enumerate(m32.config.species)}
    idx[0, :12] = torch.tensor([zi[int(z)] for z in at.numbers], dtype=torch.int32)
    er, _, fr = ds.dense_step_reference(m64, pos, idx)
    e, _, f = ds.DenseStep(m32.to(triton_device), torch.float32, triton_device)(
        pos.float().to(triton_device), idx.to(triton_device)
    )
    assert abs(float(e) - float(er)) < 5e-5
    assert (f.double().cpu() - fr).abs().max() < 2e-5


@pytest.mark.parametrize(("layers", "fan"), [(1, True), (2, True), (4, (True, False))])
def test_other_depths(triton_device, layers, fan):
    """Students of 1, 2 and 4 layers (a launch per layer each way; the scratch's slots follow the depth; one layer:
    the last forward's fan feeds the only backward, which takes no ``early``): float64 against autograd."""
    model = _model(seed=layers, layers=layers)
    pos, idx = _molecules([11, 4], seed=layers, spread=1.9)
    er, ar, fr = ds.dense_step_reference(model, pos, idx)
    step = ds.DenseStep(model, torch.float64, triton_device, fan=fan)
    assert [kw["EARLY"] for _, _, kw in step.plan(2, 16, False)] == [True] * layers + [layers > 1] * layers
    e, a, f = step(pos.to(triton_device), idx.to(triton_device))
    _close(e, er, rtol=1e-12)
    _close(a, ar, rtol=1e-12, atol=1e-12)
    _close(f, fr, rtol=1e-10, atol=1e-11)
    assert [ds.slots(n) for n in (1, 2, 3, 4)] == [18, 44, 70, 96]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_overlapping_launches_replayed_back_to_back_on_cuda():
    """With PDL and ``early`` (the defaults) each launch starts while its predecessor runs and reads what that one
    does not write before its wait. Captured in a CUDA graph and replayed 20 times back to back on each of four
    position sets, the last replay's results equal the float64 autograd's every time (a race would not)."""
    import os

    from mlff_distiller.kernels._triton_utils import pdl_args, sm90

    dev = torch.device("cuda")
    model = _model(seed=5)
    step = ds.DenseStep(model, torch.float64, dev)
    pos0, idx = _molecules([16, 9], seed=5, spread=1.8)
    pos_in, idx_in = pos0.to(dev), idx.to(dev)
    if sm90(dev) and os.environ.get("MLFF_DISTILLER_PDL", "1").strip() != "0":
        assert pdl_args(pos_in)["PDL"], "the launches this test is about do not overlap here"
    step(pos_in, idx_in)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        e, a, f = step(pos_in, idx_in)
    gen = torch.Generator().manual_seed(6)
    for _ in range(4):
        pos = pos0 + 0.05 * torch.randn(pos0.shape, generator=gen, dtype=torch.float64) * (idx >= 0)[..., None]
        pos_in.copy_(pos)
        for _ in range(20):
            graph.replay()
        torch.cuda.synchronize()
        er, ar, fr = ds.dense_step_reference(model, pos, idx)
        _close(e, er, rtol=1e-12)
        _close(a, ar, rtol=1e-12, atol=1e-12)
        _close(f, fr, rtol=1e-10, atol=1e-11)


def test_rejects_what_it_does_not_compute():
    assert ds.supports(_model()) is None
    assert ds.supports(_model(layers=2)) is None
    with pytest.raises(ValueError, match="hidden 48"):
        ds.DenseStep(_model(hidden=48))
    step = ds.DenseStep(_model(), torch.float64)  # (on the CPU: every refusal comes before a launch)
    with pytest.raises(ValueError, match="NP = 8"):
        step(torch.zeros(1, 8, 3, dtype=torch.float64), torch.zeros(1, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="NP = 24"):
        step(torch.zeros(1, 24, 3, dtype=torch.float64), torch.zeros(1, 24, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"idx \[B, NP\]"):
        step(torch.zeros(1, 16, 3, dtype=torch.float64), torch.zeros(2, 16, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32 idx"):
        step(torch.zeros(1, 16, 3, dtype=torch.float32), torch.zeros(1, 16, dtype=torch.int32))
    assert [ds.padded_atoms(n) for n in (1, 12, 16, 17, 33)] == [16, 16, 16, 32, 64]
    assert "hidden 48" in ds.supports(_model(hidden=48))
    assert "basis" in ds.supports(_model(basis="gaussian"))
    grad = _model()
    grad.interactions[0].phi[0].weight.requires_grad_(True)
    assert "species table" in ds.supports(grad)


def test_launch_options_default_to_the_measured_ones():
    """rows on, 8 warps up to 64 features and 16 above (stop 70 on the H200: benzene 69 µs against 92 for stop 69's
    column sums on 4 warps); without rows stop 69's 4 and 8; a pair sets the two directions apart. Stop 71: the kept
    geometry, the forward's fan and the early loads under PDL on (benzene 69.1 → 65.1 → 62.6 → 55.7 µs); the
    backward's fan (slower) off, and never without ``split``."""
    step = ds.DenseStep(_model())
    assert (step.rows, step.num_warps) == ((True, True), (8, 8))
    assert (step.geometry, step.fan, step.pdl, step.early) == (True, ("auto", False), True, True)
    assert ds.DenseStep(_model(), fan=True, split=False).fan == (True, False)
    # "auto": the forward's fan where its programs (four an atom) fit one an SM (C60 in 64 slots: 159.5 µs with
    # it, 110.3 without; stop71_gpu/e/)
    fans = {(b, n): step.plan(b, n, False)[0][2]["FAN"] for b, n in [(1, 16), (1, 32), (2, 16), (1, 64), (2, 32)]}
    assert step.sm_count == ds.FAN_SMS == 132 and fans == {(1, 16): True, (1, 32): True, (2, 16): True} | {
        (1, 64): False,
        (2, 32): False,
    }
    assert [g for _, g, _ in step.plan(1, 32, False)] == [(32, 1, 4), (32, 1, 4), (32, 1, 3)] + [(32, 1, 2)] * 2 + [
        (32, 1, 1)
    ]
    with pytest.raises(ValueError, match="fan"):
        ds.DenseStep(_model(), fan="sometimes")
    assert ds.DenseStep(_model(hidden=128, n_rbf=8)).num_warps == (16, 16)
    assert ds.DenseStep(_model(), rows=False).num_warps == (4, 4)
    assert ds.DenseStep(_model(hidden=128, n_rbf=8), rows=False).num_warps == (8, 8)
    step = ds.DenseStep(_model(), rows=(True, False), num_warps=(8, 4))
    assert (step.rows, step.num_warps) == ((True, False), (8, 4))


def test_packed_weights_hold_every_weight_once_in_each_orientation():
    model = _model(hidden=32, n_rbf=20)
    w = ds.pack_weights(model)
    f, rp = 32, 32
    layer = model.interactions[1]
    assert w.numel() == 3 * ds.layer_size(f, rp) + 4 * 4 * f + 2 * f * 16 + 2 * 16 + 1 + 2 * 4
    base = ds.layer_size(f, rp)  # layer 1: W1^T first, then W1
    torch.testing.assert_close(w[base : base + f * f].view(f, f), layer.phi[0].weight.t())
    torch.testing.assert_close(w[base + f * f : base + 2 * f * f].view(f, f), layer.phi[0].weight)


_COMPILE_SM90 = """
import sys
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mlff_distiller.kernels import dense_step as ds
from mlff_distiller.model.painn import StudentModel

model = StudentModel(hidden=32, layers=3, n_rbf=20, cutoff=5.0).eval()
for p in model.parameters():
    p.requires_grad_(False)
steps = [("default", ds.DenseStep(model), None), ("other", ds.DenseStep(model, fan=True, early=True), {"PDL": True})]
zeros = {"default": True, "other": False}  # (the engine's launch zeros its output's other slots)
seen = set()
for dtype in ("fp64", "fp32"):
    for label, step, pdl in steps:
        for kernel, grid, kw in step.plan(1, 16, True, pdl, zeros[label]):
            kw = dict(kw)
            num_warps = kw.pop("num_warps")
            key = (dtype, kernel.fn.__name__, tuple(sorted(kw.items())))
            if key in seen or (dtype == "fp64" and label != "default"):
                continue
            seen.add(key)
            names = kernel.arg_names

            def ty(n):
                if n in ("idx_ptr", "batch_ptr"):
                    return "*i64"
                if n == "z2i_ptr":
                    return "*i32"
                if n == "energy_ptr":
                    return "*fp64"
                return f"*{dtype}" if n.endswith("_ptr") else "i32"

            src = ASTSource(
                fn=kernel,
                signature={n: "constexpr" if n in kw else ty(n) for n in names},
                constexprs={(names.index(c),): v for c, v in kw.items()},
                attrs={(names.index(p),): [["tt.divisibility", 16]] for p in names if p.endswith("_ptr")},
            )
            try:
                compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
            except (ImportError, FileNotFoundError) as exc:  # a Triton without its NVIDIA backend or ptxas
                print("SKIP", exc)
                sys.exit(0)
            print("compiled", label, kernel.fn.__name__, dtype, kw["LAYER"], len(compiled.asm["cubin"]))
"""


def test_the_engines_launches_compile_for_sm90():
    """The kernels as the engine launches them (``FROM_Z``: int64 atomic numbers and structure indices; every launch
    of :meth:`DenseStep.plan`, the defaults in float64 and float32, ``fan`` both ways with ``early`` and PDL in
    float32) compile for sm_90 with the
    installed Triton on a host with no GPU (in a process of its own: the interpreter, which the suite selects, never
    compiles). Triton 3.6 could not compile the float64 forward's
    geometry (``rx / d``: "'arith.divf' op requires the same encoding") until stop 70; the engine found out on the
    GPU, at its first molecule."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _COMPILE_SM90], env=env, capture_output=True, text=True, timeout=600)
    if run.stdout.startswith("SKIP"):
        pytest.skip(f"no sm_90 compiler here: {run.stdout[5:].strip()}")
    assert run.returncode == 0, run.stderr[-3000:]
    # float64: the default step's six launches; float32: those and the six others
    assert run.stdout.count("compiled") == 18, run.stdout
