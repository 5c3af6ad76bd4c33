"""The MD frames of ``mlff-distill md`` (``format_md_frame`` in ``mlff_distiller._extxyz_fast``): for the frames
it takes, exactly the text of ASE's extxyz writer; everything else declined (``None``), which the command then
writes through ASE; and the command's own output, frame for frame, the bytes ASE writes for the same run."""

from __future__ import annotations

import io
import json

import ase.io
import numpy as np
import pytest
from ase import Atoms
from ase.build import bulk, molecule
from ase.calculators.singlepoint import SinglePointCalculator
from ase.constraints import FixAtoms, FixCartesian, FixCom

from mlff_distiller._extxyz_fast import format_md_frame


def _ase_text(atoms: Atoms, results: dict, info: dict) -> str:
    """What ``mlff-distill md`` wrote before (and writes for declined frames): a copy with the info added, the
    results in a calculator, through ``ase.io.write``."""
    frame = atoms.copy()
    frame.info.update(info)
    frame.calc = SinglePointCalculator(frame)
    frame.calc.results = dict(results)
    buf = io.StringIO()
    ase.io.write(buf, frame, format="extxyz")
    return buf.getvalue()


def _random_case(rng: np.random.Generator, k: int) -> tuple[Atoms, dict, dict]:
    """Molecules and cells (triclinic, partly periodic), momenta in float64 or float32, other real columns, values
    from 1e-9 to 1e5 in size, results with and without stress (Voigt or 3 x 3) and free energy."""
    if k % 3 == 2:
        a = bulk("Si", "diamond", a=5.43) * (1, 2, 1)
        a.set_cell(a.cell.array + rng.normal(0, 0.4, (3, 3)), scale_atoms=True)
        a.pbc = [True, bool(rng.random() < 0.7), True]
    else:
        a = molecule(["C6H6", "CH3CH2OH", "H2O", "NH3"][k % 4])
        if k % 2:
            a.set_constraint(FixCom())
    scale = 10.0 ** rng.integers(-9, 6)
    a.positions += rng.normal(size=a.positions.shape) * scale
    momenta = rng.normal(size=(len(a), 3)) * scale
    a.set_momenta(momenta.astype(np.float32) if k % 5 == 4 else momenta, apply_constraint=False)
    if k % 4 == 3:
        a.set_array("charges_guess", rng.normal(size=len(a)))  # a 1-column real array
    n = len(a)
    results = {"energy": float(rng.normal() * 10.0 ** rng.integers(-3, 5))}
    if k % 2 == 0:
        results["free_energy"] = results["energy"] - float(rng.random())
    results["forces"] = rng.normal(size=(n, 3)) * 10.0 ** rng.integers(-6, 3)
    results["energies"] = rng.normal(size=n)
    if a.cell.any():
        results["stress"] = rng.normal(size=6) * 1e-3 if k % 4 else rng.normal(size=(3, 3)) * 1e-2
    info = {"time_fs": float(k * 0.5), "total_energy": float(rng.normal() * 1e3)}
    if k % 3 == 2:
        info["volume"] = float(a.get_volume())
        info["pressure_gpa"] = float(rng.normal() * 10.0 ** rng.integers(-12, 1))
    if k % 3 == 1:  # BatchedMD's frames name their replica
        info["replica"] = int(rng.integers(-(10**12), 10**12)) if k % 2 else k
    if k % 6 == 4:  # ... and a frozen one says so, first (mlff-distill md moves it there from the template)
        info = {"frozen": bool(k % 12 == 4), **info}
    return a, results, info


@pytest.mark.parametrize("seed", [0, 1])
def test_md_frames_are_the_text_ase_writes(seed):
    rng = np.random.default_rng(seed)
    for k in range(24):
        atoms, results, info = _random_case(rng, k)
        text = format_md_frame(atoms, results, info)
        assert text is not None, k
        assert text == _ase_text(atoms, results, info), k


def _declined():
    base = molecule("H2O")
    base.set_momenta(np.ones((3, 3)))
    res = {"energy": -1.0, "forces": np.zeros((3, 3)), "energies": np.zeros(3)}
    info = {"time_fs": 1.0}
    cases = {}

    def case(name, atoms=None, results=None, extra=None):
        cases[name] = (
            atoms if atoms is not None else base.copy(),
            res if results is None else results,
            info if extra is None else extra,
        )

    fixed = base.copy()
    fixed.set_constraint(FixAtoms(indices=[0]))
    case("FixAtoms (ASE writes a move_mask)", fixed)
    cart = base.copy()
    cart.set_constraint(FixCartesian(0, mask=[True, False, False]))
    case("FixCartesian", cart)
    tagged = base.copy()
    tagged.set_tags([1, 2, 3])
    case("an integer array", tagged)
    kept = base.copy()
    kept.info["config_type"] = "water"
    case("info the input carried", kept)
    case("a NumPy integer in the info", extra={"step": np.int64(3)})
    case("an info key that is also a result", extra={"energy": 1.0})
    case("a dipole result", results={**res, "dipole": np.zeros(3)})
    case("forces that are not real numbers", results={**res, "forces": np.zeros((3, 3), dtype=int)})
    own = base.copy()
    own.set_array("forces", np.zeros((3, 3)))
    case("an array with a result's name", own)
    initial = base.copy()
    initial.set_initial_charges([0.1, 0.2, 0.3])
    case("initial charges", initial)
    return cases


