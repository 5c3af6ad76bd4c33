"""``mlff-distill`` smoke tests: every subcommand, --help, configs and bad input."""

import json
import os
from pathlib import Path

import ase.io
import numpy as np
import pytest
import torch
import yaml
from ase.build import molecule

from mlff_distiller.cli import TrainJob, main
from mlff_distiller.distill import read_frames
from mlff_distiller.distill.config import from_dict


@pytest.mark.parametrize(
    "command", ["label", "train", "evaluate", "predict", "md", "relax", "check", "harvest", "models"]
)
def test_help(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    assert f"mlff-distill {command}" in capsys.readouterr().out


def test_all_subcommands(tmp_path, capsys):
    lab = tmp_path / "lab"
    cfg = tmp_path / "label.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "teacher": "emt",
                "seeds": "molecule:H2O,CH4",
                "out": str(lab),
                "progress": False,
                "sampling": {"temperatures": [300], "md_steps": 40, "sample_every": 4, "rattle_per_seed": 2},
            }
        )
    )
    assert main(["label", "--config", str(cfg)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["total"] == len(read_frames(lab)) == 2 * 10 + 4

    run = tmp_path / "run"
    args = ["train", "--data", str(lab), "--out", str(run), "--export", str(tmp_path / "student.pt")]
    for s in ("train.max_steps=4", "train.model.hidden=8", "train.model.layers=1", "train.device=cpu"):
        args += ["--set", s]
    assert main([*args, "--set", "train.eval_every=2", "--set", "val_fraction=0.3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["steps"] == 4 and (tmp_path / "student.pt").exists()

    ev = tmp_path / "ev"
    args = ["evaluate", "--model", str(run / "best.pt"), "--data", str(lab), "--out", str(ev), "--device", "cpu"]
    assert (
        main([*args, "--history", str(run / "history.json"), "--nve-steps", "5", "--by", "kind", "--by", "formula"])
        == 0
    )
    metrics = json.loads((ev / "metrics.json").read_text())
    assert metrics["frames"] == report["total"] and "nve" in metrics
    # --by: per group of frames (2 molecules x (10 MD frames + 2 rattles))
    assert {k: v["frames"] for k, v in metrics["by"]["kind"].items()} == {"md": 20, "rattle": 4}
    assert {k: v["frames"] for k, v in metrics["by"]["formula"].items()} == {"H2O": 12, "CH4": 12}
    assert (ev / "parity.png").exists() and (ev / "learning_curve.png").exists()
    capsys.readouterr()

    structures = tmp_path / "in.xyz"
    ase.io.write(structures, [molecule("H2O"), molecule("CH4")])
    pred = tmp_path / "pred.extxyz"
    assert main(["predict", "--model", str(run / "best.pt"), "--input", str(structures), "--output", str(pred)]) == 0
    got = ase.io.read(pred, index=":")
    assert len(got) == 2 and got[1].get_forces().shape == (5, 3) and np.isfinite(got[1].get_forces()).all()

    traj = tmp_path / "md.extxyz"
    args = ["md", "--model", str(run / "best.pt"), "--input", str(structures), "--output", str(traj)]
    assert main([*args, "--steps", "10", "--interval", "5", "--device", "cpu"]) == 0
    assert len(ase.io.read(traj, index=":")) == 3  # steps 0, 5 and 10


def test_train_without_validation_frames_says_why(tmp_path, capsys):
    lab = tmp_path / "lab"
    args = ["label", "--teacher", "emt", "--seeds", "molecule:H2O", "--out", str(lab), "--no-progress"]
    for s in ("sampling.md_steps=20", "sampling.sample_every=5", "sampling.temperatures=[300]"):
        args += ["--set", s]
    assert main(args) == 0
    capsys.readouterr()
    assert main(["train", "--data", str(lab), "--out", str(tmp_path / "run"), "--set", "train.device=cpu"]) == 2
    err = capsys.readouterr().err
    assert "no validation frames" in err and "holds 1 trajectory" in err and "--val-data" in err


def test_label_committee_needs_an_on_policy_round(tmp_path, capsys):
    base = ["label", "--teacher", "emt", "--seeds", "molecule:H2O", "--out", str(tmp_path / "x"), "--no-progress"]
    assert main([*base, "--committee", "builtin:chno-gfn2"]) == 2
    assert "--committee selects the frames of an on-policy round" in capsys.readouterr().err
    args = [*base, "--student", "builtin:chno-gfn2-small", "--on-policy-round", "1"]
    assert main([*args, "--set", "sampling.select_disagreement=50"]) == 2
    assert "needs --committee" in capsys.readouterr().err


def test_bad_input_is_a_clear_error(tmp_path, capsys):
    assert main(["predict", "--model", "x.pt", "--input", str(tmp_path / "nope.xyz")]) == 2
    assert "input file not found" in capsys.readouterr().err
    assert main(["train", "--set", "train.bogus=1"]) == 2
    assert "unknown key(s) ['bogus']" in capsys.readouterr().err
    assert main(["train", "--set", "train.lr=-1"]) == 2
    assert "lr must be > 0" in capsys.readouterr().err
    assert main(["train", "--set", "train.lr=fast"]) == 2
    assert "train config.train.lr: expected a number, got 'fast'" in capsys.readouterr().err
    assert main(["label", "--teacher", "emt", "--seeds", "molecule:NotAMolecule", "--out", str(tmp_path)]) == 2
    assert "unknown molecule" in capsys.readouterr().err
    assert main(["train", "--data", str(tmp_path / "missing")]) == 2
    assert "no labelled data" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("[1, 2]")
    assert main(["label", "--config", str(bad)]) == 2
    assert "mapping" in capsys.readouterr().err
    assert main(["md", "--model", "x", "--input", str(bad), "--set", "ensemble=nvt"]) == 2
    assert "ensemble" in capsys.readouterr().err
    # files ASE cannot read: an error naming the cause, not ASE's traceback
    garbage, empty = tmp_path / "garbage.xyz", tmp_path / "empty.xyz"
    garbage.write_text("hello\nworld\n")
    empty.write_text("")
    out = ["--output", str(tmp_path / "o.extxyz"), "--device", "cpu"]
    for args, says in (
        (["md", "--model", "builtin:chno-gfn2", "--input", str(garbage), *out], f"cannot read {garbage}"),
        (["check", "--input", str(garbage)], f"cannot read {garbage}"),
        (["predict", "--model", "builtin:chno-gfn2", "--input", str(garbage), *out], "Expected xyz header"),
        (["predict", "--model", "builtin:chno-gfn2", "--input", str(empty), *out], "Empty file"),
        (["evaluate", "--model", "builtin:chno-gfn2", "--data", str(garbage), "--device", "cpu"], "cannot read"),
    ):
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert f"mlff-distill {args[0]}: error:" in err and says in err, (args, err)


def test_numbers_yaml_reads_as_text_are_numbers_where_a_number_is_wanted():
    """YAML 1.1 (PyYAML) reads ``1e-4`` and ``1E4`` as strings (no dot); a float setting takes them as numbers, in
    a config file and in ``--set``, and refuses other text by name."""
    from mlff_distiller.cli_jobs import LabelJob, TrainJob

    job = from_dict(TrainJob, {"train": yaml.safe_load("lr: 1e-4\nweight_decay: 5E-6\nenergy_weight: 16")})
    assert (job.train.lr, job.train.weight_decay, job.train.energy_weight) == (1e-4, 5e-6, 16)
    job = from_dict(LabelJob, {"sampling": {"max_force": "1e4", "rattle_std": ".05"}})
    assert (job.sampling.max_force, job.sampling.rattle_std) == (1e4, 0.05)
    with pytest.raises(ValueError, match=r"LabelJob.sampling.max_force: expected a number, got '1e4x'"):
        from_dict(LabelJob, {"sampling": {"max_force": "1e4x"}})
    assert from_dict(LabelJob, {"seeds": "1e4"}).seeds == "1e4"  # text where text is wanted stays text


def test_yaml_configs_in_repo_are_valid():
    from pathlib import Path

    from mlff_distiller.cli import LabelJob
    from mlff_distiller.distill.config import load_yaml

    root = Path(__file__).resolve().parents[2] / "configs"
    assert from_dict(TrainJob, load_yaml(root / "chno_gfn2_train.yaml")).train.model.hidden == 128
    for name in ("chno_gfn2_label.yaml", "chno_gfn2_test.yaml"):
        assert from_dict(LabelJob, load_yaml(root / name)).teacher == "gfn2-xtb"


def test_models_lists_the_builtin_students(capsys, monkeypatch):
    """Also: the command sets the CUDA allocator's expandable segments where the user set no allocator setting
    (and keeps the user's own)."""
    from mlff_distiller.cli import ALLOCATOR_DEFAULT

    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.setenv(name, "x")  # (recorded, so that the test's end restores what was there before)
        monkeypatch.delenv(name)
    assert main(["models"]) == 0
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == ALLOCATOR_DEFAULT
    rows = {r["model"]: r for r in json.loads(capsys.readouterr().out)}
    assert {"builtin:chno-gfn2", "builtin:chno-gfn2-small"} <= set(rows)
    small, default = rows["builtin:chno-gfn2-small"], rows["builtin:chno-gfn2"]
    assert (small["hidden"], small["layers"], default["hidden"], default["layers"]) == (64, 3, 128, 3)
    assert small["parameters"] < default["parameters"] / 3
    assert small["elements"] == [1, 6, 7, 8] and small["teacher"] == "gfn2-xtb"
    assert 0 < small["test_force_mae_mev_a"] < 40 and 0 < default["test_force_mae_mev_a"] < 40
    assert small["tf32_grid"] is True and default["tf32_grid"] is True
    # Since stop 85 the 64 x 3 student is the one the commands use when none is named.
    assert small["default"] is True and default["default"] is False
    assert sum(r["default"] for r in rows.values()) == 1
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.8")
    assert main(["models"]) == 0
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "garbage_collection_threshold:0.8"
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")
    assert main(["models"]) == 0
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ


def test_md_npt_changes_the_volume_and_refuses_molecules(tmp_path, capsys):
    """``md --ensemble npt``: Berendsen NPT on a periodic box with the student's stress; a molecule is refused."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from systems import water_box

    from mlff_distiller import StudentModel

    torch.manual_seed(0)
    model = tmp_path / "m.pt"
    StudentModel(species=[1, 8], hidden=16, layers=1).save(model)
    box = water_box(24, seed=3)
    start = tmp_path / "box.extxyz"
    ase.io.write(start, box)
    traj = tmp_path / "npt.extxyz"
    args = ["md", "--model", str(model), "--input", str(start), "--output", str(traj), "--device", "cpu"]
    args += ["--ensemble", "npt", "--steps", "20", "--interval", "10", "--pressure-bar", "5000"]
    assert main(args) == 0
    frames = ase.io.read(traj, index=":")
    volumes = [f.info["volume"] for f in frames]
    assert len(frames) == 3 and volumes[0] == pytest.approx(box.get_volume())
    assert volumes[-1] != pytest.approx(volumes[0], rel=1e-6)  # the barostat moved the cell
    assert all(np.isfinite(f.get_forces()).all() for f in frames)
    mass = box.get_masses().sum() * 1.66053904
    for f in frames:
        assert f.info["density_g_cm3"] == pytest.approx(mass / f.info["volume"], rel=1e-6)
        assert np.isfinite(f.info["pressure_gpa"])
    out = capsys.readouterr().out
    assert "final_density_g_cm3" in out and "list_builds" in out
    capsys.readouterr()
    mol = tmp_path / "mol.xyz"
    ase.io.write(mol, molecule("H2O"))
    assert main(["md", "--model", str(model), "--input", str(mol), "--ensemble", "npt", "--device", "cpu"]) == 2
    assert "fully periodic" in capsys.readouterr().err
