"""A fine-tuning round's frames on their way to training: ``label --as-given`` keeps each structure's loss weight
(``config_weight``), and ``scripts/split_round.py`` splits a labelled round by trajectory (the held-out hot frames of
``scripts/finetune_weights_ab.sh``)."""

import ase.io
import numpy as np
import pytest
from ase.calculators.emt import EMT
from distill_helpers import emt_seeds

from mlff_distiller.distill import SamplingConfig, label, read_frames


def test_split_round_keeps_trajectories_whole(tmp_path):
    """scripts/split_round.py: a round labelled as given is split by the harvest's trajectory (``info["replica"]``),
    every labelled frame lands on exactly one side with its own geometry and labels, a frame the teacher dropped does
    not shift the others' trajectories, and each frame's task names its trajectory."""
    import subprocess
    import sys
    from pathlib import Path

    picked = []
    for k, seed in enumerate([*emt_seeds(), *emt_seeds()]):
        atoms = seed.copy()
        atoms.positions += 0.01 * k
        atoms.info["replica"] = k // 2
        picked.append(atoms)
    squeezed = picked[1]
    squeezed.positions[1] = squeezed.positions[0] + [0.3, 0.0, 0.0]  # dropped by the teacher's sanity check
    ase.io.write(tmp_path / "picked.extxyz", picked)
    config = SamplingConfig(label_seeds=True, md_steps=0, rattle_per_seed=0)
    label(picked, "emt", tmp_path / "round", config, progress=False)
    script = Path(__file__).resolve().parents[2] / "scripts" / "split_round.py"
    out = [tmp_path / "train.extxyz", tmp_path / "test.extxyz"]
    args = [tmp_path / "round", tmp_path / "picked.extxyz", *out, "--test-fraction", "0.34"]
    subprocess.run([sys.executable, script, *map(str, args)], check=True, capture_output=True)
    train, test = (ase.io.read(p, index=":") for p in out)
    assert len(train) + len(test) == len(picked) - 1 and train and test
    sides = [{f.info["task"] for f in part} for part in (train, test)]
    assert not sides[0] & sides[1]
    for frame in [*train, *test]:
        k = next(i for i, a in enumerate(picked) if len(a) == len(frame) and np.allclose(a.positions, frame.positions))
        assert frame.info["task"] == f"replica{picked[k].info['replica']}"
        ref = picked[k].copy()
        ref.calc = EMT()
        assert frame.get_potential_energy() == pytest.approx(ref.get_potential_energy(), abs=1e-8)


def test_label_as_given_keeps_each_structures_config_weight(tmp_path):
    """A structure's ``info["config_weight"]`` survives ``label --as-given`` (database, extxyz, and the training
    dataset's weights); structures without one get none (weight 1.0); frames sampled around a weighted seed (MD,
    rattles) do not inherit it; a bad weight is refused before any frame is labelled; a resume with another weight
    is refused as another run."""
    from mlff_distiller.distill.dataset import FrameDataset

    seeds = emt_seeds()
    seeds[0].info["config_weight"] = 0.2
    seeds[2].info["config_weight"] = 3
    config = SamplingConfig(label_seeds=True, md_steps=0, rattle_per_seed=0)
    label(seeds, "emt", tmp_path / "given", config, progress=False)
    frames = read_frames(tmp_path / "given")
    assert [f.info.get("config_weight") for f in frames] == [0.2, None, 3.0]
    xyz = ase.io.read(tmp_path / "given" / "frames.extxyz", index=":")
    assert [f.info.get("config_weight") for f in xyz] == [0.2, None, 3.0]
    weights = FrameDataset(frames, cutoff=4.0).weight
    assert weights.tolist() == pytest.approx([0.2, 1.0, 3.0])

    with_md = SamplingConfig(label_seeds=True, md_steps=8, sample_every=4, temperatures=[300.0], rattle_per_seed=1)
    label(seeds[:1], "emt", tmp_path / "md", with_md, progress=False)
    kinds = {(f.info["kind"], f.info.get("config_weight")) for f in read_frames(tmp_path / "md")}
    assert kinds == {("given", 0.2), ("md", None), ("rattle", None)}

    bad = [s.copy() for s in seeds]
    bad[1].info["config_weight"] = -1.0
    with pytest.raises(ValueError, match="seed 1: config_weight"):
        label(bad, "emt", tmp_path / "bad", config, progress=False)
    assert not (tmp_path / "bad" / "frames.extxyz").exists()
    seeds[0].info["config_weight"] = 0.5
    with pytest.raises(ValueError, match="different"):
        label(seeds, "emt", tmp_path / "given", config, progress=False)
