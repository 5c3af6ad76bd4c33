"""One forward layer of a dense step with each atom's features split over S programs (the GPU's timing; any machine
checks the arithmetic at S = 1 under the Triton interpreter).

Stop 84 estimated a 128-wide dense step split over S = 4 programs an atom at ~63 µs for benzene (issue 5's row is
0.05 ms; the 128-wide dense step as built, one program an atom, 154.7 µs), from two measured facts: an exchange
between the programs of one launch costs ~1.2 µs (``probe_cta_exchange.py``), and at S = 4 a program's node products
are the 64-wide student's. This probe measures the second assumption directly, on a layer written for it (not the
shipped kernels, whose backward is not split): program ``(i, c)`` makes atom i's messages for the column block c of
the features (filter products ``rbf W_f`` by ``tl.dot``, the PaiNN sums over the senders), exchanges v with its atom's
other programs, computes U v and V v for its columns, M1's sum over its rows (exchanged and summed: an
all-reduce), M2 for its columns, the update, W1's sum over its rows (an all-reduce) and W2 for its columns: the next
layer's φ. Three exchanges a launch. The same kernel at S = 1 is the unsplit layer (one program an atom, no spin).

Timed as a CUDA graph of ``--launches`` layers (their counters zeroed by one fill a replay): µs a layer, F = 64
and 128, S = 1, 2, 4 (8); with ``--phased`` also the form of four launches a layer, one a part, whose launch
boundaries replace the exchanges (no spin: what the Triton interpreter can run at S > 1, so CI checks the split's
arithmetic in that form). Every result is checked against a float64 torch model of the same layer.

    python benchmarks/probe_split_dense.py [--features 64,128] [--splits 1,2,4] [--atoms 12] [--warps 8] [--phased]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mlff_distiller.kernels._triton_utils import HAS_TRITON, INTERPRETING, tl, triton

NP = 16  # partner slots (a power of two, >= 16 for tl.dot's rows)
N_RBF, RP = 20, 32
CUTOFF = 5.0

if HAS_TRITON:

    @triton.jit
    def _silu(x):
        return x / (1.0 + tl.exp(-x))

    @triton.jit
    def _exchange(flag, target, S: tl.constexpr):
        """Wait until the S programs of the atom have written their part (``flag``: the atom's counter for this
        exchange): a barrier of this program's warps, one release add, a spin on acquire reads. Nothing at S = 1."""
        if S > 1:
            tl.debug_barrier()
            tl.atomic_add(flag, 1, sem="release", scope="gpu")
            seen = tl.atomic_add(flag, 0, sem="acquire", scope="gpu")
            while seen < target:
                seen = tl.atomic_add(flag, 0, sem="acquire", scope="gpu")

    @triton.jit
    def _mv_cols(x, w_ptr, ld, rows, cols):
        """``x @ W[rows, cols]`` (W row-major with leading dimension ``ld``): one output per column."""
        w = tl.load(w_ptr + rows[:, None] * ld + cols[None, :])
        return tl.sum(x[:, None] * w, axis=0)

    @triton.jit
    def _split_layer_kernel(
        pos_ptr, phi_ptr, s_ptr, v_ptr, wf_ptr, u_ptr, vw_ptr, m1_ptr, b1_ptr, m2_ptr, b2_ptr, w1_ptr, c1_ptr,
        w2_ptr, c2_ptr, s_out, v_out, phi_out, xs_ptr, xh_ptr, xg_ptr, keep_ptr, flags_ptr, n,
        F: tl.constexpr, S: tl.constexpr, NPT: tl.constexpr, R: tl.constexpr, RPT: tl.constexpr, RC: tl.constexpr,
        PHASE: tl.constexpr,
    ):  # fmt: skip
        """PHASE 0: the whole layer in one launch, the S programs of an atom meeting at three spinning exchanges.
        PHASE 1 to 4: one part a launch (the messages; U v, V v and M1's partial sums; the update and W1's; W2),
        the launch boundaries in place of the exchanges (what the Triton interpreter can run at S > 1: it runs the
        programs of a launch one after another), the values a later part needs kept in ``keep`` (s, v, U v, V v of
        the program's columns: 9 F floats an atom)."""
        i = tl.program_id(0)
        c = tl.program_id(1)
        FB: tl.constexpr = F // S
        blk = c * FB + tl.arange(0, FB)
        full = tl.arange(0, F)
        parts = tl.arange(0, S)
        row = xs_ptr + i * 3 * F
        keep = keep_ptr + i * 9 * F
        if PHASE == 0 or PHASE == 1:
            j = tl.arange(0, NPT)
            live = (j < n) & (j != i)
            # pair geometry and the Bessel basis with the cosine cutoff
            xi = tl.load(pos_ptr + i * 3)
            yi = tl.load(pos_ptr + i * 3 + 1)
            zi = tl.load(pos_ptr + i * 3 + 2)
            dx = tl.load(pos_ptr + j * 3, mask=j < n, other=0.0) - xi
            dy = tl.load(pos_ptr + j * 3 + 1, mask=j < n, other=0.0) - yi
            dz = tl.load(pos_ptr + j * 3 + 2, mask=j < n, other=0.0) - zi
            r = tl.sqrt(dx * dx + dy * dy + dz * dz)
            inside = live & (r < RC)
            rs = tl.where(inside, r, 1.0)
            k = tl.arange(0, RPT)
            basis = tl.sin((k[None, :] + 1).to(tl.float32) * (3.141592653589793 / RC) * rs[:, None]) / rs[:, None]
            cut = 0.5 * (tl.cos(rs * (3.141592653589793 / RC)) + 1.0)
            basis = tl.where(inside[:, None] & (k[None, :] < R), basis * cut[:, None] * math.sqrt(2.0 / RC), 0.0)
            ux, uy, uz = dx / rs, dy / rs, dz / rs
            # messages for this program's columns
            kr = tl.arange(0, RPT)
            f_s = tl.dot(basis, tl.load(wf_ptr + kr[:, None] * (3 * F) + blk[None, :]), input_precision="ieee")
            f_vv = tl.dot(basis, tl.load(wf_ptr + kr[:, None] * (3 * F) + F + blk[None, :]), input_precision="ieee")
            f_vs = tl.dot(basis, tl.load(wf_ptr + kr[:, None] * (3 * F) + 2 * F + blk[None, :]), input_precision="ieee")
            m2d = (j < n)[:, None]
            ps = tl.load(phi_ptr + j[:, None] * (3 * F) + blk[None, :], mask=m2d, other=0.0)
            pvv = tl.load(phi_ptr + j[:, None] * (3 * F) + F + blk[None, :], mask=m2d, other=0.0)
            pvs = tl.load(phi_ptr + j[:, None] * (3 * F) + 2 * F + blk[None, :], mask=m2d, other=0.0)
            a_vv = pvv * f_vv
            a_vs = pvs * f_vs
            s_b = tl.load(s_ptr + i * F + blk) + tl.sum(ps * f_s, axis=0)
            vj = v_ptr + (j[:, None] * 3) * F + blk[None, :]
            v0 = tl.load(v_ptr + (i * 3) * F + blk) + tl.sum(
                a_vv * tl.load(vj, mask=m2d, other=0.0) + a_vs * ux[:, None], 0
            )
            v1 = tl.load(v_ptr + (i * 3 + 1) * F + blk) + tl.sum(
                a_vv * tl.load(vj + F, mask=m2d, other=0.0) + a_vs * uy[:, None], 0
            )
            v2 = tl.load(v_ptr + (i * 3 + 2) * F + blk) + tl.sum(
                a_vv * tl.load(vj + 2 * F, mask=m2d, other=0.0) + a_vs * uz[:, None], 0
            )
            # exchange 1: v of the atom, every column (s enters M1 through its rows: no exchange of its own)
            tl.store(row + blk, v0)
            tl.store(row + F + blk, v1)
            tl.store(row + 2 * F + blk, v2)
            if PHASE == 1:
                tl.store(keep + blk, s_b)
        if PHASE == 0:
            _exchange(flags_ptr + i * 3, S, S)
        if PHASE == 0 or PHASE == 2:
            if PHASE == 2:
                s_b = tl.load(keep + blk)
            vf0 = tl.load(row + full, cache_modifier=".cg")
            vf1 = tl.load(row + F + full, cache_modifier=".cg")
            vf2 = tl.load(row + 2 * F + full, cache_modifier=".cg")
            # the update block: U v, V v for this program's columns, M1's sum over its rows (all-reduced)
            uv0 = _mv_cols(vf0, u_ptr, F, full, blk)
            uv1 = _mv_cols(vf1, u_ptr, F, full, blk)
            uv2 = _mv_cols(vf2, u_ptr, F, full, blk)
            vv0 = _mv_cols(vf0, vw_ptr, F, full, blk)
            vv1 = _mv_cols(vf1, vw_ptr, F, full, blk)
            vv2 = _mv_cols(vf2, vw_ptr, F, full, blk)
            nrm = tl.sqrt(vv0 * vv0 + vv1 * vv1 + vv2 * vv2 + 1e-8)
            h_part = _mv_cols(s_b, m1_ptr, F, blk, full) + _mv_cols(nrm, m1_ptr, F, F + blk, full)
            tl.store(xh_ptr + (i * S + c) * F + full, h_part)
            if PHASE == 2:
                tl.store(keep + 3 * F + blk, uv0)
                tl.store(keep + 4 * F + blk, uv1)
                tl.store(keep + 5 * F + blk, uv2)
                tl.store(keep + 6 * F + blk, vv0)
                tl.store(keep + 7 * F + blk, vv1)
                tl.store(keep + 8 * F + blk, vv2)
        if PHASE == 0:
            _exchange(flags_ptr + i * 3 + 1, S, S)
        if PHASE == 0 or PHASE == 3:
            if PHASE == 3:
                s_b = tl.load(keep + blk)
                v0 = tl.load(row + blk)
                v1 = tl.load(row + F + blk)
                v2 = tl.load(row + 2 * F + blk)
                uv0 = tl.load(keep + 3 * F + blk)
                uv1 = tl.load(keep + 4 * F + blk)
                uv2 = tl.load(keep + 5 * F + blk)
                vv0 = tl.load(keep + 6 * F + blk)
                vv1 = tl.load(keep + 7 * F + blk)
                vv2 = tl.load(keep + 8 * F + blk)
            h = tl.sum(tl.load(xh_ptr + (i * S + parts[:, None]) * F + full[None, :], cache_modifier=".cg"), axis=0)
            h = _silu(h + tl.load(b1_ptr + full))
            a_v = _mv_cols(h, m2_ptr, 3 * F, full, blk) + tl.load(b2_ptr + blk)
            a_sv = _mv_cols(h, m2_ptr, 3 * F, full, F + blk) + tl.load(b2_ptr + F + blk)
            a_ss = _mv_cols(h, m2_ptr, 3 * F, full, 2 * F + blk) + tl.load(b2_ptr + 2 * F + blk)
            s_n = s_b + a_sv * (uv0 * vv0 + uv1 * vv1 + uv2 * vv2) + a_ss
            tl.store(s_out + i * F + blk, s_n)
            tl.store(v_out + (i * 3) * F + blk, v0 + a_v * uv0)
            tl.store(v_out + (i * 3 + 1) * F + blk, v1 + a_v * uv1)
            tl.store(v_out + (i * 3 + 2) * F + blk, v2 + a_v * uv2)
            # the next layer's φ: W1's sum over this program's rows (all-reduced), then W2 for its columns
            tl.store(xg_ptr + (i * S + c) * F + full, _mv_cols(s_n, w1_ptr, F, blk, full))
        if PHASE == 0:
            _exchange(flags_ptr + i * 3 + 2, S, S)
        if PHASE == 0 or PHASE == 4:
            g = tl.sum(tl.load(xg_ptr + (i * S + parts[:, None]) * F + full[None, :], cache_modifier=".cg"), axis=0)
            g = _silu(g + tl.load(c1_ptr + full))
            for q in tl.static_range(3):
                out = _mv_cols(g, w2_ptr, 3 * F, full, q * F + blk) + tl.load(c2_ptr + q * F + blk)
                tl.store(phi_out + i * 3 * F + q * F + blk, out)


