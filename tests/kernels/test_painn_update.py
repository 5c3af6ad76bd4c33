"""Fused PaiNN update block (inference): forward and first derivative vs the torch reference, the dispatch rules.

Tolerances. The oracle is the torch reference evaluated in float64 on the same inputs (float32 inputs too), its
gradients by autograd. Normwise, |x - x_ref| <= tol · |x_ref| with tol = 1e-12 (float64) and 1e-5 (float32), for
the outputs and for the gradients wrt s and v under random upstream gradients. The whole StudentModel (frozen,
float64), triton vs torch: energies and forces agree to 1e-10 relative (normwise).
"""

import importlib

import pytest
import torch
from mlff_distiller.kernels import painn_update, painn_update_fusable, painn_update_reference, use_backend
from torch.utils._python_dispatch import TorchDispatchMode

from mlff_distiller import StudentModel
from mlff_distiller.model.painn import PaiNNUpdate

pu_module = importlib.import_module("mlff_distiller.kernels.painn_update")
lin_module = importlib.import_module("mlff_distiller.kernels.linear")

TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def _inputs(n, f, dtype, device, seed=0, zero_v=False):
    """s [N,F], v [N,3,F] (requiring grad) and the six weights of the block (not requiring grad)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(device=device, dtype=dtype)

    s = rand(n, f).requires_grad_(True)
    v = (torch.zeros(n, 3, f, dtype=dtype, device=device) if zero_v else rand(n, 3, f)).requires_grad_(True)
    weights = [
        rand(f, f, scale=f**-0.5),
        rand(f, f, scale=f**-0.5),
        rand(f, 2 * f, scale=(2 * f) ** -0.5),
        rand(f),
        rand(3 * f, f, scale=f**-0.5),
        rand(3 * f),
    ]
    return s, v, weights


def _close(actual, expected, tol, what):
    assert actual.shape == expected.shape, what
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err = (actual.double() - expected).norm().item()
    assert err <= tol * expected.norm().item(), f"{what}: normwise error {err:.3e} vs |ref| {expected.norm():.3e}"


def _fused_block(f, dtype, device, seed=0):
    torch.manual_seed(seed)
    return PaiNNUpdate(f).to(device=device, dtype=dtype).requires_grad_(False)


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts the calls of the fused autograd Function."""
    calls = []
    apply = pu_module._PaiNNUpdateFused.apply

    def spy(*args):
        calls.append(1)
        return apply(*args)

    monkeypatch.setattr(pu_module._PaiNNUpdateFused, "apply", spy)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("f", [8, 20, 128])
@pytest.mark.parametrize("n", [0, 1, 7, 33])
@pytest.mark.parametrize("zero_v", [False, True], ids=["v", "v0"])
def test_matches_reference(triton_device, poison, fused_calls, dtype, f, n, zero_v):
    s, v, weights = _inputs(n, f, dtype, triton_device, seed=n + f, zero_v=zero_v)
    poison(8 * n * f, dtype, triton_device)
    with use_backend("triton"):
        s_out, v_out = painn_update(s, v, *weights)
    assert len(fused_calls) == 1
    gen = torch.Generator().manual_seed(1)
    g_s = torch.randn(n, f, generator=gen, dtype=torch.float64).to(triton_device)
    g_v = torch.randn(n, 3, f, generator=gen, dtype=torch.float64).to(triton_device)
    grads = torch.autograd.grad((s_out, v_out), (s, v), (g_s.to(dtype), g_v.to(dtype)))

    s64, v64 = (t.detach().double().requires_grad_(True) for t in (s, v))
    s_ref, v_ref = painn_update_reference(s64, v64, *(w.double() for w in weights))
    grads_ref = torch.autograd.grad((s_ref, v_ref), (s64, v64), (g_s, g_v))
    assert s_out.dtype == v_out.dtype == dtype
    for name, got, ref in zip(
        ("s_out", "v_out", "grad_s", "grad_v"), (s_out, v_out, *grads), (s_ref, v_ref, *grads_ref), strict=True
    ):
        _close(got, ref.detach(), TOL[dtype], name)


def test_torch_path_unchanged(triton_device):
    """With trainable weights the block runs today's torch code: bit for bit the reference."""
    blk = PaiNNUpdate(20).to(triton_device).double()
    s, v, _ = _inputs(7, 20, torch.float64, triton_device)
    params = (blk.U.weight, blk.V.weight, blk.mix[0].weight, blk.mix[0].bias, blk.mix[2].weight, blk.mix[2].bias)
    with use_backend("triton"):
        out = blk(s, v)
    ref = painn_update_reference(s, v, *params)
    assert all(torch.equal(a, b) for a, b in zip(out, ref, strict=True))


