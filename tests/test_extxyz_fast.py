"""The fast extxyz reader and writer of ``mlff-distill predict`` (``mlff_distiller._extxyz_fast``): on the frames
it takes, exactly ASE's arrays and ASE's bytes; everything else declined (for ASE), and ``predict_file``'s output
the same either way."""

from __future__ import annotations

import io

import ase.io
import numpy as np
import pytest
from ase import Atoms
from ase.build import bulk, molecule
from ase.calculators.singlepoint import SinglePointCalculator

import mlff_distiller._extxyz_fast as fast
import mlff_distiller._extxyz_parallel as par
from mlff_distiller import load_model
from mlff_distiller._extxyz_parallel import frames_text
from mlff_distiller.predict_stream import predict_file


def _text(frames: list[Atoms]) -> str:
    buf = io.StringIO()
    ase.io.write(buf, frames, format="extxyz")
    return buf.getvalue()


def _random_frames(rng: np.random.Generator, n: int) -> list[Atoms]:
    """Molecules, periodic cells (triclinic, partly periodic, scaled to odd floats), frames with kept columns
    (initial_magmoms, momenta) and with calculator results in the input (energy, forces, stress, free_energy)."""
    names = ["H2O", "CH4", "C6H6", "CH3CH2OH", "NH3", "HCN", "CH3", "O2"]
    out = []
    for k in range(n):
        kind = k % 5
        if kind == 3:
            a = bulk("C", "diamond", a=3.57 + rng.uniform(-0.2, 0.2)) * (1, 1, 2)
            a.set_cell(a.cell.array + rng.normal(0, 0.3, (3, 3)), scale_atoms=True)
            a.pbc = [True, True, rng.random() < 0.5]
        else:
            a = molecule(names[int(rng.integers(len(names)))])
        a.positions += rng.normal(0, 0.3, a.positions.shape) * 10.0 ** rng.integers(-6, 2)
        if kind == 1:
            a.set_initial_magnetic_moments(rng.normal(size=len(a)))
        if kind == 2:
            a.set_momenta(rng.normal(size=(len(a), 3)))
        if k % 3 == 0:  # info strings ASE reads as such: kept in the output
            a.info["name"] = ["2-butyne", "1,2-dichloro ethane", "x-ray"][k % 2]
        if k % 6 == 1:
            a.info["config_type"] = "md frame"
            a.info["domain"] = "an input finding"  # replaced where the result has one (frames_text does so)
        if kind in (3, 4):
            results = {"energy": float(rng.normal() * 100), "forces": rng.normal(size=(len(a), 3))}
            if kind == 3:
                results["stress"] = rng.normal(size=6)
                results["free_energy"] = results["energy"] - 0.01
            a.calc = SinglePointCalculator(a, **results)
        out.append(a)
    return out


def _results(rng: np.random.Generator, frames: list[Atoms]) -> list[dict | None]:
    rows = []
    for k, a in enumerate(frames):
        if k % 7 == 6:
            rows.append(None)  # left out
            continue
        row = {
            "energy": float(rng.normal() * 10.0 ** rng.integers(-3, 4)),
            "forces": rng.normal(size=(len(a), 3)) * 10.0 ** rng.integers(-4, 3),
            "energies": rng.normal(size=len(a)),
        }
        if a.pbc.all():
            row["stress"] = rng.normal(size=6) * 1e-3
        if k % 4 == 1:
            row["domain"] = ['an "H-H" pair at 0.3 Å; shorter than seen (0.6 Å)', "12 neighbours of O"]
        rows.append(row)
    return rows


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reads_what_ase_reads_and_writes_what_ase_writes(seed):
    rng = np.random.default_rng(seed)
    frames = _random_frames(rng, 40)
    text = _text(frames)
    assert fast.parse_frames(text) is None  # info strings: taken only with info=True
    arrays = fast.parse_frames(text, info=True)
    assert arrays is not None
    numbers, positions, cells, pbc, counts, kept, infos = arrays
    read = ase.io.read(io.StringIO(text), index=":", format="extxyz")
    assert infos == [a.info for a in read] and any(infos)
    assert counts.tolist() == [len(a) for a in read]
    np.testing.assert_array_equal(numbers, np.concatenate([a.numbers for a in read]))
    np.testing.assert_array_equal(positions, np.concatenate([a.positions for a in read]))  # bit for bit
    np.testing.assert_array_equal(cells, np.stack([a.cell.array for a in read]))
    np.testing.assert_array_equal(pbc, np.stack([a.pbc for a in read]))
    for a, columns in zip(read, kept, strict=True):
        extra = {k: v for k, v in a.arrays.items() if k not in ("numbers", "positions")}
        assert [name for name, _ in columns] == list(extra)
        for name, values in columns:
            np.testing.assert_array_equal(values.reshape(extra[name].shape), extra[name])
    results = _results(rng, read)
    assert fast.format_frames(arrays, results) == frames_text(read, results)


