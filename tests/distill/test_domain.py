"""The training data's envelope (shortest pair per element pair, most neighbours per element), stored by training and
checked on new structures: no teacher, no second student."""

import json

import ase.io
import numpy as np
import pytest
import torch
from ase import Atoms
from ase.build import molecule
from ase.calculators.emt import EMT
from ase.calculators.singlepoint import SinglePointCalculator
from helpers import make_model

from mlff_distiller import AtomsBatch, FrameTable, load_model, predict_forces
from mlff_distiller.cli import main
from mlff_distiller.distill import FrameDataset, train
from mlff_distiller.domain import DomainEnvelope


def _md_like(name: str, n: int, rattle: float = 0.05, seed: int = 0) -> list[Atoms]:
    out = []
    for k in range(n):
        a = molecule(name)
        a.rattle(rattle, seed=seed + k)
        out.append(a)
    return out


def _labelled(frames):
    for a in frames:
        a.calc = EMT()
        e, f = a.get_potential_energy(), a.get_forces()
        a.calc = SinglePointCalculator(a, energy=e, forces=f)
    return frames


def _same(a: DomainEnvelope, b: DomainEnvelope, tol: float = 1e-5) -> bool:
    """Equal up to float32 rounding of the distances (training keeps its frames in float32)."""
    return (
        a.cutoff == b.cutoff
        and a.frames == b.frames
        and a.max_neighbors == b.max_neighbors
        and set(a.min_distance) == set(b.min_distance)
        and all(abs(a.min_distance[k] - b.min_distance[k]) <= tol for k in a.min_distance)
    )


def test_envelope_of_frames_matches_a_direct_count():
    frames = _md_like("CH3CH2OH", 6) + _md_like("H2O", 3)
    env = DomainEnvelope.from_frames(frames, cutoff=4.0)
    want_d: dict = {}
    want_n: dict = {}
    for a in frames:
        d = a.get_all_distances()
        z = a.numbers
        for i in range(len(a)):
            near = [j for j in range(len(a)) if j != i and d[i, j] <= 4.0]
            want_n[int(z[i])] = max(want_n.get(int(z[i]), 0), len(near))
            for j in near:
                key = tuple(sorted((int(z[i]), int(z[j]))))
                want_d[key] = min(want_d.get(key, np.inf), d[i, j])
    assert set(env.min_distance) == set(want_d) and env.max_neighbors == want_n and env.frames == 9
    for key, value in want_d.items():
        assert env.min_distance[key] == pytest.approx(value, abs=1e-9)
    again = DomainEnvelope.from_dict(json.loads(json.dumps(env.to_dict())))
    assert again == env


def test_periodic_frames_count_images():
    """A periodic cell: the pairs through the boundary count (a 2-atom cell of 1.5 Å has each atom's images)."""
    cell = Atoms("H2", positions=[[0, 0, 0], [0.75, 0, 0]], cell=[1.5, 8.0, 8.0], pbc=True)
    env = DomainEnvelope.from_frames([cell], cutoff=2.0)
    assert env.min_distance[(1, 1)] == pytest.approx(0.75)
    # Within 2 Å along x: images at 0.75, 1.5 (itself shifted), 2.25 > 2 ... per atom: +-0.75, +-1.5 -> 4
    assert env.max_neighbors[1] == 4


def test_check_names_what_is_outside():
    frames = _md_like("CH3CH2OH", 8)
    env = DomainEnvelope.from_frames(frames, cutoff=4.0)
    inside = molecule("CH3CH2OH")
    inside.rattle(0.03, seed=99)
    assert env.check(inside) == []
    squeezed = molecule("CH3CH2OH")
    squeezed.positions *= 0.7  # every bond 30 % short
    found = env.check(squeezed)
    assert found and any("pair at" in f for f in found), found
    new_pair = Atoms("N2", positions=[[0, 0, 0], [1.1, 0, 0]])  # N: never in the data
    assert any("N-N pairs" in f and "none in the training data" in f for f in env.check(new_pair))
    crowded = molecule("CH3CH2OH")
    crowded.set_cell([3.0, 3.0, 3.0])
    crowded.pbc = True  # a 3 Å periodic cell: images crowd every atom
    assert any("neighbours within" in f for f in env.check(crowded, limit=20))


