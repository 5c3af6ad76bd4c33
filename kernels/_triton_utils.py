"""Shared plumbing for the Triton kernels: a guarded import, launch checks and block-size choices.

Importing this module never fails: without Triton, ``HAS_TRITON`` is False, ``triton``/``tl`` are None and the
kernel files skip their ``@triton.jit`` definitions, so the torch references keep working.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch

from ._backend import interpreter_enabled

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch path must not depend on Triton
    triton = None
    tl = None

__all__ = [
    "HAS_TRITON",
    "INTERPRETING",
    "LIB",
    "FirstOrderOnly",
    "cdiv",
    "check_launchable",
    "dot_fin",
    "dot_rn",
    "dot_w",
    "edge_block",
    "next_pow2",
    "num_warps",
    "pdl_args",
    "pdl_enabled",
    "pdl_prologue",
    "round_tf32",
    "sm90",
    "tf32_hi",
    "tl",
    "triton",
    "triton_op",
    "tuning",
    "unspecialized",
    "widest_chunk",
    "wrap_triton",
]

HAS_TRITON = triton is not None


def keep_fp_fusion_default(version: str | None = None, environ=os.environ) -> bool:
    """Set ``TRITON_DEFAULT_FP_FUSION=1`` where Triton 3.9 would otherwise warn that it is unset (once a process,
    at our kernels' first compile: "The default will change to DISABLED in Triton 3.10"). 1 is the default Triton
    3.9 applies anyway, so nothing compiles differently in this process: our kernels are tuned and tested with
    fusion on (as under Triton 3.6 to 3.8), and other Triton code keeps what it had. A value the user set stays;
    other Triton versions are left alone (3.10's new default is outside the versions we support). Passing
    ``enable_fp_fusion`` at each launch instead would not cover the launches traced by ``torch.compile``
    (``wrap_triton`` takes no launch options). Returns whether it set the variable."""
    version = version if version is not None else getattr(triton, "__version__", "")
    if not version.startswith("3.9") or "TRITON_DEFAULT_FP_FUSION" in environ:
        return False
    environ["TRITON_DEFAULT_FP_FUSION"] = "1"
    return True


if HAS_TRITON:
    keep_fp_fusion_default()
# Namespace of every custom op of the package: torch.ops.mlff_distiller.<name>.
LIB = "mlff_distiller"
# The Triton interpreter (CPU tensors; the tests' way to run the kernels without a GPU), as at this import: triton.jit
# reads the same variable when a kernel is defined, so it holds for the kernels of this process.
INTERPRETING = HAS_TRITON and interpreter_enabled()


def _wrap_interpreted(kernel):
    """``torch.library.wrap_triton`` that passes an interpreted kernel through unwrapped, as torch 2.13 and later do.
    torch 2.11 and 2.12 raise for one ("wrap_triton only works on functions annotated with triton.jit"), which
    failed every interpreted test of our triton_ops there (stop 80: the CPU suite on torch 2.11). Interpreted
    kernels run eagerly only (torch.compile over them fails: fake tensors have no data), so nothing traceable is
    lost."""
    if isinstance(kernel, _interpreted_function()):
        return kernel
    return torch.library.wrap_triton(kernel)


def mend_interpreter_index(module=None) -> bool:
    """Triton 3.6's interpreter makes a tensor used as a Python index (a loop bound, a ``range`` argument) an int by
    ``int()`` of its one-element 1-D array. NumPy 2.4 refuses that ("only 0-dimensional arrays can be converted to
    Python scalars"), so under Triton 3.6 with NumPy >= 2.4 every interpreted kernel of ours with such a bound
    failed (stop 80: torch 2.11's pinned Triton). Triton 3.7 squeezes the array first; this wraps the interpreter's
    ``_patch_lang_tensor`` (``module``: ``triton.runtime.interpreter`` by default) to set that attribute the same way
    after Triton's own patching, where its source still has the unsqueezed form. Returns whether it wrapped."""
    import inspect

    if module is None:
        from triton.runtime import interpreter as module
    patch = getattr(module, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "_squeezed_index", False):
        return False
    try:
        source = inspect.getsource(patch)
    except (OSError, TypeError):
        return False
    if "int(self.handle.data)" not in source:
        return False

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched._squeezed_index = True
    module._patch_lang_tensor = patched
    return True


if INTERPRETING:
    wrap_triton = _wrap_interpreted
    mend_interpreter_index()
elif HAS_TRITON:
    from torch.library import wrap_triton
else:
    wrap_triton = None


# Triton specialises each int argument of a kernel on divisibility by 16 (and on == 1) and each pointer on 16-byte
# alignment, and compiles the kernel again for every new combination. Counts (edges, atoms, rows), the edge list's
# row stride (its edge count) and pointers into a size-dependent offset change with each batch: a relaxation whose
# batch shrinks met new combinations step after step, each compiled synchronously at its first launch (~10 s of a
# first relaxation with an empty cache, results/stop41_gpu/probe_first_call_compiles_h200.md). The kernels take
# them unspecialised (the counts bound masks; the stride only offsets the senders' index row, a few bytes per edge of a
# message kernel's ~3 KB): one compile per launch configuration. MLFF_DISTILLER_SPECIALIZE_COUNTS=1, read when the
# kernels are defined, restores Triton's default (A/B runs: benchmarks/probe_specialize_counts.py).
SPECIALIZE_COUNTS = os.environ.get("MLFF_DISTILLER_SPECIALIZE_COUNTS", "0") == "1"


def unspecialized(*counts: str, aligned: tuple[str, ...] = ()) -> dict:
    """``triton.jit`` keywords that leave the int arguments ``counts`` unspecialised and the pointers ``aligned``
    without their alignment specialisation (where this Triton has that switch); ``{}`` with
    ``MLFF_DISTILLER_SPECIALIZE_COUNTS=1``."""
    if SPECIALIZE_COUNTS:
        return {}
    out = {"do_not_specialize": list(counts)}
    if aligned and _JIT_HAS_ALIGNMENT_SWITCH:
        out["do_not_specialize_on_alignment"] = list(aligned)
    return out


def _jit_takes(name: str) -> bool:
    import inspect

    try:
        return name in inspect.signature(triton.jit).parameters
    except (TypeError, ValueError):
        return False


_JIT_HAS_ALIGNMENT_SWITCH = HAS_TRITON and _jit_takes("do_not_specialize_on_alignment")


# Host-side integer helpers. ``triton.cdiv`` and ``triton.next_power_of_2`` are ``constexpr_function``s (Triton
# 3.6-3.9), whose wrapper unwraps its arguments on every call from host code: ~4 µs a call on the development CPU
# against ~0.03 µs for the arithmetic, and an eager step computes ~200 launch grids and tile sizes
# (benchmarks/results/stop52_gpu/). The kernels keep Triton's own inside @triton.jit code.
def cdiv(x: int, y: int) -> int:
    """``ceil(x / y)`` for ints (what ``triton.cdiv`` computes)."""
    return -(-x // y)


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``; what ``triton.next_power_of_2`` computes for n >= 1)."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def widest_chunk(n_cols: int) -> int:
    """Widest power-of-two chunk the kernels split ``n_cols`` into (20 -> 16 + 4), capped at 128."""
    return min(128, 1 << (max(1, int(n_cols)).bit_length() - 1))


@functools.cache
def _interpreted_function() -> type:
    """Triton's interpreted-kernel class, imported once (an import statement per launch cost ~4 µs on the CPU)."""
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction


def check_launchable(kernel, tensor: torch.Tensor) -> None:
    """Fail clearly when a kernel cannot run on ``tensor``'s device.

    ``triton.jit`` picks compiled vs interpreted code when the kernel is *defined*, from ``TRITON_INTERPRET``;
    a CPU tensor therefore needs the variable set before ``mlff_distiller.kernels`` is first imported.
    """
    if tensor.is_cuda:
        return
    if tensor.device.type != "cpu" or not isinstance(kernel, _interpreted_function()):
        raise RuntimeError(
            f"Triton kernel {getattr(kernel, '__name__', kernel)} cannot run on a "
            f"{tensor.device.type} tensor: CPU tensors need the Triton interpreter, i.e. "
            "TRITON_INTERPRET=1 set before mlff_distiller.kernels "
            "is imported"
        )


# Launch knobs for tuning sweeps (benchmarks/bench_kernels.py --tune); the defaults are the shipped
# configuration.
_TUNING = {"block_scale": 1.0, "num_warps": 4}


@contextlib.contextmanager
def tuning(block_scale: float | None = None, num_warps: int | None = None) -> Iterator[None]:
    """Temporarily scale the GPU tile budget of every kernel and/or change its warps per program."""
    old = dict(_TUNING)
    if block_scale is not None:
        _TUNING["block_scale"] = float(block_scale)
    if num_warps is not None:
        _TUNING["num_warps"] = int(num_warps)
    try:
        yield
    finally:
        _TUNING.update(old)


def num_warps() -> int:
    return _TUNING["num_warps"]


def edge_block(device: torch.device, n_cols: int, elems: int) -> int:
    """Edges per program (a power of two) for a ``[BLOCK_E, n_cols]`` tile of about ``elems`` elements.

    On the GPU ``elems`` bounds the registers per thread; under the interpreter (CPU) each program costs
    Python overhead, so fewer, larger programs are much faster.
    """
    if device.type == "cuda":
        elems = int(elems * _TUNING["block_scale"])
    else:
        elems = max(elems, 131072)
    rows = max(16, min(4096, elems // max(1, n_cols)))
    return 1 << (rows.bit_length() - 1)


# Programmatic dependent launch (PDL, sm90+). Each of our kernels (but the pair repulsion's two, where it measured no
# gain: kernels/repulsion.py) is launched with ``launch_pdl`` and starts with ``pdl_prologue``: it waits for the
# previous grid in the stream to finish and flush its memory (griddepcontrol.wait, before any load or store, so every
# read-after-write and write-after-read order of the plain launch holds, also transitively) and then lets the next grid
# launch at once (griddepcontrol.launch_dependents). The next kernel's launch and its programs' start then overlap this
# kernel's work instead of following it. That launches our programs only after the previous grid's last programs have
# started, so a multi-wave kernel is not crowded by its waiting successor. A kernel not launched as a dependent (after a
# torch or cuBLAS kernel, a copy, or on the first launch) passes the wait at once. In a CUDA graph of small dependent
# kernels on an H100 this took 1.75 -> 1.10 µs per kernel (benchmarks/results/probe_pdl_h100.md). Off under
# torch.compile (the traced ops get PDL=False), on the CPU interpreter and on GPUs before sm90; MLFF_DISTILLER_PDL=0
# turns it off everywhere.
def _pdl_from_env(value: str | None) -> bool:
    """``MLFF_DISTILLER_PDL``: unset or anything but "0" (spaces ignored) means on."""
    return (value if value is not None else "1").strip() != "0"


_PDL = {"on": _pdl_from_env(os.environ.get("MLFF_DISTILLER_PDL"))}


@contextlib.contextmanager
def pdl_enabled(on: bool) -> Iterator[None]:
    """Temporarily turn programmatic dependent launch on or off (benchmarks and tests)."""
    old = _PDL["on"]
    _PDL["on"] = bool(on)
    try:
        yield
    finally:
        _PDL["on"] = old


class _KernelsOfOp(list):
    """The Triton kernels inside one custom op's function, found on first use instead of when the op is defined.

    ``torch.library.triton_op`` walks the op function's source, and the source of every function it calls, to list
    the kernels inside (``torch._library.triton.get_inner_triton_kernels``). The only reader of that list is the
    AOTAutograd cache of ``torch.compile``: it puts the kernels' source into its cache keys. The walk imports
    ``torch._dynamo`` and ``torch._inductor`` and parses our kernel files: ~1.3 s of the package's 1.6 s import on
    the development CPU, for every process, whether it compiles anything or not. Registered as this list, the walk
    runs the first time anything reads it, and a process that never compiles skips it.

    The walk finds none of our kernels (they are launched through helpers it does not follow), so the cache key of
    a compiled graph would not change with a kernel's source, and a changed kernel under an unchanged op would
    load old compiled code from a persistent cache. The list therefore adds every ``@triton.jit`` kernel in the op
    function's module globals (7-12 per op; their source is what the cache hashes, ~1 ms per kernel on the
    development CPU, only when compiling)."""

    def __init__(self, find, fn) -> None:
        super().__init__()
        self._find, self._fn = find, fn

    def _found(self) -> _KernelsOfOp:
        if self._find is not None:
            find, self._find = self._find, None
            super().extend(_module_kernels(find(self._fn), self._fn))
        return self

    def __iter__(self):
        return super(_KernelsOfOp, self._found()).__iter__()

    def __len__(self) -> int:
        return super(_KernelsOfOp, self._found()).__len__()

    def __getitem__(self, i):
        return super(_KernelsOfOp, self._found()).__getitem__(i)

    def __contains__(self, item) -> bool:
        return super(_KernelsOfOp, self._found()).__contains__(item)

    def __eq__(self, other) -> bool:
        return list(self._found()) == other

    __hash__ = None

    def __bool__(self) -> bool:
        return len(self) > 0

    def __repr__(self) -> str:
        return f"_KernelsOfOp({list(self._found())!r})"


def _module_kernels(found, fn) -> list:
    """``found`` (torch's walk), then the ``@triton.jit`` kernels (and autotuners) among ``fn``'s module globals that
    it lacks, in name order. Under the Triton interpreter the kernels are interpreted functions: none added (there is
    nothing to compile)."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    out = list(found)
    seen = {id(k) for k in out}
    g = fn.__globals__
    for name in sorted(g):
        k = g[name]
        if isinstance(k, (JITFunction, Autotuner)) and id(k) not in seen:
            out.append(k)
            seen.add(id(k))
    return out


def triton_op(name: str, *, mutates_args):
    """``torch.library.triton_op`` (same arguments, same op) whose kernel list is found lazily (:class:`_KernelsOfOp`).
    On a torch whose ``torch._library.triton`` lacks the function or table this relies on, it is the plain
    ``torch.library.triton_op``."""
    import torch._library.triton as lib_triton

    find = getattr(lib_triton, "get_inner_triton_kernels", None)
    if find is None or not isinstance(getattr(lib_triton, "triton_ops_to_kernels", None), dict):
        return torch.library.triton_op(name, mutates_args=mutates_args)

    def register(fn):
        lib_triton.get_inner_triton_kernels = lambda f: _KernelsOfOp(find, f)
        try:
            return torch.library.triton_op(name, mutates_args=mutates_args)(fn)
        finally:
            lib_triton.get_inner_triton_kernels = find

    return register


def sm90(device: torch.device) -> bool:
    """Whether CUDA ``device`` (no index: the current one) is a Hopper (compute capability 9.0) or newer GPU."""
    return _sm90_index(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=16)
def _sm90_index(index: int) -> bool:  # cached: ~1 µs a query
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_args(ref: torch.Tensor) -> dict:
    """Launch arguments of a kernel with a ``PDL`` constexpr whose work is on ``ref``'s device: ``PDL`` and, when
    on, Triton's ``launch_pdl``. Off for fake or functional tensors (torch.compile's tracing: wrap_triton takes no
    launch options) and while compiling."""
    on = (
        _PDL["on"]
        and ref.is_cuda
        and type(ref) is torch.Tensor
        and not torch.compiler.is_compiling()
        and sm90(ref.device)
    )
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


if HAS_TRITON:

    @triton.jit
    def pdl_prologue(PDL: tl.constexpr):
        """First statement of every kernel: with PDL, wait for the previous grid, then release the next one."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def round_tf32(x):
        """float32 ``x`` rounded to the nearest TF32 value (ties away from zero), as float32, by the hardware's
        ``cvt.rna.tf32.f32``. Since stop 61 no kernel calls it: they round with :func:`tf32_hi` (the same bits,
        one compare fewer); it stays as the oracle of tests/kernels/test_tf32_grid.py's CUDA check of that."""
        return tl.inline_asm_elementwise(
            "cvt.rna.tf32.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
        )

    @triton.jit
    def dot_rn(a, b, DOT: tl.constexpr):
        """``tl.dot(a, b, input_precision=DOT)``, except that "tf32" rounds both operands to the nearest TF32 value
        first: the TF32 MMA itself ignores their low 13 bits, i.e. truncates toward zero, and that bias adds up
        over a sum (on the shipped student, tf32's energy error went from 9.1 to 0.89 meV/atom with the rounding).
        The rounding in integer ops (``tf32_hi``: the bits of ``cvt.rna.tf32.f32`` for every finite and infinite
        value, one compare fewer; a NaN whose payload lies in its low 13 bits comes out infinite, non-finite
        either way). "tf32w" promises that ``b`` is exact in TF32 (a weight on the TF32 grid): only ``a`` is
        rounded, the same bits as "tf32" without the weight tile's rounding (and, for a weight tile the warpgroup
        MMA reads from shared memory, without its trip through registers and back).
        "tf32x2w" promises that ``b`` is exact in TF32 (a weight on the TF32 grid, ``_frozen.tf32_exact``): only
        ``a`` is split, two MMAs (``dot_w``); a kernel given it must pass it only to its weight dots."""
        if DOT == "tf32":
            return tl.dot(tf32_hi(a), tf32_hi(b), input_precision="tf32")
        elif DOT == "tf32w":  # b is a weight on the TF32 grid (round to nearest leaves it as it is): a alone rounded
            return tl.dot(tf32_hi(a), b, input_precision="tf32")
        elif DOT == "tf32x2w":  # b is a weight on the TF32 grid: two MMAs, the sums of tf32x3 (see dot_w)
            return dot_w(a, b, b, "tf32x2w")
        else:
            return tl.dot(a, b, input_precision=DOT)

    @triton.jit
    def dot_fin(a, b, DOT: tl.constexpr):
        """:func:`dot_rn` for an ``a`` that the caller knows to be finite (the message-passing kernels' radial
        basis rows, feature and gradient products): "tf32x2w" without :func:`dot_w`'s NaN guard, which only turns
        the NaN of ``inf - inf`` in the small part into the large part's inf, so the same bits for finite ``a``
        (and a non-finite result either way otherwise). The guard's compare and select per output element and
        product were 6 of a message's ~50 instructions per edge and feature in the block forward (stop 61,
        ``benchmarks/probe_sass.py``). Other modes: :func:`dot_rn`."""
        if DOT == "tf32x2w":
            a_hi = tf32_hi(a)
            part = tl.dot(a - a_hi, b, input_precision="tf32")
            return tl.dot(a_hi, b, part, input_precision="tf32")
        else:
            return dot_rn(a, b, DOT)

    @triton.jit
    def tf32_hi(x):
        """float32 ``x`` rounded to the nearest TF32 value (ties away from zero, as ``cvt.rna.tf32.f32``) in integer
        ops, which the interpreter runs too: the same bits as W_hi of :func:`._frozen.tf32_parts`."""
        return ((x.to(tl.int32, bitcast=True) + 0x1000) & -8192).to(tl.float32, bitcast=True)

    @triton.jit
    def dot_w(a, b, b_lo, DOT: tl.constexpr):
        """``a @ W`` for a frozen weight's tile: with "tf32x3w", ``b`` = W_hi and ``b_lo`` = W_lo, W's two TF32
        parts made once (:func:`._frozen.tf32_parts`), and only A is split here: three TF32 MMAs, float32 accuracy,
        as tf32x3, which splits both tiles in registers at every call (on Hopper the split B tile then goes back
        to shared memory for the warpgroup MMA). The small products go into a fresh tile, the large one onto
        them, and the caller adds the result in float32, as Triton's tf32x3 does: accumulating the K steps inside
        the MMAs measured 8-20x its error (benchmarks/results/stop43_gpu/probe_gemm_split_h200.md). NaN from
        inf - inf in a small part is dropped, as there. Other modes: ``dot_rn(a, b, DOT)`` (b_lo unread)."""
        if DOT == "tf32x3w":
            a_hi = tf32_hi(a)
            part = tl.dot(a - a_hi, b, input_precision="tf32")
            part = tl.dot(a_hi, b_lo, part, input_precision="tf32")
            part = tl.where(part != part, 0.0, part)
            return tl.dot(a_hi, b, part, input_precision="tf32")
        elif DOT == "tf32x2w":  # W exact in TF32 (W_lo = 0): "tf32x3w" without its zero product (the same sums)
            a_hi = tf32_hi(a)
            part = tl.dot(a - a_hi, b, input_precision="tf32")
            part = tl.where(part != part, 0.0, part)
            return tl.dot(a_hi, b, part, input_precision="tf32")
        else:
            return dot_rn(a, b, DOT)

else:  # the kernel files import them by name; without Triton they define no kernel that calls them
    pdl_prologue = round_tf32 = dot_rn = dot_fin = tf32_hi = dot_w = None


class FirstOrderOnly(torch.autograd.Function):
    """Guard of the inference-only fused ops (frozen weights, first derivative only) under ``create_graph=True``:
    ``FirstOrderOnly.apply(what, n, *grads_then_depends_on)`` passes the first ``n`` tensors through (one tensor
    for n = 1, else a tuple) and raises, naming ``what``, if they are differentiated. Not @once_differentiable: its
    error node hangs on detached copies of the outputs, which ``torch.autograd.grad(..., inputs=positions)`` never
    visits, so a second derivative would silently lose the op's terms; this guard hangs on everything passed in
    (the op's inputs and its upstream gradients)."""

    @staticmethod
    def forward(ctx, what: str, n: int, *tensors):
        ctx.what = what
        out = tuple(t.view_as(t) for t in tensors[:n])
        return out[0] if n == 1 else out

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(
            f"{ctx.what} (inference path: frozen weights, Triton backend) is differentiable once only; for second "
            "derivatives let a parameter require grad or use MLFF_DISTILLER_KERNELS=torch"
        )