def test_lines_as_ase_reads_them():
    """Lower-case symbols (ASE capitalises), tokens past the declared columns (ASE ignores them), CRLF line ends,
    a Lattice without pbc (periodic), a zero Lattice (no cell written), a "charge" column (ASE's name for the
    calculator's charges: dropped) beside a kept one, blank lines at the end."""
    text = (
        '2\r\nLattice="4.0 0.0 0.0 0.0 5.0 0.0 0.5 0.0 6.0" Properties=species:S:1:pos:R:3 energy=-1.5\r\n'
        "cl 0.1 0.2 0.3 extra tokens\r\nC 1 2 3\r\n"
        '1\nLattice="0 0 0 0 0 0 0 0 0" pbc="F F F"\nh 1e-3 -2.5E1 3\n'
        "1\nProperties=species:S:1:pos:R:3:charge:R:1:initial_magmoms:R:1\nO 0 0 0 -0.5 2.0\n\n\n"
    )
    arrays = fast.parse_frames(text)
    read = ase.io.read(io.StringIO(text), index=":", format="extxyz")
    assert arrays is not None and len(read) == 3
    np.testing.assert_array_equal(arrays[0], [17, 6, 1, 8])
    np.testing.assert_array_equal(arrays[1], np.concatenate([a.positions for a in read]))
    np.testing.assert_array_equal(arrays[2], np.stack([a.cell.array for a in read]))
    np.testing.assert_array_equal(arrays[3], np.stack([a.pbc for a in read]))
    results = _results(np.random.default_rng(3), read)
    assert fast.format_frames(arrays, results) == frames_text(read, results)


DECLINED = {
    "an info key that ASE keeps": '1\nProperties=species:S:1:pos:R:3 config_type=bulk pbc="F F F"\nH 0 0 0\n',
    "a number ASE keeps as info": '1\nProperties=species:S:1:pos:R:3 temperature=300 pbc="F F F"\nH 0 0 0\n',
    "a plain xyz comment": "1\nwater molecule\nH 0 0 0\n",
    "a flag without value": '1\nProperties=species:S:1:pos:R:3 relaxed pbc="F F F"\nH 0 0 0\n',
    "an integer column": "1\nProperties=species:S:1:pos:R:3:tags:I:1\nH 0 0 0 3\n",
    "a Z column": "1\nProperties=species:S:1:pos:R:3:Z:I:1\nH 0 0 0 1\n",
    "a constraint": "1\nProperties=species:S:1:pos:R:3:move_mask:L:1\nH 0 0 0 T\n",
    "initial charges": "1\nProperties=species:S:1:pos:R:3:initial_charges:R:1\nH 0 0 0 0.5\n",
    "another column order": "1\nProperties=pos:R:3:species:S:1\n0 0 0 H\n",
    "pbc without a cell": '1\nProperties=species:S:1:pos:R:3 pbc="T T T"\nH 0 0 0\n',
    "an unknown element": "1\nProperties=species:S:1:pos:R:3\nXx 0 0 0\n",
    "a number ASE cannot read": "1\nProperties=species:S:1:pos:R:3\nH 0 0 0.1.2\n",
    "a result that is not a number": "1\nProperties=species:S:1:pos:R:3:forces:R:3\nH 0 0 0 1 2 x\n",
    "a short line": "2\nProperties=species:S:1:pos:R:3\nH 0 0 0\nH 0 0\n",
    "too few lines": "3\nProperties=species:S:1:pos:R:3\nH 0 0 0\nH 0 0 1\n",
    "a blank line between frames": "1\n\nH 0 0 0\n\n1\n\nH 0 0 1\n",
    "a quoted escape": '1\nProperties=species:S:1:pos:R:3 energy="1 \\" 2"\nH 0 0 0\n',
    "a key given twice": '1\nProperties=species:S:1:pos:R:3 pbc="F F F" pbc="F F F"\nH 0 0 0\n',
    "no atoms": "0\nProperties=species:S:1:pos:R:3\n",
    "a count that is not a number": "one\n\nH 0 0 0\n",
    "a Lattice of 6 numbers": '1\nLattice="1 0 0 0 1 0"\nH 0 0 0\n',
    "a stress of 6 numbers (ASE wants 9)": '1\nProperties=species:S:1:pos:R:3 stress="1 2 3 4 5 6"\nH 0 0 0\n',
    "an empty value (ASE joins it to the next pair)": (
        '1\nProperties=species:S:1:pos:R:3 energy="" pbc="F F F"\nH 0 0 0\n'
    ),
}


@pytest.mark.parametrize("case", sorted(DECLINED))
def test_declines_what_it_does_not_take(case):
    assert fast.parse_frames(DECLINED[case]) is None


