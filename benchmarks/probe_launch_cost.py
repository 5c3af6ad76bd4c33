"""Probe (GPU): what one launch costs the host, by layer, and how much of an eager step that is.

Stop 51 put an eager step's host time at 10-13 ms on an H200 host whatever the box (``probe_eager_host.md``), with
Triton's launch path (``JITFunction.run``: the argument binder and its per-argument specialisation, the cache key,
the launcher) the largest single part of its cProfile. Before building anything around it, this probe measures the
layers one at a time, each as the mean host µs per call of ``--reps`` calls issued back to back (the device work is
a few µs, so the host is the bound):

* ``torch add_``: one small torch op (the floor of any launch through torch's dispatcher);
* ``triton [grid]``: a small Triton kernel with 16 arguments (6 pointers, 6 ints, 4 constexprs, as the package's
  kernels have) launched as the package launches them, ``kernel[grid](...)``;
* ``triton direct``: the same compiled kernel through its launcher directly (what ``JITFunction.run`` does after
  its binder and cache lookup: ``launch_metadata`` + ``CompiledKernel.run``), the floor of a cached launch path;
* ``gemm() 16 rows``: the package's GEMM wrapper (checks, frozen-weight lookups, one launch) on 16 x 128 -> 384;
* the eager benzene and 3,000-atom water steps (the shipped 128-wide student's shape, random weights): host µs per
  step and the number of kernels a step launches (torch profiler), so launches x cost can be set beside the step;
  and the same steps with Triton's ``cdiv`` / ``next_power_of_2`` swapped back into the kernels' host code (what
  the tree before stop 52 ran), in the same process.

    python benchmarks/probe_launch_cost.py --out DIR [--name NAME] [--reps 2000]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import host_us, write_lines


def _best(run, reps: int, rounds: int = 5) -> float:
    run()
    return min(host_us(run, reps) for _ in range(rounds))


def _kernels_per_call(run) -> int:
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


@contextlib.contextmanager
def _tritons_helpers():
    """The kernels' host code with ``triton.cdiv`` / ``triton.next_power_of_2`` (constexpr functions) in place of
    the package's plain ``cdiv`` / ``next_pow2`` (stop 52): the tree before that change, for an A/B in one run."""
    import triton

    from mlff_distiller import kernels

    swapped = []
    for mod in [m for name, m in sys.modules.items() if name.startswith(kernels.__name__ + ".")]:
        for name, theirs in (("cdiv", triton.cdiv), ("next_pow2", triton.next_power_of_2)):
            if hasattr(mod, name):
                swapped.append((mod, name, getattr(mod, name)))
                setattr(mod, name, theirs)
    try:
        yield
    finally:
        for mod, name, ours in swapped:
            setattr(mod, name, ours)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--step-reps", type=int, default=30)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="probe_launch_cost")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_launch_cost: needs a CUDA device")
        return 0
    import triton
    import triton.language as tl
    from triton import knobs

    @triton.jit(do_not_specialize=["n0", "n1"])
    def _toy(
        a, b, c, d, e, f, n0, n1, n2, n3, n4, n5, B: tl.constexpr, C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr
    ):
        i = tl.program_id(0) * B + tl.arange(0, B)
        m = i < n0
        x = tl.load(a + i, mask=m, other=0.0) + tl.load(b + i, mask=m, other=0.0)
        if C0:
            x = x + tl.load(c + i, mask=m, other=0.0) + tl.load(d + i, mask=m, other=0.0)
        if C1:
            x = x * (n1 + n2 + n3 + n4 + n5)
        if C2:
            x = x + tl.load(e + i, mask=m, other=0.0)
        tl.store(f + i, x, mask=m)

    dev = torch.device("cuda")
    xs = [torch.randn(256, device=dev) for _ in range(6)]
    grid = (2,)

    def toy_launch():
        return _toy[grid](*xs, 256, 3, 5, 7, 11, 13, B=128, C0=True, C1=False, C2=True)

    compiled = toy_launch()
    stream = torch.cuda.current_stream().cuda_stream
    bound = (*xs, 256, 3, 5, 7, 11, 13, 128, True, False, True)

    def toy_direct():
        md = compiled.launch_metadata(grid, stream, *bound)
        compiled.run(
            2,
            1,
            1,
            stream,
            compiled.function,
            compiled.packed_metadata,
            md,
            knobs.runtime.launch_enter_hook,
            knobs.runtime.launch_exit_hook,
            *bound,
        )

    out = torch.empty_like(xs[5])
    ref = xs[0] + xs[1] + xs[2] + xs[3] + xs[4]
    xs[5].zero_()
    toy_direct()
    torch.cuda.synchronize()
    direct_ok = bool(torch.allclose(xs[5], ref))
    del out

    y = torch.zeros(16, device=dev)

    def torch_add():
        y.add_(1.0)

    from mlff_distiller.kernels import linear

    a16 = torch.randn(16, 128, device=dev)
    w = torch.randn(384, 128, device=dev)

    def gemm16():
        linear.gemm(a16, w)

    rows = [
        ("torch add_ (one small torch op)", _best(torch_add, args.reps)),
        ("triton kernel[grid](...) (16 arguments)", _best(toy_launch, args.reps)),
        ("triton compiled launcher directly (same kernel)", _best(toy_direct, args.reps)),
        ("linear.gemm() 16 x 128 -> 384 (wrapper + one launch)", _best(gemm16, args.reps)),
    ]
    for r in rows:
        print(r, flush=True)

    from ase.build import molecule
    from peers import StepImpl, make_student
    from systems import water_box

    model = make_student(hidden=128)
    steps = []
    for label, atoms in (("benzene", molecule("C6H6")), ("water 3,000", water_box(3000, seed=0))):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            impl = StepImpl("eager", "ours", model, "cuda", mode="eager")
            run = impl.prepare([atoms], True)
            run()
            run()
        host = _best(run, args.step_reps, rounds=3)
        with _tritons_helpers():
            host_triton = _best(run, args.step_reps, rounds=3)
        host = min(host, _best(run, args.step_reps, rounds=3))
        n_kernels = _kernels_per_call(run)
        steps.append((label, host, n_kernels, host_triton))
        print(label, host, n_kernels, host_triton, flush=True)
        del impl, run
        torch.cuda.empty_cache()

    lines = [
        "# probe_launch_cost.py: the host's cost of one launch, by layer, beside the eager step",
        "",
        f"{torch.cuda.get_device_name()} · torch {torch.__version__} · triton {triton.__version__} · host µs per "
        f"call, best of 5 rounds of {args.reps} calls issued back to back (one synchronisation per round)",
        "",
        "| launch | host µs per call |",
        "|---|---:|",
    ]
    lines += [f"| {name} | {us:.2f} |" for name, us in rows]
    lines += [
        "",
        f"The direct launch computed the kernel's result correctly: {direct_ok}.",
        "",
        "| eager step (128-wide student, random weights) | host µs per step | device kernels per step | "
        "host µs per kernel | host µs per step with Triton's cdiv / next_power_of_2 (before stop 52) | ratio |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {label} | {host:.0f} | {k} | {host / max(k, 1):.1f} | {old:.0f} | {old / host:.3f} |"
        for label, host, k, old in steps
    ]
    write_lines(lines, Path(args.out), args.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
