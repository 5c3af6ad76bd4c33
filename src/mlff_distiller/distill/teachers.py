"""Teachers: the slow reference force fields a student is distilled from.

Any ASE ``Calculator`` that implements ``energy`` (eV) and ``forces`` (eV/Å) is a teacher. Three presets:

* ``gfn2-xtb``: GFN2-xTB through ``tblite`` (pip extra ``xtb``: ``pip install 'mlff-distiller[xtb]'``);
  option ``omp_threads`` (default 1, see :func:`_set_openmp_threads`; None keeps tblite's default).
* ``sevennet-0``: the SevenNet-0 foundation model through ``sevenn`` (pip extra ``sevennet``); its weights
  ship inside the ``sevenn`` wheel, so nothing is downloaded at run time.
* ``emt``: ASE's effective-medium theory (always available; metals and a toy H/C/N/O parametrisation; the
  teacher of the fast tests).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from ase.calculators.calculator import Calculator

__all__ = ["TEACHERS", "MissingExtraError", "get_teacher", "teacher_name"]


class MissingExtraError(ImportError):
    """A teacher preset needs an optional dependency that is not installed."""


def _need(module: str, extra: str, preset: str):
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(
            f"teacher {preset!r} needs the Python package providing {module!r}, which is not installed; "
            f"install it with: pip install 'mlff-distiller[{extra}]'  ({exc})"
        ) from exc


def _set_openmp_threads(n: int) -> None:
    """Set the OpenMP thread count of the already-loaded ``libgomp`` (tblite's runtime) for this thread.

    Measured: GFN2-xTB MD on ethanol with tblite's default OpenMP threads on a busy 2-core machine ran 25 s
    where one thread took 0.75 s; on small molecules the threads only contend. ``OMP_NUM_THREADS`` cannot
    help once the runtime is loaded (torch loads it on import), so the count is set through the C API.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("gomp") or "libgomp.so.1"
    try:
        ctypes.CDLL(name).omp_set_num_threads(int(n))
    except (OSError, AttributeError):  # not GNU OpenMP (macOS, Windows): leave the runtime's default
        pass


def _gfn2(omp_threads: int | None = 1, **kw) -> Calculator:
    tblite_ase = _need("tblite.ase", "xtb", "gfn2-xtb")
    if omp_threads is not None:
        if int(omp_threads) < 1:
            raise ValueError(f"omp_threads must be >= 1, got {omp_threads}")
        _set_openmp_threads(omp_threads)
    opts = {"method": "GFN2-xTB", "verbosity": 0}
    opts.update(kw)
    return tblite_ase.TBLite(**opts)


def _sevennet(**kw) -> Calculator:
    calc_mod = _need("sevenn.calculator", "sevennet", "sevennet-0")
    opts = {"model": "7net-0"}
    opts.update(kw)
    return calc_mod.SevenNetCalculator(**opts)


def _emt(**kw) -> Calculator:
    from ase.calculators.emt import EMT

    return EMT(**kw)


# preset name -> factory; keyword arguments are passed to the calculator's constructor.
TEACHERS: dict[str, Callable[..., Calculator]] = {"gfn2-xtb": _gfn2, "sevennet-0": _sevennet, "emt": _emt}


def get_teacher(teacher: str | Calculator, **kwargs) -> Calculator:
    """A teacher calculator from a preset name (``gfn2-xtb``, ``sevennet-0``, ``emt``) or an ASE Calculator.

    Raises ``ValueError`` for an unknown name or an object that is not a calculator, and
    :class:`MissingExtraError` (an ``ImportError``) naming the pip extra when a preset's package is missing.
    """
    if isinstance(teacher, str):
        key = teacher.strip().lower()
        if key not in TEACHERS:
            raise ValueError(f"unknown teacher {teacher!r}; choose one of {sorted(TEACHERS)} or pass an ASE Calculator")
        return TEACHERS[key](**kwargs)
    if kwargs:
        raise ValueError("keyword options apply only to a preset teacher name, not to a Calculator instance")
    if not (hasattr(teacher, "get_potential_energy") and hasattr(teacher, "get_forces")):
        raise ValueError(f"teacher must be a preset name or an ASE Calculator, got {type(teacher).__name__}")
    return teacher


def teacher_name(teacher: str | Calculator) -> str:
    """A short label for metadata: the preset name, or the calculator's class name."""
    return teacher.strip().lower() if isinstance(teacher, str) else type(teacher).__name__
