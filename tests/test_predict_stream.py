"""predict_file / ``mlff-distill predict``: chunked output equal to one predict_forces call, an interrupted run that
resumes to the same file, and structures left out by name rather than stopping the run."""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import ase.io
import numpy as np
import pytest
import torch
from ase import Atoms
from ase.build import bulk, molecule
from helpers import InterruptAt, rattled_molecules

import mlff_distiller.predict_stream as pf
from mlff_distiller import load_model, predict_forces
from mlff_distiller.cli import main
from mlff_distiller.domain import OutOfDomainWarning
from mlff_distiller.predict_stream import PROGRESS_SUFFIX, model_fingerprint, predict_file

MODEL = "builtin:chno-gfn2"


@pytest.fixture(scope="module")
def model():
    return load_model(MODEL)


def _frames(n: int = 11) -> list[Atoms]:
    return rattled_molecules(["H2O", "CH4", "C6H6", "CH3CH2OH", "NH3", "HCN", "CH3OH"], n, 0.03)


def _write(path, frames) -> str:
    ase.io.write(path, frames, format="extxyz")
    return str(path)


_REAL = pf.run_predictions


def _Interrupt(at: int | None) -> InterruptAt:
    """predict_file's run_predictions, interrupted at call ``at``."""
    return InterruptAt(_REAL, at)


def test_chunked_output_equals_one_call(model, tmp_path, monkeypatch):
    frames = _frames(11)
    src = _write(tmp_path / "in.extxyz", frames)
    out = tmp_path / "out.extxyz"
    real, calls = pf.run_predictions, []

    def slow(*args, **kwargs):  # a known 50 ms in each prediction: it must be counted as "predict", not elsewhere
        calls.append(1)
        time.sleep(0.05)
        return real(*args, **kwargs)

    monkeypatch.setattr(pf, "run_predictions", slow)
    # fp64: batches of 3 and of 11 structures differ by float32 rounding (up to ~5e-7 eV/Å on a 16-core host)
    result = predict_file(model, src, out, chunk=3, device="cpu", precision="fp64")
    assert result["structures"] == 11 and result["resumed_from"] == 0
    assert not (tmp_path / ("out.extxyz" + PROGRESS_SUFFIX)).exists()
    parts = result["parts"]  # where the time went: each part timed, together no more than the whole call
    assert set(parts) == {"start", "read", "predict", "format", "write"} and min(parts.values()) > 0
    assert sum(parts.values()) - parts["start"] <= result["seconds"]
    assert len(calls) == 4 and parts["predict"] >= 0.05 * len(calls)  # (a timing of one host would be flaky)
    xyz = tmp_path / "in.pdb"  # the same through ase.io.iread (a format the blocks do not take): the same parts
    ase.io.write(xyz, frames, format="proteindatabank")
    assert set(predict_file(model, xyz, tmp_path / "pdb.extxyz", chunk=3, device="cpu")["parts"]) == set(parts)
    written = ase.io.read(out, ":")
    expected = predict_forces(model, ase.io.read(src, ":"), device="cpu", precision="fp64")  # the input as read
    assert [a.get_chemical_formula() for a in written] == [a.get_chemical_formula() for a in frames]
    for a, ref, src_atoms in zip(written, expected, frames, strict=True):
        assert a.get_potential_energy() == pytest.approx(ref["energy"], abs=1e-9)
        np.testing.assert_allclose(a.get_forces(), ref["forces"], atol=1e-8)  # extxyz keeps 8 decimals
        np.testing.assert_allclose(a.positions, src_atoms.positions, atol=1e-8)
        assert "stress" not in a.calc.results