def test_dispatch_rules(triton_device, fused_calls, monkeypatch):
    f = 8
    blk = _fused_block(f, torch.float64, triton_device)
    s, v, _ = _inputs(5, f, torch.float64, triton_device)
    with use_backend("triton"):
        blk(s, v)
        assert len(fused_calls) == 1, "frozen parameters + triton backend: the fused path"
        blk.mix[2].bias.requires_grad_(True)
        blk(s, v)
        assert len(fused_calls) == 1, "a parameter requires grad: the torch path"
        blk.mix[2].bias.requires_grad_(False)
        assert not painn_update_fusable(s.half(), v.half(), *blk.parameters()), "float16: the torch path"
        assert not painn_update_fusable(s.float(), v.float(), *blk.parameters()), "dtypes differ: the torch path"
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        assert not painn_update_fusable(s, v, *blk.parameters()), "under torch.compile: the torch path"
        monkeypatch.undo()
    with use_backend("torch"):
        blk(s, v)
    assert len(fused_calls) == 1, "torch backend: the torch path"


def test_weights_requiring_grad_are_rejected(triton_device):
    s, v, weights = _inputs(3, 8, torch.float64, triton_device)
    weights[0].requires_grad_(True)
    with pytest.raises(RuntimeError, match="inference-only"):
        pu_module._PaiNNUpdateFused.apply(s, v, *weights)


def test_double_backward_raises(triton_device, fused_calls):
    """Differentiating the fused backward raises, also through torch.autograd.grad(..., inputs), which never
    visits the error node of @once_differentiable (that would silently drop this block's second-order terms)."""
    blk = _fused_block(8, torch.float64, triton_device)
    s, v, _ = _inputs(4, 8, torch.float64, triton_device)
    with use_backend("triton"):
        s_out, v_out = blk(s, v)
    assert len(fused_calls) == 1
    g_s, g_v = torch.autograd.grad((s_out.sum() + (v_out**2).sum()), (s, v), create_graph=True)
    with pytest.raises(RuntimeError, match="differentiable once"):
        torch.autograd.grad(g_s.sum() + g_v.sum(), (s, v))
    with pytest.raises(RuntimeError, match="differentiable once"):
        (g_s.sum() + g_v.sum()).backward()


