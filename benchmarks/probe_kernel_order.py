"""Which code launches each kernel of one small padded step, in launch order (GPU diagnostic for issue 5).

A captured benzene step is ~70 dependent kernels at ~2.6 µs each; this lists them as the eager padded step launches
them (the same kernels a capture records, the edge kernels on one stream), each with the operator that launched it
and the innermost frames of this package's Python code, so that small launches that could go (fills, copies,
concatenations, elementwise adds) are found by their source line; then the kernels of the captured step's replay
(the graph's own list, with the second stream's kernels and without what the capture leaves out).

    python benchmarks/probe_kernel_order.py --out DIR [--systems benzene,water192]
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mlff_distiller import AtomsBatch, ForceEngine, load_model

OURS = ("mlff_distiller/", "kernels/")  # the profiler names frames by path from site-packages or the repo root


def _frames(evt, depth: int = 3) -> str:
    """The innermost ``depth`` frames of this package above ``evt``. With ``with_stack`` the profiler records
    Python calls as events of their own, named ``path(line): function``, which are the ancestors of the operators
    they call (older torch versions filled each event's ``stack`` instead: both are read)."""
    found, e = [], evt
    while e is not None and len(found) < depth:
        frames = [e.name, *(getattr(e, "stack", None) or [])]
        found += [f.split("/")[-1] for f in frames if any(o in f for o in OURS) and "(" in f]
        e = e.cpu_parent
    return " <- ".join(found[:depth]) if found else "(no Python frame: autograd's engine thread)"


def _ops(evt, depth: int = 3) -> str:
    names, e = [], evt
    while e is not None and len(names) < depth:
        if not e.name.startswith(("cuda", "cu")):
            names.append(e.name)
        e = e.cpu_parent
    return " < ".join(names)


def kernel_order(step, reps: int = 2) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    launches = sorted((e for e in prof.events() if e.kernels), key=lambda e: e.time_range.start)
    per_step = len(launches) // reps
    lines = ["| # | kernel | µs | operator | our code |", "|---:|---|---:|---|---|"]
    for n, evt in enumerate(launches[-per_step:]):
        for k in evt.kernels:
            name = k.name if len(k.name) < 60 else k.name[:57] + "..."
            lines.append(f"| {n} | `{name}` | {k.duration:.1f} | {_ops(evt)} | {_frames(evt)} |")
    return lines


def replay_kernels(replay, reps: int = 3) -> list[str]:
    """The device kernels of one graph ``replay()`` in start order (names and device µs; a replay records no
    operator or Python frame), the last of ``reps`` replays; a table whose last line counts them."""
    from torch.profiler import ProfilerActivity, profile

    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            replay()
            torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: e.time_range.start)
    one = kernels[-(len(kernels) // reps) :] if kernels else []
    lines = ["| # | kernel | µs |", "|---:|---|---:|"]
    for n, k in enumerate(one):
        name = k.name if len(k.name) < 60 else k.name[:57] + "..."
        lines.append(f"| {n} | `{name}` | {k.device_time:.1f} |")
    torch_kernels = sum(1 for k in one if "at::native" in k.name or "at::" in k.name)
    lines += [
        "",
        f"{len(one)} kernels, {sum(k.device_time for k in one):.1f} µs of device time; {torch_kernels} torch.",
    ]
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--systems", default="benzene,water192")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_kernel_order: needs CUDA")
        return
    from ase.build import molecule
    from systems import water_box

    report = [f"# probe_kernel_order.py: {torch.cuda.get_device_name()} · torch {torch.__version__}", ""]
    model = load_model("builtin:chno-gfn2")
    for name in args.systems.split(","):
        if name == "benzene":
            structs, net = [molecule("C6H6")], model
        else:
            from peers import make_student

            structs, net = [water_box(int(name[5:]))], make_student()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            eng = ForceEngine(net, device="cuda", mode="cudagraph")
        batch = AtomsBatch.from_atoms(structs)
        eng.compute(batch, to_host=True)
        bucket = next(iter(eng._runners))
        graph = eng._graph(bucket)
        report += [f"## {name}: bucket {bucket}, the padded step run eagerly", ""]
        report += kernel_order(lambda g=graph, e=eng: e._step(*g.inputs()))
        report += ["", f"### {name}: the captured step's replay (the graph's kernel nodes in start order)", ""]
        report += replay_kernels(eng._runners[bucket].replay)
        report.append("")
    text = "\n".join(report)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe_kernel_order.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