def test_an_interrupted_run_resumes_to_the_same_file(model, tmp_path, monkeypatch):
    frames = _frames(11)
    src = _write(tmp_path / "in.extxyz", frames)
    whole = tmp_path / "whole.extxyz"
    predict_file(model, src, whole, chunk=3, device="cpu")

    out = tmp_path / "out.extxyz"
    progress = tmp_path / ("out.extxyz" + PROGRESS_SUFFIX)
    stop = _Interrupt(at=3)
    monkeypatch.setattr(pf, "run_predictions", stop)
    with pytest.raises(KeyboardInterrupt):
        predict_file(model, src, out, chunk=3, device="cpu")
    assert len(ase.io.read(out, ":")) == 6  # the two finished chunks are on disk
    assert json.loads(progress.read_text())["state"]["done"] == 6

    again = _Interrupt(at=None)
    monkeypatch.setattr(pf, "run_predictions", again)
    result = predict_file(model, src, out, chunk=3, device="cpu")
    assert again.calls == 2  # only the chunks not yet done: structures 6-8 and 9-10
    assert result["resumed_from"] == 6 and result["structures"] == 11
    assert out.read_bytes() == whole.read_bytes()
    assert not progress.exists()


def test_a_chunk_cut_off_mid_write_is_dropped_on_resume(model, tmp_path, monkeypatch):
    frames = _frames(7)
    src = _write(tmp_path / "in.extxyz", frames)
    whole = tmp_path / "whole.extxyz"
    predict_file(model, src, whole, chunk=2, device="cpu")
    out = tmp_path / "out.extxyz"
    monkeypatch.setattr(pf, "run_predictions", _Interrupt(at=4))  # the last chunk: one structure
    with pytest.raises(KeyboardInterrupt):
        predict_file(model, src, out, chunk=2, device="cpu")
    with open(out, "a") as f:  # what a kill during a longer append leaves behind
        f.write('5\nLattice="0 0 0" Properties=species:S:1:pos:R:3 energy=-1.0\n' + "O 0.0 0.0 0.0\n" * 400)
    monkeypatch.setattr(pf, "run_predictions", _Interrupt(at=None))
    predict_file(model, src, out, chunk=2, device="cpu")
    assert out.read_bytes() == whole.read_bytes()


def test_resume_refuses_another_job_and_restart_discards_it(model, tmp_path, monkeypatch):
    src = _write(tmp_path / "in.extxyz", _frames(5))
    out = tmp_path / "out.extxyz"
    monkeypatch.setattr(pf, "run_predictions", _Interrupt(at=2))
    with pytest.raises(KeyboardInterrupt):
        predict_file(model, src, out, chunk=2, device="cpu")
    monkeypatch.setattr(pf, "run_predictions", _Interrupt(at=None))
    with pytest.raises(ValueError, match=r"unfinished run of another job \(precision: was 'fp32', now 'fp64'\)"):
        predict_file(model, src, out, chunk=2, device="cpu", precision="fp64")
    other = load_model("builtin:chno-gfn2-small")
    with pytest.raises(ValueError, match="model: was"):
        predict_file(other, src, out, chunk=2, device="cpu")
    result = predict_file(model, src, out, chunk=2, device="cpu", precision="fp64", restart=True)
    assert result["resumed_from"] == 0 and len(ase.io.read(out, ":")) == 5


def test_a_changed_input_is_not_resumed(model, tmp_path, monkeypatch):
    frames = _frames(5)
    src = _write(tmp_path / "in.extxyz", frames)
    out = tmp_path / "out.extxyz"
    monkeypatch.setattr(pf, "run_predictions", _Interrupt(at=2))
    with pytest.raises(KeyboardInterrupt):
        predict_file(model, src, out, chunk=2, device="cpu")
    _write(tmp_path / "in.extxyz", frames[::-1])
    monkeypatch.setattr(pf, "run_predictions", _Interrupt(at=None))
    with pytest.raises(ValueError, match="input_"):
        predict_file(model, src, out, chunk=2, device="cpu")


