"""The torch (aten) ops of one eager energy + forces step that launch device kernels, with their input shapes (GPU).

The captured step's kernel table (probe_kernel_table.py) names the torch elementwise kernels only by template; this
lists the aten calls behind them, grouped by input shape, with their device time, so that each can be traced to the
code that makes it.

    python benchmarks/probe_torch_ops.py --systems water3000 --out DIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_ncu import step, structures


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
        if e.key.startswith("aten::") and e.device_time_total > 0
    ]
    rows.sort(key=lambda e: -e.self_device_time_total)
    lines = ["| aten op | input shapes | calls | self device µs |", "|---|---|---:|---:|"]
    for e in rows[:limit]:
        if e.self_device_time_total <= 0:
            continue
        lines.append(f"| {e.key} | {e.input_shapes} | {e.count} | {e.self_device_time_total:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--systems", default="water3000")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--name", default="probe_torch_ops")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_torch_ops.py needs a CUDA device")
        return 0
    import triton

    dev = torch.device("cuda")
    report = [f"{torch.cuda.get_device_name(dev)} torch {torch.__version__} triton {triton.__version__}"]
    for name in args.systems.split(","):
        atoms, model = structures(name, None, None)
        run = step(name, atoms, model.to(dev), dev, "eager")
        report += ["", f"## {name}, eager step", "", op_table(run)]
        del run
        torch.cuda.empty_cache()
    text = "\n".join(report)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
