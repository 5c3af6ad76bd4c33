"""YAML configs mapped onto dataclasses, with unknown or mistyped keys reported by name."""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

__all__ = ["from_dict", "load_yaml", "to_dict"]

T = TypeVar("T")


def from_dict(cls: type[T], data: dict | None, *, where: str = "") -> T:
    """Build dataclass ``cls`` from a mapping; nested dataclass fields are built recursively.

    Raises ``ValueError`` naming an unknown key or a value that is not a mapping where one is needed.
    """
    where = where or cls.__name__
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; valid keys are {sorted(known)}")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        sub = _dataclass_of(hints.get(name))
        if sub is not None and value is not None and not dataclasses.is_dataclass(value):
            value = from_dict(sub, value, where=f"{where}.{name}")
        elif isinstance(value, str) and _takes_float(hints.get(name)):
            if not _FLOAT_TEXT.fullmatch(value.strip()):
                raise ValueError(f"{where}.{name}: expected a number, got {value!r}")
            value = float(value)  # YAML 1.1 reads 1e-4 (no dot) as a string; a float field means the number
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ValueError(f"{where}: {exc}") from exc


_FLOAT_TEXT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _takes_float(hint) -> bool:
    if hint is float:
        return True
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return float in typing.get_args(hint)
    return False


def _dataclass_of(hint) -> type | None:
    if hint is None:
        return None
    if dataclasses.is_dataclass(hint):
        return hint
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        for arg in typing.get_args(hint):
            if dataclasses.is_dataclass(arg):
                return arg
    return None


def to_dict(obj) -> dict:
    """A dataclass as plain (YAML/JSON-serialisable) Python data."""
    return dataclasses.asdict(obj)


def load_yaml(path: str | Path) -> dict:
    """Read a YAML mapping (an empty file is an empty mapping)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"config file not found: {path}")
    data = yaml.safe_load(path.read_text())
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: top level of a config must be a mapping, got {type(data).__name__}")
    return data
