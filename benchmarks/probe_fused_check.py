"""The fused sender + edge backward (``sender_edge_fused``, stop 56) against the two kernels on the GPU: the forces
of bench_large's water boxes through the step alone (``probe_ncu.step``: eager, or the captured replay), with the
switch on and off in one process; max |ΔF| and max |F|, per system and step mode.

    python benchmarks/probe_fused_check.py --systems water192,water3000,water24000 --out DIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import write_lines
from probe_ncu import mp, step, structures


def forces(out) -> torch.Tensor:
    """The step's position gradient (eager: a tuple from autograd.grad; captured: the engine's output buffer)."""
    t = out[0] if isinstance(out, tuple | list) else out
    return t.detach().double().clone()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--systems", default="water192,water3000,water24000")
    p.add_argument("--modes", default="eager,cudagraph")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_fused_check.py needs CUDA")
        return 0
    dev = torch.device("cuda")
    lines = [
        "# probe_fused_check.py: forces with the fused sender + edge backward against the two kernels",
        "",
        f"{torch.cuda.get_device_name(dev)} · torch {torch.__version__}",
        "",
        "| system | step | max abs ΔF (eV/Å) | max abs F | finite |",
        "|---|---|---:|---:|---|",
    ]
    for name in args.systems.split(","):
        atoms, model = structures(name)
        model = model.to(dev)
        for mode in args.modes.split(","):
            got = {}
            for fused in (False, True):
                with mp._configured(sender_edge_fused=fused, fused_min_edges=0):
                    run = step(name, atoms, model, dev, mode)
                    run()
                    got[fused] = forces(run())
                del run
                torch.cuda.empty_cache()
            d = (got[True] - got[False]).abs().max().item()
            finite = bool(torch.isfinite(got[True]).all())
            lines.append(f"| {name} | {mode} | {d:.2e} | {got[False].abs().max().item():.3f} | {finite} |")
            print(lines[-1], flush=True)
    write_lines(lines, args.out, "probe_fused_check")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