def make_inputs(n: int, f: int, device, dtype=torch.float32, seed: int = 0) -> dict:
    """A molecule of ``n`` atoms (random, 1.0-1.5 Å apart on average, within the cutoff of each other) and a layer of
    width ``f`` (random weights at 1 / sqrt(fan-in))."""
    g = torch.Generator().manual_seed(seed)

    def w(rows, cols, fan=None):
        return torch.randn(rows, cols, generator=g) / math.sqrt(fan or rows)

    pos = torch.zeros(NP, 3)
    pos[:n] = torch.randn(n, 3, generator=g) * 1.2
    wf = torch.zeros(RP, 3 * f)
    wf[:N_RBF] = w(N_RBF, 3 * f)
    t = {
        "pos": pos, "phi": w(NP, 3 * f, 1) * 0.5, "s": w(NP, f, 1), "v": w(NP * 3, f, 1) * 0.3, "wf": wf,
        "u": w(f, f), "vw": w(f, f), "m1": w(2 * f, f), "b1": w(1, f, 1)[0] * 0.1, "m2": w(f, 3 * f),
        "b2": w(1, 3 * f, 1)[0] * 0.1, "w1": w(f, f), "c1": w(1, f, 1)[0] * 0.1, "w2": w(f, 3 * f),
        "c2": w(1, 3 * f, 1)[0] * 0.1,
    }  # fmt: skip
    return {k: x.to(device=device, dtype=dtype).contiguous() for k, x in t.items()}


