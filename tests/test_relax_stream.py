"""relax_file / ``mlff-distill relax``: chunked output equal to one relax_batch call, an interrupted run that resumes
to the same file, and structures that cannot be relaxed left out by name rather than stopping the run."""

from __future__ import annotations

import json

import ase.io
import numpy as np
import pytest
import torch
from ase import Atoms
from ase.build import molecule
from ase.constraints import FixAtoms
from helpers import InterruptAt, rattled_molecules

import mlff_distiller.batched_relax as br
from mlff_distiller import load_model
from mlff_distiller.batched_relax import relax_batch
from mlff_distiller.cli import main
from mlff_distiller.domain import OutOfDomainWarning
from mlff_distiller.predict_stream import PROGRESS_SUFFIX
from mlff_distiller.relax_stream import relax_file

MODEL = "builtin:chno-gfn2"
KW = dict(fmax=0.05, steps=300, device="cpu", precision="fp64")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module")
def model():
    return load_model(MODEL)


def _frames(n: int) -> list[Atoms]:
    return rattled_molecules(["H2O", "CH4", "NH3", "CH3OH", "HCN", "C2H2", "H2CO"], n, 0.08)


def _write(path, frames) -> str:
    ase.io.write(path, frames, format="extxyz")
    return str(path)


_REAL = br.relax_arrays


def _Interrupt(at: int | None) -> InterruptAt:
    """relax_arrays (under relax_batch, and called alone for plain extxyz), interrupted at call ``at``."""
    return InterruptAt(_REAL, at)


@pytest.mark.parametrize("device", DEVICES)
def test_chunked_output_equals_one_relax_batch_call(model, tmp_path, monkeypatch, device):
    """Chunks of 3 give what one call over all 7 gives (fp64; on CUDA through the captured FIRE step)."""
    frames = _frames(7)
    src = _write(tmp_path / "in.extxyz", frames)
    out = tmp_path / "out.extxyz"
    stop = _Interrupt(at=None)
    monkeypatch.setattr(br, "relax_arrays", stop)
    lines = []
    kw = {**KW, "device": device}
    result = relax_file(model, src, out, chunk=3, log=lines.append, **kw)
    assert stop.calls == 3 and len(lines) == 3 and "7 structures done" in lines[-1]
    assert not (tmp_path / ("out.extxyz" + PROGRESS_SUFFIX)).exists()
    want = relax_batch(model, ase.io.read(src, ":"), **kw)  # the input as read back
    assert result["structures"] == 7 and result["resumed_from"] == 0 and result["output"] == str(out)
    assert result["converged"] == sum(a.info["relax_converged"] for a in want) == 7
    assert result["steps_max"] == max(a.info["relax_steps"] for a in want) > 0
    written = ase.io.read(out, ":")
    for got, ref in zip(written, want, strict=True):
        assert got.get_chemical_formula() == ref.get_chemical_formula()
        assert got.info["relax_converged"] and got.info["relax_steps"] == ref.info["relax_steps"]
        np.testing.assert_allclose(got.positions, ref.positions, atol=1e-8)  # extxyz keeps 8 decimals
        np.testing.assert_allclose(got.get_forces(), ref.get_forces(), atol=1e-8)
        assert got.get_potential_energy() == pytest.approx(ref.get_potential_energy(), abs=1e-8)
        assert np.abs(got.get_forces()).max() < KW["fmax"]


def test_an_interrupted_run_resumes_to_the_same_file(model, tmp_path, monkeypatch):
    frames = _frames(8)
    src = _write(tmp_path / "in.extxyz", frames)
    whole = tmp_path / "whole.extxyz"
    relax_file(model, src, whole, chunk=3, **KW)

    out = tmp_path / "out.extxyz"
    progress = tmp_path / ("out.extxyz" + PROGRESS_SUFFIX)
    lines = []
    monkeypatch.setattr(br, "relax_arrays", _Interrupt(at=3))
    with pytest.raises(KeyboardInterrupt):
        relax_file(model, src, out, chunk=3, log=lines.append, **KW)
    assert "interrupted" in lines[-1] and "holds the first 6 input structures" in lines[-1]
    assert len(ase.io.read(out, ":")) == 6  # the two finished chunks are on disk
    assert json.loads(progress.read_text())["state"]["done"] == 6
    with open(out, "a") as f:  # what a kill during the next append leaves behind: dropped on resume
        f.write("400\nProperties=species:S:1:pos:R:3 energy=-1.0\n" + "O 0.0 0.0 0.0\n" * 400)

    again = _Interrupt(at=None)
    monkeypatch.setattr(br, "relax_arrays", again)
    result = relax_file(model, src, out, chunk=3, **KW)
    assert again.calls == 1  # only the chunk not yet done: structures 6-7
    assert result["resumed_from"] == 6 and result["structures"] == 8 and result["converged"] == 8
    assert out.read_bytes() == whole.read_bytes()
    assert not progress.exists()


