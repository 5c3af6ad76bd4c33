"""Names of a package imported on first use (PEP 562), as SciPy's and scikit-image's ``lazy_loader`` do: a
package's ``__init__`` stays free of torch and ASE imports until something of it is used. (``lazy_loader`` itself
is one more dependency for ~20 lines; these keep the eager names for type checkers under ``TYPE_CHECKING``.)"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

__all__ = ["attach"]


def attach(package: str, exports: dict[str, str], public: list[str]) -> tuple[Callable, Callable]:
    """``(__getattr__, __dir__)`` for ``package``: a name of ``exports`` (name -> defining module) is imported from
    its module, any other name as a submodule of ``package`` (``mlff_distiller.engine`` without importing it
    first, as when the package imported everything eagerly); either is then kept in the package."""

    def __getattr__(name: str):
        module = exports.get(name)
        if module is not None:
            value = getattr(importlib.import_module(module), name)
        elif not name.startswith("__"):
            try:
                value = importlib.import_module(f"{package}.{name}")
            except ModuleNotFoundError as err:
                if err.name != f"{package}.{name}":  # the submodule exists but something it imports does not
                    raise
                raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *public})

    return __getattr__, __dir__