def test_bad_and_failing_structures_are_left_out_and_named(model, tmp_path):
    frames = _frames(9)
    frames[4] = molecule("SiH4")  # an element the student does not know
    # a 0.5 Å cell puts thousands of images within the cutoff: float32 overflows (a real non-finite output)
    frames[7] = Atoms("H2", positions=[[0, 0, 0], [0.7, 0, 0]], cell=[0.5] * 3, pbc=True)
    src = _write(tmp_path / "in.extxyz", frames)
    out = tmp_path / "out.extxyz"
    with pytest.raises(ValueError, match=r"2 of 9 input structures were left out") as err:
        predict_file(model, src, out, chunk=4, device="cpu")
    assert "structure 4: unknown element(s) ['Si']" in str(err.value)
    assert "structure 7: non-finite output" in str(err.value)
    written = ase.io.read(out, ":")
    kept = [a for k, a in enumerate(ase.io.read(src, ":")) if k not in (4, 7)]
    assert [a.get_chemical_formula() for a in written] == [a.get_chemical_formula() for a in kept]
    expected = predict_forces(model, kept, device="cpu")
    for a, ref in zip(written, expected, strict=True):
        assert a.get_potential_energy() == pytest.approx(ref["energy"], abs=1e-9)
    size = out.stat().st_size
    with pytest.raises(ValueError, match="structure 4: unknown"):  # a rerun says it again and writes nothing
        predict_file(model, src, out, chunk=4, device="cpu")
    assert out.stat().st_size == size


def test_stress_of_periodic_structures(model, tmp_path):
    diamond = bulk("C", "diamond", a=3.6)
    diamond.rattle(0.02, seed=1)
    box = molecule("CH4")
    box.cell, box.pbc = [7.0, 7.5, 8.0], True
    box.center()
    frames = [molecule("H2O"), diamond, box]
    src = _write(tmp_path / "in.extxyz", frames)
    out = tmp_path / "out.extxyz"
    predict_file(model, src, out, chunk=2, device="cpu", stress=True, precision="fp64")
    written = ase.io.read(out, ":")
    expected = predict_forces(model, ase.io.read(src, ":"), device="cpu", stress=True, precision="fp64")
    assert "stress" not in written[0].calc.results
    for a, ref in zip(written[1:], expected[1:], strict=True):
        np.testing.assert_allclose(a.get_stress(), ref["stress"], rtol=1e-9, atol=1e-12)


def test_a_format_ase_cannot_iterate(model, tmp_path):
    crystal = bulk("C", "diamond", a=3.6)
    ase.io.write(tmp_path / "POSCAR", crystal, format="vasp")
    out = tmp_path / "out.extxyz"
    assert predict_file(model, tmp_path / "POSCAR", out, device="cpu")["structures"] == 1
    ref = predict_forces(model, [crystal], device="cpu")[0]
    assert ase.io.read(out).get_potential_energy() == pytest.approx(ref["energy"], abs=1e-9)


def test_model_fingerprint_follows_the_weights(model):
    other = load_model(MODEL)
    assert model_fingerprint(other) == model_fingerprint(model)
    with np.errstate(all="ignore"):
        next(other.parameters()).data[0] += 1e-6
    assert model_fingerprint(other) != model_fingerprint(model)


def test_cli_predict_chunks_resumes_and_reports(tmp_path, monkeypatch, capsys):
    frames = _frames(5)
    src = _write(tmp_path / "in.extxyz", frames)
    out = tmp_path / "out.extxyz"
    args = ["predict", "--input", src, "--output", str(out), "--device", "cpu", "--chunk", "2"]
    monkeypatch.setattr(pf, "run_predictions", _Interrupt(at=2))
    assert main(args) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "holds the first 2 input structures" in err
    monkeypatch.setattr(pf, "run_predictions", _Interrupt(at=None))
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["structures"] == 5 and summary["resumed_from"] == 2
    assert len(ase.io.read(out, ":")) == 5
    assert main([*args, "--chunk", "0"]) == 2
    assert main([*args, "--workers", "-1"]) == 2
    assert main([*args, "--workers", "2", "--output", str(tmp_path / "w.extxyz")]) == 0
    assert (tmp_path / "w.extxyz").read_bytes() == out.read_bytes()