def test_resume_refuses_other_settings_and_restart_discards_them(model, tmp_path, monkeypatch):
    src = _write(tmp_path / "in.extxyz", _frames(5))
    out = tmp_path / "out.extxyz"
    monkeypatch.setattr(br, "relax_arrays", _Interrupt(at=2))
    with pytest.raises(KeyboardInterrupt):
        relax_file(model, src, out, chunk=2, **KW)
    monkeypatch.setattr(br, "relax_arrays", _Interrupt(at=None))
    with pytest.raises(ValueError, match=r"unfinished run of another job \(fmax: was 0.05, now 0.01\)"):
        relax_file(model, src, out, chunk=2, **{**KW, "fmax": 0.01})
    with pytest.raises(ValueError, match="steps: was 300, now 10"):
        relax_file(model, src, out, chunk=2, **{**KW, "steps": 10})
    with pytest.raises(ValueError, match="model: was"):
        relax_file(load_model("builtin:chno-gfn2-small"), src, out, chunk=2, **KW)
    result = relax_file(model, src, out, chunk=2, restart=True, **{**KW, "fmax": 0.01})
    assert result["resumed_from"] == 0 and len(ase.io.read(out, ":")) == 5
    assert all(np.abs(a.get_forces()).max() < 0.01 for a in ase.io.read(out, ":"))


def test_structures_that_cannot_be_relaxed_are_left_out_and_named(model, tmp_path, monkeypatch):
    frames = _frames(7)
    frames[1] = molecule("SiH4")  # an element the student does not know
    fixed = molecule("H2O")
    fixed.set_constraint(FixAtoms(indices=[0]))
    frames[5] = fixed  # a constraint relax_batch would not apply
    src = tmp_path / "in.traj"  # a trajectory keeps the constraint (extxyz would drop it)
    ase.io.write(src, frames)
    real = br.relax_batch

    def blows_up(model, structures, **kw):  # the NaN path of relax_batch, for the HCN of the second chunk
        out = real(model, structures, **kw)
        bad = [k for k, a in enumerate(structures) if a.get_chemical_formula() == "CHN"]
        if not bad:
            return out
        from mlff_distiller.batching import NonFiniteOutputError

        results = [None if k in bad else a for k, a in enumerate(out)]
        raise NonFiniteOutputError("relax_batch: ...", bad, results, reasons={k: "reached non-finite" for k in bad})

    monkeypatch.setattr(br, "relax_batch", blows_up)
    out = tmp_path / "out.extxyz"
    with pytest.raises(ValueError, match=r"3 of 7 input structures were left out") as err:
        relax_file(model, src, out, chunk=3, **KW)
    text = str(err.value)
    assert "structure 1: " in text and "element" in text
    assert "structure 4: reached non-finite" in text
    assert "structure 5: carries ASE constraints (FixAtoms)" in text
    written = ase.io.read(out, ":")
    assert [a.get_chemical_formula() for a in written] == [frames[k].get_chemical_formula() for k in (0, 2, 3, 6)]
    assert all(a.info["relax_converged"] for a in written)
    # Run again: nothing is redone, and the same error says which are missing.
    monkeypatch.setattr(br, "relax_arrays", _Interrupt(at=1))  # would interrupt if it relaxed anything
    with pytest.raises(ValueError, match=r"3 of 7 input structures were left out"):
        relax_file(model, src, out, chunk=3, **KW)


