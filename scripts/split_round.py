"""Split a labelled fine-tuning round (``mlff-distill label --as-given`` of a harvest's frames) by trajectory into a
training half and a held-out half of hot frames: frames of one trajectory (the harvest's ``info["replica"]``) stay
on one side, so the held-out frames are not near-copies of trained ones.

    python scripts/split_round.py ROUND_DIR PICKED.extxyz TRAIN.extxyz TEST.extxyz [--test-fraction 0.5] [--seed 0]

ROUND_DIR: the label output of ``--seeds PICKED.extxyz --as-given`` (its tasks ``given/sNNNN`` name the frame of
PICKED that each labelled frame came from). Both outputs are extxyz with the teacher's energy and forces; each
frame's ``info["task"]`` becomes ``replica<R>``, so that training's own validation split also keeps trajectories
whole.
"""

from __future__ import annotations

import argparse

import ase.io
import numpy as np

from mlff_distiller.distill.labelling import read_frames


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("round")
    p.add_argument("picked")
    p.add_argument("train")
    p.add_argument("test")
    p.add_argument("--test-fraction", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    picked = ase.io.read(args.picked, index=":")
    frames = read_frames(args.round)
    replica = []
    for atoms in frames:
        task = str(atoms.info.get("task", ""))
        if not task.startswith("given/s"):
            raise ValueError(f"{args.round}: task {task!r} is not a given/sNNNN task of an --as-given run")
        replica.append(int(picked[int(task.split("/s")[1])].info.get("replica", 0)))
    keys = sorted(set(replica))
    rng = np.random.default_rng(args.seed)
    rng.shuffle(keys)
    test_keys = set(keys[: round(args.test_fraction * len(keys))])
    train, test = [], []
    for atoms, r in zip(frames, replica, strict=True):
        atoms.info["task"] = f"replica{r}"
        (test if r in test_keys else train).append(atoms)
    ase.io.write(args.train, train, format="extxyz")
    ase.io.write(args.test, test, format="extxyz")
    print(f"{len(frames)} frames of {len(keys)} trajectories: {len(train)} to {args.train}, {len(test)} to {args.test}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