def test_a_frame_selection_predicts_those_frames_only(model, tmp_path, monkeypatch, capsys):
    """``index`` (``--input file@INDEX``, as md and relax take it): the selected frames only, resumable like the
    whole file; a selection of nothing or past the end is a ValueError."""
    frames = _frames(9)
    src = _write(tmp_path / "in.extxyz", frames)
    out = tmp_path / "out.extxyz"
    monkeypatch.setattr(pf, "run_predictions", _Interrupt(at=2))
    with pytest.raises(KeyboardInterrupt):
        predict_file(model, src, out, index="1:8:2", chunk=2, device="cpu", precision="fp64")
    again = _Interrupt(at=None)
    monkeypatch.setattr(pf, "run_predictions", again)
    result = predict_file(model, src, out, index="1:8:2", chunk=2, device="cpu", precision="fp64")
    assert result["resumed_from"] == 2 and result["structures"] == 4 and again.calls == 1
    written = ase.io.read(out, ":")
    expected = predict_forces(model, ase.io.read(src, "1:8:2"), device="cpu", precision="fp64")
    assert [a.get_chemical_formula() for a in written] == [frames[k].get_chemical_formula() for k in (1, 3, 5, 7)]
    for a, ref in zip(written, expected, strict=True):
        np.testing.assert_allclose(a.get_forces(), ref["forces"], atol=1e-8)
    monkeypatch.setattr(pf, "run_predictions", _Interrupt(at=2))
    with pytest.raises(KeyboardInterrupt):
        predict_file(model, src, tmp_path / "o2.extxyz", index="0:4", chunk=2, device="cpu")
    with pytest.raises(ValueError, match="index: was '0:4', now '0:5'"):  # another selection is another job
        predict_file(model, src, tmp_path / "o2.extxyz", index="0:5", chunk=2, device="cpu")
    with pytest.raises(ValueError, match="selects no structures"):
        predict_file(model, src, tmp_path / "none.extxyz", index="20:", device="cpu")
    monkeypatch.setattr(pf, "run_predictions", _REAL)
    assert main(["predict", "--input", f"{src}@-1", "--output", str(tmp_path / "last.extxyz"), "--device", "cpu"]) == 0
    assert json.loads(capsys.readouterr().out)["structures"] == 1
    last = ase.io.read(tmp_path / "last.extxyz", ":")
    assert len(last) == 1 and last[0].get_chemical_formula() == frames[-1].get_chemical_formula()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_resume_on_the_gpu(model, tmp_path, monkeypatch):
    """On CUDA (captured buckets, the pipelined predict): an interrupted run resumes to the frames of an
    uninterrupted one, and they match predict_forces. In fp64 and compared as numbers: an engine that has captured
    other buckets may pad a batch differently, which moves float32 results by rounding."""
    frames = _frames(40)
    src = _write(tmp_path / "in.extxyz", frames)
    whole, out = tmp_path / "whole.extxyz", tmp_path / "out.extxyz"
    predict_file(model, src, whole, chunk=16, device="cuda", precision="fp64")
    monkeypatch.setattr(pf, "run_predictions", _Interrupt(at=2))
    with pytest.raises(KeyboardInterrupt):
        predict_file(model, src, out, chunk=16, device="cuda", precision="fp64")
    monkeypatch.setattr(pf, "run_predictions", _Interrupt(at=None))
    assert predict_file(model, src, out, chunk=16, device="cuda", precision="fp64")["resumed_from"] == 16
    expected = predict_forces(model, ase.io.read(src, ":"), device="cuda", precision="fp64")
    resumed, uninterrupted = ase.io.read(out, ":"), ase.io.read(whole, ":")
    assert len(resumed) == len(uninterrupted) == 40
    for a, b, ref in zip(resumed, uninterrupted, expected, strict=True):
        assert a.get_chemical_formula() == b.get_chemical_formula()
        assert a.get_potential_energy() == pytest.approx(b.get_potential_energy(), abs=1e-7)
        np.testing.assert_allclose(a.get_forces(), b.get_forces(), atol=2e-8)  # a last printed digit at most
        np.testing.assert_allclose(a.get_forces(), ref["forces"], atol=2e-8)


def test_a_file_cut_short_keeps_the_chunks_before_it(model, tmp_path):
    frames = _frames(7)
    src = tmp_path / "in.extxyz"
    _write(src, frames)
    text = src.read_text()
    src.write_text(text[: int(len(text) * 0.8)])  # the last frames cut off mid-line
    out = tmp_path / "out.extxyz"
    with pytest.raises(ValueError, match=r"in.extxyz: structures? \d(-\d)? could not be read"):
        predict_file(model, src, out, chunk=2, device="cpu")
    written = ase.io.read(out, ":")
    assert len(written) >= 2 and len(written) % 2 == 0  # whole chunks only
    assert [a.get_chemical_formula() for a in written] == [a.get_chemical_formula() for a in frames[: len(written)]]


