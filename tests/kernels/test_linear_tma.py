"""The GEMM's tensor-descriptor (TMA) launch and its norm prologue (kernels/linear.py, kernels/_gemm_kernels.py): the
descriptor kernel on the interpreter and against the pointer path on CUDA (the same bits), its row threshold and
operand checks, and the switches that must change no bits. Split from test_linear.py at stop 79 (size); tolerances
as there (linear_helpers.py)."""

import pytest
import torch
from linear_helpers import TOL, _close, _rand
from mlff_distiller.kernels import gemm, gemm_fusable, use_backend
from torch.nn import functional as nnf


def _interpreter_linear(triton_device, cuda_test: str):
    """``kernels.linear`` for a test of the descriptor kernel on the interpreter: skipped on CUDA (where ``cuda_test``
    runs the kernel) and on a Triton without host-side tensor descriptors."""
    import importlib

    lin = importlib.import_module("mlff_distiller.kernels.linear")
    if triton_device.type != "cpu":
        pytest.skip(f"the interpreter's case; on CUDA {cuda_test} runs the kernel")
    if lin._TensorDescriptor is None:
        pytest.skip("this Triton has no host-side tensor descriptors")
    return lin


_TMA_FORMS = ["linear", "silu", "pro_silu", "pro_add", "addend", "accumulate", "zero"]


