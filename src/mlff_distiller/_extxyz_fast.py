"""A fast reader and writer for the plain extxyz frames that ``mlff-distill predict`` reads and writes.

ASE's extxyz reader and writer are general and pure Python: on the development CPU they take ~110 µs to read and
~210 µs to write one small molecule with its results, of which the key=value comment line alone costs 30-75 µs
(``ase.io.extxyz.key_val_str_to_dict``). :func:`~mlff_distiller.predict_stream.predict_file` spends almost all of
its time there (``benchmarks/results/probe_predict_reuse_h100.md``). This module reads and writes the one shape of
frame such a run meets most, several times faster, and declines anything else, which ASE then reads and writes as
before. No other library reads extxyz faster and writes what ASE writes (the output must stay what ASE gives).

A frame is taken here when its comment line holds only

* ``Lattice="<9 numbers>"``, ``pbc="<T|F> <T|F> <T|F>"`` (``pbc`` without ``Lattice`` only as ``"F F F"``),
* ``Properties=species:S:1:pos:R:3`` followed by real columns of per-atom calculator results (``forces``,
  ``energies``, ``charge``, ...), and
* per-structure calculator results (``energy``, ``stress``, ``free_energy``, ...) given as numbers, and
* with ``parse_frames(info=True)`` (what ``predict`` and ``relax`` read), keys that ASE reads into ``Atoms.info``
  as strings (``name=2-butyne``, ``config_type="a b"``; see ``_ase_reads_string``),

every key at most once, values without escapes or braces and not empty, every element symbol known to ASE, every
number one that Python's ``float`` reads, and every atom line with at least the declared columns. ASE's reader moves
those calculator results into a calculator that the written frame does not keep, so a frame taken here has nothing
beyond its species, positions, cell, periodicity, kept real columns and info strings. For such frames both
functions here give exactly what
``ase.io.read`` / ``frames_text`` (ASE's writer) give: the same floats (Python's ``float`` parses both) and the
same bytes (ASE's column formats and ASE's own ``escape`` for strings); the tests compare them on random frames.
"""

from __future__ import annotations

import re
from functools import lru_cache

import numpy as np

__all__ = ["format_frames", "format_md_frame", "format_plain_frame", "parse_frames"]