def reference(t: dict, n: int, f: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer in float64 torch: ``(s', v' [n, 3, F], φ' [n, 3F])``."""
    t = {k: x.double().cpu() for k, x in t.items()}
    pos = t["pos"][:n]
    d = pos[None, :, :] - pos[:, None, :]  # d[i, j] = x_j - x_i
    r = d.norm(dim=-1)
    live = ~torch.eye(n, dtype=torch.bool) & (r < CUTOFF)
    rs = torch.where(live, r, torch.ones_like(r))
    k = torch.arange(1, N_RBF + 1, dtype=torch.float64)
    basis = torch.sin(k * math.pi / CUTOFF * rs[..., None]) / rs[..., None] * math.sqrt(2.0 / CUTOFF)
    basis = basis * (0.5 * (torch.cos(rs * math.pi / CUTOFF) + 1.0))[..., None] * live[..., None]
    filt = basis @ t["wf"][:N_RBF]  # [n, n, 3F]
    phi = t["phi"][:n]
    x = phi[None, :, :] * filt
    unit = d / rs[..., None]
    v = t["v"][: 3 * n].view(n, 3, f)
    s = t["s"][:n] + x[..., :f].sum(1)
    v = v + torch.einsum("ijf,jkf->ikf", x[..., f : 2 * f], v) + torch.einsum("ijf,ijk->ikf", x[..., 2 * f :], unit)
    uv, vv = v @ t["u"], v @ t["vw"]
    nrm = torch.sqrt((vv * vv).sum(1) + 1e-8)
    h = torch.nn.functional.silu(torch.cat([s, nrm], 1) @ t["m1"] + t["b1"])
    a = h @ t["m2"] + t["b2"]
    v_n = v + a[:, None, :f] * uv
    s_n = s + a[:, f : 2 * f] * (uv * vv).sum(1) + a[:, 2 * f :]
    phi_n = torch.nn.functional.silu(s_n @ t["w1"] + t["c1"]) @ t["w2"] + t["c2"]
    return s_n, v_n, phi_n


def run_layer(
    t: dict, n: int, f: int, split: int, warps: int = 8, launches: int = 1, scratch: dict | None = None,
    phased: bool = False,
):  # fmt: skip
    """Run the layer ``launches`` times: each one launch with spinning exchanges (each with its own counters: one
    fill of all of them first), or with ``phased`` four launches, one a part (no counters, no spin: any S on the
    Triton interpreter); returns ``(s', v', φ', scratch)`` of the last."""
    dev = t["pos"].device
    if scratch is None:
        scratch = {
            "s": torch.empty(NP, f, device=dev), "v": torch.empty(NP * 3, f, device=dev),
            "phi": torch.empty(NP, 3 * f, device=dev), "xs": torch.empty(NP, 3 * f, device=dev),
            "xh": torch.empty(NP * split, f, device=dev), "xg": torch.empty(NP * split, f, device=dev),
            "keep": torch.empty(NP, 9 * f, device=dev),
            "flags": torch.zeros(launches, NP * 3, dtype=torch.int32, device=dev),
        }  # fmt: skip
    if scratch["flags"].shape[0] < launches:
        scratch["flags"] = torch.zeros(launches, NP * 3, dtype=torch.int32, device=dev)
    if not phased:
        scratch["flags"].zero_()
    for k in range(launches):
        for phase in (1, 2, 3, 4) if phased else (0,):
            _split_layer_kernel[(n, split)](
                t["pos"], t["phi"], t["s"], t["v"], t["wf"], t["u"], t["vw"], t["m1"], t["b1"], t["m2"], t["b2"],
                t["w1"], t["c1"], t["w2"], t["c2"], scratch["s"], scratch["v"], scratch["phi"], scratch["xs"],
                scratch["xh"], scratch["xg"], scratch["keep"], scratch["flags"][k], n,
                F=f, S=split, NPT=NP, R=N_RBF, RPT=RP, RC=CUTOFF, PHASE=phase, num_warps=warps,
            )  # fmt: skip
    return scratch["s"][:n], scratch["v"][: 3 * n].view(n, 3, f), scratch["phi"][:n], scratch


def max_error(got, want) -> float:
    pairs = zip(got, want, strict=True)
    return max(float((g.double().cpu() - w).abs().max() / max(1.0, float(w.abs().max()))) for g, w in pairs)


def main(argv: list[str] | None = None) -> list[str]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--features", default="64,128")
    p.add_argument("--splits", default="1,2,4")
    p.add_argument("--atoms", type=int, default=12)
    p.add_argument("--warps", type=int, default=8)
    p.add_argument("--launches", type=int, default=20)
    p.add_argument("--phased", action="store_true", help="also the four-launch form (launch boundaries, no spin)")
    args = p.parse_args(argv)
    n = args.atoms
    if not HAS_TRITON or (not torch.cuda.is_available() and not INTERPRETING):
        print("probe_split_dense needs CUDA (or TRITON_INTERPRET=1 for the arithmetic)")
        return []
    cuda = torch.cuda.is_available() and not INTERPRETING
    dev = torch.device("cuda" if cuda else "cpu")
    name = torch.cuda.get_device_name(dev) if cuda else "CPU (Triton interpreter: the four-launch form at S > 1)"
    lines = [
        f"# One dense-step forward layer split over S programs an atom: {name}, torch {torch.__version__}, "
        f"triton {triton.__version__}",
        "",
        f"{n} atoms in {NP} slots, {N_RBF} Bessel functions; {args.warps} warps a program. One launch: three spinning "
        "exchanges at S > 1; four launches: a launch boundary at each. µs a layer: the median replay of a CUDA graph "
        f"of {args.launches} layers (one counter fill each replay) / layers. Error: max |Δ| / max(1, max |ref|) "
        "against the float64 torch layer.",
        "",
        "| features | S | form | programs a launch | µs a layer | rel. error |",
        "|---:|---:|---|---:|---:|---:|",
    ]
    forms = (False, True) if args.phased else (False,)
    for f in (int(x) for x in args.features.split(",")):
        t = make_inputs(n, f, dev)
        want = reference(t, n, f)
        for split in (int(x) for x in args.splits.split(",")):
            if f % split or f // split < 16:
                continue
            for phased in forms if cuda or split == 1 else (True,):
                *got, scratch = run_layer(t, n, f, split, args.warps, phased=phased)
                err = max_error(got, want)
                us = float("nan")
                if cuda:
                    from harness import capture_graph

                    def layers(t=t, f=f, split=split, scratch=scratch, phased=phased):
                        return run_layer(t, n, f, split, args.warps, args.launches, scratch, phased)

                    graph = capture_graph(layers)
                    times = []
                    for _ in range(30):
                        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        a.record()
                        graph.replay()
                        b.record()
                        b.synchronize()
                        times.append(a.elapsed_time(b) * 1e3 / args.launches)
                    us = statistics.median(times)
                    *got, _ = run_layer(t, n, f, split, args.warps, 1, scratch, phased)
                    err = max(err, max_error(got, want))
                form = "four launches" if phased else "one launch"
                lines.append(f"| {f} | {split} | {form} | {n * split} | {us:.2f} | {err:.1e} |")
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()