def test_a_frame_selection_relaxes_those_frames_only(model, tmp_path):
    frames = _frames(6)
    src = _write(tmp_path / "in.extxyz", frames)
    out = tmp_path / "out.extxyz"
    result = relax_file(model, src, out, index="1:5:2", chunk=1, **KW)
    assert result["structures"] == 2
    got = [a.get_chemical_formula() for a in ase.io.read(out, ":")]
    assert got == [frames[1].get_chemical_formula(), frames[3].get_chemical_formula()]
    with pytest.raises(ValueError, match="selects no structures"):
        relax_file(model, src, tmp_path / "none.extxyz", index="10:", **KW)
    with pytest.raises(ValueError, match="is the input file"):
        relax_file(model, src, src, **KW)
    with pytest.raises(ValueError, match="chunk must be"):
        relax_file(model, src, out, chunk=0, **KW)
    for bad, match in (({"fmax": 0.0}, "fmax must be"), ({"steps": -1}, "steps must be"), ({"max_atoms": 0}, "max_a")):
        with pytest.raises(ValueError, match=match):  # before anything is read or written
            relax_file(model, src, tmp_path / "bad.extxyz", **{**KW, **bad})
        assert not (tmp_path / "bad.extxyz").exists()
    with pytest.raises(FileNotFoundError):
        relax_file(model, tmp_path / "missing.extxyz", out, **KW)