class _CountOps(TorchDispatchMode):
    """The aten ops that compute (no views, no allocations; set_/copy_ are the interpreter's argument
    plumbing)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        view = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
        if not view and not name.startswith(("empty", "new_empty", "set_", "copy_")):
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


def test_launch_counts(triton_device, monkeypatch):
    """Per layer: 3 Triton GEMMs + 2 Triton kernels forward ([U; V] concatenated on the first call only), 3 GEMMs
    + 2 kernels backward (the torch path: 17 and ~23 launches)."""
    launches, gemms = [], []
    launch, real_gemm = pu_module._launch, pu_module.gemm
    monkeypatch.setattr(
        pu_module, "_launch", lambda kernel, *a, **k: launches.append(kernel) or launch(kernel, *a, **k)
    )
    monkeypatch.setattr(pu_module, "gemm", lambda *a, **k: gemms.append(1) or real_gemm(*a, **k))
    blk = _fused_block(8, torch.float32, triton_device)
    s, v, _ = _inputs(5, 8, torch.float32, triton_device)
    go = (torch.ones_like(s), torch.ones_like(v))
    with use_backend("triton"), _CountOps() as first:
        blk(s, v)
    with use_backend("triton"), _CountOps() as fwd:
        out = blk(s, v)
    n_fwd = len(gemms)
    with _CountOps() as bwd:
        torch.autograd.grad(out, (s, v), go)
    # (the first call also looks once at whether each weight is on the TF32 grid, where tf32x3 runs: CUDA)
    grid_check = ("bitwise_and", "eq", "all", "_local_scalar_dense")
    assert [op for op in first.ops if op not in grid_check] == ["cat"] and fwd.ops == [] and n_fwd == 6
    assert bwd.ops == [] and len(gemms) == 9
    assert len(launches) == 6


def test_launch_counts_without_triton_gemms(triton_device, monkeypatch):
    """Where the Triton GEMMs do not apply (float64 on the GPU), cuBLAS: 4 aten ops forward, 4 backward."""
    monkeypatch.setattr(pu_module, "gemm_fusable", lambda *a: False)
    blk = _fused_block(8, torch.float32, triton_device)
    s, v, _ = _inputs(5, 8, torch.float32, triton_device)
    go = (torch.ones_like(s), torch.ones_like(v))
    with use_backend("triton"):
        blk(s, v)
    with use_backend("triton"), _CountOps() as fwd:
        out = blk(s, v)
    with _CountOps() as bwd:
        torch.autograd.grad(out, (s, v), go)
    assert fwd.ops == ["mm", "addmm", "silu", "addmm"]
    assert bwd.ops == ["mm", "silu_backward", "mm", "addmm_"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("triton_gemm", [True, False], ids=["triton-gemm", "cublas"])
@pytest.mark.parametrize("n, f", [(0, 8), (7, 20), (33, 128)])
def test_residual_terms_fused(triton_device, monkeypatch, fused_calls, dtype, triton_gemm, n, f):
    """update(s, v, ds=, dv=) is update(s + ds, v + dv) bit for bit (the sums are rounded once, as two torch
    adds would), with no add kernel on the Triton GEMMs; the gradients wrt ds and dv are those wrt s and v."""
    if not triton_gemm:
        monkeypatch.setattr(pu_module, "gemm_fusable", lambda *a: False)
    s, v, weights = _inputs(n, f, dtype, triton_device, seed=n + 3)
    ds, dv, _ = _inputs(n, f, dtype, triton_device, seed=n + 4)
    with use_backend("triton"):
        triton_gemm = pu_module.gemm_fusable(s, *weights)  # (not float64 on the GPU: cuBLAS there)
    gen = torch.Generator().manual_seed(5)
    go = (torch.randn(n, f, generator=gen, dtype=dtype), torch.randn(n, 3, f, generator=gen, dtype=dtype))
    go = tuple(g.to(triton_device) for g in go)
    with use_backend("triton"):
        painn_update(s, v, *weights, ds=ds, dv=dv)  # warm the [U; V] cache
        with _CountOps() as fwd:
            out = painn_update(s, v, *weights, ds=ds, dv=dv)
        grads = torch.autograd.grad(out, (s, v, ds, dv), go)
        s1, v1 = (s + ds).detach().requires_grad_(True), (v + dv).detach().requires_grad_(True)
        ref = painn_update(s1, v1, *weights)
        ref_grads = torch.autograd.grad(ref, (s1, v1), go)
    assert len(fused_calls) == 3
    if n > 0:  # (with no rows the GEMMs only zero their outputs) cuBLAS has no prologue: v + dv is stored
        assert fwd.ops == ([] if triton_gemm else ["add", "mm", "addmm", "silu", "addmm"])
    for a, b in zip(out, ref, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(grads, (*ref_grads, *ref_grads), strict=True):
        assert torch.equal(a, b)
    with use_backend("torch"):  # and the torch reference agrees
        want = painn_update_reference(s, v, *weights, ds=ds, dv=dv)
    for a, b in zip(out, want, strict=True):
        _close(a, b.double(), TOL[dtype], "residual form vs reference")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_unused_v_out_needs_no_zero_gradient(triton_device, dtype):
    """When v_out is not used (the last layer), autograd passes None for its gradient (no zero-filled buffer):
    the same gradients as with an explicit zero upstream gradient, and no fill op."""
    blk = _fused_block(20, dtype, triton_device)
    s, v, _ = _inputs(9, 20, dtype, triton_device, seed=2)
    g_s = torch.randn(9, 20, generator=torch.Generator().manual_seed(2), dtype=dtype).to(triton_device)
    with use_backend("triton"):
        s_out, v_out = blk(s, v)
        with _CountOps() as bwd:
            got = torch.autograd.grad(s_out, (s, v), g_s, retain_graph=True)
        want = torch.autograd.grad((s_out, v_out), (s, v), (g_s, torch.zeros_like(v_out)))
    assert not any(op in ("zeros", "zero_", "fill_", "new_zeros", "zeros_like") for op in bwd.ops), bwd.ops
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_stacked_weights_follow_in_place_edits(triton_device):
    """[U; V] is cached per weight version and data: an in-place edit of U or V (refreshed in place, at the same
    address, for graphs that captured it) or a dtype round trip of the module (same parameters, same versions,
    new data) is never served stale."""
    blk = _fused_block(8, torch.float64, triton_device)
    s, v, _ = _inputs(4, 8, torch.float64, triton_device)

    def params():
        return blk.U.weight, blk.V.weight, blk.mix[0].weight, blk.mix[0].bias, blk.mix[2].weight, blk.mix[2].bias

    edits = (
        lambda: None,
        lambda: blk.U.weight.mul_(0.5),
        lambda: blk.V.weight.add_(0.25),
        lambda: blk.float(),
        lambda: blk.double(),
        lambda: torch.nn.init.normal_(blk.U.weight),
    )
    addresses = []
    with use_backend("triton"), torch.no_grad():
        for k, edit in enumerate(edits):
            edit()
            x, y = s.to(blk.U.weight.dtype), v.to(blk.U.weight.dtype)
            got = blk(x, y)
            want = painn_update_reference(x, y, *params())
            for a, b in zip(got, want, strict=True):
                _close(a, b.double(), TOL[a.dtype], f"after edit {k}")
            stacked = pu_module._stacked_uv(blk.U.weight, blk.V.weight)
            assert torch.equal(stacked, torch.cat([blk.U.weight, blk.V.weight]))
            addresses.append(stacked.data_ptr())
    assert addresses[0] == addresses[1] == addresses[2], "an in-place edit is refreshed where it was"


def _molecules(n_mol, device):
    """A few water-like molecules in a box: numbers, positions [N,3] (float64), edges within 4 Å (sorted)."""
    gen = torch.Generator().manual_seed(3)
    o = torch.rand(n_mol, 3, generator=gen, dtype=torch.float64) * 6.0
    h1 = o + 0.96 * torch.nn.functional.normalize(torch.randn(n_mol, 3, generator=gen, dtype=torch.float64), dim=-1)
    h2 = o + 0.96 * torch.nn.functional.normalize(torch.randn(n_mol, 3, generator=gen, dtype=torch.float64), dim=-1)
    pos = torch.cat([o, h1, h2]).to(device)
    numbers = torch.tensor([8] * n_mol + [1] * 2 * n_mol, device=device)
    d = torch.cdist(pos, pos)
    i, j = torch.nonzero((d < 4.0) & (d > 0), as_tuple=True)
    return numbers, pos, torch.stack([i, j])


def test_student_model_triton_vs_torch(triton_device, fused_calls):
    """A frozen float64 StudentModel (F = 20, not a power of two): energies and forces, triton vs torch."""
    torch.manual_seed(0)
    model = StudentModel(species=[1, 8], hidden=20, layers=2, n_rbf=6, cutoff=4.0).double().to(triton_device)
    model.requires_grad_(False)
    numbers, pos, ei = _molecules(4, triton_device)
    shifts = torch.zeros(ei.shape[1], 3, dtype=torch.float64, device=triton_device)
    batch = torch.zeros(len(numbers), dtype=torch.long, device=triton_device)

    def run(backend):
        p = pos.clone().requires_grad_(True)
        with use_backend(backend):
            energy = model(numbers, p, ei, shifts, batch, 1)["energy"]
            forces = -torch.autograd.grad(energy.sum(), p)[0]
        return energy.detach(), forces

    (e_t, f_t), calls = run("triton"), len(fused_calls)
    e_r, f_r = run("torch")
    assert calls == 2 and len(fused_calls) == 2, "the fused path ran once per layer on triton, never on torch"
    _close(e_t, e_r, 1e-10, "energy")
    _close(f_t, f_r, 1e-10, "forces")
    # A second derivative wrt the positions (other paths reach them too) raises instead of missing terms.
    p = pos.clone().requires_grad_(True)
    with use_backend("triton"):
        energy = model(numbers, p, ei, shifts, batch, 1)["energy"]
        forces = torch.autograd.grad(energy.sum(), p, create_graph=True)[0]
        with pytest.raises(RuntimeError, match="differentiable once"):
            torch.autograd.grad((forces**2).sum(), p)


@pytest.mark.gpu
def test_cuda_graph_capture_replays():
    """The fused forward + backward captured in a CUDA graph replays to the eager result on new inputs (fp32)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    blk = _fused_block(128, torch.float32, dev)
    s_buf, v_buf, _ = _inputs(300, 128, torch.float32, dev, seed=1)
    s_buf, v_buf = s_buf.detach(), v_buf.detach()
    g_s, g_v = torch.randn_like(s_buf), torch.randn_like(v_buf)

    def step():
        # Fresh leaves from the static buffers, as the engine does with its positions.
        s, v = s_buf.detach().requires_grad_(True), v_buf.detach().requires_grad_(True)
        s_out, v_out = blk(s, v)
        return (s_out, v_out, *torch.autograd.grad((s_out, v_out), (s, v), (g_s, g_v)))

    with use_backend("triton"):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        s2, v2, _ = _inputs(300, 128, torch.float32, dev, seed=2)
        with torch.no_grad():
            s_buf.copy_(s2), v_buf.copy_(v2)
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
    for got, ref in zip(captured, eager, strict=True):
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)


