"""Probe (GPU): an MD step's two transfers as zero-copy accesses of page-locked host memory inside the captured graph.

Stop 66's ``probe_md_step`` (results/stop66_gpu/a/) put the benzene MD step's device path at 166.5 µs against a
149.1 µs replay + sync: the positions' H2D copy and the packed output's blocking D2H copy cost ~17 µs, and as two
memcpy nodes captured in the graph still ~14 µs (each a DMA of a few hundred bytes). With unified addressing, a
page-locked host buffer is addressable from a kernel, so a CUDA tensor view of it (``__cuda_array_interface__``)
lets a copy *kernel* read the positions over the bus, and lets the step's output be written straight into host
memory: no DMA engine on the step's path. Rows (wall clock of one step as the MD path runs it, median of
``--steps``; the variants alternate within each round; each checked against the engine path's forces):

* ``engine``: the shipped path (page-locked staging, H2D copy, replay, blocking D2H copy into a page-locked buffer);
* ``memcpy nodes``: both copies captured in the graph as memcpy nodes (host write, launch, stream sync, read);
* ``zero-copy in + out``: an elementwise kernel reads the positions from the host view, and one writes the packed
  output into a host view (host write, launch, stream sync, read);
* ``zero-copy out``: the positions' H2D copy as now, the output written into the host view by a kernel.

    python benchmarks/probe_zero_copy.py --out DIR [--name probe_zero_copy_h200] [--steps 2000]
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import wall_us, write_lines

from mlff_distiller import StudentCalculator, load_model
from mlff_distiller.cudagraph import GraphRunner, HostBuffer, copy_bits
from mlff_distiller.engine_padded import unpack


def _system(name: str):
    from ase.build import molecule

    from mlff_distiller.ase_compat import maxwell_boltzmann

    if name == "benzene":
        atoms = molecule("C6H6")
    else:
        from systems import water_box

        atoms = water_box(int(name.removeprefix("water")), seed=0)
    maxwell_boltzmann(atoms, 300, rng=np.random.default_rng(0))
    return atoms


def _variants(model, atoms, steps: int) -> tuple[dict, dict]:
    from ase import units
    from ase.md.verlet import VelocityVerlet

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        calc = StudentCalculator(model, device="cuda")
    calc.engine.zero_copy = False  # the copies, as the engine ran before stop 66: its bucket's plain graph is captured
    calc.launch_ahead = False
    atoms.calc = calc
    VelocityVerlet(atoms, timestep=0.5 * units.fs).run(30)  # the bucket captured, the Verlet fill made
    eng = calc.engine
    fill = eng._verlet_fill
    bucket, graph, static_pos, staging = fill.bucket, fill.graph, fill.positions, fill.staging
    runner = eng._runners[bucket]
    n = len(atoms)
    pos = calc._last_batch.positions.numpy().copy()  # the step's own float32 positions (origin-shifted)
    host_out = eng._host_out[(bucket, False)]

    def engine():
        staging.copy_(torch.from_numpy(pos))
        static_pos.copy_(staging, non_blocking=True)
        packed = runner.replay()
        host_out.copy_(packed)
        return unpack(host_out.numpy(), bucket.atoms, n, 1)["forces"].copy()

    buf_in = HostBuffer((n, 3), torch.float32, torch.device("cuda"))  # the engine's zero-copy buffers (stop 66)
    buf_out = HostBuffer(tuple(host_out.shape), host_out.dtype, torch.device("cuda"))
    pin_in, pin_out, view_in, view_out = buf_in.host, buf_out.host, buf_in.view, buf_out.view
    in_np, out_np = buf_in.array, buf_out.array
    stream = torch.cuda.current_stream()

    def memcpy_step(*inputs):
        inputs[1][:n].copy_(pin_in, non_blocking=True)
        out = eng._step(*inputs)
        pin_out.copy_(out, non_blocking=True)
        return out

    def zero_step(*inputs):
        copy_bits(view_in, inputs[1][:n])
        out = eng._step(*inputs)
        copy_bits(out, view_out)
        return out

    def zero_out_step(*inputs):
        out = eng._step(*inputs)
        copy_bits(out, view_out)
        return out

    pin_in.copy_(torch.from_numpy(pos))

    with torch.no_grad():
        g_memcpy = GraphRunner(memcpy_step, graph)
        g_zero = GraphRunner(zero_step, graph)
        g_zero_out = GraphRunner(zero_out_step, graph)

    def via(g, write_in: bool):
        def run():
            if write_in:
                np.copyto(in_np, pos)
            else:
                staging.copy_(torch.from_numpy(pos))
                static_pos.copy_(staging, non_blocking=True)
            g.replay()
            stream.synchronize()
            return unpack(out_np, bucket.atoms, n, 1)["forces"].copy()

        return run

    fns = {
        "engine": engine,
        "memcpy nodes": via(g_memcpy, True),
        "zero-copy in + out": via(g_zero, True),
        "zero-copy out": via(g_zero_out, False),
    }
    want = engine()
    diffs = {}
    for name, fn in fns.items():
        out_np[:] = np.nan
        diffs[name] = float(np.abs(fn() - want).max())
    return fns, diffs


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--name", default="probe_zero_copy_h200")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--systems", default="benzene,water192")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_zero_copy: needs CUDA")
        return
    import triton

    model = load_model("builtin:chno-gfn2")
    lines = [
        "# probe_zero_copy.py: an MD step's transfers as zero-copy accesses inside the graph",
        "",
        f"{torch.cuda.get_device_name()} · torch {torch.__version__} · triton {triton.__version__} · "
        f"{args.steps} steps a row; builtin:chno-gfn2 (water: its C/H/N/O species)",
        "",
        "| system | variant | round | median µs | p20 µs | max abs ΔF vs engine (eV/Å) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name in args.systems.split(","):
        fns, diffs = _variants(model, _system(name), args.steps)
        for rnd in range(1, args.rounds + 1):
            for label, fn in fns.items():
                med, p20 = wall_us(fn, args.steps)
                lines.append(f"| {name} | {label} | {rnd} | {med:.1f} | {p20:.1f} | {diffs[label]:.2e} |")
                print(lines[-1], flush=True)
    write_lines(lines, args.out, args.name)


if __name__ == "__main__":
    main()
