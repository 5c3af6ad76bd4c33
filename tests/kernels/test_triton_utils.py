"""``_triton_utils.triton_op``: the package's custom Triton ops are registered without torch's import-time source
walk (which imported torch._dynamo and torch._inductor in every process: ~1.3 s of a 1.6 s package import on the
development CPU), and the kernel list that walk makes is still there, found on first read."""

import os
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

    def op(x):  # its module globals (this test file's) hold no Triton kernel
        return x

    lazy = _KernelsOfOp(find, op)
    assert calls == []
    assert list(lazy) == ["k1", "k2"] and calls == [op]
    assert len(lazy) == 2 and lazy[1] == "k2" and "k1" in lazy and lazy == ["k1", "k2"] and bool(lazy)
    assert calls == [op]  # found once
    assert not _KernelsOfOp(lambda fn: [], op)


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
def test_the_package_kernels_are_listed_for_the_compile_cache():
    """Each op's lazy list holds what torch's own walk returns for the same function, then the op module's kernels,
    which the walk misses (launched through helpers). In a process without the interpreter (where the kernels are
    compiled ones) every op lists its module's kernels, and torch can take the source the AOTAutograd cache hashes
    from each of them."""
    import mlff_distiller.kernels  # noqa: F401  (registers the ops)
    import torch._library.triton as lib_triton

    ours = {k: v for k, v in lib_triton.triton_ops_to_kernels.items() if k.startswith("mlff_distiller::")}
    assert {"mlff_distiller::message_passing", "mlff_distiller::rbf_cutoff", "mlff_distiller::edge_basis"} <= set(ours)
    for kernels_of_op in ours.values():
        assert isinstance(kernels_of_op, _KernelsOfOp)
        walked = list(lib_triton.get_inner_triton_kernels(kernels_of_op._fn))
        assert list(kernels_of_op)[: len(walked)] == walked

    code = (
        "import torch, mlff_distiller.kernels, torch._library.triton as t; "
        "from torch._inductor.codegen.wrapper import user_defined_triton_kernel_transitive_closure_source_code as src; "
        "ops = {k: list(v) for k, v in t.triton_ops_to_kernels.items() if k.startswith('mlff_distiller::')}; "
        "names = {k: sorted(getattr(x, '__name__', '') for x in v) for k, v in ops.items()}; "
        "n = sum(len(src(x)) > 0 for v in ops.values() for x in v); "
        "mp = '_mp_fwd_block_kernel' in names['mlff_distiller::message_passing']; "
        "rbf = '_rbf_cutoff_fwd_kernel' in names['mlff_distiller::rbf_cutoff']; "
        "edge = '_edge_fwd_kernel' in names['mlff_distiller::edge_basis']; "
        "print(min(len(v) for v in ops.values()), mp, rbf, edge, n == sum(len(v) for v in ops.values()))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=180, check=True)
    fewest, mp, rbf, edge, sources = out.stdout.split()[-5:]
    # Every op launches at least its forward, backward and backward-of-backward kernels (edge ops: exactly those 3).
    assert int(fewest) >= 3 and (mp, rbf, edge, sources) == ("True",) * 4, out.stdout + out.stderr


def test_importing_the_package_imports_no_dynamo():
    """The package and every public name (imported on first use) add neither torch._dynamo nor torch._inductor to
    what ``import torch`` loads."""
    code = (
        "import sys, torch; before = {m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules}; "
        "import mlff_distiller; [getattr(mlff_distiller, name) for name in mlff_distiller.__all__]; "
        "print(sorted({m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules} - before))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_host_integer_helpers_equal_tritons():
    import triton

    for x in [*range(0, 70), 127, 128, 129, 1000, 4095, 4096, 4097, 2**31 - 1, 2**31, 2**40 + 3]:
        for y in (1, 2, 3, 16, 64, 128, 1000):
            assert _triton_utils.cdiv(x, y) == triton.cdiv(x, y), (x, y)
        if x >= 1:
            assert _triton_utils.next_pow2(x) == triton.next_power_of_2(x), x
    assert _triton_utils.next_pow2(0) == 1


def test_no_host_call_of_tritons_constexpr_functions():
    """The kernels' host code sizes grids and tiles with the plain helpers: ``triton.cdiv`` and
    ``triton.next_power_of_2`` are constexpr functions costing ~4 µs a call from host code (stop 52)."""
    import pathlib
    import re

    root = pathlib.Path(_triton_utils.__file__).parent
    files = [*root.glob("*.py"), *(root.parent / "neighbors").glob("*.py")]
    if not (root.parent / "neighbors").is_dir():  # the editable layout: kernels/ beside src/
        files += list((root.parent / "src" / "mlff_distiller" / "neighbors").glob("*.py"))
    pattern = re.compile(r"^(?!\s*#).*\btriton\.(cdiv|next_power_of_2)\(", re.M)
    offenders = []
    for f in files:
        text = f.read_text()
        # Inside @triton.jit functions the constexpr functions are what Triton wants: a call is allowed where the
        # enclosing (nearest preceding) def is decorated with @triton.jit.
        for m in pattern.finditer(text):
            before = text[: m.start()]
            defs = list(re.finditer(r"^(\s*)def ", before, re.M))
            last_def = defs[-1].start() if defs else 0
            deco_of_def = re.findall(r"^\s*@(\S+)", before[max(0, last_def - 200) : last_def], re.M)
            if not any(d.startswith("triton.jit") for d in deco_of_def):
                offenders.append(f"{f.name}: {m.group(0).strip()}")
    assert offenders == []


def test_fp_fusion_default_is_kept_on_triton_3_9_only():
    """Triton 3.9 warns that ``TRITON_DEFAULT_FP_FUSION`` is unset (3.10 turns fusion off by default): the kernels'
    import sets the 3.9 default, 1, where the variable is unset; a user's value stays, other versions are left."""
    env: dict = {}
    assert _triton_utils.keep_fp_fusion_default("3.9.0", env) and env == {"TRITON_DEFAULT_FP_FUSION": "1"}
    env = {"TRITON_DEFAULT_FP_FUSION": "0"}
    assert not _triton_utils.keep_fp_fusion_default("3.9.1", env) and env == {"TRITON_DEFAULT_FP_FUSION": "0"}
    for version in ("3.6.0", "3.8.0", "3.10.0"):
        env = {}
        assert not _triton_utils.keep_fp_fusion_default(version, env) and env == {}


@pytest.mark.skipif(not HAS_TRITON, reason="needs Triton")
def test_no_fp_fusion_warning_after_the_import():
    """In a fresh process with the variable unset, Triton's default fusion (what a launch without
    ``enable_fp_fusion`` compiles with) is on and raises no warning once the kernels are imported; a user's 0 is
    kept. On a Triton without the 3.9 knob there is nothing to check."""
    import triton

    if not hasattr(getattr(getattr(triton, "knobs", None), "language", None), "fp_fusion_enabled"):
        pytest.skip(f"Triton {triton.__version__} has no fp_fusion_enabled knob")
    code = (
        "import os, warnings, triton; warnings.simplefilter('error'); import mlff_distiller.kernels; "
        "print(triton.knobs.language.fp_fusion_enabled(None), os.environ.get('TRITON_DEFAULT_FP_FUSION'))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_DEFAULT_FP_FUSION"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    expect = "1" if triton.__version__.startswith("3.9") else "None"
    assert out.stdout.split() == ["True", expect], out.stdout
    out = subprocess.run(
        [sys.executable, "-c", code.replace("'error'", "'ignore'")], capture_output=True, text=True, timeout=120,
        env={**env, "TRITON_DEFAULT_FP_FUSION": "0"},
    )  # fmt: skip
    assert out.stdout.split() == ["False", "0"], out.stdout + out.stderr