def test_predict_file_writes_the_same_through_ase_and_the_fast_codec(tmp_path, monkeypatch):
    """A file mixing frames the codec takes with frames it declines (ASE reads and writes those blocks), in one
    process and in chunks: the same bytes as with the codec switched off."""
    rng = np.random.default_rng(7)
    frames = _random_frames(rng, 12)
    frames[5].info["temperature"] = 300  # a number in the info (ASE keeps it): its block goes through ASE
    src = tmp_path / "in.extxyz"
    ase.io.write(src, frames, format="extxyz")
    model = load_model("builtin:chno-gfn2")
    calls = []
    real = fast.parse_frames

    def counting(text, info=False):
        out = real(text, info=info)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(par, "parse_frames", counting)
    predict_file(model, src, tmp_path / "fast.extxyz", chunk=3, device="cpu", precision="fp64", stress=True)
    assert True in calls and False in calls  # both kinds of block were met
    monkeypatch.setattr(par, "parse_frames", lambda text, info=False: None)
    predict_file(model, src, tmp_path / "ase.extxyz", chunk=3, device="cpu", precision="fp64", stress=True)
    assert (tmp_path / "fast.extxyz").read_bytes() == (tmp_path / "ase.extxyz").read_bytes()
    written = ase.io.read(tmp_path / "fast.extxyz", ":")
    assert [a.get_chemical_formula() for a in written] == [a.get_chemical_formula() for a in frames]
    assert written[1].arrays["initial_magmoms"].shape == (len(frames[1]),)
    assert written[3].get_stress().shape == (6,)
    assert written[5].info["temperature"] == 300 and written[0].info["name"] == frames[0].info["name"]


INFO_VALUES = [
    "2-butyne",
    '"a b, c"',
    "1,2-dichloroethane",
    "0x10",
    "1_000",
    "nan",
    "inf",
    "1e5",
    "-3",
    "T",
    "false",
    '"T F"',
    '"1 2 3"',
    "_JSON",
    '"_JSON [1, 2]"',
    "x=y",
    "12abc",
    "Infinity",
    '""',
    "TRUEish",
]


@pytest.mark.parametrize("key", ["name", "config_type", "uid", "virial"])
@pytest.mark.parametrize("value", INFO_VALUES)
def test_info_strings_as_ase_reads_them(key, value):
    """``parse_frames(info=True)`` takes a frame's info only where ASE reads the value as this very string, and then
    gives ASE's dict; a number, a boolean, an array or JSON in the info is declined (for ASE). Without ``info``
    every such frame is declined, as ``predict`` needs."""
    text = f'1\nProperties=species:S:1:pos:R:3 {key}={value} energy=-1.5 pbc="F F F"\nH 0 0 0\n'
    assert fast.parse_frames(text) is None
    got = fast.parse_frames(text, info=True)
    try:
        want = ase.io.read(io.StringIO(text), format="extxyz").info
    except Exception:  # ASE refuses it (a 3 x 3 key that is not 9 numbers): so does the fast reader
        assert got is None
        return
    if isinstance(want.get(key), str):
        if got is not None:  # (quoted values with what ASE unescapes, e.g., are left to ASE)
            assert got[6] == [want] and list(want) == [key]
    else:
        assert got is None
    if key == "name" and value in ("2-butyne", '"a b, c"', "1,2-dichloroethane", "0x10", "12abc"):
        assert got is not None  # the names a file of molecules carries are taken


def test_random_comment_lines_as_ase_reads_them():
    """Random comment lines of keys and values (numbers, strings, booleans, arrays, calculator results, cells):
    whatever ``parse_frames(info=True)`` takes, it reads as ``ase.io.read`` does (ASE reads it without error; the
    same numbers, positions, cell, pbc and info)."""
    import random

    rng = random.Random(0)
    keys = ["name", "config_type", "uid", "energy", "stress", "virial", "Lattice", "pbc", "tag", "T", "free_energy"]
    values = ["2-butyne", '"a b"', "1", "1.5", "-3e4", "T", "true", '"1 2 3"', '"T F T"', "nan", "x=y", "a,b", '""']
    values += ['"_JSON {}"', "0x1F", "1_0", "abc.def", '"with = sign"', "+1", ".5", "TRUEx", '"1 2 3 4 5 6 7 8 9"']
    taken = 0
    for _ in range(1500):
        pairs = [f"{rng.choice(keys)}={rng.choice(values)}" for _ in range(rng.randint(0, 4))]
        text = f"2\n{' '.join(pairs)}\nH 0 0 0\nO 0.9 0.1 0\n"
        got = fast.parse_frames(text, info=True)
        if got is None:
            continue
        taken += 1
        ref = ase.io.read(io.StringIO(text), format="extxyz")
        np.testing.assert_array_equal(got[0], ref.numbers)
        np.testing.assert_array_equal(got[1], ref.positions)
        np.testing.assert_array_equal(got[2][0], ref.cell.array)
        assert got[3][0].tolist() == ref.pbc.tolist() and got[6][0] == ref.info, pairs
    assert taken > 300
