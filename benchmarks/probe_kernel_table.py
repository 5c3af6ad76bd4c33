"""The kernels of one energy + forces step, for any of probe_ncu.py's systems (GPU only).

For each system (``water<N>``, ``g2x<N>``, ``benzene``) and the student of ``--hidden`` / ``--layers``: the step
alone (``probe_ncu.step``: the captured replay, or eager with ``--step-mode eager``), its do_bench median, and
``profile_step._kernel_table`` of it with the kernel groups (names, launches, device time per step).

``--ops`` (eager steps only: a replay makes no aten calls) adds the torch (aten) ops that launched device kernels,
grouped by input shape, with their device time: the kernel table names torch's elementwise kernels only by
template, and this traces each to the code that makes it.

    python benchmarks/probe_kernel_table.py --systems g2x4096,water3000 --out DIR
    python benchmarks/probe_kernel_table.py --systems water3000 --step-mode eager --ops --out DIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_ncu import step, structures
from profile_step import _kernel_table


def op_table(run, limit: int = 40) -> str:
    """aten ops of ``run()`` with device time, grouped by name and input shapes, most device time first."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        run()
        torch.cuda.synchronize()
    rows = [
        e
        for e in prof.key_averages(group_by_input_shape=True)
        if e.key.startswith("aten::") and e.self_device_time_total > 0
    ]
    rows.sort(key=lambda e: -e.self_device_time_total)
    lines = ["| aten op | input shapes | calls | self device µs |", "|---|---|---:|---:|"]
    lines += [f"| {e.key} | {e.input_shapes} | {e.count} | {e.self_device_time_total:.1f} |" for e in rows[:limit]]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--systems", default="g2x4096")
    p.add_argument("--step-mode", default="cudagraph", choices=("cudagraph", "eager"))
    p.add_argument("--ops", action="store_true", help="add the aten ops of the step (needs --step-mode eager)")
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--precisions", default="fp32", help="comma-separated engine precisions (fp32, tf32, bf16, ...)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--name", default="probe_kernel_table")
    args = p.parse_args(argv)
    if args.ops and args.step_mode != "eager":
        p.error("--ops needs --step-mode eager (a captured replay makes no aten calls)")
    if not torch.cuda.is_available():
        print("probe_kernel_table.py needs a CUDA device")
        return 0
    import triton

    dev = torch.device("cuda")
    report = [f"{torch.cuda.get_device_name(dev)} torch {torch.__version__} triton {triton.__version__}"]
    for name in args.systems.split(","):
        atoms, model = structures(name, args.hidden, args.layers)
        model = model.to(dev)
        for precision in args.precisions.split(","):
            run = step(name, atoms, model, dev, args.step_mode, precision)
            run()
            ms = triton.testing.do_bench(run, warmup=50, rep=300, return_mode="median")
            width = model.config.hidden if args.hidden is None else args.hidden
            head = f"{name}, hidden {width}, {precision}, {args.step_mode}"
            report.append(f"\n===== {head}: {ms:.3f} ms (do_bench median)")
            report.append(_kernel_table(run, groups=True))
            if args.ops:
                report += ["", f"--- aten ops of the {name} step", "", op_table(run)]
            del run
            torch.cuda.empty_cache()
    text = "\n".join(report)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