def _tma_case(form, m, k, n, device, gen, grid_w):
    """(kwargs of gemm, W, A) of one form with W as nn.Linear [N, K] (the large-M launches' layout)."""
    from mlff_distiller.kernels._frozen import round_tf32_

    a = _rand(m, k, gen=gen, dtype=torch.float32, device=device)
    w = _rand(n, k, gen=gen, dtype=torch.float32, device=device, scale=k**-0.5)
    if grid_w:
        round_tf32_(w)
    kw = {"bias": _rand(n, gen=gen, dtype=torch.float32, device=device)}
    if form == "silu":
        kw["act"] = "silu"
    elif form == "pro_silu":
        kw = {"prologue_silu_of": _rand(m, k, gen=gen, dtype=torch.float32, device=device)}
    elif form == "pro_add":
        kw["prologue_add"] = _rand(m, k, gen=gen, dtype=torch.float32, device=device)
    elif form == "addend":
        kw = {"addend": _rand(m, n, gen=gen, dtype=torch.float32, device=device)}
    elif form == "accumulate":
        kw = {"out": _rand(m, n, gen=gen, dtype=torch.float32, device=device), "accumulate": True}
    elif form == "zero":
        kw["zero"] = torch.full((m // 2 + 1,), float("nan"), device=device)
    return kw, w, a


def _tma_reference(form, a, w, kw):
    x = a.double()
    if form == "pro_silu":
        p = kw["prologue_silu_of"].double()
        x = x * torch.sigmoid(p) * (1 + p * (1 - torch.sigmoid(p)))
    elif form == "pro_add":
        x = x + kw["prologue_add"].double()
    c = x @ w.double().T
    if "bias" in kw:
        c = c + kw["bias"].double()
    if form == "silu":
        c = nnf.silu(c)
    if form == "addend":
        c = c + kw["addend"].double()
    return c


@pytest.mark.parametrize("form", _TMA_FORMS)
def test_gemm_tma_kernel_on_the_interpreter(triton_device, form):
    """The large-M launch through tensor descriptors (``_gemm_tma_kernel``, CUDA only in the engine) run by the
    interpreter on CPU tensors: every form it takes (bias, SiLU with its pre-activation, the SiLU' and add
    prologues, an addend, accumulating into the output, the side zeroing) against float64, with rows and columns
    that do not fill the last tiles (the descriptors' zero fill and clipped stores)."""
    lin = _interpreter_linear(triton_device, "test_gemm_tma_equals_pointer_path_on_cuda")
    m, k, n = 150, 64, 96
    gen = torch.Generator().manual_seed(7)
    kw, w, a = _tma_case(form, m, k, n, torch.device("cpu"), gen, grid_w=False)
    before = kw["out"].clone() if form == "accumulate" else None
    out = kw.get("out", torch.empty(m, n))
    pre = torch.empty(m, n) if form == "silu" else None
    aux = kw.get("prologue_silu_of", kw.get("prologue_add"))
    pro = 1 if form == "pro_silu" else (2 if form == "pro_add" else 0)
    addend = kw.get("addend", out if form == "accumulate" else None)
    c, p = lin._launch_tma(
        a, w, w, kw.get("bias"), aux, out, pre, addend, kw.get("zero"), m, n, k, kw.get("act", "none"), pro,
        64, 32, 32, 4, "ieee",
    )  # fmt: skip
    expect = _tma_reference(form, a, w, kw)
    if form == "accumulate":
        expect = expect + before.double()
    _close(c, expect, 1e-6, form)
    if form == "silu":
        _close(p, _tma_reference("linear", a, w, kw), 1e-6, "pre")
    if form == "zero":
        assert not kw["zero"].any() and not torch.isnan(kw["zero"]).any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("form", _TMA_FORMS)
@pytest.mark.parametrize("m, grid_w", [(3001, True), (5003, False), (2049, True)])
def test_gemm_tma_equals_pointer_path_on_cuda(monkeypatch, form, m, grid_w):
    """On a Hopper GPU the large-M launches take the tensor-descriptor kernel (a spy counts it), with the same
    bits as the element-wise kernel (``_CONFIG["tma"]`` off) for every form, with W on the TF32 grid (two MMAs) and
    off it (tf32x3 with W's parts made once), both within float32 accuracy of float64."""
    import importlib

    lin = importlib.import_module("mlff_distiller.kernels.linear")
    dev = torch.device("cuda")
    if torch.cuda.get_device_capability(dev)[0] < 9 or lin._TensorDescriptor is None:
        pytest.skip("the descriptor path needs sm90+ and Triton's host-side descriptors")
    k, n = 128, 384
    res, calls = {}, []
    real = lin._launch_tma
    monkeypatch.setattr(lin, "_launch_tma", lambda *args, **kw: calls.append(1) or real(*args, **kw))
    monkeypatch.setitem(lin._CONFIG, "tma_eager_min_rows", 0)  # eager calls here: the descriptors at any size
    for tma in (True, False):
        monkeypatch.setitem(lin._CONFIG, "tma", tma)
        calls.clear()
        kw, w, a = _tma_case(form, m, k, n, dev, torch.Generator().manual_seed(m + len(form)), grid_w)
        before = kw["out"].clone() if form == "accumulate" else None
        c, pre = gemm(a, w, dot="tf32x3", **kw)
        assert len(calls) == (1 if tma else 0)
        res[tma] = (c.clone(), None if pre is None else pre.clone())
        expect = _tma_reference(form, a, w, kw) + (before.double() if form == "accumulate" else 0)
        _close(c, expect, 1e-6, f"{form} tma={tma}")
        if form == "zero":
            assert not kw["zero"].any() and not torch.isnan(kw["zero"]).any()
    assert torch.equal(res[True][0], res[False][0])
    if res[True][1] is not None:
        assert torch.equal(res[True][1], res[False][1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gemm_tma_declines_unaligned_operands():
    """An operand the copy engine cannot take (rows not 16-byte aligned: K = 130) keeps the element-wise kernel,
    with the right product."""
    import importlib

    lin = importlib.import_module("mlff_distiller.kernels.linear")
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(3)
    a = _rand(3000, 130, gen=gen, dtype=torch.float32, device=dev)
    w = _rand(64, 130, gen=gen, dtype=torch.float32, device=dev)
    assert not lin._tma_ok(a, w)
    c, _ = gemm(a, w)
    _close(c, a.double() @ w.double().T, 1e-6, "C")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gemm_tma_eager_only_from_its_row_threshold(monkeypatch):
    """Eager calls take the descriptor launch only from ``tma_eager_min_rows`` rows on (their host cost per call);
    inside a CUDA-graph capture every large-M launch takes it, and the replay equals the eager result."""
    import importlib

    lin = importlib.import_module("mlff_distiller.kernels.linear")
    dev = torch.device("cuda")
    if torch.cuda.get_device_capability(dev)[0] < 9 or lin._TensorDescriptor is None:
        pytest.skip("the descriptor path needs sm90+ and Triton's host-side descriptors")
    calls = []
    real = lin._launch_tma
    monkeypatch.setattr(lin, "_launch_tma", lambda *args, **kw: calls.append(args[9]) or real(*args, **kw))
    monkeypatch.setitem(lin._CONFIG, "tma_eager_min_rows", 4000)
    gen = torch.Generator().manual_seed(5)
    w = _rand(256, 128, gen=gen, dtype=torch.float32, device=dev)
    small, large = (_rand(m, 128, gen=gen, dtype=torch.float32, device=dev) for m in (3001, 4001))
    eager_small = gemm(small, w, act="silu")[0].clone()
    gemm(large, w)
    assert calls == [4001]
    out = torch.empty(3001, 256, device=dev)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        gemm(small, w, act="silu", out=out)  # warm-up outside the capture (eager: no descriptors)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemm(small, w, act="silu", out=out)
    assert calls == [4001, 3001]
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager_small)


def _same_bits_under_switch(monkeypatch, form, m, tma, key, dot, kernel_dots, tol):
    """gemm on CUDA with ``linear._CONFIG[key]`` True and False: the launch's kernel dot (a spy on both launches)
    is ``kernel_dots[value]``, the results have the same bits, and each is within ``tol`` of float64."""
    import importlib

    lin = importlib.import_module("mlff_distiller.kernels.linear")
    dev = torch.device("cuda")
    monkeypatch.setitem(lin._CONFIG, "tma", tma)
    monkeypatch.setitem(lin._CONFIG, "tma_eager_min_rows", 0)
    dots = []
    real_kernel, real_tma = lin._gemm_kernel, lin._launch_tma

    class _Spy:  # records the element-wise launch's DOT
        def __getitem__(self, grid):
            return lambda *args, **kw: dots.append(kw["DOT"]) or real_kernel[grid](*args, **kw)

    monkeypatch.setattr(lin, "_gemm_kernel", _Spy())
    monkeypatch.setattr(lin, "_launch_tma", lambda *args, **kw: dots.append(args[-1]) or real_tma(*args, **kw))
    res = {}
    for value in (True, False):
        monkeypatch.setitem(lin._CONFIG, key, value)
        dots.clear()
        kw, w, a = _tma_case(form, m, 128, 384, dev, torch.Generator().manual_seed(m + len(form)), True)
        before = kw["out"].clone() if form == "accumulate" else None
        c, pre = gemm(a, w, dot=dot, **kw)
        assert dots == [kernel_dots[value]]
        res[value] = (c.clone(), None if pre is None else pre.clone())
        expect = _tma_reference(form, a, w, kw) + (before.double() if form == "accumulate" else 0)
        _close(c, expect, tol, f"{form} {key}={value}")
    assert torch.equal(res[True][0], res[False][0])
    if res[True][1] is not None:
        assert torch.equal(res[True][1], res[False][1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("form", _TMA_FORMS)
@pytest.mark.parametrize("m", [40, 3001])
@pytest.mark.parametrize("tma", [True, False])
def test_gemm_nan_guard_changes_no_bits_on_cuda(monkeypatch, form, m, tma):
    """``nan_guard`` False: the two-MMA launches (W on the TF32 grid) take dot_fin, without dot_w's NaN guard (the
    kernel dot "tf32x2f"); the same bits as with the guard for every form, small and large M, element-wise and
    descriptor launches, within float32 accuracy of float64."""
    _same_bits_under_switch(monkeypatch, form, m, tma, "nan_guard", "tf32x3", {True: "tf32x2w", False: "tf32x2f"}, 1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("form", _TMA_FORMS)
@pytest.mark.parametrize("m", [40, 3001])
@pytest.mark.parametrize("tma", [True, False])
def test_gemm_tf32_with_w_on_the_grid_rounds_a_alone_on_cuda(monkeypatch, form, m, tma):
    """``w_exact_tf32``: a "tf32" launch (the engine's tf32 precision) with W on the TF32 grid takes "tf32w" (A
    alone rounded to nearest); the same bits as "tf32", which rounds W too and leaves it unchanged, within TF32's
    accuracy of float64."""
    _same_bits_under_switch(monkeypatch, form, m, tma, "w_exact_tf32", "tf32", {True: "tf32w", False: "tf32"}, 2e-3)


def _norm_case(m, f, n, dtype, device, gen, with_d):
    """S, D (or None), U [3M, 2F] and a weight [N, 2F], bias: the update block's first mixing GEMM."""
    s = _rand(m, f, gen=gen, dtype=dtype, device=device)
    d = _rand(m, f, gen=gen, dtype=dtype, device=device) if with_d else None
    u = _rand(3 * m, 2 * f, gen=gen, dtype=dtype, device=device)
    w = _rand(n, 2 * f, gen=gen, dtype=dtype, device=device, scale=(2 * f) ** -0.5)
    b = _rand(n, gen=gen, dtype=dtype, device=device)
    return s, d, u, w, b


def _norm_reference(s, d, u, w, b):
    m, f = s.shape
    vv = u.double().view(m, 3, 2 * f)[:, :, f:]
    x = s.double() if d is None else s.double() + d.double()
    x = torch.cat([x, torch.sqrt((vv * vv).sum(dim=1) + 1e-8)], dim=1)
    return x @ w.double().T + b.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("with_d", [False, True], ids=["s", "s+ds"])
@pytest.mark.parametrize("m, f, n", [(1, 8, 16), (37, 20, 24), (130, 64, 128)])
def test_gemm_norm_prologue(triton_device, dtype, with_d, m, f, n):
    """``prologue_norm = (S, D, U)``: A = [S + D | sqrt(Σ_k vv_k² + 1e-8)] made in the load from the update block's
    [uv | vv] rows (F not a power of two, a K step across both halves under the interpreter), with SiLU and its
    pre-activation, against float64."""
    gen = torch.Generator().manual_seed(m + f + with_d)
    s, d, u, w, b = _norm_case(m, f, n, dtype, triton_device, gen, with_d)
    with use_backend("triton"):
        if not gemm_fusable(s, w, b):
            pytest.skip("float64 on the GPU: no Triton GEMM")
        h, pre = gemm(None, w, b, act="silu", prologue_norm=(s, d, u))
    ref = _norm_reference(s, d, u, w, b)
    _close(pre, ref, TOL[dtype], "pre")
    _close(h, nnf.silu(ref), TOL[dtype], "silu")


def test_gemm_norm_prologue_rejects_bad_operands():
    """A given with the norm prologue, U of the wrong shape, D not S's shape, or another prologue beside it."""
    gen = torch.Generator().manual_seed(3)
    s, d, u, w, b = _norm_case(6, 8, 16, torch.float32, torch.device("cpu"), gen, True)
    with pytest.raises(ValueError, match="pass A as None"):
        gemm(s, w, b, prologue_norm=(s, d, u))
    with pytest.raises(ValueError, match="prologue_norm wants"):
        gemm(None, w, b, prologue_norm=(s, d, u[:-3]))
    with pytest.raises(ValueError, match="D must be"):
        gemm(None, w, b, prologue_norm=(s, d[:-1], u))
    with pytest.raises(ValueError, match="one prologue"):
        gemm(None, w, b, prologue_norm=(s, d, u), prologue_add=s)


@pytest.mark.parametrize("with_d", [False, True], ids=["s", "s+ds"])
def test_gemm_tma_norm_prologue_on_the_interpreter(triton_device, with_d):
    """The descriptor kernel's norm prologue (S, D through their descriptors, the vv halves through U viewed
    [M, 6F]) on the interpreter, with rows that leave the last tile partial, against float64."""
    lin = _interpreter_linear(triton_device, "test_gemm_norm_prologue_equals_the_norm_kernel_on_cuda")
    m, f, n = 150, 64, 96
    gen = torch.Generator().manual_seed(17 + with_d)
    s, d, u, w, b = _norm_case(m, f, n, torch.float32, torch.device("cpu"), gen, with_d)
    out, pre = torch.full((m, n), float("nan")), torch.full((m, n), float("nan"))
    c, p = lin._launch_tma(
        s, w, w, b, d if with_d else s, out, pre, None, None, m, n, 2 * f, "silu", lin._PRO_NORM, 64, 32, 32, 4,
        "ieee", u=u, norm_d=with_d,
    )  # fmt: skip
    ref = _norm_reference(s, d, u, w, b)
    _close(p, ref, 1e-6, "pre")
    _close(c, nnf.silu(ref), 1e-6, "silu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("m", [700, 3001, 22000])
@pytest.mark.parametrize("with_d", [False, True], ids=["s", "s+ds"])
def test_gemm_norm_prologue_equals_the_norm_kernel_on_cuda(monkeypatch, m, with_d):
    """On the GPU (small tiles at 700 rows, the descriptors above) the norm prologue gives the bits of the update
    block's norm kernel followed by the plain GEMM, with the weight on the TF32 grid (two MMAs)."""
    import importlib

    from mlff_distiller.kernels._frozen import round_tf32_

    lin = importlib.import_module("mlff_distiller.kernels.linear")
    pu = importlib.import_module("mlff_distiller.kernels.painn_update")
    monkeypatch.setitem(lin._CONFIG, "tma_eager_min_rows", 0)
    dev = torch.device("cuda")
    f, n = 128, 128
    gen = torch.Generator().manual_seed(m + with_d)
    s, d, u, w, b = _norm_case(m, f, n, torch.float32, dev, gen, with_d)
    round_tf32_(w)
    h, pre = gemm(None, w, b, act="silu", prologue_norm=(s, d, u), dot="tf32x3")
    x = torch.empty(m, 2 * f, device=dev)
    pu._launch(pu._painn_update_norm_kernel, s, m, f, s, d if with_d else s, u, x, HAS_DS=with_d)
    h_ref, pre_ref = gemm(x, w, b, act="silu", dot="tf32x3")
    assert torch.equal(pre, pre_ref)
    assert torch.equal(h, h_ref)
    _close(pre, _norm_reference(s, d, u, w, b), 1e-6, "pre")