DECLINED = _declined()


STRINGS = ["water", "2-butyne", "a b", 'say "hi"', "{x}", "[1, 2]", "", "T", "1.5", "x=y", "it's", "é", "a\\b"]


def test_string_info_is_the_text_ase_writes():
    """String info (a molecule's name, relax_file's domain findings) is quoted as ASE quotes it."""
    atoms = molecule("H2O")
    res = {"energy": -1.0, "forces": np.zeros((3, 3)), "energies": np.zeros(3)}
    for value in STRINGS:
        info = {"name": value, "relax_converged": True, "relax_steps": 3}
        text = format_md_frame(atoms, res, info)
        assert text is not None and text == _ase_text(atoms, res, info), value


@pytest.mark.parametrize("name", sorted(DECLINED))
def test_md_frames_decline_what_ase_writes_otherwise(name):
    atoms, results, info = DECLINED[name]
    assert format_md_frame(atoms, results, info) is None


def test_md_command_writes_what_ase_wrote(tmp_path, capsys):
    """``mlff-distill md``, Langevin with ``FixCom`` on a molecule and NPT on a periodic box: every frame it wrote
    is the text ASE writes for the frame read back (positions, momenta, results and info to the last digit
    printed), one frame per interval, and the start-up is reported apart from the steps."""
    import torch

    from mlff_distiller import StudentModel
    from mlff_distiller.cli import main

    torch.manual_seed(0)
    model = tmp_path / "m.pt"
    StudentModel(species=[1, 6, 8], hidden=16, layers=1).save(model)
    box = bulk("C", "diamond", a=3.57) * 2
    for name, start, extra in (
        ("mol", molecule("CH3CH2OH"), []),
        ("box", box, ["--ensemble", "npt", "--pressure-bar", "1000"]),
    ):
        src = tmp_path / f"{name}.xyz"
        ase.io.write(src, start)
        out = tmp_path / f"{name}.extxyz"
        args = ["md", "--model", str(model), "--input", str(src), "--output", str(out), "--device", "cpu"]
        assert main([*args, "--steps", "12", "--interval", "4", "--precision", "fp64", *extra]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["startup_s"] > 0 and report["s_per_step"] > 0
        assert report["precision"] == "fp64"
        text = out.read_text()
        frames = ase.io.read(out, index=":")
        assert [f.info["time_fs"] for f in frames] == [0.0, 2.0, 4.0, 6.0]  # 0.5 fs steps, a frame every 4
        blocks, at = [], 0
        lines = text.splitlines(keepends=True)
        while at < len(lines):
            n = int(lines[at])
            blocks.append("".join(lines[at : at + n + 2]))
            at += n + 2
        assert len(blocks) == len(frames)
        for frame, block in zip(frames, blocks, strict=True):
            calc = frame.calc
            info = {k: v for k, v in frame.info.items() if k not in calc.results}
            frame.calc = None
            assert _ase_text(frame, calc.results, info) == block
        if name == "box":
            assert "stress=" in blocks[-1] and "pressure_gpa=" in blocks[-1]
        else:
            assert "momenta:R:3" in blocks[0]
            assert np.abs(frames[-1].get_center_of_mass() - start.get_center_of_mass()).max() < 1e-7  # FixCom


def test_md_command_writes_ase_trajectories_for_a_traj_name(tmp_path, capsys):
    """``--output x.traj``: ASE's binary trajectory (what ``ase.io.read`` and ``ase gui`` take by that name), the
    same frames as the extxyz run of the same seed: positions, momenta, energies, forces, info and the ``FixCom``."""
    import torch

    from mlff_distiller import StudentModel
    from mlff_distiller.cli import main

    torch.manual_seed(0)
    model = tmp_path / "m.pt"
    StudentModel(species=[1, 6, 8], hidden=16, layers=1).save(model)
    src = tmp_path / "mol.xyz"
    ase.io.write(src, molecule("CH3CH2OH"))
    runs = {}
    for name in ("md.extxyz", "md.traj"):
        args = ["md", "--model", str(model), "--input", str(src), "--output", str(tmp_path / name), "--device", "cpu"]
        assert main([*args, "--steps", "9", "--interval", "3", "--precision", "fp64"]) == 0
        capsys.readouterr()
        runs[name] = ase.io.read(tmp_path / name, index=":")
    text, binary = runs["md.extxyz"], runs["md.traj"]
    assert len(binary) == len(text) == 4
    assert isinstance(binary[0].constraints[0], FixCom)
    for a, b in zip(text, binary, strict=True):
        np.testing.assert_allclose(b.positions, a.positions, atol=5e-9)  # extxyz prints 8 decimals
        np.testing.assert_allclose(b.get_momenta(), a.get_momenta(), atol=5e-9)
        np.testing.assert_allclose(b.get_forces(apply_constraint=False), a.get_forces(), atol=5e-9)
        assert b.get_potential_energy() == pytest.approx(a.get_potential_energy(), abs=1e-9)
        assert b.info == pytest.approx(a.info)


def test_md_command_continues_from_a_frame_it_wrote(tmp_path, capsys, monkeypatch):
    """``--input md.extxyz@-1 --velocities input``: the run goes on from the last frame written, positions and
    momenta as written; velocity Verlet from there is the single longer run (to the 8 decimals extxyz keeps).
    Bad selections are errors that name the problem."""
    import torch

    from mlff_distiller import StudentModel
    from mlff_distiller.cli import main

    torch.manual_seed(0)
    model = tmp_path / "m.pt"
    StudentModel(species=[1, 6, 8], hidden=16, layers=1).save(model)
    src = tmp_path / "mol.xyz"
    ase.io.write(src, molecule("CH3CH2OH"))
    base = ["md", "--model", str(model), "--device", "cpu", "--precision", "fp64", "--ensemble", "nve"]

    def run(inp, out, steps, *extra, says=""):
        code = main([*base, "--input", str(inp), "--output", str(tmp_path / out), "--steps", str(steps), *extra])
        assert says in capsys.readouterr().err
        return code

    assert run(src, "first.extxyz", 10, "--interval", "5") == 0
    assert run(src, "whole.extxyz", 15, "--interval", "5") == 0
    import mlff_distiller._extxyz_fast as fast

    declined = []
    real = fast.format_md_frame
    monkeypatch.setattr(fast, "format_md_frame", lambda *a: declined.append(1) if (t := real(*a)) is None else t)
    assert run(f"{tmp_path / 'first.extxyz'}@-1", "next.extxyz", 5, "--interval", "5", "--velocities", "input") == 0
    assert not declined  # the input's info from the earlier run is dropped: its frames take the fast writer
    first, whole, after = (
        ase.io.read(tmp_path / n, index=":") for n in ("first.extxyz", "whole.extxyz", "next.extxyz")
    )
    np.testing.assert_array_equal(after[0].positions, first[-1].positions)
    np.testing.assert_array_equal(after[0].get_momenta(), first[-1].get_momenta())
    np.testing.assert_allclose(after[-1].positions, whole[-1].positions, atol=1e-6)
    np.testing.assert_allclose(after[-1].get_momenta(), whole[-1].get_momenta(), atol=1e-6)
    assert [f.info["time_fs"] for f in after] == [5.0, 7.5] == [f.info["time_fs"] for f in whole[2:]]  # its clock
    assert run(src, "x.extxyz", 2, "--velocities", "input", says="has no momenta") == 2  # a plain xyz frame
    assert run(f"{tmp_path / 'first.extxyz'}@7", "x.extxyz", 2, says="first.extxyz has no frame 7") == 2  # 3 frames
    assert run(src, "x.extxyz", 2, "--velocities", "random", says="velocities must be") == 2
    # --seed: the same seed, the same Langevin run; another seed, another run
    lv = ["--ensemble", "langevin", "--interval", "4", "--friction-per-fs", "0.02"]
    for name, seed in (("s1.extxyz", "1"), ("s1b.extxyz", "1"), ("s2.extxyz", "2")):
        main([*base[:-2], "--input", str(src), "--output", str(tmp_path / name), "--steps", "4", *lv, "--seed", seed])
    s1, s1b, s2 = (ase.io.read(tmp_path / n, index=-1) for n in ("s1.extxyz", "s1b.extxyz", "s2.extxyz"))
    assert np.array_equal(s1.positions, s1b.positions) and not np.array_equal(s1.positions, s2.positions)
    assert run(f"{tmp_path / 'missing.extxyz'}@-1", "x.extxyz", 2, says="input file not found") == 2
    kept = (tmp_path / "first.extxyz").read_bytes()  # continuing into the file it reads: refused, the file kept
    assert run(f"{tmp_path / 'first.extxyz'}@-1", "first.extxyz", 2, "--velocities", "input", says="is the input") == 2
    assert (tmp_path / "first.extxyz").read_bytes() == kept


def test_md_command_runs_in_fp32_unless_asked(tmp_path, capsys):
    """The command's default precision is the calculator's (fp32): fp64 cost 1.8-2.6x per step on an H100 and
    conserved the energy no better (``benchmarks/results/probe_md_precision_h100.md``)."""
    from mlff_distiller.cli import main

    src = tmp_path / "mol.xyz"
    ase.io.write(src, molecule("H2O"))
    args = ["md", "--input", str(src), "--output", str(tmp_path / "o.extxyz"), "--device", "cpu", "--steps", "2"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["precision"] == "fp32"
