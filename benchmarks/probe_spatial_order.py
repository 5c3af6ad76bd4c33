"""Probe (GPU): what ``ordering.spatial_order`` costs a call, shipped against its form before stop 64.

Until stop 64 the Morton sort found each structure's lowest corner by a ``scatter_reduce(..., "amin")`` of every
atom's float64 coordinates (one large box: all atoms on the same three addresses) and spread each axis's bits in
13 elementwise ops, ~55 launches a call, each a launch of host time. Now one structure's corner is a reduction and
the spread bits come from a table (one gather). This times both on water boxes (one structure) and on batches of
small boxes, and checks that they give the same permutation.

    python benchmarks/probe_spatial_order.py --out DIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import write_lines


def scatter_low_order(positions, batch, num_structures, bin_size):
    """``spatial_order`` as it was before stop 64 (the scatter's corner, the spread bits as elementwise ops)."""
    from mlff_distiller.ordering import _BITS, _spread_bits

    pos = positions.detach().to(torch.float64)
    low = torch.full((num_structures, 3), float("inf"), dtype=pos.dtype, device=pos.device)
    low = low.scatter_reduce(0, batch[:, None].expand(-1, 3), pos, reduce="amin", include_self=True)
    q = torch.floor((pos - low[batch]) / bin_size).to(torch.int64).clamp_(0, (1 << _BITS) - 1)
    code = _spread_bits(q[:, 0]) | (_spread_bits(q[:, 1]) << 1) | (_spread_bits(q[:, 2]) << 2)
    key = (batch.to(torch.int64) << (3 * _BITS)) | code
    return torch.argsort(key, stable=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--name", default="probe_spatial_order")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_spatial_order: needs a CUDA device")
        return 0
    import triton.testing
    from systems import water_box

    from mlff_distiller import AtomsBatch
    from mlff_distiller.ordering import spatial_order

    dev = torch.device("cuda")
    cases = [(f"water {n:,}", [water_box(n, seed=0)]) for n in (12000, 24000, 100000)]
    cases.append(("1,024 water boxes of 24 atoms", [water_box(24, seed=i) for i in range(1024)]))
    lines = [
        "# probe_spatial_order: one Morton sort per call, before stop 64 and shipped",
        "",
        f"{torch.cuda.get_device_name()} · torch {torch.__version__}; do_bench medians (ms), float32 positions",
        "",
        "| batch | atoms | before ms | shipped ms | before / shipped | same permutation |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for label, structures in cases:
        b = AtomsBatch.from_atoms(structures, dtype=torch.float32).to(dev)
        args_ = (b.positions, b.batch, b.num_structures, 2.5)
        same = torch.equal(spatial_order(*args_), scatter_low_order(*args_))
        t_old = triton.testing.do_bench(lambda a=args_: scatter_low_order(*a), warmup=25, rep=200, return_mode="median")
        t_new = triton.testing.do_bench(lambda a=args_: spatial_order(*a), warmup=25, rep=200, return_mode="median")
        lines.append(f"| {label} | {b.num_atoms:,} | {t_old:.3f} | {t_new:.3f} | {t_old / t_new:.2f} | {same} |")
        print(lines[-1], flush=True)
    write_lines(lines, args.out, args.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