def test_the_output_cannot_be_the_input(model, tmp_path):
    src = _write(tmp_path / "in.extxyz", _frames(2))
    with pytest.raises(ValueError, match="is the input file"):
        predict_file(model, src, src, device="cpu")
    assert len(ase.io.read(src, ":")) == 2


def test_a_structure_too_large_for_the_device_is_left_out(model, tmp_path, monkeypatch):
    """Out of device memory even alone (forced: any batch holding benzene's 12 atoms): the others are computed."""
    from mlff_distiller import ForceEngine

    real = ForceEngine.compute

    def compute(self, batch, **kw):
        if int(batch.ptr.diff().max()) >= 12:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return real(self, batch, **kw)

    monkeypatch.setattr(ForceEngine, "compute", compute)
    frames = _frames(9)
    src = _write(tmp_path / "in.extxyz", frames)
    out = tmp_path / "out.extxyz"
    big = [k for k, a in enumerate(frames) if len(a) >= 12]
    with pytest.raises(ValueError, match=rf"{len(big)} of 9 input structures were left out") as err:
        predict_file(model, src, out, chunk=4, device="cpu")
    for k in big:
        assert f"structure {k}: does not fit in device memory (12 atoms)" in str(err.value)
    written = ase.io.read(out, ":")
    assert [a.get_chemical_formula() for a in written] == [
        a.get_chemical_formula() for k, a in enumerate(frames) if k not in big
    ]


# ------------------------------------------------------------------------------------- worker processes


def _mixed_frames() -> list[Atoms]:
    frames = _frames(9)
    frames[5] = molecule("SiH4")  # left out: unknown element
    diamond = bulk("C", "diamond", a=3.6)
    diamond.rattle(0.02, seed=3)
    frames.insert(3, diamond)
    squeezed = molecule("CH3CH2OH")
    squeezed.positions *= 0.7  # outside the training envelope: info["domain"]
    frames.append(squeezed)
    return frames


def test_worker_processes_write_the_same_file(model, tmp_path):
    frames = _mixed_frames()
    frames[0].info["name"] = "first frame"  # an info string: the workers' fast codec keeps it
    src = _write(tmp_path / "in.extxyz", frames)
    outs = {}
    for workers in (0, 2):
        out = tmp_path / f"out{workers}.extxyz"
        with pytest.raises(ValueError, match=r"structure 6: unknown element") as err, pytest.warns(OutOfDomainWarning):
            predict_file(model, src, out, chunk=3, device="cpu", stress=True, check_domain=True, workers=workers)
        outs[workers] = (out.read_bytes(), str(err.value).replace(str(out), "OUT"))
    assert outs[2] == outs[0]
    written = ase.io.read(tmp_path / "out2.extxyz", ":")
    assert len(written) == 10 and "stress" in written[3].calc.results and "domain" in written[-1].info
    assert written[0].info["name"] == "first frame"


def test_worker_processes_resume(model, tmp_path, monkeypatch):
    """Interrupted while blocks are still being formatted: those already computed are written first."""
    from mlff_distiller import _extxyz_parallel as par

    src = _write(tmp_path / "in.extxyz", _frames(11))
    whole = tmp_path / "whole.extxyz"
    predict_file(model, src, whole, chunk=3, device="cpu", workers=0)
    out = tmp_path / "out.extxyz"
    monkeypatch.setattr(pf, "run_predictions", _Interrupt(at=3))
    monkeypatch.setattr(par, "_FORMAT_DELAY_S", 0.5)  # the workers write slowly
    with pytest.raises(KeyboardInterrupt):
        predict_file(model, src, out, chunk=3, device="cpu", workers=2)
    monkeypatch.setattr(par, "_FORMAT_DELAY_S", 0.0)
    done = json.loads((tmp_path / ("out.extxyz" + PROGRESS_SUFFIX)).read_text())["state"]["done"]
    assert done == 6 and len(ase.io.read(out, ":")) == 6  # the two blocks computed before it are written
    monkeypatch.setattr(pf, "run_predictions", _Interrupt(at=None))
    assert predict_file(model, src, out, chunk=3, device="cpu", workers=2)["resumed_from"] == done
    assert out.read_bytes() == whole.read_bytes()


