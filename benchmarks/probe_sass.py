"""Registers, spills and instruction mix of the Triton kernels, compiled for the H100/H200 on a machine without a GPU.

    python benchmarks/probe_sass.py [--kernels gemm,gemm_tma,edge,fwd,fwd_atom,sender,sender_block]
                                    [--set KEY=VALUE ...]
    python benchmarks/probe_sass.py --dense builtin:chno-gfn2 --warps 16   (the dense step's launches)

Triton compiles for a target named in code (``GPUTarget("cuda", 90, 32)``) with the ``ptxas`` its wheel carries, so
the machine code of a kernel can be read where no GPU is: this prints each kernel's registers per thread, its stack
frame (spills), and counts of its warpgroup MMAs (``HGMMA``), warp MMAs (``HMMA``), global loads, spill stores and
loads (``STL``/``LDL``), shared-memory traffic and barriers, from ``cuobjdump --dump-resource-usage`` and ``nvdisasm``.
It does not time anything: what a change does to the register budget or the spills is seen before a device call,
and the device call then measures what matters (stop 60 found the shipped edge backward at 255 registers with a
432-byte stack here; 32-feature chunks spill 144 bytes, yet measured slower at stop 55).

The constexprs are the shipped launches' for the 128 x 3 student on a large graph (``--set`` changes one, e.g.
``--set BLOCK_F=32``); ``--warps`` and ``--stages`` the launch options. Runs with ``TRITON_INTERPRET`` unset (the
interpreter's kernels cannot be compiled).
"""

from __future__ import annotations

import argparse
import ast
import inspect
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

_INT64_PTRS = ("ei_ptr", "live_ptr", "rowptr_ptr", "csr_ptr", "colptr_ptr", "perm_ptr", "idx_ptr", "seg_ptr")
# The message kernels' shared constexprs (the 128 x 3 student, 20 radial functions, weights on the TF32 grid).
_MP = dict(N_FEAT=128, N_RBF=20, R_PAD=32, DOT_PRECISION="tf32x2w", PDL=False)
# Water's launch of the edge backward: two feature slices, chained (edge_split_chain "fold": no sum kernel), inert
# rows past the CSR, the folded p, ∂u as dots and the NaN guard kept (edge_nan_guard "fold").
_EDGE = dict(
    _MP, BLOCK_E=64, BLOCK_F=64, SPLIT=2, LIVE=True, HAS_V=True, FOLD=True, DU_DOT=True, GUARD=True, CHAIN=True
)
KERNELS = {
    "gemm": (
        "_gemm_kernels",
        "_gemm_kernel",
        dict(
            HAS_BIAS=True,
            EPI=0,
            PRO=0,
            ACC=False,
            HAS_A=True,
            AFFINE=False,
            SEGSUM=False,
            ZERO=False,
            BM=64,
            BN=64,
            BK=32,
            DOT="tf32x2w",
            PDL=False,
            COL_FAST=True,
        ),
    ),
    "edge": ("_mp_edge_kernels", "_mp_bwd_edge_kernel", _EDGE),
    "fwd": (
        "_mp_kernels",
        "_mp_fwd_block_kernel",
        dict(_MP, BLOCK_A=16, BLOCK_E=32, BLOCK_F=64, HAS_V=True, SEG_SPLIT=True, FOLD=True),
    ),
    "fwd_atom": ("_mp_kernels", "_mp_fwd_kernel", dict(_MP, BLOCK_E=64, BLOCK_F=32, HAS_V=True)),
    "sender": (
        "_mp_kernels",
        "_mp_bwd_sender_kernel",
        dict(_MP, BLOCK_E=16, BLOCK_F=64, ADD_GV=True, SYM=True, FOLD_HALF=True),
    ),
    "sender_block": (
        "_mp_kernels",
        "_mp_bwd_sender_block_kernel",
        dict(_MP, BLOCK_A=16, BLOCK_E=16, BLOCK_F=64, SEG_SPLIT=True, ADD_GV=True, SYM=True),
    ),
}
_COUNTS = {"HGMMA": r"HGMMA", "HMMA": r"HMMA", "LDG": r"LDG", "STL": r"STL", "LDL": r"LDL", "LDS": r"LDS",
           "STS": r"STS", "BAR": r"BAR"}  # fmt: skip


def constexprs(kernel, const: dict) -> dict:
    """``const`` with the defaults of ``kernel``'s other constexpr parameters (a ``triton.jit`` function, compiled
    or interpreted); a constexpr with neither is an error: compiled as a runtime argument it would take both
    branches of its ``if``s, and the counts would be of no launch that runs (FOLD, GUARD at stop 61)."""
    given = dict(const)
    for name, param in inspect.signature(kernel.fn).parameters.items():
        if "constexpr" not in str(param.annotation) or name in given:
            continue
        if param.default is inspect.Parameter.empty:
            raise ValueError(f"{kernel.fn.__name__}: no value for the constexpr {name}")
        given[name] = param.default
    return given


