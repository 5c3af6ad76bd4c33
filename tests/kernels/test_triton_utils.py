"""``_triton_utils.triton_op``: the package's custom Triton ops are registered without torch's import-time source
walk (which imported torch._dynamo and torch._inductor in every process: ~1.3 s of a 1.6 s package import on the
development CPU), and the kernel list that walk makes is still there, found on first read."""

import subprocess
import sys

import pytest
import torch
from mlff_distiller.kernels import _triton_utils
from mlff_distiller.kernels._triton_utils import HAS_TRITON, _KernelsOfOp


def test_kernels_of_op_are_found_once_on_first_read():
    calls = []

    def find(fn):
        calls.append(fn)
        return ["k1", "k2"]

    lazy = _KernelsOfOp(find, len)
    assert calls == []
    assert list(lazy) == ["k1", "k2"] and calls == [len]
    assert len(lazy) == 2 and lazy[1] == "k2" and "k1" in lazy and lazy == ["k1", "k2"] and bool(lazy)
    assert calls == [len]  # found once
    assert not _KernelsOfOp(lambda fn: [], len)


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_triton_op_defers_the_source_walk(monkeypatch):
    import torch._library.triton as lib_triton

    walked = []

    def walk(fn):
        walked.append(fn)
        return ["a kernel"]

    monkeypatch.setattr(lib_triton, "get_inner_triton_kernels", walk)

    def twice(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    name = "mlff_distiller_test::twice_lazy"
    op = _triton_utils.triton_op(name, mutates_args=())(twice)
    assert walked == []  # nothing walked at definition
    assert lib_triton.get_inner_triton_kernels is walk  # torch's function is back in place
    assert list(lib_triton.get_triton_kernels_for_op(name)) == ["a kernel"] and walked == [twice]
    x = torch.arange(3.0)
    torch.testing.assert_close(op(x), x * 2)


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_the_package_kernels_are_those_torch_finds():
    """Each op's lazy list equals what torch's own walk returns for the same function (today: none of our kernels,
    which sit behind launch helpers the walk does not follow; configure_compile_cache keys its directory by their
    source for that reason)."""
    import mlff_distiller.kernels  # noqa: F401  (registers the ops)
    import torch._library.triton as lib_triton

    ours = {k: v for k, v in lib_triton.triton_ops_to_kernels.items() if k.startswith("mlff_distiller::")}
    assert {"mlff_distiller::message_passing", "mlff_distiller::rbf_cutoff", "mlff_distiller::edge_basis"} <= set(ours)
    for kernels_of_op in ours.values():
        assert isinstance(kernels_of_op, _KernelsOfOp)
        assert list(kernels_of_op) == list(lib_triton.get_inner_triton_kernels(kernels_of_op._fn))


def test_importing_the_package_imports_no_dynamo():
    """``import mlff_distiller`` adds neither torch._dynamo nor torch._inductor to what ``import torch`` loads."""
    code = (
        "import sys, torch; before = {m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules}; "
        "import mlff_distiller; "
        "print(sorted({m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules} - before))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr
