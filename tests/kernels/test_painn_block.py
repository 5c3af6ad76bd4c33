"""Fused atom-wise PaiNN block (inference): forward and first derivative vs the torch reference, dispatch rules,
and the whole StudentModel on the fused path.

Tolerances. The oracle is the torch reference evaluated in float64 on the same inputs, its gradients by autograd.
Normwise, |x - x_ref| <= tol · |x_ref| with tol = 1e-12 (float64) and 1e-5 (float32: tf32x3 dots on the GPU), for
every output and for the gradients wrt s, Δs, v and Δv under random upstream gradients. The whole frozen
StudentModel in float64, fused (triton) vs torch backend: energies and forces to 1e-10 (normwise).
"""

import importlib

import pytest
import torch
from mlff_distiller.kernels import painn_block, painn_block_fusable, painn_block_reference, use_backend

from mlff_distiller import StudentModel

pb_module = importlib.import_module("mlff_distiller.kernels.painn_block")

TOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def _inputs(n, f, head, dtype, device, seed=0, with_s=True, with_v=True):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0, grad=False):
        t = (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(device=device, dtype=dtype)
        return t.requires_grad_(grad)

    s = rand(n, f, grad=True) if with_s else None
    ds = rand(n, f, grad=True)
    v = rand(n, 3, f, grad=True) if with_v else None
    dv = rand(n, 3, f, grad=True)
    update = (
        rand(f, f, scale=f**-0.5),
        rand(f, f, scale=f**-0.5),
        rand(f, 2 * f, scale=(2 * f) ** -0.5),
        rand(f),
        rand(3 * f, f, scale=f**-0.5),
        rand(3 * f),
    )
    h = max(1, f // 2)
    if head == "phi":
        hp = (rand(f, f, scale=f**-0.5), rand(f), rand(3 * f, f, scale=f**-0.5), rand(3 * f))
    else:
        hp = (rand(h, f, scale=f**-0.5), rand(h), rand(1, h, scale=h**-0.5), rand(1))
    return s, ds, v, dv, update, hp


def _double(t):
    return None if t is None else t.detach().double().requires_grad_(t.requires_grad)


def _close(actual, expected, tol, what):
    assert actual.shape == expected.shape, what
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err = (actual.double() - expected).norm().item()
    assert err <= tol * max(expected.norm().item(), 1e-30), f"{what}: normwise error {err:.3e} vs {expected.norm():.3e}"


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts the calls of the fused autograd Function."""
    calls = []
    apply = pb_module._PaiNNBlockFused.apply

    def spy(*args):
        calls.append(1)
        return apply(*args)

    monkeypatch.setattr(pb_module._PaiNNBlockFused, "apply", spy)
    return calls


@pytest.fixture(params=[0, 16], ids=["rows", "chunks16"])
def chunked(request, monkeypatch):
    """Under the interpreter: whole feature rows in one chunk, or 16-feature chunks (the GPU's chunk loops)."""
    monkeypatch.setitem(pb_module._CONFIG, "interp_chunk", request.param)
    return request.param


@pytest.mark.parametrize("head", ["phi", "readout"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("f", [8, 20, 128])
@pytest.mark.parametrize("n", [0, 1, 7, 33])
@pytest.mark.parametrize("inputs", ["s,v", "no s,v"])
def test_matches_reference(triton_device, poison, fused_calls, chunked, head, dtype, f, n, inputs):
    if triton_device.type == "cuda" and chunked:
        pytest.skip("interp_chunk applies to the interpreter only")
    with_sv = inputs == "s,v"
    s, ds, v, dv, update, hp = _inputs(n, f, head, dtype, triton_device, seed=n + f, with_s=with_sv, with_v=with_sv)
    if triton_device.type == "cuda" and dtype == torch.float64:
        assert not painn_block_fusable(ds, *update, *hp)  # float64 tiles do not fit one program on the GPU
        return
    poison(8 * n * f + 64, dtype, triton_device)
    with use_backend("triton"):
        out = painn_block(s, ds, v, dv, update, head, hp)
    assert len(fused_calls) == 1
    ref_in = [_double(t) for t in (s, ds, v, dv)]
    ref = painn_block_reference(*ref_in, tuple(map(_double, update)), head, tuple(map(_double, hp)))
    assert len(out) == len(ref) == (3 if head == "phi" else 1)
    for a, b, name in zip(out, ref, ("s_out", "v_out", "x") if head == "phi" else ("e",), strict=True):
        _close(a, b.detach(), TOL[dtype], f"{head} {name}")
    if n == 0:
        return
    gen = torch.Generator().manual_seed(7)
    ups = [torch.randn(r.shape, generator=gen, dtype=torch.float64) for r in ref]
    wrt = [t for t in (s, ds, v, dv) if t is not None]
    wrt_ref = [t for t in ref_in if t is not None]
    got = torch.autograd.grad(out, wrt, [u.to(device=triton_device, dtype=dtype) for u in ups])
    want = torch.autograd.grad(ref, wrt_ref, ups)
    for a, b in zip(got, want, strict=True):
        _close(a, b, TOL[dtype], f"{head} gradient")


def test_unused_outputs_get_no_gradient(triton_device):
    """Only x is used downstream: s_out and v_out get no upstream gradient (HAS_GS/HAS_GV false) and the input
    gradients are still the reference's."""
    s, ds, v, dv, update, hp = _inputs(19, 16, "phi", torch.float64, triton_device, seed=3)
    with use_backend("triton"):
        _, _, x = painn_block(s, ds, v, dv, update, "phi", hp)
    _, _, x_ref = painn_block_reference(s, ds, v, dv, update, "phi", hp)
    got = torch.autograd.grad(x.square().sum(), (s, ds, v, dv))
    want = torch.autograd.grad(x_ref.square().sum(), (s, ds, v, dv))
    for a, b in zip(got, want, strict=True):
        _close(a, b, 1e-12, "x-only gradient")


def test_first_order_only(triton_device):
    s, ds, v, dv, update, hp = _inputs(9, 16, "readout", torch.float64, triton_device, seed=4)
    with use_backend("triton"):
        (e,) = painn_block(s, ds, v, dv, update, "readout", hp)
    (g,) = torch.autograd.grad(e.sum(), ds, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiable once"):
        torch.autograd.grad(g.sum(), ds)


def test_no_grad_call_skips_autograd(triton_device, fused_calls):
    s, ds, v, dv, update, hp = _inputs(9, 16, "phi", torch.float64, triton_device, seed=5)
    with use_backend("triton"), torch.no_grad():
        out = painn_block(s, ds, v, dv, update, "phi", hp)
    assert not fused_calls
    ref = painn_block_reference(s, ds, v, dv, update, "phi", hp)
    for a, b in zip(out, ref, strict=True):
        _close(a, b.detach(), 1e-12, "no-grad output")


def test_dispatch_rules(triton_device, fused_calls):
    s, ds, v, dv, update, hp = _inputs(5, 16, "phi", torch.float64, triton_device, seed=6)
    with use_backend("torch"):
        assert not painn_block_fusable(ds, *update, *hp)
        painn_block(s, ds, v, dv, update, "phi", hp)
    with use_backend("triton"):
        trained = [update[0].detach().clone().requires_grad_(True), *update[1:]]
        assert not painn_block_fusable(ds, *trained, *hp)  # a parameter requires grad: the torch path
        painn_block(s, ds, v, dv, tuple(trained), "phi", hp)
        assert not painn_block_fusable(ds, *update[:-1], update[-1].float(), *hp)  # mixed dtypes
    assert not fused_calls


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU limits apply to CUDA tensors")
def test_gpu_limits():
    s, ds, v, dv, update, hp = _inputs(5, 256, "phi", torch.float32, "cuda", seed=8)
    with use_backend("triton"):
        assert not painn_block_fusable(ds, *update, *hp)  # F > 128 does not fit one program
        out = painn_block(s, ds, v, dv, update, "phi", hp)
    ref = painn_block_reference(s, ds, v, dv, update, "phi", hp)
    for a, b in zip(out, ref, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: {**a, "head": "mlp"}, "unknown head"),
        (lambda a: {**a, "dv": a["dv"][:, :2]}, "dv \\[N, 3, F\\]"),
        (lambda a: {**a, "s": a["s"][:-1]}, "s must match"),
        (lambda a: {**a, "hp": (a["hp"][0][:, :-1], *a["hp"][1:])}, "expected"),
        (lambda a: {**a, "update": a["update"][:5]}, "6 tensors"),
    ],
)
def test_bad_input(change, match):
    s, ds, v, dv, update, hp = _inputs(4, 8, "phi", torch.float64, "cpu")
    args = change(dict(s=s, ds=ds, v=v, dv=dv, update=update, head="phi", hp=hp))
    with pytest.raises(ValueError, match=match):
        painn_block(args["s"], args["ds"], args["v"], args["dv"], args["update"], args["head"], args["hp"])


def _benzene_graph(device, dtype):
    from ase.build import molecule

    atoms = molecule("C6H6")
    n = len(atoms)
    i, j = torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij")
    keep = i != j
    edges = torch.stack([i[keep], j[keep]]).to(device)
    pos = torch.tensor(atoms.positions, dtype=dtype, device=device)
    pos = pos + 0.05 * torch.randn(pos.shape, generator=torch.Generator().manual_seed(0), dtype=dtype).to(device)
    return (
        torch.tensor(atoms.numbers, device=device),
        pos,
        edges,
        torch.zeros(edges.shape[1], 3, dtype=dtype, device=device),
        torch.zeros(n, dtype=torch.long, device=device),
    )


@pytest.mark.parametrize("hidden", [16, 20])
def test_model_fused_matches_torch(triton_device, fused_calls, hidden):
    """The frozen StudentModel on the fused path (one block per layer) gives the torch backend's energy and forces."""
    dtype = torch.float64 if triton_device.type == "cpu" else torch.float32
    torch.manual_seed(0)
    model = StudentModel(species=[1, 6], hidden=hidden, layers=3, cutoff=5.0).to(triton_device, dtype)
    model.requires_grad_(False)
    with torch.no_grad():
        model.atomic_scale.fill_(0.7)
        model.atomic_shift.copy_(torch.tensor([-0.3, -1.1]))
    numbers, pos, edges, shifts, batch = _benzene_graph(triton_device, dtype)
    out = {}
    for backend in ("triton", "torch"):
        p = pos.clone().requires_grad_(True)
        with use_backend(backend):
            res = model(numbers, p, edges, shifts, batch, 1)
            (g,) = torch.autograd.grad(res["energy"].sum(), p)
        out[backend] = (res["energy"].detach(), res["atomic_energies"].detach(), -g)
    assert len(fused_calls) == 3
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    for a, b, what in zip(out["triton"], out["torch"], ("energy", "atomic energies", "forces"), strict=True):
        _close(a, b.double(), tol, what)
    assert out["torch"][2].abs().max() > 0


def test_model_trains_on_torch_path(triton_device, fused_calls):
    """A parameter requiring grad (training) keeps the model off the fused path."""
    dtype = torch.float64 if triton_device.type == "cpu" else torch.float32
    model = StudentModel(species=[1, 6], hidden=16, layers=2).to(triton_device, dtype)
    numbers, pos, edges, shifts, batch = _benzene_graph(triton_device, dtype)
    with use_backend("triton"):
        e = model(numbers, pos, edges, shifts, batch, 1)["energy"]
    e.sum().backward()
    assert not fused_calls
    assert model.readout[2].weight.grad is not None