def test_training_stores_the_envelope_and_fine_tuning_merges_it(tmp_path, capsys):
    from distill_helpers import small_train_config

    frames = _labelled(_md_like("CH3CH2OH", 24, rattle=0.08))
    cfg = small_train_config(max_steps=4, eval_every=2)
    result = train(frames[:18], frames[18:], cfg, tmp_path / "a", log=lambda m: None)
    saved = load_model(tmp_path / "a" / "best.pt")
    env = DomainEnvelope.of_model(saved)
    assert _same(env, DomainEnvelope.from_frames(frames[:18], cfg.model.cutoff))
    assert DomainEnvelope.of_model(result.model) == env
    # A FrameDataset given instead of frames: the same envelope.
    ds = FrameDataset(frames[:18], cfg.model.cutoff)
    assert _same(DomainEnvelope.from_dataset(ds), env)
    # Fine-tuning on water frames: the stored envelope covers both sets.
    water = _labelled(_md_like("H2O", 12, rattle=0.08))
    tuned = train(water[:9], water[9:], cfg, tmp_path / "b", model=saved, log=lambda m: None)
    merged = DomainEnvelope.of_model(load_model(tmp_path / "b" / "best.pt"))
    water_env = DomainEnvelope.from_frames(water[:9], cfg.model.cutoff)
    for key in set(env.min_distance) | set(water_env.min_distance):
        want = min(env.min_distance.get(key, np.inf), water_env.min_distance.get(key, np.inf))
        assert merged.min_distance[key] == pytest.approx(want, abs=1e-5)
    assert merged.frames == 18 + 9 and DomainEnvelope.of_model(tuned.model) == merged
    # A resumed fine-tuning run keeps the merged envelope its state recorded.
    longer = small_train_config(max_steps=6, eval_every=2)
    resumed = train(water[:9], water[9:], longer, tmp_path / "b", resume=True, log=lambda m: None)
    assert resumed.steps == 6 and DomainEnvelope.of_model(resumed.model) == merged
    assert DomainEnvelope.of_model(load_model(tmp_path / "b" / "last.pt")) == merged
    # From a student without an envelope (the shipped ones), fine-tuning records none: its domain is unknown.
    # mlff-distill check with this one student: the squeezed and the periodic-crowded structures are flagged.
    structures = tmp_path / "in.xyz"
    squeezed = molecule("CH3CH2OH")
    squeezed.positions *= 0.7
    ase.io.write(structures, [molecule("H2O"), squeezed, molecule("CH3CH2OH")])
    report = tmp_path / "report.json"
    argv = ["check", "--input", str(structures), "--models", str(tmp_path / "b" / "best.pt"), "--output", str(report)]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["flagged_indices"] == [1] and out["envelope_frames"] == 27 and "1 of 3" in out["verdict"]
    assert [r["index"] for r in json.loads(report.read_text()) if r["outside"]] == [1]
    saved.metadata.pop("domain")
    blind = train(water[:9], water[9:], cfg, tmp_path / "c", model=saved, log=lambda m: None)
    assert DomainEnvelope.of_model(load_model(tmp_path / "c" / "best.pt")) is None
    assert DomainEnvelope.of_model(blind.model) is None


