"""The kernels of one energy + forces step, for any of probe_ncu.py's systems (GPU only).

For each system (``water<N>``, ``g2x<N>``, ``benzene``) and the student of ``--hidden`` / ``--layers``: the step
alone (``probe_ncu.step``: the captured replay, or eager with ``--step-mode eager``), its do_bench median, and
``profile_step._kernel_table`` of it with the kernel groups (names, launches, device time per step).

    python benchmarks/probe_kernel_table.py --systems g2x4096,water3000 --out DIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from probe_ncu import step, structures
from profile_step import _kernel_table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--systems", default="g2x4096")
    p.add_argument("--step-mode", default="cudagraph", choices=("cudagraph", "eager"))
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--name", default="probe_kernel_table")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_kernel_table.py needs a CUDA device")
        return 0
    import triton

    dev = torch.device("cuda")
    report = [f"{torch.cuda.get_device_name(dev)} torch {torch.__version__} triton {triton.__version__}"]
    for name in args.systems.split(","):
        atoms, model = structures(name, args.hidden, args.layers)
        run = step(name, atoms, model.to(dev), dev, args.step_mode)
        run()
        ms = triton.testing.do_bench(run, warmup=50, rep=300, return_mode="median")
        width = model.config.hidden if args.hidden is None else args.hidden
        report.append(f"\n===== {name}, hidden {width}, {args.step_mode}: {ms:.3f} ms (do_bench median)")
        report.append(_kernel_table(run, groups=True))
        del run
        torch.cuda.empty_cache()
    text = "\n".join(report)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