_PAIR = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_-]*)=(?:"([^"\\{}\[\]\']*)"|([^\s"\\{}\[\]\'=]+))')
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Columns ASE reads into something other than an array of the same name (numbers, constraints, charges given to
# the Atoms constructor, which also puts them first among the arrays it writes back).
_SPECIAL_COLUMNS = frozenset({"species", "pos", "Z", "move_mask", "initial_charges", "masses", "numbers", "positions"})


@lru_cache(maxsize=1)
def _ase_tables() -> tuple:
    from ase.data import atomic_numbers, chemical_symbols
    from ase.io.extxyz import REV_PROPERTY_NAME_MAP, escape, per_atom_properties, per_config_properties
    from ase.stress import voigt_6_to_full_3x3_stress

    return (
        atomic_numbers,
        chemical_symbols,
        REV_PROPERTY_NAME_MAP,
        frozenset(per_atom_properties),
        frozenset(per_config_properties),
        escape,
        voigt_6_to_full_3x3_stress,
    )


def _floats(text: str, count: int | None = None) -> list[float] | None:
    try:
        values = [float(t) for t in text.split()]
    except ValueError:
        return None
    return values if count is None or len(values) == count else None


@lru_cache(maxsize=4096)
def _header(comment: str, with_info: bool = False) -> tuple | None:
    """``(cell [3, 3] or None, pbc (3 bools), columns per atom line, kept, info)`` of a comment line this module
    takes, else None; ``kept``: ``(name, number of columns, first token)`` of each other real column, which ASE keeps
    as an array of the frame (``initial_magmoms``, ``momenta``, ...); ``info``: ``(key, value)`` of the keys ASE
    reads into ``Atoms.info`` as strings (``name=...``, ``config_type=...``), taken only ``with_info`` (else such
    a line is declined). Cached: comment lines without per-structure values repeat through a file."""
    _, _, rev_names, per_atom, per_config, _, _ = _ase_tables()
    fields: dict[str, str] = {}
    end = 0
    for m in _PAIR.finditer(comment):
        value = m.group(2) if m.group(2) is not None else m.group(3)
        if m.start() != end or m.group(1) in fields or not value.strip():
            return None  # (ASE reads an empty value as the start of the next key's: declined)
        fields[m.group(1)] = value
        end = m.end()
    if comment[end:].strip():
        return None
    columns, kept, names = 4, [], set()
    props = fields.pop("Properties", "species:S:1:pos:R:3").split(":")
    if len(props) % 3 or props[:6] != ["species", "S", "1", "pos", "R", "3"]:
        return None
    for name, kind, ncols in zip(props[6::3], props[7::3], props[8::3], strict=True):
        if kind != "R" or not ncols.isdigit() or int(ncols) < 1 or name in names or name in _SPECIAL_COLUMNS:
            return None
        names.add(name)
        if rev_names.get(name, name) not in per_atom:
            if name in rev_names or not _NAME.fullmatch(name):
                return None
            kept.append((name, int(ncols), columns))
        columns += int(ncols)
    lattice, pbc = fields.pop("Lattice", None), fields.pop("pbc", None)
    info = []
    for key, value in fields.items():  # calculator results, which the output replaces, or info strings
        if key in per_config:
            if _floats(value, 9 if key in _SPECIAL_3_3 else None) is None:
                return None  # (ASE refuses a stress that is not 9 numbers)
        elif with_info and _NAME.fullmatch(key) and _ase_reads_string(key, value):
            info.append((key, value))
        else:
            return None
    flags = pbc.split() if pbc is not None else (["T"] * 3 if lattice is not None else ["F"] * 3)
    if len(flags) != 3 or not set(flags) <= {"T", "F"}:
        return None
    if lattice is None:
        return (None, (False, False, False), columns, tuple(kept), tuple(info)) if flags == ["F"] * 3 else None
    cell = _floats(lattice, 9)
    if cell is None:
        return None
    cell = np.array(cell, dtype=np.float64).reshape(3, 3)
    return cell, tuple(f == "T" for f in flags), columns, tuple(kept), tuple(info)


_SPECIAL_3_3 = frozenset({"Lattice", "virial", "stress"})  # ase.io.extxyz.SPECIAL_3_3_KEYS
_ASE_BOOLS = frozenset({"T", "F", "true", "false", "True", "False", "TRUE", "FALSE"})


def _ase_reads_string(key: str, value: str) -> bool:
    """Whether ASE's ``key_val_str_to_dict`` keeps ``value`` (unquoted already) as this very string: its own
    tests, in its order (numbers and arrays of numbers, 3 x 3 keys, booleans, JSON), on its own split."""
    from ase.io.extxyz import SPECIAL_3_3_KEYS, UNPROCESSED_KEYS

    if key.lower() in UNPROCESSED_KEYS:
        return True
    if key in SPECIAL_3_3_KEYS:
        return False
    parts = re.findall(r"[^\s,]+", value)
    for dtype in (int, float):
        try:
            np.array(parts, dtype=dtype)
            return False
        except (ValueError, OverflowError):
            pass
    return not all(p in _ASE_BOOLS for p in parts) and not value.startswith("_JSON ")


@lru_cache(maxsize=512)
def _number(symbol: str) -> int | None:
    atomic_numbers = _ase_tables()[0]
    return atomic_numbers.get(symbol.capitalize())  # ASE capitalises the species column as it reads it


def parse_frames(text: str, info: bool = False) -> tuple | None:
    """The frames of ``text`` (whole extxyz frames) as ``(numbers [N], positions [N, 3], cells [B, 3, 3],
    pbc [B, 3], counts [B], kept)``, the arrays ``ase.io.read`` would give, ``kept`` holding per frame the other
    columns ASE keeps (``(name, values [n, k])`` pairs; empty for most frames); None when some frame is not one
    this module takes (see the module's docstring), for ASE to read. With ``info``, frames whose comment line
    also holds keys ASE reads as strings into ``Atoms.info`` are taken too, and a seventh item holds each frame's
    ``info`` dict (what ``ase.io.read`` gives; :func:`format_frames` writes it back)."""
    lines = text.split("\n")
    n_lines = len(lines)
    counts, cells, pbcs, frames, infos = [], [], [], [], []  # frames: (first atom line, atom count, columns, kept)
    zero = np.zeros((3, 3))
    k = 0
    while k < n_lines:
        line = lines[k]
        if not line.strip():
            if any(rest.strip() for rest in lines[k + 1 :]):
                return None  # a blank line between frames: ASE decides
            break
        try:
            n = int(line)
        except ValueError:
            return None
        if n < 1 or k + 2 + n > n_lines:
            return None
        head = _header(lines[k + 1].strip(), info)
        if head is None:
            return None
        cell, pbc, columns, kept, pairs = head
        infos.append(dict(pairs))
        counts.append(n)
        cells.append(zero if cell is None else cell)
        pbcs.append(pbc)
        frames.append((k + 2, n, columns, kept))
        k += 2 + n
    if not counts:
        return None
    rows = [ln.split() for a, n, _, _ in frames for ln in lines[a : a + n]]
    need = [c for _, n, c, _ in frames for _ in range(n)]
    if any(len(r) < c for r, c in zip(rows, need, strict=True)):
        return None
    numbers = [_number(r[0]) for r in rows]
    if None in numbers:
        return None
    try:
        positions = [float(t) for r in rows for t in r[1:4]]
        if max(need) > 4:  # the other columns: numbers, as ASE reads them (the output keeps or drops them)
            extra = [[float(t) for t in r[4:c]] for r, c in zip(rows, need, strict=True)]
    except ValueError:
        return None
    kept_values, row = [], 0
    for _, n, _, kept in frames:
        if kept:
            block = np.array(extra[row : row + n], dtype=np.float64)
            kept_values.append([(name, block[:, first - 4 : first - 4 + k]) for name, k, first in kept])
        else:
            kept_values.append([])
        row += n
    arrays = (
        np.array(numbers, dtype=np.int64),
        np.array(positions, dtype=np.float64).reshape(-1, 3),
        np.stack(cells).astype(np.float64),
        np.array(pbcs, dtype=bool),
        np.array(counts, dtype=np.int64),
        kept_values,
    )
    return (*arrays, infos) if info else arrays


def format_frames(arrays: tuple, results: list[dict | None]) -> str:
    """The text ``frames_text`` (ASE's writer) gives for the frames of ``arrays`` (from :func:`parse_frames`,
    with ``info=True`` or without) with ``results`` (``None``: the frame is left out): the input's info strings,
    energy, forces, per-atom energies, stress and ``info["domain"]`` as ASE writes them."""
    _, symbols, _, _, _, escape, voigt_to_full = _ase_tables()
    numbers, positions, cells, pbc, counts, kept, *rest = arrays
    infos = rest[0] if rest else None  # (parse_frames(info=True): the input's info strings, kept in the output)
    ends = np.cumsum(counts).tolist()
    starts = [0, *ends[:-1]]
    names = [symbols[z] for z in numbers.tolist()]
    out = []
    for b, r in enumerate(results):
        if r is None:
            continue
        a, e = starts[b], ends[b]
        head = [f"{e - a}\n"]
        if cells[b].any():  # ASE writes the Lattice of a non-zero cell only
            head.append('Lattice="' + " ".join(str(x) for x in cells[b].reshape(9)) + '" ')
        columns = [positions[a:e]]
        head.append("Properties=species:S:1:pos:R:3")
        for name, values in kept[b]:
            head.append(f":{name}:R:{values.shape[1]}")
            columns.append(values)
        head.append(":forces:R:3:energies:R:1")
        columns += [np.asarray(r["forces"], dtype=np.float64), np.asarray(r["energies"], np.float64).reshape(-1, 1)]
        info = dict(infos[b]) if infos else {}
        if r.get("domain"):
            info["domain"] = "; ".join(r["domain"])  # (in place of an input's own, as frames_text sets it)
        head.extend(f" {key}={escape(value)}" for key, value in info.items())
        head.append(f" energy={r['energy']}")
        if "stress" in r:
            full = voigt_to_full(np.asarray(r["stress"], dtype=np.float64)).reshape(9, order="F")
            head.append(' stress="' + " ".join(f"{v}" for v in full) + '"')
        head.append(' pbc="' + " ".join("T" if p else "F" for p in pbc[b].tolist()) + '"\n')
        out.append("".join(head))
        reals = np.concatenate(columns, axis=1)
        values = np.empty((e - a, 1 + reals.shape[1]), dtype=object)
        values[:, 0] = names[a:e]
        values[:, 1:] = reals
        line = "%-2s" + " %16.8f" * reals.shape[1] + "\n"  # ASE's formats: '%-2s' symbols, '%16.8f' reals
        out.append((line * (e - a)) % tuple(values.ravel().tolist()))
    return "".join(out)


@lru_cache(maxsize=1)
def _ase_constraint_types() -> tuple:
    from ase import Atoms
    from ase.constraints import FixAtoms, FixCartesian
    from ase.io.extxyz import PROPERTY_NAME_MAP

    return Atoms, (FixAtoms, FixCartesian), frozenset(PROPERTY_NAME_MAP) | frozenset(PROPERTY_NAME_MAP.values())


def format_md_frame(atoms, results: dict, info: dict) -> str | None:
    """The text ASE's extxyz writer gives for a copy of ``atoms`` with ``info`` added to its ``info`` and a
    calculator holding ``results`` (``ase.io.write(f, frame, format="extxyz")``), for the frames an MD run
    writes: species, positions and real per-atom columns (``momenta``), a cell or none, constraints ASE does not
    write (``FixCom``), float, int, bool and string ``info`` and the calculator's energy, free energy, stress,
    forces and per-atom energies. ``None`` for anything else, which ASE then writes. One MD frame of benzene on the
    development CPU: ~76 µs here, 310-430 µs through ``ase.io.write`` (a file opened per frame), 190-350 µs through
    ASE's ``write_extxyz`` on an open file."""
    atoms_type, move_mask_constraints, _ = _ase_constraint_types()
    if (
        type(atoms) is not atoms_type
        or atoms.info
        or any(isinstance(c, move_mask_constraints) for c in atoms.constraints)
    ):
        return None
    arrays = atoms.arrays
    keys = list(arrays)
    if keys[:2] != ["numbers", "positions"]:
        return None
    extra = [(k, arrays[k]) for k in keys[2:]]
    return format_plain_frame(arrays["numbers"], arrays["positions"], atoms.cell.array, atoms.pbc, results, info, extra)


def format_plain_frame(
    numbers: np.ndarray,
    positions: np.ndarray,
    cell: np.ndarray,
    pbc,
    results: dict,
    info: dict,
    extra: list[tuple[str, np.ndarray]] = (),
) -> str | None:
    """:func:`format_md_frame` of the ``Atoms`` these fields make (``extra``: its arrays after ``numbers`` and
    ``positions``, in order), without the ``Atoms``: ``mlff-distill relax`` writes its structures from arrays."""
    _, _, renamed = _ase_constraint_types()
    _, symbols, _, per_atom, per_config, escape, voigt_to_full = _ase_tables()
    n = len(numbers)
    head = [f"{n}\n"]
    cell = np.asarray(cell)
    if cell.any():  # ASE writes the Lattice of a non-zero cell only
        head.append('Lattice="' + " ".join(str(x) for x in cell.reshape(9)) + '" ')
    head.append("Properties=species:S:1:pos:R:3")
    columns = [positions]
    names = {k for k, _ in extra}
    atom_results = [(k, v) for k, v in results.items() if k in per_atom]
    for name, values in list(extra) + atom_results:
        values = np.asarray(values)
        if (
            values.dtype.kind != "f"
            or values.ndim not in (1, 2)
            or values.shape[0] != n
            or not _NAME.fullmatch(name)
            or name in renamed
            or name in _SPECIAL_COLUMNS
            or (name in per_atom and name in names)  # ASE refuses a result that is already an array
        ):
            return None
        values = values.reshape(n, -1)
        head.append(f":{name}:R:{values.shape[1]}")
        columns.append(values)
    config = list(info.items()) + [(k, v) for k, v in results.items() if k in per_config]
    if len({k for k, _ in config}) != len(config):
        return None
    for key, value in config:
        if key == "stress" and np.shape(value) in ((6,), (3, 3)):
            full = np.asarray(value, dtype=np.float64)
            full = voigt_to_full(full) if full.shape == (6,) else full
            text = '"' + " ".join(f"{v}" for v in full.reshape(9, order="F")) + '"'
        elif not _NAME.fullmatch(key) or key in ("pbc", "Lattice", "Properties"):
            return None
        elif isinstance(value, bool):
            text = "T" if value else "F"  # ASE's bools (BatchedMD's "frozen")
        elif isinstance(value, float | int):
            text = f"{value}"  # ASE's str() of a Python float or int
        elif isinstance(value, str):
            text = escape(value)  # ASE's quoting of a string (a molecule's name, a config_type)
        else:
            return None
        head.append(f" {key}={text}")
    head.append(' pbc="' + " ".join("T" if p else "F" for p in np.asarray(pbc).tolist()) + '"\n')
    reals = np.concatenate([np.asarray(c, dtype=np.float64) for c in columns], axis=1)
    values = np.empty((n, 1 + reals.shape[1]), dtype=object)
    values[:, 0] = [symbols[z] for z in np.asarray(numbers).tolist()]
    values[:, 1:] = reals
    line = "%-2s" + " %16.8f" * reals.shape[1] + "\n"  # ASE's formats: '%-2s' symbols, '%16.8f' reals
    return "".join(head) + (line * n) % tuple(values.ravel().tolist())