@pytest.mark.parametrize("name", ["builtin:chno-gfn2", "builtin:chno-gfn2-small"])
def test_shipped_students_carry_their_training_envelope(name):
    """Recorded from a relabelling of their recipe (the same 13,179 training frames): the closed-shell CHNO g2
    molecules lie inside, rattled too; squeezed ethanol, liquid water (three times the neighbours of any gas-phase
    atom) and an element the students never saw lie outside."""
    env = DomainEnvelope.of_model(load_model(name))
    assert env is not None and env.frames == 13179 and env.cutoff == 5.0
    assert set(env.max_neighbors) == {1, 6, 7, 8}
    from mlff_distiller.distill import g2_chno

    chno = g2_chno()  # the recipe's 61 closed-shell seeds
    assert len(chno) == 61 and not any(env.check(m) for m in chno)
    assert not any(env.check(m) for m in _md_like("CH3CH2OH", 3) + _md_like("C6H6", 3))
    squeezed = molecule("CH3CH2OH")
    squeezed.positions *= 0.7
    water = _water_box(4)  # 192 atoms at ~1 g/cm³
    assert env.check(squeezed) and any("neighbours" in f for f in env.check(water))
    assert any("pairs within" in f for f in env.check(molecule("CH3Cl")))


def test_calculator_warns_when_a_structure_leaves_the_envelope(tmp_path):
    """StudentCalculator checks the first calculation and every check_domain-th after; it warns when a check finds the
    structure outside after one that did not, and keeps the findings in calc.domain_findings."""
    import warnings

    from distill_helpers import small_train_config

    from mlff_distiller import StudentCalculator
    from mlff_distiller.domain import OutOfDomainWarning

    frames = _labelled(_md_like("CH3CH2OH", 16, rattle=0.08))
    model = train(frames[:12], frames[12:], small_train_config(max_steps=2, eval_every=2), log=lambda m: None).model
    atoms = molecule("CH3CH2OH")
    atoms.calc = StudentCalculator(model, device="cpu", check_domain=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OutOfDomainWarning)
        atoms.get_forces()  # calculation 1: checked, inside
    assert atoms.calc.domain_findings == []
    atoms.positions *= 0.7
    with warnings.catch_warnings():
        warnings.simplefilter("error", OutOfDomainWarning)
        atoms.get_forces()  # calculation 2: not checked
    with pytest.warns(OutOfDomainWarning, match="outside the student's training data: a .* pair at"):
        atoms.positions *= 1.0001
        atoms.get_forces()  # calculation 3: checked, outside
    assert atoms.calc.domain_findings
    # No checks at all, or a student without an envelope: never a warning.
    bare = make_model(seed=4, species=[1, 6, 8])
    for calc in (StudentCalculator(model, device="cpu", check_domain=None), StudentCalculator(bare, device="cpu")):
        squeezed = atoms.copy()
        squeezed.calc = calc
        with warnings.catch_warnings():
            warnings.simplefilter("error", OutOfDomainWarning)
            squeezed.get_forces()
        assert calc.domain_findings == []
    with pytest.raises(ValueError, match="check_domain"):
        StudentCalculator(model, device="cpu", check_domain=0)


def _student_with_envelope(frames):
    """A random student that stores the envelope of ``frames`` (as training would)."""
    model = make_model(seed=2)
    model.metadata = {"domain": DomainEnvelope.from_frames(frames, cutoff=model.cutoff).to_dict()}  # as load_model
    return model


