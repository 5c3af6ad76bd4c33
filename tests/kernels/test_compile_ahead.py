"""``kernels.compile_ahead``: a dry run that compiles a step's Triton kernels in parallel before its first real run
(a cold process compiled them one after another: 15-18 s to the first benzene result on the H100 host)."""

import importlib
import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from mlff_distiller.kernels import _compile_ahead
from mlff_distiller.kernels._triton_utils import HAS_TRITON

from mlff_distiller import kernels

needs_compiled_triton = pytest.mark.skipif(
    not (HAS_TRITON and torch.cuda.is_available() and _compile_ahead.compile_ahead_supported()),
    reason="needs a CUDA device and a Triton with AsyncCompileMode",
)


def test_off_under_the_interpreter_and_by_the_switch(monkeypatch):
    """Where the dry run is not supported the block runs as it is: launches included, ``precompile`` a no-op."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not _compile_ahead.compile_ahead_supported()
    with kernels.compile_ahead() as on:
        assert on is False and not kernels.dry_run_active()
    calls = []
    assert kernels.precompile(calls.append, 1) is False and calls == []
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("MLFF_DISTILLER_COMPILE_AHEAD", "0")
    assert not _compile_ahead.compile_ahead_supported()


def test_edge_compact_gives_valid_indices_under_a_dry_run(monkeypatch):
    """Under a dry run no compaction kernel runs; the outputs the torch ops after it index with are zeros, not
    whatever the allocator held (the stress step's virial indexes atoms with them)."""
    if not HAS_TRITON:
        pytest.skip("needs Triton")
    ec = importlib.import_module("mlff_distiller.kernels.edge_compact")  # the package attribute is the function

    monkeypatch.setattr(ec, "dry_run_active", lambda: True)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: the interpreter (conftest)
    n, c = 5, 12
    pos = torch.randn(n, 3, dtype=torch.float64, device=dev)
    ei = torch.randint(0, n, (2, c), device=dev)
    ei = ei[:, torch.argsort(ei[0], stable=True)].contiguous()
    row_ptr = torch.searchsorted(ei[0], torch.arange(n + 1, device=dev))
    perm = torch.argsort(ei[1], stable=True)
    sptr = torch.searchsorted(ei[1][perm], torch.arange(n + 1, device=dev))
    shifts = torch.zeros(c, 3, dtype=torch.float64, device=dev)
    with kernels.use_backend("triton"):
        out = ec._edge_compact_triton(pos, ei, shifts, row_ptr, perm, sptr, 2.0, 100.0)
    for t in out:
        assert torch.count_nonzero(t) == 0


@needs_compiled_triton
@pytest.mark.gpu
def test_a_dry_run_launches_nothing_then_the_kernel_is_compiled():
    from mlff_distiller.kernels.edge_compact import _keep_kernel  # any kernel of the package: a fresh signature
    from triton.runtime.jit import JITFunction

    compiles = []
    do_compile = JITFunction._do_compile

    def counting(self, *args, **kwargs):
        compiles.append((self.fn.__name__, kernels.dry_run_active()))
        return do_compile(self, *args, **kwargs)

    JITFunction._do_compile = counting
    try:
        n, c = 7, 33  # sizes no other test uses: a specialisation not compiled in this process yet
        dev = torch.device("cuda")
        pos = torch.randn(n, 3, device=dev)
        ei = torch.randint(0, n, (2, c), device=dev)
        keep = torch.full((2, c), -7, dtype=torch.int32, device=dev)
        cnt = torch.full((2, 1), -7, dtype=torch.int32, device=dev)
        args = (pos, ei, torch.zeros(c, 3, device=dev), torch.arange(c, device=dev), torch.tensor([c], device=dev))
        with kernels.compile_ahead() as on:
            assert on and kernels.dry_run_active()
            _keep_kernel[(1,)](*args, keep, cnt, c, ei.stride(0), 1, 4.0, BLOCK=64, PDL=False)
        torch.cuda.synchronize()
        assert not kernels.dry_run_active()
        assert (keep == -7).all()  # not launched
        assert compiles == [("_keep_kernel", True)]
        _keep_kernel[(1,)](*args, keep, cnt, c, ei.stride(0), 1, 4.0, BLOCK=64, PDL=False)
        torch.cuda.synchronize()
        assert compiles == [("_keep_kernel", True)]  # compiled by the dry run: none now
        assert (keep != -7).any()  # launched
    finally:
        JITFunction._do_compile = do_compile


@needs_compiled_triton
@pytest.mark.gpu
def test_other_threads_launch_during_a_dry_run():
    """The dry run belongs to the context that opened it: a kernel launched from another thread meanwhile runs."""
    from mlff_distiller.kernels.edge_compact import _keep_kernel

    n, c = 6, 21
    dev = torch.device("cuda")
    pos = torch.randn(n, 3, device=dev)
    ei = torch.randint(0, n, (2, c), device=dev)
    keep = torch.full((2, c), -7, dtype=torch.int32, device=dev)
    cnt = torch.full((2, 1), -7, dtype=torch.int32, device=dev)
    args = (pos, ei, torch.zeros(c, 3, device=dev), torch.arange(c, device=dev), torch.tensor([c], device=dev))
    seen = []

    def other():
        seen.append(kernels.dry_run_active())
        _keep_kernel[(1,)](*args, keep, cnt, c, ei.stride(0), 1, 4.0, BLOCK=32, PDL=False)
        torch.cuda.synchronize()

    with kernels.compile_ahead() as on:
        assert on
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert seen == [False]
    assert (keep != -7).any()  # launched


_CHILD = textwrap.dedent(
    """
    import json, sys, time
    import torch
    from ase.build import molecule
    from triton.runtime.jit import JITFunction
    from mlff_distiller import ForceEngine, load_model, kernels
    from mlff_distiller.batch import AtomsBatch

    compiles = []
    do_compile = JITFunction._do_compile
    import threading
    def counting(self, *args, **kwargs):
        compiles.append([self.fn.__name__, kernels.dry_run_active(), threading.current_thread().name])
        return do_compile(self, *args, **kwargs)
    JITFunction._do_compile = counting

    model = load_model("builtin:chno-gfn2")
    atoms = molecule("C6H6")
    atoms.rattle(0.05, seed=1)
    batch = AtomsBatch.from_atoms([atoms])
    t0 = time.perf_counter()
    fast = ForceEngine(model, device="cuda", mode="cudagraph").compute(batch, forces=True)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    n_fast = len(compiles)
    ref = ForceEngine(model, device="cuda", mode="eager").compute(batch, forces=True)
    from mlff_distiller.kernels import _compile_ahead
    print(json.dumps({
        "first_s": first,
        "dry_run": _compile_ahead.LAST,
        "compiles": compiles[:n_fast],
        "energy": [fast["energy"].item(), ref["energy"].item()],
        "force_err": (fast["forces"] - ref["forces"]).abs().max().item(),
        "force_max": ref["forces"].abs().max().item(),
    }))
    """
)


def _cold_child(tmp_path, ahead: bool) -> dict:
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    env = dict(os.environ)
    env["TRITON_CACHE_DIR"] = str(tmp_path / ("cache_on" if ahead else "cache_off"))
    env["MLFF_DISTILLER_COMPILE_AHEAD"] = "1" if ahead else "0"
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@needs_compiled_triton
@pytest.mark.gpu
def test_a_cold_capture_compiles_in_the_dry_run_and_gives_the_eager_results(tmp_path):
    """A fresh process on an empty Triton cache: the captured benzene step's kernels are all compiled by the dry run
    (none later, in the capture), and its result equals the eager engine's."""
    on = _cold_child(tmp_path, ahead=True)
    print(json.dumps(on))
    late = [(name, thread) for name, dry, thread in on["compiles"] if not dry]
    assert on["dry_run"]["error"] is None and on["dry_run"]["compiled"] >= 10, on
    assert late == [], f"compiled after the dry run: {late}; {on['dry_run']}"  # all in it: none in the capture
    e_fast, e_ref = on["energy"]
    assert abs(e_fast - e_ref) <= 1e-4 * max(1.0, abs(e_ref))
    assert on["force_err"] <= 1e-3 * max(1.0, on["force_max"])
    off = _cold_child(tmp_path, ahead=False)
    assert not any(dry for _, dry, _ in off["compiles"])
    # The same kernels, each compiled once either way (Triton 3.6 asks again for every launch of a kernel still
    # compiling, which its async mode answers with the same compile).
    assert on["dry_run"]["compiled"] == on["dry_run"]["submitted"] == len(off["compiles"])
    assert sorted({n for n, _, _ in on["compiles"]}) == sorted({n for n, _, _ in off["compiles"]})
    print(f"cold first result: {on['first_s']:.2f} s with the dry run, {off['first_s']:.2f} s without")