def _block_case(triton_device, n, f, residual, seed):
    """``(dtype, s, v, weights, extra, go)`` of one block: float64 on the CPU (the interpreter), float32 on CUDA;
    ``extra`` the residual terms ds, dv or nothing; ``go`` the outputs' gradients."""
    dtype = torch.float64 if triton_device.type == "cpu" else torch.float32
    s, v, weights = _inputs(n, f, dtype, triton_device, seed=seed)
    ds, dv, _ = _inputs(n, f, dtype, triton_device, seed=seed + 1)
    gen = torch.Generator().manual_seed(seed)
    go = tuple(
        torch.randn(shape, generator=gen, dtype=torch.float64).to(triton_device, dtype) for shape in ((n, f), (n, 3, f))
    )
    return dtype, s, v, weights, ({"ds": ds, "dv": dv} if residual else {}), go


@pytest.mark.parametrize("triton_gemm", [True, False], ids=["triton-gemm", "cublas"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "ds-dv"])
def test_recomputed_uvvv_gives_the_same_gradients_and_keeps_less(triton_device, monkeypatch, triton_gemm, residual):
    """``recompute_uv_min_atoms``: from that many atoms on the forward keeps no uvvv [3N, 2F] (the saved tensors
    shrink by exactly its bytes) and the backward makes it again with the forward's own GEMM: the gradients are
    bit for bit those of the kept uvvv (on the CPU), with and without the residual terms, on the Triton GEMMs and
    on the cuBLAS path. Below the limit it is kept."""
    if not triton_gemm:
        monkeypatch.setattr(pu_module, "gemm_fusable", lambda *a: False)
    n, f = 21, 32
    dtype, s, v, weights, extra, go = _block_case(triton_device, n, f, residual, seed=31)
    got = {}
    for limit in (None, n + 1, n):
        monkeypatch.setitem(pu_module._CONFIG, "recompute_uv_min_atoms", limit)
        kept = []

        def pack(t, kept=kept):
            kept.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), use_backend("triton"):
            out = painn_update(s, v, *weights, **extra)
        grads = torch.autograd.grad(out, (s, v, *extra.values()), go)
        got[limit] = (sum(kept), [t.detach() for t in (*out, *grads)])
    assert got[n + 1][0] == got[None][0]  # below the limit: kept
    assert got[None][0] - got[n][0] == 3 * n * 2 * f * torch.finfo(dtype).bits // 8
    for a, b in zip(got[n][1], got[None][1], strict=True):
        if triton_device.type == "cpu":
            assert torch.equal(a, b)
        else:
            _close(a, b.double(), TOL[dtype], "recomputed uvvv")