def test_predict_forces_checks_the_envelope_when_asked():
    import warnings

    from mlff_distiller import predict_forces
    from mlff_distiller.domain import OutOfDomainWarning

    model = _student_with_envelope(_md_like("CH3CH2OH", 8) + _md_like("H2O", 4))
    inside = _md_like("CH3CH2OH", 2, seed=50) + _md_like("H2O", 1, seed=60)
    squeezed = molecule("CH3CH2OH")
    squeezed.positions *= 0.7
    structures = [inside[0], squeezed, inside[1], molecule("NH3"), inside[2]]
    with pytest.warns(OutOfDomainWarning, match=r"2 of 5 structures lie outside") as record:
        out = predict_forces(model, structures, device="cpu", check_domain=True)
    assert len(record) == 1
    assert [bool(r["domain"]) for r in out] == [False, True, False, True, False]
    assert any("pair at" in f for f in out[1]["domain"]) and any("H-N pairs" in f for f in out[3]["domain"])
    # The same energies and forces as without the check, and no "domain" key then.
    plain = predict_forces(model, structures, device="cpu")
    for a, b in zip(out, plain, strict=True):
        assert "domain" not in b and a["energy"] == b["energy"] and np.array_equal(a["forces"], b["forces"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", OutOfDomainWarning)
        assert all(r["domain"] == [] for r in predict_forces(model, inside, device="cpu", check_domain=True))
    with pytest.raises(ValueError, match="stores no training envelope"):
        predict_forces(make_model(seed=4), inside, device="cpu", check_domain=True)


def test_predict_forces_names_failed_structures_outside_the_envelope(monkeypatch):
    """A non-finite output keeps the partial results; with check_domain they carry their findings and the error
    names the failed structures that lie outside."""
    from mlff_distiller import ForceEngine, predict_forces
    from mlff_distiller.batching import NonFiniteOutputError
    from mlff_distiller.domain import OutOfDomainWarning

    model = _student_with_envelope(_md_like("CH3CH2OH", 8))
    squeezed = molecule("CH3CH2OH")
    squeezed.positions *= 0.6
    structures = [_md_like("CH3CH2OH", 1, seed=70)[0], squeezed, _md_like("CH3CH2OH", 1, seed=80)[0]]

    def failing(self, structures, **kw):
        raise NonFiniteOutputError("non-finite output for structures [1, 2]", [1, 2], [{"energy": 0.0}, None, None])

    monkeypatch.setattr(ForceEngine, "predict", failing)
    with pytest.raises(
        NonFiniteOutputError, match=r"outside the training envelope among them: structures \[1\]"
    ) as err:
        with pytest.warns(OutOfDomainWarning):
            predict_forces(model, structures, device="cpu", check_domain=True)
    assert err.value.results[0]["domain"] == [] and err.value.results[1] is None


def test_cli_predict_checks_the_envelope(tmp_path, capsys):
    from mlff_distiller.domain import OutOfDomainWarning

    frames = _md_like("CH3CH2OH", 8)
    model = _student_with_envelope(frames)
    ckpt = tmp_path / "student.pt"
    model.save(ckpt, metadata=model.metadata)
    squeezed = molecule("CH3CH2OH")
    squeezed.positions *= 0.7
    ase.io.write(tmp_path / "in.extxyz", [_md_like("CH3CH2OH", 1, seed=90)[0], squeezed])
    args = ["predict", "--model", str(ckpt), "--input", str(tmp_path / "in.extxyz"), "--device", "cpu"]
    with pytest.warns(OutOfDomainWarning):
        assert main([*args, "--output", str(tmp_path / "out.extxyz"), "--check-domain"]) == 0
    assert json.loads(capsys.readouterr().out)["outside_domain"] == 1
    out = ase.io.read(tmp_path / "out.extxyz", ":")
    assert "domain" not in out[0].info and "pair at" in out[1].info["domain"]
    assert main([*args, "--output", str(tmp_path / "plain.extxyz")]) == 0  # without the flag: no check
    assert "outside_domain" not in json.loads(capsys.readouterr().out)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_check_on_the_gpu_equals_the_host_check():
    """The envelope check with its neighbour list and reductions on the GPU (what the calculator and predict_forces
    use from 1,000 atoms on) finds what the host check finds."""
    from mlff_distiller.domain import _frame_stats

    env = DomainEnvelope.of_model(load_model("builtin:chno-gfn2"))
    squeezed = molecule("CH3CH2OH")
    squeezed.positions *= 0.7
    boxes = []
    for n in (4, 10):  # 192 and 3,000 atoms of water at ~1 g/cm³, rattled
        box = _water_box(n)
        box.rattle(0.05, seed=n)
        boxes.append(box)
    for atoms in [molecule("C6H6"), squeezed, molecule("CH3Cl"), *boxes, *_duplicated()]:
        assert env.check(atoms, device="cuda") == env.check(atoms), atoms.get_chemical_formula()
    frames = _md_like("CH3CH2OH", 5) + boxes
    on_gpu = DomainEnvelope(5.0, *_frame_stats(frames, 5.0, "cuda"), len(frames))
    assert _same(on_gpu, DomainEnvelope.from_frames(frames, 5.0), tol=1e-12)


def _water_box(n: int) -> Atoms:
    water = molecule("H2O")
    water.cell = [3.1, 3.1, 3.1]
    water.center()
    water.pbc = True
    return water.repeat((n, n, n))


def test_large_structures_are_checked_on_the_callers_gpu():
    from mlff_distiller.domain import GPU_CHECK_MIN_ATOMS

    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert DomainEnvelope.check_device(GPU_CHECK_MIN_ATOMS, gpu) == gpu
    assert DomainEnvelope.check_device(GPU_CHECK_MIN_ATOMS - 1, gpu) is None
    assert DomainEnvelope.check_device(10**6, cpu) is None


def _mixed_for_check() -> list[Atoms]:
    """Inside, squeezed (a short pair), crowded (too many neighbours), an element pair never seen, a single atom,
    periodic boxes, and rattled MD-like frames."""
    out = _md_like("CH3CH2OH", 6) + _md_like("CH4", 3, seed=5)
    squeezed = molecule("CH3CH2OH")
    squeezed.positions *= 0.7
    crowded = molecule("CH4")
    crowded.positions *= 0.95
    out += [squeezed, crowded, molecule("CH3Cl"), Atoms("H", positions=[[0, 0, 0]]), molecule("O2")]
    box = _water_box(2)
    box.rattle(0.1, seed=3)
    out += [box, molecule("C6H6"), _md_like("CH3CH2OH", 1, rattle=0.3, seed=9)[0]]
    cluster = Atoms()  # eight methanes 3.6 Å apart: only the neighbour counts are outside
    for x in (0, 3.6):
        for y in (0, 3.6):
            for zz in (0, 3.6):
                m = molecule("CH4")
                m.positions += (x, y, zz)
                cluster += m
    return [*out, cluster, *_duplicated()]


def _duplicated() -> list[Atoms]:
    """A methane with one hydrogen listed twice, and a periodic water box with an oxygen listed twice (a duplicated
    atom, e.g. a structure file that lists a boundary atom at both ends of the cell)."""
    twin = molecule("CH4")
    twin += twin[2]
    box = _water_box(2)
    box.rattle(0.05, seed=4)
    box += box[9]
    return [twin, box]


@pytest.mark.parametrize("tolerances", [{}, {"distance_tolerance": 0.99, "neighbor_tolerance": 1.0}])
def test_check_many_finds_what_check_finds(tolerances, monkeypatch):
    """The batched screen flags exactly the structures with findings, and their findings are check's own; also with
    screens smaller than the input (several batches) and with other tolerances."""
    from mlff_distiller import domain

    env = DomainEnvelope.from_frames(_md_like("CH3CH2OH", 12) + _md_like("CH4", 4, seed=2), 5.0)
    frames = _mixed_for_check()
    expected = [env.check(a, **tolerances) for a in frames]
    assert any(expected) and not all(expected)
    assert env.check_many(frames, **tolerances) == expected
    monkeypatch.setattr(domain, "_SCREEN", 4)
    assert env.check_many(frames, **tolerances) == expected
    assert env.check_many(frames, limit=1, **tolerances) == [f[:1] for f in expected]
    assert env.check_many([]) == []


def test_check_many_with_the_shipped_envelope():
    env = DomainEnvelope.of_model(load_model("builtin:chno-gfn2"))
    frames = _mixed_for_check()
    assert env.check_many(frames, device=torch.device("cpu")) == [env.check(a) for a in frames]


def _as_table(frames: list[Atoms]) -> FrameTable:
    return FrameTable(
        np.concatenate([a.numbers for a in frames]),
        np.concatenate([a.positions for a in frames]),
        np.stack([a.cell.array for a in frames]),
        np.stack([a.pbc for a in frames]),
        [len(a) for a in frames],
    )


def _larger_on_the_device(monkeypatch):
    """Structures of 20 atoms or more take the per-structure device branch of check_many (here on the CPU)."""
    monkeypatch.setattr(DomainEnvelope, "check_device", staticmethod(lambda n, device: device if n >= 20 else None))
    return torch.device("cpu")


@pytest.mark.parametrize("tolerances", [{}, {"distance_tolerance": 0.99, "neighbor_tolerance": 1.0}])
def test_check_many_of_a_frame_table_is_that_of_its_atoms(tolerances, monkeypatch):
    """A FrameTable of molecules and periodic boxes, inside and outside, gets the findings of the same list of
    Atoms: in one screen, in several, with a limit, and with its larger structures checked one by one."""
    from mlff_distiller import domain

    env = DomainEnvelope.from_frames(_md_like("CH3CH2OH", 12) + _md_like("CH4", 4, seed=2), 5.0)
    frames = _mixed_for_check()
    table = _as_table(frames)
    expected = env.check_many(frames, **tolerances)
    assert any(expected) and not all(expected)
    assert env.check_many(table, **tolerances) == expected
    assert env.check_many(table, limit=1, **tolerances) == env.check_many(frames, limit=1, **tolerances)
    monkeypatch.setattr(domain, "_SCREEN", 4)
    assert env.check_many(table, **tolerances) == expected
    device = _larger_on_the_device(monkeypatch)
    assert env.check_many(table, device=device, **tolerances) == env.check_many(frames, device=device, **tolerances)
    assert env.check_many(table[:0]) == []


def test_check_many_of_a_frame_table_builds_atoms_only_for_structures_checked_alone(monkeypatch):
    """Structures the batched screen finds inside build no ``ase.Atoms``: only those found outside, and those of the
    per-structure (GPU) branch, are indexed."""
    from mlff_distiller import domain

    env = DomainEnvelope.from_frames(_md_like("CH3CH2OH", 12) + _md_like("CH4", 4, seed=2), 5.0)
    frames = _mixed_for_check()
    table = _as_table(frames)
    outside = {k for k, found in enumerate(env.check_many(frames)) if found}
    built: list[int] = []
    getitem = FrameTable.__getitem__

    def counting(self, k):
        if not isinstance(k, slice):
            built.append(k)
        return getitem(self, k)

    monkeypatch.setattr(FrameTable, "__getitem__", counting)
    monkeypatch.setattr(domain, "_SCREEN", 4)
    env.check_many(table)
    assert sorted(built) == sorted(outside)
    built.clear()
    env.check_many(table, device=_larger_on_the_device(monkeypatch))
    assert sorted(built) == sorted(outside | {k for k, a in enumerate(frames) if len(a) >= 20})


def test_check_names_atoms_at_the_same_position():
    """Two atoms of one structure at exactly the same position (which no neighbour list pairs, so the student's
    energy ignores them): named by check, screened by check_many, warned about by the calculator; equal atoms of
    different structures, or at -0.0 and 0.0, are told apart correctly."""
    from mlff_distiller import StudentCalculator
    from mlff_distiller.domain import _coincident

    model = load_model("builtin:chno-gfn2")
    env = DomainEnvelope.of_model(model)
    rng = np.random.default_rng(0)
    for trial in range(6):
        a = molecule(["CH3CH2OH", "C6H6", "CH4"][trial % 3])
        a.rattle(0.05, seed=trial)
        k = int(rng.integers(len(a)))
        at = int(rng.integers(len(a) + 1))
        doubled = a[:at] + a[k : k + 1] + a[at:]  # atom k listed again at index `at`
        first, second = sorted((k + (k >= at), at))
        found = env.check(doubled)
        names = f"({doubled[first].symbol} and {doubled[second].symbol})"
        assert found[0].startswith(f"atoms {first} and {second} {names} at the same position"), found
        assert env.check(a) == [] and env.check_many([a, doubled, a]) == [[], found, []]
    triple = molecule("H2O") + molecule("H2O")[1:2] + molecule("H2O")[1:2]  # an H three times
    assert env.check(triple)[0].startswith("atoms 1 and 3 (H and H) at the same position (2 such pairs)")
    signed = Atoms("HH", positions=[[0.0, 1.0, 0.0], [-0.0, 1.0, 0.0]])
    assert _coincident(AtomsBatch.from_atoms(signed)).tolist() == [[0, 1]]
    copies = AtomsBatch.from_atoms([molecule("C6H6")] * 5)  # the same positions in five structures: no twins
    assert _coincident(copies).shape == (0, 2)
    # Periodic: an atom listed again one lattice vector away (fractional 0 and 1) is at distance 0 from the
    # other's image, which no neighbour list pairs either; in a cubic and in a triclinic cell, next to clean boxes.
    box = _water_box(2)
    box.rattle(0.05, seed=5)
    cubic = box + Atoms("O", positions=[box.positions[3] + box.cell[0]])
    skew = box.copy()
    skew.set_cell(skew.cell.array + rng.normal(0, 0.3, (3, 3)), scale_atoms=True)
    skew_twin = skew + Atoms("H", positions=[skew.positions[4] + skew.cell[1] - 2 * skew.cell[2]])
    n = len(box)
    got = _coincident(AtomsBatch.from_atoms([box, cubic, skew, skew_twin])).tolist()
    assert got == [[n + 3, 2 * n], [3 * n + 1 + 4, 4 * n + 1]], got  # (box, cubic, skew, skew_twin) in a row
    assert env.check(cubic)[0].startswith(f"atoms 3 and {n} (O and O) at the same position"), env.check(cubic)
    doubled = molecule("CH4")
    doubled += doubled[0]
    doubled.calc = StudentCalculator(model, device="cpu")
    with pytest.warns(UserWarning, match="atoms 0 and 5 .C and C. at the same position"):
        doubled.get_potential_energy()


def test_training_puts_the_wall_below_the_data(tmp_path):
    """Training sets the ZBL wall from the training frames' shortest pairs (0.9 x each), zero on every training
    frame; fine-tuning recomputes it from the merged envelope; ``repulsion: false`` trains without one."""
    from distill_helpers import small_train_config

    frames = _labelled(_md_like("CH3CH2OH", 24, rattle=0.08))
    cfg = small_train_config(max_steps=2, eval_every=2)
    result = train(frames[:18], frames[18:], cfg, tmp_path / "a", log=lambda m: None)
    saved = load_model(tmp_path / "a" / "best.pt")
    env = DomainEnvelope.from_frames(frames[:18], cfg.model.cutoff)
    want = env.repulsion_radii(saved.species_list)
    got = {(za, zb): r for za, zb, r in saved.config.repulsion}
    assert set(got) == set(want) and all(got[k] == pytest.approx(want[k], abs=1e-5) for k in want)
    assert got[(1, 6)] == pytest.approx(0.9 * env.min_distance[(1, 6)], abs=1e-5)
    assert result.model.config.repulsion == saved.config.repulsion
    # Zero on the training frames: the same energies as the student without it.
    bare = load_model(tmp_path / "a" / "best.pt")
    bare.set_repulsion(None)
    walled = [r["energy"] for r in predict_forces(saved, frames[:18], device="cpu", precision="fp64")]
    assert walled == [r["energy"] for r in predict_forces(bare, frames[:18], device="cpu", precision="fp64")]
    # Fine-tuning on frames with a shorter C-H: the radius follows the merged envelope.
    short = _labelled(_md_like("CH4", 8, rattle=0.25, seed=3))
    tuned = train(short[:6], short[6:], cfg, tmp_path / "b", model=saved, log=lambda m: None)
    merged = DomainEnvelope.of_model(tuned.model)
    assert merged.min_distance[(1, 6)] < env.min_distance[(1, 6)]
    got = {(za, zb): r for za, zb, r in tuned.model.config.repulsion}
    assert got[(1, 6)] == pytest.approx(0.9 * merged.min_distance[(1, 6)], abs=1e-5)
    off = train(frames[:18], frames[18:], small_train_config(max_steps=2, repulsion=False), tmp_path / "c",
                log=lambda m: None)  # fmt: skip
    assert off.model.config.repulsion is None and load_model(tmp_path / "c" / "best.pt").repulsion_table is None