def test_worker_processes_and_a_file_cut_short(model, tmp_path):
    frames = _frames(7)
    src = tmp_path / "in.extxyz"
    _write(src, frames)
    text = src.read_text()
    src.write_text(text[: int(len(text) * 0.8)])
    out = tmp_path / "out.extxyz"
    with pytest.raises(ValueError, match=r"in.extxyz: structures \d-\d could not be read"):
        predict_file(model, src, out, chunk=2, device="cpu", workers=2)
    written = ase.io.read(out, ":")
    assert len(written) >= 2 and len(written) % 2 == 0
    assert [a.get_chemical_formula() for a in written] == [a.get_chemical_formula() for a in frames[: len(written)]]


def test_when_worker_processes_are_used(tmp_path, monkeypatch):
    from mlff_distiller import _extxyz_parallel as par

    src = Path(_write(tmp_path / "in.extxyz", _frames(4)))
    assert par.auto_workers(src) == 0  # a small file
    monkeypatch.setattr(par, "MIN_BYTES", 0)
    monkeypatch.setattr(par.os, "cpu_count", lambda: 16)
    assert par.auto_workers(src) == 12
    monkeypatch.setattr(par.os, "cpu_count", lambda: 2)
    assert par.auto_workers(src) == 0
    monkeypatch.setattr(par.os, "cpu_count", lambda: 16)
    ase.io.write(tmp_path / "POSCAR", bulk("C", "diamond", a=3.6), format="vasp")
    assert par.auto_workers(tmp_path / "POSCAR") == 0
    chunks = par.blocks_of(src, 1, 2)
    assert [[(b.first, b.count) for b in c] for c in chunks] == [[(1, 2)], [(3, 1)]]
    assert chunks[-1][-1].end == src.stat().st_size
    src7 = Path(_write(tmp_path / "in7.extxyz", _frames(7)))
    chunks = par.blocks_of(src7, 0, 5, parts=2)  # chunks of 5 frames, each in two blocks
    assert [[(b.first, b.count) for b in c] for c in chunks] == [[(0, 2), (2, 3)], [(5, 1), (6, 1)]]
    assert all(a.end == b.start for c in chunks for a, b in itertools.pairwise(c))
    assert chunks[0][-1].end == chunks[1][0].start and chunks[-1][-1].end == src7.stat().st_size
    (tmp_path / "odd.xyz").write_text("two\ncomment\nH 0 0 0\n")
    assert par.blocks_of(tmp_path / "odd.xyz", 0, 2) is None
    with pytest.raises(ValueError, match="workers must be >= 0"):
        predict_file(MODEL, src, tmp_path / "o.extxyz", device="cpu", workers=-1)


def test_workers_are_the_cli_default_not_the_api_default(tmp_path, monkeypatch):
    """Worker processes re-import the caller's __main__ (forkserver), so a script opts in; the CLI (whose entry
    point guards its __main__) takes the automatic choice."""
    from mlff_distiller import _extxyz_parallel as par

    used, real = [], pf.run_blocks

    def run_blocks(path, chunks, workers, *a, **kw):  # the one-process run for real; no worker processes here
        used.append(workers)
        return real(path, chunks, workers, *a, **kw) if workers == 0 else None

    started = []
    monkeypatch.setattr(pf, "run_blocks", run_blocks)
    monkeypatch.setattr(pf, "start_pool", lambda workers: started.append(workers) or par._InlinePool())
    monkeypatch.setattr(par, "MIN_BYTES", 0)
    monkeypatch.setattr(par.os, "cpu_count", lambda: 16)
    src = _write(tmp_path / "in.extxyz", _frames(3))
    predict_file(MODEL, src, tmp_path / "api.extxyz", device="cpu")
    assert used == [0] and len(ase.io.read(tmp_path / "api.extxyz", ":")) == 3
    main(["predict", "--input", src, "--output", str(tmp_path / "cli.extxyz"), "--device", "cpu"])
    assert used == [0, 12] and started == [12]  # the CLI's workers started before the run, not the API's