@pytest.mark.parametrize("triton_gemm", [True, False], ids=["triton-gemm", "cublas"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "ds-dv"])
@pytest.mark.parametrize("n, f", [(0, 8), (21, 32), (7, 20)])
def test_need_v_false_makes_s_out_alone(triton_device, monkeypatch, fused_calls, triton_gemm, residual, n, f):
    """``need_v=False`` (a model's last layer): v_out is None, s_out and the gradients wrt s, v (and ds, dv) are
    those of the full block with v_out unused (the mixing MLP's last GEMM over the a_sv, a_ss rows only: bit for
    bit on the interpreter's GEMMs, else to rounding), on the fused path and the reference; the fused path keeps
    mix at 2F wide (the saved tensors shrink by N x F elements, and by F x F for w2's tail)."""
    if not triton_gemm:
        monkeypatch.setattr(pu_module, "gemm_fusable", lambda *a: False)
    dtype, s, v, weights, extra, go = _block_case(triton_device, n, f, residual, seed=41)
    ins = (s, v, *extra.values())
    got = {}
    for need_v in (True, False):
        kept = []

        def pack(t, kept=kept):
            kept.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), use_backend("triton"):
            s_out, v_out = painn_update(s, v, *weights, **extra, need_v=need_v)
        assert (v_out is None) is not need_v
        grads = torch.autograd.grad(s_out, ins, go[0])
        got[need_v] = (sum(kept), [s_out.detach(), *grads])
    assert len(fused_calls) == 2
    assert got[True][0] - got[False][0] == n * f + f * f  # mix [N, 3F] -> [N, 2F], w2 [3F, F] -> its [2F, F] tail
    for a, b in zip(got[False][1], got[True][1], strict=True):
        if triton_device.type == "cpu" and triton_gemm:  # the interpreter's GEMM sums each row alike
            assert torch.equal(a, b)
        else:  # a library GEMM over fewer columns may block its sums differently
            _close(a, b.double(), TOL[dtype], "need_v=False")
    s64, v64 = (t.detach().double().requires_grad_(True) for t in (s, v))
    d64 = {k: t.detach().double() for k, t in extra.items()}
    s_ref, v_ref = painn_update_reference(s64, v64, *(w.double() for w in weights), **d64, need_v=False)
    assert v_ref is None
    full = painn_update_reference(s64, v64, *(w.double() for w in weights), **d64)[0]
    torch.testing.assert_close(s_ref, full, rtol=0, atol=1e-13)
    _close(got[False][1][0], s_ref.detach(), TOL[dtype], "need_v=False vs reference")


