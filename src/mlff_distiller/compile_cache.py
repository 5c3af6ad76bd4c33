"""The compile cache of the force engine: ``torch.compile`` and Triton artifacts kept on disk so that a second process
starts fast (``ForceEngine(cache_dir=)``), keyed by the source of our Triton kernels, and the recompile limit that
lets every bucket keep its own compiled specialisation."""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Iterable
from pathlib import Path

from mlff_distiller import kernels

__all__ = ["COMPILE_RECOMPILE_LIMIT", "configure_compile_cache", "kernels_source_digest", "raise_recompile_limit"]

# Separate torch.compile specialisations allowed (one per bucket); torch's default of 8 would silently send
# later buckets back to eager.
COMPILE_RECOMPILE_LIMIT = 64


def configure_compile_cache(cache_dir: str | Path) -> Path:
    """Persist ``torch.compile`` and Triton artifacts under ``cache_dir`` so a second process starts fast.

    Sets ``TORCHINDUCTOR_CACHE_DIR`` (Inductor's FX-graph and AOTAutograd caches) and ``TRITON_CACHE_DIR``
    (compiled kernels, including this package's own Triton ops) to directories under ``cache_dir``, replacing
    values they had, and switches the FX-graph and AOTAutograd caches on. Call it before the first compilation of
    the process (``ForceEngine(cache_dir=)`` does). Returns the directory. Without a ``cache_dir`` the engine
    leaves both variables alone: set them yourself to place torch's and Triton's caches.

    Replacing, not keeping, values already there: Inductor writes both variables into ``os.environ`` itself on its
    first compile (its default directory under ``/tmp``), so after any compile in this process, or in a parent
    that started this one, "already set" says nothing about the caller's choice. Keeping them sent a
    ``ForceEngine(cache_dir=...)`` made after such a compile to ``/tmp`` without a word (found at stop 80, when
    bench_engine's "cold" compiled start-up read the parent process's warm cache).
    """
    path = Path(cache_dir).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    # One Inductor directory per version of our Triton kernels' source. The AOTAutograd cache keys a compiled graph
    # by what torch.compile traced, and our custom ops hide their kernels from it: torch's source walk finds none
    # of them. Our ops now list their kernels themselves (_triton_utils._KernelsOfOp), where torch's registry has
    # the table for it; this directory key also covers a torch without it. Triton's own cache is keyed by kernel
    # source already.
    inductor = path / "inductor" / f"kernels-{kernels_source_digest()[:16]}"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor)
    os.environ["TRITON_CACHE_DIR"] = str(path / "triton")
    # The FX-graph and AOTAutograd caches on. Importing Inductor's config imports torch._dynamo and Inductor (~1.4 s
    # on the development CPU), which a process that never compiles should not pay: before that import, the same
    # switches are set through the environment variables those configs read when they are first imported.
    switches = (
        ("torch._inductor.config", "fx_graph_cache", "TORCHINDUCTOR_FX_GRAPH_CACHE"),
        ("torch._functorch.config", "enable_autograd_cache", "TORCHINDUCTOR_AUTOGRAD_CACHE"),
    )
    for module, name, env in switches:
        config = sys.modules.get(module)
        if config is None:
            os.environ[env] = "1"
        elif hasattr(config, name):
            setattr(config, name, True)
    return path


def kernels_source_digest(files: Iterable[Path] | None = None) -> str:
    """SHA-256 (hex) over the source of our Triton kernel modules (``mlff_distiller.kernels``, every ``*.py``;
    ``files`` to hash others), in name order: the compile cache's directory key (:func:`configure_compile_cache`)."""
    if files is None:
        files = Path(kernels.__file__).parent.glob("*.py")
    h = hashlib.sha256()
    for f in sorted(Path(f) for f in files):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def raise_recompile_limit() -> None:
    """Let torch.compile keep ``COMPILE_RECOMPILE_LIMIT`` specialisations of one function (one per bucket)."""
    import torch._dynamo.config as dynamo_config

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), COMPILE_RECOMPILE_LIMIT))
            break
