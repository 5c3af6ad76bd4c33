"""Probe (GPU): what is allocated at the peak of one large energy + forces call, and where it was allocated.

Issue 7's largest-box row (``bench_large.py``: ``ForceEngine`` eager, our cell list, energy + forces) peaked at
42 GB for 1,000,002 water atoms at stop 20 and at 56.9 GB at stop 46, ~1.05 kB per edge; the 24,000-atom box
(1.31M edges) at 1.45 GB, ~1.1 kB per edge. This probe says which allocations make that peak: it records the
CUDA caching allocator's history (``torch.cuda.memory._record_memory_history``) over one warm
``engine.compute(batch, forces=True)`` on a device-resident water box (as the largest-box row calls it), replays
the trace (``alloc`` adds a block, ``free_completed`` removes it) to find the moment of the peak, and lists the
blocks live then, grouped by the innermost frame in this package's code (``src/mlff_distiller`` or
``kernels/``), in bytes per edge and per atom.

    python benchmarks/probe_memory_peak.py --atoms 24000,100008 --out DIR [--name probe_memory_peak]

Without CUDA it prints one line and returns. ``peak_of_trace`` (the replay) is tested on the CPU.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

OUR_CODE = ("mlff_distiller", "/kernels/")
SKIP_CODE = ("probe_memory_peak",)


def site_of(frames: list[dict]) -> str:
    """The innermost frame of this package's code among ``frames`` (innermost first, as the allocator's history
    records them): ``file:line function``, file relative to the package; ``"(outside our code)"`` when none."""
    for fr in frames:
        name = fr.get("filename", "")
        if any(s in name for s in OUR_CODE) and not any(s in name for s in SKIP_CODE):
            short = name
            for marker in ("/src/mlff_distiller/", "/mlff_distiller/", "/kernels/"):
                if marker in name:
                    short = name.split(marker, 1)[1]
                    short = ("kernels/" if marker == "/kernels/" else "") + short
                    break
            return f"{short}:{fr.get('line')} {fr.get('name')}"
    return "(outside our code)"


def peak_of_trace(events: list[dict]) -> tuple[int, list[dict]]:
    """Replay one device's allocator trace (``snapshot["device_traces"][d]``): ``(peak bytes, blocks live at the
    first moment the peak was reached)``, counted from the start of the trace (blocks allocated before the
    recording started are not seen). ``alloc`` adds a block; ``free_completed`` removes it (``free_requested``
    only when a trace has no ``free_completed`` at all: the block stays allocated until the former)."""
    release = "free_completed" if any(e.get("action") == "free_completed" for e in events) else "free_requested"
    live: dict[int, dict] = {}
    total = peak = 0
    at_peak: list[dict] = []
    for ev in events:
        action = ev.get("action")
        if action == "alloc":
            live[ev["addr"]] = ev
            total += ev["size"]
            if total > peak:
                peak = total
                at_peak = list(live.values())
        elif action == release and ev["addr"] in live:
            total -= live.pop(ev["addr"])["size"]
    return peak, at_peak


def by_site(blocks: list[dict]) -> list[tuple[str, int, int, str]]:
    """``(site, bytes, count, largest shape hint)`` per allocation site, largest first."""
    acc: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    for b in blocks:
        a = acc[site_of(b.get("frames", []))]
        a[0] += b["size"]
        a[1] += 1
        a[2] = max(a[2], b["size"])
    return sorted(((s, v[0], v[1], v[2]) for s, v in acc.items()), key=lambda t: -t[1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--atoms", default="24000", help="comma-separated water box sizes")
    p.add_argument("--out", default=None)
    p.add_argument("--name", default="probe_memory_peak")
    p.add_argument("--top", type=int, default=25)
    p.add_argument(
        "--variant",
        default="",
        help="one probe_ncu variant spec (e.g. update:recompute_uv_min_atoms=0) applied to every measurement",
    )
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_memory_peak: needs CUDA")
        return 0
    import warnings

    from bench_large import box
    from peers import make_student

    from mlff_distiller import AtomsBatch, ForceEngine
    from mlff_distiller.neighbors import neighbor_list

    dev = torch.device("cuda")
    model = make_student()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = ForceEngine(model, device=dev, mode="eager")
    lines = [f"# probe_memory_peak: {torch.cuda.get_device_name(dev)} · torch {torch.__version__}", ""]
    if args.variant:
        import contextlib

        from probe_ncu import variants

        ((label, ctx),) = variants(args.variant)
        lines += [f"Variant: `{label}`", ""]
        stack = contextlib.ExitStack()
        stack.enter_context(ctx())
    for n in [int(s) for s in args.atoms.split(",") if s]:
        atoms = box(n)
        batch = AtomsBatch.from_atoms(atoms, dtype=engine.dtype).to(dev)
        with torch.no_grad():
            nl = neighbor_list(batch.positions, batch.cell, batch.pbc, batch.batch, batch.ptr, 5.0, "auto")
        n_edges = nl.num_edges
        del nl
        engine.compute(batch, forces=True)  # cold: compiles
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
        out = engine.compute(batch, forces=True)
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        measured = torch.cuda.max_memory_allocated(dev) - base
        del out
        events = snap["device_traces"][dev.index or 0]
        peak, blocks = peak_of_trace(events)
        lines += [
            f"## {len(atoms):,} water atoms, {n_edges:,} edges (warm engine.compute, eager)",
            "",
            f"peak over the call (max_memory_allocated - before): {measured / 1e9:.3f} GB "
            f"({measured / n_edges:.0f} B/edge, {measured / len(atoms):.0f} B/atom); replayed trace: "
            f"{peak / 1e9:.3f} GB, {len(blocks)} blocks live; {len(events)} trace events",
            "",
            "| site (innermost frame in our code) | GB | B/edge | B/atom | blocks | largest MB |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for site, size, count, big in by_site(blocks)[: args.top]:
            lines.append(
                f"| `{site}` | {size / 1e9:.3f} | {size / n_edges:.1f} | {size / len(atoms):.0f} | {count} | "
                f"{big / 1e6:.1f} |"
            )
        lines.append("")
        # The outer frames of the largest blocks: which call made them.
        lines.append("Largest blocks at the peak, with their call chain in our code (innermost first):")
        lines.append("")
        for b in sorted(blocks, key=lambda b: -b["size"])[:12]:
            chain = [site_of([fr]) for fr in b.get("frames", [])]
            chain = [c for c in chain if c != "(outside our code)"][:5]
            lines.append(f"- {b['size'] / 1e6:.1f} MB ({b['size'] / n_edges:.1f} B/edge): " + " <- ".join(chain))
        lines.append("")
        del batch
        torch.cuda.empty_cache()
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"{args.name}.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