def test_student_model_last_update_makes_no_v(triton_device, fused_calls):
    """``StudentModel.last_update_scalars_only``: the last layer's update runs with need_v=False; energies, forces
    and (torch path, training) the parameter gradients of a force loss equal those with the switch off (float64,
    to rounding), on the fused Triton path and the torch path; the a_vv rows of the last layer's mixing weight get
    zero gradient either way."""
    torch.manual_seed(3)
    model = StudentModel(species=[1, 8], hidden=16, layers=2, n_rbf=6, cutoff=4.0).double().to(triton_device)
    numbers, pos, ei = _molecules(4, triton_device)
    shifts = torch.zeros(ei.shape[1], 3, dtype=torch.float64, device=triton_device)
    batch = torch.zeros(len(numbers), dtype=torch.long, device=triton_device)
    calls = []
    real = PaiNNUpdate.forward

    def spy(self, *a, **kw):
        calls.append(kw.get("need_v", True))
        return real(self, *a, **kw)

    def run(train: bool):
        p = pos.detach().clone().requires_grad_(True)
        energy = model(numbers, p, ei, shifts, batch, 1)["energy"]
        (f,) = torch.autograd.grad(energy.sum(), p, create_graph=train)
        if not train:
            return [energy.detach(), f]
        grads = torch.autograd.grad((f**2).sum(), list(model.parameters()), allow_unused=True)
        return [energy.detach(), f.detach(), *(torch.zeros(1) if g is None else g for g in grads)]

    results = {}
    try:
        PaiNNUpdate.forward = spy
        for switch in (True, False):
            StudentModel.last_update_scalars_only = switch
            calls.clear()
            with use_backend("triton"):
                model.requires_grad_(False)
                frozen = run(False)
            assert calls == [True, not switch]
            with use_backend("torch"):
                model.requires_grad_(True)
                trained = run(True)
            results[switch] = frozen + trained
    finally:
        PaiNNUpdate.forward = real
        StudentModel.last_update_scalars_only = True
    for a, b in zip(results[True], results[False], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    names = [n for n, _ in model.named_parameters()]
    last_mix_grad = results[True][4 + names.index("updates.1.mix.2.weight")]
    assert last_mix_grad.abs().sum() > 0 and torch.equal(last_mix_grad[:16], torch.zeros_like(last_mix_grad[:16]))


def test_an_update_subclass_with_its_own_forward_is_called_as_before(triton_device):
    """A subclass of PaiNNUpdate that overrides forward (without ``need_v``) is called with the old arguments in
    the last layer too, and its v' is what it returns; the plain block gets need_v=False there."""
    seen = []

    class Logged(PaiNNUpdate):
        def forward(self, s, v, ds=None, dv=None):
            seen.append(type(self).__name__)
            return super().forward(s, v, ds, dv)

    torch.manual_seed(0)
    model = StudentModel(species=[1, 8], hidden=8, layers=2, n_rbf=4, cutoff=4.0).double().to(triton_device)
    numbers, pos, ei = _molecules(2, triton_device)
    shifts = torch.zeros(ei.shape[1], 3, dtype=torch.float64, device=triton_device)
    batch = torch.zeros(len(numbers), dtype=torch.long, device=triton_device)
    want = model(numbers, pos, ei, shifts, batch, 1)["energy"]
    old = model.updates[1]
    model.updates[1] = Logged(8).double().to(triton_device)
    model.updates[1].load_state_dict(old.state_dict())
    got = model(numbers, pos, ei, shifts, batch, 1)["energy"]
    assert seen == ["Logged"]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def _block_grads(s, v, weights, need_v, extra, ins, seed):
    """The fused block's outputs, random upstream gradients (float64-drawn) and the gradients wrt ``ins``."""
    with use_backend("triton"):
        s_out, v_out = painn_update(s, v, *weights, need_v=need_v, **extra)
        outs = (s_out,) if v_out is None else (s_out, v_out)
        gen = torch.Generator().manual_seed(seed)
        ups = tuple(torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o) for o in outs)
        grads = torch.autograd.grad(outs, ins, ups) if s.shape[0] else ()
    return outs, ups, grads