def test_one_out_of_domain_warning_for_the_whole_file(model, tmp_path):
    frames = _frames(6)
    for k in (1, 4):  # one in each chunk
        frames[k] = molecule("CH3CH2OH")
        frames[k].positions *= 0.7
    src = _write(tmp_path / "in.extxyz", frames)
    with pytest.warns(OutOfDomainWarning) as record:
        result = predict_file(model, src, tmp_path / "out.extxyz", chunk=3, device="cpu", check_domain=True)
    outside = [w for w in record if issubclass(w.category, OutOfDomainWarning)]
    assert len(outside) == 1 and "2 of 6 structures" in str(outside[0].message)
    assert result["outside_domain"] == 2


def test_started_workers_are_shut_down_when_the_run_fails_early(model, tmp_path, monkeypatch):
    """The workers start before the student is loaded; a run refused after that (another job's unfinished output)
    still shuts them down."""
    from mlff_distiller import _extxyz_parallel as par

    pools = []

    class Pool(par._InlinePool):
        def __init__(self) -> None:
            self.shut = False
            pools.append(self)

        def shutdown(self, wait=True, cancel_futures=False) -> None:
            self.shut = True

    monkeypatch.setattr(pf, "start_pool", lambda workers: Pool())
    src, out = _write(tmp_path / "in.extxyz", _frames(4)), tmp_path / "out.extxyz"
    monkeypatch.setattr(pf, "run_predictions", _Interrupt(at=2))
    with pytest.raises(KeyboardInterrupt):
        predict_file(model, src, out, chunk=2, device="cpu", workers=2)
    assert len(pools) == 1 and pools[0].shut
    monkeypatch.setattr(pf, "run_predictions", _Interrupt(at=None))
    with pytest.raises(ValueError, match="another job"):
        predict_file(model, src, out, chunk=2, device="cpu", precision="fp64", workers=2)
    assert len(pools) == 2 and pools[1].shut


def test_blocks_are_read_here_until_the_workers_have_started(model, tmp_path, monkeypatch):
    """While the workers start (~2 s: their forkserver imports torch), this process reads and writes the blocks
    itself; the workers take over once ready. The same file as one process."""
    from mlff_distiller import _extxyz_parallel as par

    class Starting(par._InlinePool):
        def __init__(self) -> None:
            self.asked, self.submitted = 0, []

        def ready(self) -> bool:
            self.asked += 1
            return self.asked > 3  # the first three tasks find it starting

        def submit(self, fn, *args):
            self.submitted.append(fn.__name__)
            return super().submit(fn, *args)

    pools = []
    monkeypatch.setattr(pf, "start_pool", lambda workers: pools.append(Starting()) or pools[-1])
    src = _write(tmp_path / "in.extxyz", _frames(10))
    predict_file(model, src, tmp_path / "one.extxyz", chunk=2, device="cpu")
    predict_file(model, src, tmp_path / "two.extxyz", chunk=2, device="cpu", workers=2)
    (pool,) = pools
    # 5 chunks of 2 blocks: 10 parse and 10 format tasks; the first three (parses) ran here, the rest in the pool
    assert pool.asked == 20 and len(pool.submitted) == 17 and pool.submitted[0] == "_parse"
    assert (tmp_path / "one.extxyz").read_bytes() == (tmp_path / "two.extxyz").read_bytes()


def test_a_pool_that_fails_to_start_says_why(monkeypatch):
    from mlff_distiller import _extxyz_parallel as par

    def broken(*args, **kwargs):
        raise OSError("no processes left (test)")

    monkeypatch.setattr(par, "ProcessPoolExecutor", broken)
    pool = par.start_pool(2)
    with pytest.raises(OSError, match="no processes left"):
        pool.submit(int)
    assert pool.ready()
    pool.shutdown()  # nothing started, nothing to stop