def test_relax_command_resumes_an_interrupted_run(model, tmp_path, capsys, monkeypatch):
    src = _write(tmp_path / "in.extxyz", _frames(5))
    out = tmp_path / "out.extxyz"
    args = ["relax", "--model", MODEL, "--device", "cpu", "--precision", "fp64", "--input", src, "--output", str(out)]
    monkeypatch.setattr(br, "relax_arrays", _Interrupt(at=2))
    assert main([*args, "--chunk", "2"]) == 130
    assert "holds the first 2 input structures" in capsys.readouterr().err
    again = _Interrupt(at=None)
    monkeypatch.setattr(br, "relax_arrays", again)
    assert main([*args, "--chunk", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["structures"] == 5 and report["resumed_from"] == 2 and again.calls == 2
    assert main([*args, "--chunk", "2", "--restart"]) == 0
    assert json.loads(capsys.readouterr().out)["resumed_from"] == 0
    assert main([*args[:-4], "--input", f"{src}@0:2", "--output", str(tmp_path / "sel.extxyz")]) == 0
    assert json.loads(capsys.readouterr().out)["structures"] == 2


def test_the_written_text_is_what_ase_writes(model, monkeypatch):
    """The fast writer's frames (a string in the info too) and the fallback's (an array in the info) give the bytes
    ``ase.io.write`` gives, and leave each frame's info as it was."""
    import io

    import ase.io.extxyz

    from mlff_distiller.relax_stream import _extxyz_text

    frames = relax_batch(model, _frames(4), **KW)
    frames[1].info["domain"] = "closer than the training data: H-H 0.5 Å"
    frames[2].info["tags"] = np.array([1, 2])
    frames[3].set_cell([10.0, 11.0, 12.0])
    frames[3].pbc = [True, False, True]
    before = [dict(a.info) for a in frames]
    want = io.StringIO()
    ase.io.write(want, frames, format="extxyz")
    fallbacks = []
    real = ase.io.extxyz.write_extxyz
    monkeypatch.setattr(ase.io.extxyz, "write_extxyz", lambda f, a: fallbacks.append(1) or real(f, a))
    assert _extxyz_text(frames) == want.getvalue()
    assert len(fallbacks) == 1  # the frame with an array in its info (strings, numbers and bools are taken)
    assert [set(a.info) for a in frames] == [set(b) for b in before]


def _periodic(n: int) -> list[Atoms]:
    out = []
    for k in range(n):
        a = molecule(["H2O", "NH3", "CH4"][k % 3])
        a.set_cell([7.0 + k, 7.5, 8.0])
        a.pbc = [True, k % 2 == 0, True]
        a.center()
        a.rattle(0.05, seed=k)
        out.append(a)
    return out


def test_plain_extxyz_goes_without_atoms_and_writes_what_the_atoms_path_writes(model, tmp_path, monkeypatch):
    """Plain extxyz chunks (info strings and extra real columns included) go file -> arrays -> relax_arrays -> text
    with no ``Atoms``; a chunk with a number in its info goes through ASE's reader and relax_batch; the output is
    byte for byte what the ``Atoms`` path writes for the whole file (molecules and periodic cells, a finding of the
    envelope check in the info), also where the fast writer declines a frame."""
    import mlff_distiller.relax_stream as rs

    frames = _frames(5) + _periodic(4)
    frames[0].info["name"] = "2-butyne"
    frames[2].info.update(config_type="a b, c", uid="0042")  # a quoted string; a key ASE keeps unconverted
    frames[4].set_momenta(np.full((len(frames[4]), 3), 0.01))  # an extra column, kept
    frames[5].set_initial_magnetic_moments(np.linspace(0.0, 1.0, len(frames[5])))
    frames[7].info["temperature"] = 300  # a number in the info: ASE's reader for its chunk
    src = _write(tmp_path / "in.extxyz", frames)
    monkeypatch.setattr(  # one structure of each path "outside the training data", with a string to escape
        br, "_domain_findings", lambda *a: {k: 'closer than "seen": H-H 0.5 Å' for k in a[3] if k == 1}
    )
    atoms_calls, table_calls = [], []
    real_batch = br.relax_batch
    monkeypatch.setattr(br, "relax_batch", lambda m, s, **kw: atoms_calls.append(len(s)) or real_batch(m, s, **kw))
    real_text = rs._table_text
    monkeypatch.setattr(rs, "_table_text", lambda run, *a: table_calls.append(len(run.energy)) or real_text(run, *a))

    def run(name: str) -> bytes:
        with pytest.warns(OutOfDomainWarning, match="3 of 9 relaxed structures"):
            result = relax_file(model, src, tmp_path / name, chunk=3, **KW)
        assert result["structures"] == 9 and result["outside_domain"] == 3 and result["converged"] == 9
        return (tmp_path / name).read_bytes()

    fast = run("fast.extxyz")
    assert table_calls == [3, 3] and atoms_calls == [3]  # chunks 0-2 and 3-5 without Atoms; 6-8 with a number
    monkeypatch.setattr(rs, "format_plain_frame", lambda *a: None)  # the fast writer declines: ASE writes
    assert run("ase_writer.extxyz") == fast
    monkeypatch.setattr(rs, "parse_frames", lambda text, info=False: None)  # every chunk through ASE's reader
    assert run("slow.extxyz") == fast and table_calls == [3, 3, 3, 3]
    written = ase.io.read(tmp_path / "fast.extxyz", ":")
    assert written[1].info["domain"] == 'closer than "seen": H-H 0.5 Å' and "domain" not in written[0].info
    assert written[0].info["name"] == "2-butyne" and written[2].info["config_type"] == "a b, c"
    assert np.allclose(written[4].get_momenta(), 0.01) and written[6].pbc.tolist() == [True, False, True]
    assert written[7].info["temperature"] == 300 and written[7].info["relax_converged"]


def test_bad_structures_in_plain_extxyz_are_left_out_and_named(model, tmp_path):
    """An unknown element and non-finite positions in a plain extxyz chunk: that chunk goes through the Atoms path,
    which names both; the others are relaxed and written."""
    frames = _frames(6)
    frames[1] = molecule("SiH4")
    src = tmp_path / "in.extxyz"
    _write(src, frames)
    text = src.read_text().split("\n")
    # structure 4's first coordinate as nan (what a broken upstream step writes)
    n_before = sum(len(a) + 2 for a in frames[:4])
    first = text[n_before + 2].split()
    text[n_before + 2] = " ".join([first[0], "nan", *first[2:]])
    src.write_text("\n".join(text))
    out = tmp_path / "out.extxyz"
    with pytest.raises(ValueError, match=r"2 of 6 input structures were left out") as err:
        relax_file(model, src, out, chunk=3, **KW)
    assert "structure 1: " in str(err.value) and "element" in str(err.value)
    assert "structure 4: " in str(err.value) and "finite" in str(err.value)
    written = ase.io.read(out, ":")
    assert [a.get_chemical_formula() for a in written] == [frames[k].get_chemical_formula() for k in (0, 2, 3, 5)]