def _check_against_float64(outs, ups, grads, s, v, ds, dv, weights, need_v, residual, tol, what):
    """Outputs and gradients of the block against the torch reference in float64 on the same inputs."""
    s64, v64, ds64, dv64 = (t.detach().double().requires_grad_(True) for t in (s, v, ds, dv))
    extra64 = dict(ds=ds64, dv=dv64) if residual else {}
    ins64 = (s64, v64, ds64, dv64) if residual else (s64, v64)
    ref = painn_update_reference(s64, v64, *(w.double() for w in weights), need_v=need_v, **extra64)
    ref = ref[:1] if not need_v else ref
    for a, b in zip(outs, ref, strict=True):
        _close(a, b.detach(), tol, f"output, {what}")
    ref_grads = torch.autograd.grad(ref, ins64, tuple(u.double() for u in ups))
    for a, b in zip(grads, ref_grads, strict=True):
        _close(a, b, tol, f"gradient, {what}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "ds-dv"])
@pytest.mark.parametrize("need_v", [True, False], ids=["v", "s-only"])
@pytest.mark.parametrize("n, f", [(0, 8), (7, 20), (33, 64), (2100, 64)])
def test_norm_in_gemm_matches_the_norm_kernel(triton_device, monkeypatch, fused_calls, dtype, residual, need_v, n, f):
    """``norm_in_gemm`` (on as shipped from ``norm_in_gemm_min_atoms``; here from 0): the mixing MLP's first GEMM
    makes [s + ds | ‖vv‖] in its load, no norm kernel runs and no x is kept; outputs and gradients wrt s, v (and ds,
    dv) match the torch reference in float64, and the norm kernel's path to rounding (the same bits on the
    interpreter). On a GPU only where the GEMM takes its descriptor kernel (``linear.tma_norm_prologue``: above
    small_rows, F a multiple of its K tile): 2,100 rows there; the smaller cases keep the norm kernel."""
    if n > 100 and triton_device.type == "cpu":
        pytest.skip("the descriptor kernel's case (GPU); the interpreter runs the prologue at every size")
    s, v, weights = _inputs(n, f, dtype, triton_device, seed=n + 11)
    ds, dv, _ = _inputs(n, f, dtype, triton_device, seed=n + 12)
    extra = dict(ds=ds, dv=dv) if residual else {}
    ins = (s, v, ds, dv) if residual else (s, v)
    with use_backend("triton"):
        if not pu_module.gemm_fusable(s, *weights):
            pytest.skip("float64 on the GPU: cuBLAS GEMMs, where the norm kernel stays")
    launches = []
    launch = pu_module._launch
    monkeypatch.setattr(pu_module, "_launch", lambda k, *a, **kw: launches.append(k.__name__) or launch(k, *a, **kw))
    res = {}
    for on in (False, True):
        monkeypatch.setitem(pu_module._CONFIG, "norm_in_gemm", on)
        monkeypatch.setitem(pu_module._CONFIG, "norm_in_gemm_min_atoms", 0)
        monkeypatch.setitem(lin_module._CONFIG, "tma_eager_min_rows", 0)  # (eager calls: the descriptor kernel)
        launches.clear()
        outs, ups, grads = _block_grads(s, v, weights, need_v, extra, ins, seed=13)
        if n:
            gate = triton_device.type == "cpu" or lin_module.tma_norm_prologue(s, n, f)
            assert gate == (triton_device.type == "cpu" or n > 100)
            assert ("_painn_update_norm_kernel" in launches) != (on and gate)
            assert "_painn_update_norm_bwd_kernel" in launches
        res[on] = (outs, grads)
    for a, b in zip((*res[True][0], *res[True][1]), (*res[False][0], *res[False][1]), strict=True):
        if triton_device.type == "cpu":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(
                a, b, rtol=1e-5, atol=1e-6 * max(1.0, float(b.abs().amax())) if b.numel() else 0.0
            )
    if n:
        _check_against_float64(
            res[True][0], ups, res[True][1], s, v, ds, dv, weights, need_v, residual, TOL[dtype], "norm in the GEMM"
        )


def test_norm_in_gemm_from_min_atoms(triton_device, monkeypatch, fused_calls):
    """``norm_in_gemm_min_atoms``: below it the norm kernel runs (and the norm backward reads its x), from it on
    the GEMM's prologue makes x (on a GPU, only on the GEMM's descriptor kernel: above small_rows, F a multiple of
    its K tile); the same results."""
    cuda = triton_device.type == "cuda"
    n, f = (lin_module._CONFIG["small_rows"] + 52, 32) if cuda else (9, 16)
    s, v, weights = _inputs(n, f, torch.float32, triton_device, seed=5)
    with use_backend("triton"):
        if not pu_module.gemm_fusable(s, *weights):
            pytest.skip("cuBLAS GEMMs: the norm kernel always runs")
    launches = []
    launch = pu_module._launch
    monkeypatch.setattr(
        pu_module, "_launch", lambda k, *a, **kw: launches.append((k.__name__, kw)) or launch(k, *a, **kw)
    )
    monkeypatch.setitem(pu_module._CONFIG, "norm_in_gemm", True)
    # On a GPU, only where the GEMM takes its descriptor kernel (eager: from tma_eager_min_rows rows).
    res = {}
    for limit, tma_rows in ((n + 1, 0), (n, n + 1), (n, 0)) if cuda else ((n + 1, 0), (n, 0)):
        monkeypatch.setitem(pu_module._CONFIG, "norm_in_gemm_min_atoms", limit)
        monkeypatch.setitem(lin_module._CONFIG, "tma_eager_min_rows", tma_rows)
        launches.clear()
        res[limit, tma_rows] = _block_grads(s, v, weights, True, {}, (s, v), seed=7)[2]
        kw = dict(launches)
        on = limit <= n and (not cuda or lin_module.tma_norm_prologue(s, n, f))
        assert on == (limit <= n and tma_rows <= n)
        assert ("_painn_update_norm_kernel" in kw) != on
        assert kw["_painn_update_norm_bwd_kernel"]["NORM_VV"] == on
    for key in res:
        for a, b in zip(res[key], res[n + 1, 0], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * max(1.0, float(b.abs().amax())))


def test_tma_norm_prologue_asks_for_the_descriptor_kernel(monkeypatch):
    """``linear.tma_norm_prologue``: the norm prologue goes in the GEMM only where the GEMM would take its
    descriptor kernel: the launch allows descriptors (tma_launches), more than small_rows rows, and F a multiple
    of the large launch's K tile (48 and 80 are not, against 32; the pointer kernel with the prologue was 0.857x)."""
    ref = torch.zeros(1)
    big = lin_module._CONFIG["small_rows"] + 1
    monkeypatch.setattr(lin_module, "tma_launches", lambda t, m: True)
    assert lin_module.tma_norm_prologue(ref, big, 64) and lin_module.tma_norm_prologue(ref, big, 128)
    assert not lin_module.tma_norm_prologue(ref, big, 48) and not lin_module.tma_norm_prologue(ref, big, 80)
    assert not lin_module.tma_norm_prologue(ref, big - 1, 64)
    monkeypatch.setitem(lin_module._CONFIG, "large_block_k", 16)
    assert lin_module.tma_norm_prologue(ref, big, 48)
    monkeypatch.setattr(lin_module, "tma_launches", lambda t, m: False)
    assert not lin_module.tma_norm_prologue(ref, big, 64)
    # The update block asks it on a GPU tensor (a stand-in here) from norm_in_gemm_min_atoms on.
    asked = []
    monkeypatch.setattr(pu_module, "tma_norm_prologue", lambda t, m, f: asked.append((m, f)) or f == 64)
    monkeypatch.setitem(pu_module._CONFIG, "norm_in_gemm_min_atoms", 100)

    class Cuda:
        is_cuda, shape = True, (100, 64)

    assert pu_module._norm_in_gemm(Cuda())
    Cuda.shape = (100, 48)
    assert not pu_module._norm_in_gemm(Cuda())
    Cuda.shape = (99, 64)
    assert not pu_module._norm_in_gemm(Cuda())
    assert asked == [(100, 64), (100, 48)]


@pytest.mark.parametrize("switch", ["gv_as_addend", "dvv_in_norm_bwd", "both"])
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "ds-dv"])
@pytest.mark.parametrize("need_v", [True, False], ids=["v", "s-only"])
def test_backward_byte_switches_match(triton_device, monkeypatch, fused_calls, switch, residual, need_v):
    """``gv_as_addend`` (g_v_out as the last GEMM's addend, no copy by the norm backward) and ``dvv_in_norm_bwd``
    (∂vv's two terms written once by the norm backward), each on and off: the gradients wrt s, v (and ds, dv)
    equal the shipped path's (bits on the interpreter) and the float64 reference; spies see the addend and the
    kernels' switches."""
    n, f = 33, 20
    s, v, weights = _inputs(n, f, torch.float32, triton_device, seed=41)
    ds, dv, _ = _inputs(n, f, torch.float32, triton_device, seed=42)
    extra = dict(ds=ds, dv=dv) if residual else {}
    ins = (s, v, ds, dv) if residual else (s, v)
    calls, launches = [], []
    real_gemm, launch = pu_module.gemm, pu_module._launch
    monkeypatch.setattr(pu_module, "gemm", lambda *a, **k: calls.append(k) or real_gemm(*a, **k))
    monkeypatch.setattr(
        pu_module, "_launch", lambda kern, *a, **k: launches.append((kern.__name__, k)) or launch(kern, *a, **k)
    )
    res = {}
    for on in (False, True):
        for key in ("gv_as_addend", "dvv_in_norm_bwd"):
            monkeypatch.setitem(pu_module._CONFIG, key, on and switch in (key, "both"))
        calls.clear()
        launches.clear()
        outs, ups, res[on] = _block_grads(s, v, weights, need_v, extra, ins, seed=43)
        kw = dict(launches)
        if on and switch != "dvv_in_norm_bwd" and need_v:  # (the last layer has no g_v_out: nothing to add)
            assert calls[-1].get("addend") is not None and not calls[-1].get("accumulate")
            assert kw["_painn_update_norm_bwd_kernel"]["HAS_GV"] is False
        if on and switch != "gv_as_addend":
            assert kw["_painn_update_out_bwd_kernel"]["VV"] is False
            assert kw["_painn_update_norm_bwd_kernel"]["DVV"] is True
    for a, b in zip(res[True], res[False], strict=True):
        if triton_device.type == "cpu":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(
                a, b, rtol=1e-5, atol=1e-6 * max(1.0, float(b.abs().amax())) if b.numel() else 0.0
            )
    _check_against_float64(
        outs, ups, res[True], s, v, ds, dv, weights, need_v, residual, TOL[torch.float32], f"with {switch}"
    )