def compile_counts(kernel, const: dict, warps: int, stages: int, types: dict | None = None) -> dict:
    """``{REG, STACK, HGMMA, ...}`` of ``kernel`` (a ``triton.jit`` function) compiled for sm_90 with ``const``;
    ``types``: arguments whose type is not the default (float32 pointers, int32 scalars, the int64 pointers named in
    ``_INT64_PTRS``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    const = constexprs(kernel, const)
    sig = {}
    for n in names:
        if n in const:
            sig[n] = "constexpr"
        elif types and n in types:
            sig[n] = types[n]
        elif n.endswith("_ptr"):
            sig[n] = "*i64" if n in _INT64_PTRS else ("*i32" if n == "flag_ptr" else "*fp32")
        else:
            sig[n] = "i32"
    src = ASTSource(
        fn=kernel,
        signature=sig,
        constexprs={(names.index(c),): v for c, v in const.items()},
        attrs={(names.index(p),): [["tt.divisibility", 16]] for p in names if p.endswith("_ptr")},
    )
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(ck.asm["cubin"])
        usage = subprocess.run(
            [str(bindir / "cuobjdump"), "--dump-resource-usage", str(cubin)], capture_output=True, text=True
        ).stdout
        sass = subprocess.run([str(bindir / "nvdisasm"), "-c", str(cubin)], capture_output=True, text=True).stdout
    reg = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    out = {"REG": int(reg.group(1)) if reg else -1, "STACK": int(stack.group(1)) if stack else -1}
    out.update({k: len(re.findall(p, sass)) for k, p in _COUNTS.items()})
    return out


# The dense step's launches as the engine makes them (FROM_Z: int64 atomic numbers; the energies float64).
_DENSE_TYPES = {"idx_ptr": "*i64", "batch_ptr": "*i64", "z2i_ptr": "*i32", "energy_ptr": "*fp64"}


def dense_rows(student: str, warps: int, slots: int = 16) -> list[str]:
    """Registers and stack of each launch of ``student``'s dense step (:meth:`DenseStep.plan`: one molecule of
    ``slots`` slots, PDL with early loads, the fan as "auto" decides on an H200) at ``warps`` warps a program."""
    from mlff_distiller.kernels import dense_step as ds

    from mlff_distiller import load_model

    model = load_model(student).eval()
    step = ds.DenseStep(model, num_warps=warps)
    rows = []
    for kernel, _, kw in step.plan(1, slots, True, {"PDL": True}):
        kw = dict(kw)
        nw = kw.pop("num_warps")
        c = compile_counts(kernel, kw, nw, 3, _DENSE_TYPES)
        rows.append(
            f"| {kernel.fn.__name__} | layer {kw['LAYER']}, fan {kw.get('FAN')} | {nw} | 3 | {c['REG']} | "
            f"{c['STACK']} | " + " | ".join(str(c[k]) for k in _COUNTS) + " |"
        )
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", default="gemm,edge,fwd,fwd_atom,sender,sender_block")
    p.add_argument("--set", action="append", default=[], help="KEY=VALUE: one constexpr changed (Python literal)")
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--dense", default="", help="a student: its dense step's launches instead of --kernels")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("probe_sass.py: unset TRITON_INTERPRET (the interpreter's kernels cannot be compiled)")
        return 2
    import importlib

    changes = {}
    for item in args.set:
        key, value = item.split("=", 1)
        try:
            changes[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            changes[key] = value
    print("| kernel | changes | warps | stages | REG | STACK | " + " | ".join(_COUNTS) + " |")
    print("|---|---|---:|---:|---:|---:|" + "---:|" * len(_COUNTS))
    if args.dense:
        print("\n".join(dense_rows(args.dense, args.warps)), flush=True)
        return 0
    for name in args.kernels.split(","):
        module, kname, const = KERNELS[name]
        kernel = getattr(importlib.import_module(f"mlff_distiller.kernels.{module}"), kname)
        const = {**const, **{k: v for k, v in changes.items() if k in kernel.arg_names}}
        counts = compile_counts(kernel, const, args.warps, args.stages)
        shown = ", ".join(f"{k}={v}" for k, v in changes.items() if k in kernel.arg_names) or "shipped"
        print(
            f"| {name} | {shown} | {args.warps} | {args.stages} | {counts['REG']} | {counts['STACK']} | "
            + " | ".join(str(counts[k]) for k in _COUNTS)
            + " |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
