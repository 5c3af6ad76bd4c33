"""How often a block of receivers shares its senders: the case for cluster-pair message passing (issue 7).

The large step is three quarters message passing, and those kernels gather the sender's feature rows once per
edge (5F floats per edge in the forward, 9F in the edge backward), at ~2.4 TB/s from L2. A kernel that took a
block of BA consecutive receivers (spatially sorted, as the engine orders large boxes) and walked the *distinct*
senders of the block would gather each sender row once per block, and compute the pairs as dense [BA x BS] tiles
with a mask (GROMACS's cluster pairs). This probe counts, with no GPU, for water boxes in the engine's spatial
order and its 5 Å list:

* ``edges/block``: the edges of a block of BA receivers (the gathers today);
* ``senders/block``: its distinct senders (the gathers of a block kernel);
* ``reuse``: their ratio, the factor by which the sender gathers would shrink;
* ``density``: edges / (BA x distinct senders), the useful fraction of the dense pair tiles (the rest is masked
  work on the tensor cores);
* the same for the senders grouped in tiles of BS (a pair tile is skipped when it holds no edge).

    python benchmarks/probe_sender_reuse.py --out benchmarks/results --name probe_sender_reuse_cpu
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import write_lines
from systems import water_box

from mlff_distiller import AtomsBatch
from mlff_distiller.neighbors import neighbor_list
from mlff_distiller.ordering import spatial_order

CUTOFF = 5.0


def block_stats(receivers: np.ndarray, senders: np.ndarray, n_atoms: int, ba: int, bs: int) -> dict:
    """Per block of ``ba`` receivers: edges, distinct senders, and the [ba x bs] pair tiles that hold an edge when
    the block's distinct senders are taken in index order, ``bs`` at a time."""
    block = receivers // ba
    n_blocks = -(-n_atoms // ba)
    edges = np.bincount(block, minlength=n_blocks)
    pairs = np.unique(block.astype(np.int64) * n_atoms + senders)  # distinct (block, sender), sorted
    pb = pairs // n_atoms
    distinct = np.bincount(pb, minlength=n_blocks)
    # Rank of each distinct sender within its block (its sender tile = rank // bs): every tile of a block holds an
    # edge, since the distinct senders are exactly the block's senders.
    tiles = -(-distinct // bs)
    return {
        "edges": edges.mean(),
        "senders": distinct.mean(),
        "reuse": edges.sum() / distinct.sum(),
        "density": edges.sum() / (ba * distinct.sum()),
        "tiles": tiles.mean(),
        "tile_density": edges.sum() / (ba * bs * tiles.sum()),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--name", default="probe_sender_reuse_cpu")
    p.add_argument("--sizes", type=int, nargs="+", default=[3000, 24000])
    p.add_argument("--blocks", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    p.add_argument("--sender-tile", type=int, default=16)
    args = p.parse_args(argv)
    lines = [
        "# probe_sender_reuse.py: distinct senders per block of receivers (water, spatial order, 5 Å)",
        "",
        f"torch {torch.__version__}, CPU. Sender tiles of {args.sender_tile}. Edges are the full list within the "
        "cutoff (both directions).",
        "",
        "| atoms | order | BA | edges/block | senders/block | reuse | density | sender tiles/block | tile density |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in args.sizes:
        batch = AtomsBatch.from_atoms(water_box(n, seed=0), dtype=torch.float64)
        for order in ("spatial", "as built"):
            if order == "spatial":
                perm = spatial_order(batch.positions, batch.batch, 1, CUTOFF / 2)
                pos = batch.positions[perm]
            else:
                pos = batch.positions
            nl = neighbor_list(pos, batch.cell, batch.pbc, batch.batch, batch.ptr, CUTOFF)
            i, j = (t.numpy() for t in nl.edge_index)
            for ba in args.blocks:
                st = block_stats(i, j, len(pos), ba, args.sender_tile)
                lines.append(
                    f"| {len(pos)} | {order} | {ba} | {st['edges']:.0f} | {st['senders']:.0f} | {st['reuse']:.2f} "
                    f"| {st['density']:.3f} | {st['tiles']:.1f} | {st['tile_density']:.3f} |"
                )
    write_lines(lines, args.out, args.name)


if __name__ == "__main__":
    main()
