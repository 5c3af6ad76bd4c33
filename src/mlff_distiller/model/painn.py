"""``StudentModel``: a PaiNN-class equivariant message-passing potential (Schütt et al., ICML 2021).

Scalar features s ``[N, F]`` and vector features v ``[N, 3, F]`` are refined by ``layers`` rounds of message and
update blocks. The hot ops (edge geometry fused with radial basis × cutoff, message aggregation) come from
``mlff_distiller.kernels`` and dispatch to Triton or the torch reference; this file never branches on the backend.
Energy = Σ_i (scale[z_i] · ε_i + shift[z_i]) in eV.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from mlff_distiller import kernels
from mlff_distiller.kernels._frozen import derived

__all__ = ["ModelConfig", "StudentModel"]


@dataclass(kw_only=True)
class ModelConfig:
    """Hyper-parameters of :class:`StudentModel` (everything a checkpoint needs to rebuild it)."""

    species: list[int] = field(default_factory=lambda: [1, 6, 7, 8])
    hidden: int = 128
    layers: int = 3
    n_rbf: int = 20
    cutoff: float = 5.0  # Å
    basis: str = "bessel"
    envelope: str = "cosine"
    # A ZBL pair repulsion below these radii (``kernels.repulsion``): ``[[Z_a, Z_b, r_off Å], ...]``, or None for
    # none. Training sets it from the training data's shortest pairs (DomainEnvelope.repulsion_radii).
    repulsion: list | None = None

    def __post_init__(self) -> None:
        self.species = sorted({int(z) for z in self.species})
        if not self.species or self.species[0] < 1 or self.species[-1] > 118:
            raise ValueError(f"species must be atomic numbers in 1..118, got {self.species}")
        for name in ("hidden", "layers", "n_rbf"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.cutoff > 0:
            raise ValueError(f"cutoff must be > 0 Å, got {self.cutoff}")
        if self.basis not in kernels.BASES:
            raise ValueError(f"unknown basis {self.basis!r}; choose one of {kernels.BASES}")
        if self.envelope not in kernels.ENVELOPES:
            raise ValueError(f"unknown envelope {self.envelope!r}; choose one of {kernels.ENVELOPES}")
        if self.repulsion is not None:
            try:
                rows = [(int(za), int(zb), float(r)) for za, zb, r in self.repulsion]
            except (TypeError, ValueError):
                raise ValueError(f"repulsion must be [[Z_a, Z_b, r_off], ...], got {self.repulsion!r}") from None
            for za, zb, r in rows:
                if not 0 <= r < self.cutoff:
                    raise ValueError(f"repulsion radius of the pair ({za}, {zb}) must be in [0, cutoff), got {r} Å")
            self.repulsion = sorted([min(za, zb), max(za, zb), r] for za, zb, r in rows)
            kernels.repulsion_table(self.species, {(za, zb): r for za, zb, r in self.repulsion})  # checks species


def _mlp(n_in: int, n_hidden: int, n_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(n_in, n_hidden), nn.SiLU(), nn.Linear(n_hidden, n_out))


def _phi_table(embedding: torch.Tensor, w1, b1, w2, b2) -> torch.Tensor:
    """φ(embedding row) of every species, ``[species, 3F]`` in the embedding's dtype: the MLP in float64 (no TF32,
    no 16-bit GEMM mode can reach it, and the table is made once), rounded once to the model's dtype."""
    with torch.no_grad():
        wide = embedding.dtype if embedding.device.type == "mps" else torch.float64
        e, w1, b1, w2, b2 = (t.detach().to(wide) for t in (embedding, w1, b1, w2, b2))
        out = torch.nn.functional.linear(torch.nn.functional.silu(torch.nn.functional.linear(e, w1, b1)), w2, b2)
        return out.to(embedding.dtype).contiguous()


def _moment_weights(embedding: torch.Tensor, w1, b1, w2, b2, w_filter) -> torch.Tensor:
    """``[M_a; M_c]`` ``[2, S·R, F]`` of :mod:`mlff_distiller.kernels.species_moments`: M[(z, r), f] = Φ[z, f] W[f, r]
    for the a-block and the c-block of the first layer's φ table Φ and filter W, made in float64 and rounded once."""
    with torch.no_grad():
        wide = embedding.dtype if embedding.device.type == "mps" else torch.float64
        phi = _phi_table(embedding.to(wide), w1, b1, w2, b2)  # in float64
        f = w1.shape[0]
        w = w_filter.detach().to(phi.dtype)
        m_a = torch.einsum("zf,fr->zrf", phi[:, :f], w[:f])
        m_c = torch.einsum("zf,fr->zrf", phi[:, 2 * f :], w[2 * f :])
        s, r = m_a.shape[0], m_a.shape[1]
        return torch.stack([m_a.reshape(s * r, f), m_c.reshape(s * r, f)]).to(embedding.dtype).contiguous()


def _mlp_call(mlp: nn.Sequential, x: torch.Tensor, residual: bool = False):
    """An :func:`_mlp` applied to x: :func:`mlff_distiller.kernels.mlp` (Triton GEMMs for frozen weights on the
    Triton backend, the same torch ops otherwise). Layers that are not plain ``nn.Linear`` (the 16-bit copies of
    :mod:`mlff_distiller.precision`) run as modules. ``residual``: returns ``(mlp(x), x')`` with x' standing for x
    in a residual sum (see ``kernels.mlp``)."""
    first, last = mlp[0], mlp[2]
    if type(first) is not nn.Linear or type(last) is not nn.Linear:
        return (mlp(x), x) if residual else mlp(x)
    # residual positionally: wrappers of kernels.mlp (benchmarks/bench_breakdown.py) pass *args through.
    return kernels.mlp(x, first.weight, first.bias, last.weight, last.bias, residual)


class PaiNNInteraction(nn.Module):
    """Message block: Δs_i = Σ_j a_ij, Δv_i = Σ_j b_ij v_j + c_ij u_ij, with (a, b, c) = φ(s_j) ⊙ W(r_ij)."""

    def __init__(self, hidden: int, n_rbf: int) -> None:
        super().__init__()
        self.phi = _mlp(hidden, hidden, 3 * hidden)
        # No bias: the filter is a linear map of basis × cutoff, so every message is exactly 0 at the cutoff.
        self.filter = nn.Linear(n_rbf, 3 * hidden, bias=False)

    def forward(self, s, v, rbf, unit, edge_index):
        s, ds, dv = self.messages(s, v, rbf, unit, edge_index)
        return s + ds, v + dv

    def messages(
        self, s, v, rbf, unit, edge_index, v_zero=False, phi=None, edge_sink=None, v_residual=False, symmetric=False
    ):
        """``(s', Δs [N,F], Δv [N,3,F])``: ``forward`` without its residual sums (the model hands them to the update
        block, whose fused path adds them inside its own kernels). s' is s for the residual sum: on the Triton MLP
        an alias whose gradient φ's backward adds to its own (one add kernel less). ``v_zero``: v is all zeros
        (the first layer; see :func:`mlff_distiller.kernels.message_passing`). ``phi``: φ(s) ``[N, 3F]`` already
        known (the first layer's, from the species table of :meth:`StudentModel.first_phi_table`); s is then
        returned as it is. ``edge_sink``: see :func:`mlff_distiller.kernels.defer_edge_grads`. ``v_residual``:
        also return v' fourth, v for the residual sum (on the Triton path an alias whose gradient the message
        backward adds to its own, as s' does for φ). ``symmetric``: the edge list is a full neighbour list (see
        :func:`mlff_distiller.kernels.message_passing`)."""
        if phi is None:
            phi, s = _mlp_call(self.phi, s, residual=True)
        w = self.filter.weight
        return (
            s,
            *kernels.message_passing(
                phi,
                v,
                rbf,
                w,
                unit,
                edge_index,
                v_zero=v_zero,
                edge_sink=edge_sink,
                v_residual=v_residual,
                symmetric=symmetric,
            ),
        )


class CSRInteraction(nn.Module):
    """A :class:`PaiNNInteraction` that hands the message-passing kernel its receiver CSR offsets.

    Static-shape callers (the engine's padded modes, the trainer's static/CUDA-graph steps) need it: without
    ``row_ptr`` the fused Triton kernel checks the edge order with a device→host sync (illegal inside CUDA-graph
    capture) and caches the CSR per ``edge_index`` tensor, which a captured graph would bake in while the static
    buffer's content changes every replay. The caller computes ``row_ptr`` on the device from its
    receiver-sorted edges and stores it in the shared ``csr`` dict (``{"row_ptr": [N + 1]}``) before each
    forward. It may add ``"sender": (perm [E], col_ptr [N + 1])``, the sender CSR of the same edges (see
    :func:`mlff_distiller.kernels.message_passing`), so that the backward does not sort the senders either: the
    engine's padded buckets compute both once per edge list, outside the captured step; and ``"symmetric":
    True`` where the edges are a full neighbour list (the sender backward then walks ``row_ptr`` alone). All are
    trusted as given. Same math and parameters as the wrapped block.
    """

    def __init__(self, inner: PaiNNInteraction, csr: dict) -> None:
        super().__init__()
        self.inner = inner
        self.csr = csr

    def forward(self, s, v, rbf, unit, edge_index):
        s, ds, dv = self.messages(s, v, rbf, unit, edge_index)
        return s + ds, v + dv

    def messages(
        self, s, v, rbf, unit, edge_index, v_zero=False, phi=None, edge_sink=None, v_residual=False, symmetric=False
    ):
        """``(s', Δs, Δv)``, with ``v_residual`` also v' (see :meth:`PaiNNInteraction.messages`)."""
        w = self.inner.filter.weight
        csr = self.csr
        if phi is None:
            phi, s = _mlp_call(self.inner.phi, s, residual=True)
        return s, *kernels.message_passing(
            phi,
            v,
            rbf,
            w,
            unit,
            edge_index,
            row_ptr=csr["row_ptr"],
            sender_csr=csr.get("sender"),
            v_zero=v_zero,
            edge_sink=edge_sink,
            v_residual=v_residual,
            symmetric=symmetric or bool(csr.get("symmetric", False)),
        )


class PaiNNUpdate(nn.Module):
    """Update block: mixes scalar and vector channels atom-wise (rotation-equivariant).

    When no parameter requires grad (inference) and the kernel backend is Triton, ``forward`` runs the fused
    kernels of :func:`mlff_distiller.kernels.painn_update` (same math, gradients wrt s and v only, first order);
    otherwise the torch code below (training, torch.compile, the torch backend). ``forward(s, v, ds, dv)`` updates
    ``s + ds``, ``v + dv`` (the message block's residual sums, which the fused path adds in its kernels).
    """

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.U = nn.Linear(hidden, hidden, bias=False)
        self.V = nn.Linear(hidden, hidden, bias=False)
        self.mix = _mlp(2 * hidden, hidden, 3 * hidden)

    def forward(self, s, v, ds=None, dv=None, need_v=True):
        """``(s', v')``; ``need_v`` False (the model's last layer, whose v' nothing reads): v' is None and a_vv is not
        made (the MLP's last layer computes the a_sv and a_ss rows only)."""
        params = (
            self.U.weight,
            self.V.weight,
            self.mix[0].weight,
            self.mix[0].bias,
            self.mix[2].weight,
            self.mix[2].bias,
        )
        if kernels.painn_update_fusable(s, v, *params, *(d for d in (ds, dv) if d is not None)):
            # Inference with frozen weights on the Triton backend: the fused kernels (first derivative only).
            return kernels.painn_update(s, v, *params, ds=ds, dv=dv, need_v=need_v)
        if ds is not None:
            s = s + ds
        if dv is not None:
            v = v + dv
        uv, vv = self.U(v), self.V(v)
        # +eps keeps sqrt differentiable at v = 0 (the first layer starts from zero vectors).
        vnorm = torch.sqrt((vv * vv).sum(dim=1) + 1e-8)
        x = torch.cat([s, vnorm], dim=-1)
        if not need_v:
            f, last = self.hidden, self.mix[2]
            h = self.mix[1](self.mix[0](x))
            if type(last) is nn.Linear:  # the a_sv, a_ss rows only
                a_sv, a_ss = torch.split(nn.functional.linear(h, last.weight[f:], last.bias[f:]), f, dim=-1)
            else:  # a replaced layer (the 16-bit copies of precision.py): its own forward, a_vv dropped
                _, a_sv, a_ss = torch.split(last(h), f, dim=-1)
            return s + a_ss + a_sv * (uv * vv).sum(dim=1), None
        a_vv, a_sv, a_ss = torch.split(self.mix(x), self.hidden, dim=-1)
        return s + a_ss + a_sv * (uv * vv).sum(dim=1), v + a_vv.unsqueeze(1) * uv


class StudentModel(nn.Module):
    """PaiNN-class student. Defaults (hidden 128, 3 layers, 20 Bessel functions, 5 Å) give ≈0.58M parameters.

    ``forward`` takes an already-built graph and returns ``{"energy": [B] eV, "atomic_energies": [N] eV}``.
    Use :class:`mlff_distiller.ForceEngine` (or ``predict_forces`` / ``StudentCalculator``) for forces and stress.
    """

    # The first layer's φ(s) depends on the species alone (s is an embedding row there): with frozen weights it is
    # taken from a [species, 3F] table made once (kernels._frozen.derived: made again when a weight changes) and
    # gathered per atom, instead of the MLP on every atom (two GEMMs fewer per step on the GPU, two matmuls on the
    # CPU). False: the MLP on every atom, as in training (tests and probes compare the two).
    species_table: ClassVar[bool] = True
    # Layers after the first pass v' from the message block to the update (kernels.message_passing's v_residual):
    # v's two gradients summed in the message backward's sender kernel, not in an add kernel of autograd's. False:
    # v itself (probes compare the two).
    v_residual_alias: ClassVar[bool] = True
    # With frozen weights on the Triton backend, the species index, the embedding rows, v = 0 and the first layer's
    # φ rows come from one kernel (kernels.species_inputs) instead of four torch launches. False: the torch ops
    # (probes compare the two).
    species_inputs_fused: ClassVar[bool] = True
    # The last layer's update makes s' only (PaiNNUpdate need_v=False): v' and its coefficient a_vv feed nothing
    # (the readout reads s), so the mixing MLP's last GEMM is 2F wide instead of 3F there, forward and backward, and
    # no v' is written. False: v' made and dropped, as before stop 56 (probes compare the two). The whole step on an
    # H200, on against off, two rounds (benchmarks/results/stop56_gpu/g/): benzene 1.017x, 192 water atoms
    # 1.005-1.009x, g2 x 1,024 / 4,096 1.015-1.017 / 1.013-1.014x, water 3,000 1.003-1.004x, 24,000 1.000-1.004x.
    last_update_scalars_only: ClassVar[bool] = True

    def __init__(self, config: ModelConfig | None = None, **kwargs) -> None:
        super().__init__()
        if config is None:
            config = ModelConfig(**kwargs)
        elif kwargs:
            raise TypeError("pass either a ModelConfig or keyword arguments, not both")
        self.config = config
        f = config.hidden
        species = torch.tensor(config.species, dtype=torch.long)
        z_to_index = torch.full((119,), -1, dtype=torch.long)
        z_to_index[species] = torch.arange(len(species))
        self.register_buffer("species", species, persistent=False)
        self.register_buffer("z_to_index", z_to_index, persistent=False)
        self.embedding = nn.Embedding(len(species), f)
        self.interactions = nn.ModuleList(PaiNNInteraction(f, config.n_rbf) for _ in range(config.layers))
        self.updates = nn.ModuleList(PaiNNUpdate(f) for _ in range(config.layers))
        self.readout = _mlp(f, f // 2 if f > 1 else 1, 1)
        # Per-species energy scale and shift (eV), fitted from data by the trainer.
        self.register_buffer("atomic_scale", torch.ones(len(species)))
        self.register_buffer("atomic_shift", torch.zeros(len(species)))
        self.register_buffer("repulsion_table", None, persistent=False)
        self._build_repulsion()

    # ------------------------------------------------------------------------------------------ properties
    @property
    def cutoff(self) -> float:
        return float(self.config.cutoff)

    @property
    def species_list(self) -> list[int]:
        return list(self.config.species)

    def extra_repr(self) -> str:
        c = self.config
        return (
            f"species={c.species}, hidden={c.hidden}, layers={c.layers}, n_rbf={c.n_rbf}, cutoff={c.cutoff}, "
            f"basis={c.basis}, envelope={c.envelope}, repulsion={'zbl' if c.repulsion else None}, "
            f"kernels={kernels.get_backend()}"
        )

    def kernel_backend(self) -> str:
        """The backend the hot ops will use for this model's device (``triton`` or ``torch``)."""
        return kernels.resolve_backend(self.atomic_scale.device)

    def check_species(self, numbers: torch.Tensor) -> None:
        """Raise ``ValueError`` naming any atomic number this model was not trained on."""
        # In NumPy on the host, the table from the config (a list): the species buffer may live on a GPU, and
        # reading it back was a device sync per call (~20 µs and a pipeline bubble of every single-point call).
        z = torch.as_tensor(numbers).detach().cpu().numpy()
        known = np.zeros(119, dtype=bool)
        known[self.config.species] = True
        bad = z[~known[np.clip(z, 0, 118)] | (z < 0) | (z > 118)]
        if bad.size:
            from ase.data import chemical_symbols

            names = sorted({chemical_symbols[int(x)] if 0 < int(x) < 119 else str(int(x)) for x in bad})
            raise ValueError(f"unknown element(s) {names} for this model; it knows {self._species_symbols()}")

    def _species_symbols(self) -> list[str]:
        from ase.data import chemical_symbols

        return [chemical_symbols[z] for z in self.config.species]

    def _first_interaction(self) -> nn.Module | None:
        """The first interaction block (inside its CSR wrapper, if the engine put one around it), or None."""
        inter = self.interactions[0] if len(self.interactions) else None
        return inter.inner if type(inter) is CSRInteraction else inter

    def first_phi_table(self) -> torch.Tensor | None:
        """The first layer's φ(s) of every species, ``[species, 3F]`` (made once while the weights stay as they are),
        or None where the MLP runs on every atom instead: ``species_table`` off, a weight that requires grad under
        grad mode (training), a replaced embedding or first block, or inside ``torch.compile``."""
        if not self.species_table or torch.compiler.is_compiling():
            return None
        inner = self._first_interaction()
        if type(inner) is not PaiNNInteraction or type(self.embedding) is not nn.Embedding:
            return None
        first, act, last = inner.phi[0], inner.phi[1], inner.phi[2]
        if type(first) is not nn.Linear or type(act) is not nn.SiLU or type(last) is not nn.Linear:
            return None
        weights = (self.embedding.weight, first.weight, first.bias, last.weight, last.bias)
        if torch.is_grad_enabled() and any(w.requires_grad for w in weights):
            return None
        return derived("first_phi", _phi_table, *weights)

    def first_layer_moment_weights(self, n_atoms: int, n_edges: int) -> torch.Tensor | None:
        """``[M_a; M_c]`` ``[2, S·R, F]`` (made once while the weights stay as they are) where the first layer runs from
        species-resolved radial moments (:mod:`mlff_distiller.kernels.species_moments`), else None: where
        :meth:`first_phi_table` gives no table, beyond ``MAX_SPECIES`` species, below ``model_min_edges`` edges or
        ``model_min_degree`` edges per atom (``species_moments._CONFIG``)."""
        from mlff_distiller.kernels import species_moments as sm

        least, degree = sm._CONFIG["model_min_edges"], sm._CONFIG["model_min_degree"]
        if least is None or degree is None or n_edges < least or n_edges < degree * n_atoms:
            return None  # (the counts first: a small molecule's step asks every time)
        if len(self.config.species) > sm.MAX_SPECIES or self.first_phi_table() is None:
            return None
        inner = self._first_interaction()
        first = inner.phi
        weights = (self.embedding.weight, first[0].weight, first[0].bias, first[2].weight, first[2].bias)
        return derived("first_moments", _moment_weights, *weights, inner.filter.weight)

    def _first_layer_moments(self, idx, rbf, unit, edge_index, sink=None):
        """``(Δs, Δv)`` of the first layer from the species-resolved radial moments
        (:mod:`mlff_distiller.kernels.species_moments`: no sender features gathered), or None where the message
        kernel runs instead: call it only where :meth:`first_phi_table` gave a table. The Triton backend, at most
        ``MAX_SPECIES`` species, graphs of at least ``species_moments._CONFIG["model_min_edges"]`` edges and
        ``["model_min_degree"]`` edges per atom, edges sorted by receiver. ``sink``: the step's edge-gradient sink
        (:func:`mlff_distiller.kernels.defer_edge_grads`), which the moments' backward then adds into."""
        from mlff_distiller.kernels import species_moments as sm

        if kernels.resolve_backend(rbf.device) != "triton":
            return None
        m = self.first_layer_moment_weights(idx.shape[0], edge_index.shape[1])
        if m is None:
            return None
        inter = self.interactions[0]
        if type(inter) is CSRInteraction:
            row_ptr = inter.csr["row_ptr"]
        else:
            from mlff_distiller.kernels._mp_csr import _receiver_csr

            g = _receiver_csr(edge_index, idx.shape[0])  # cached per edge list, as the message kernel's
            if g.order is not None:  # not sorted by receiver
                return None
            row_ptr = g.row_ptr
        n_species = len(self.config.species)
        row_ptr = row_ptr.to(torch.int64)
        return sm.first_layer_messages(rbf, unit, edge_index, idx, n_species, row_ptr, m, edge_sink=sink)

    def set_energy_reference(self, shift: Sequence[float] | torch.Tensor, scale: Sequence[float] | torch.Tensor):
        """Set per-species energy shift (eV) and scale, ordered like ``config.species``."""
        shift = torch.as_tensor(shift, dtype=self.atomic_shift.dtype, device=self.atomic_shift.device)
        scale = torch.as_tensor(scale, dtype=self.atomic_scale.dtype, device=self.atomic_scale.device)
        if shift.shape != self.atomic_shift.shape or scale.shape != self.atomic_scale.shape:
            raise ValueError(f"shift and scale must have {len(self.config.species)} entries (one per species)")
        self.atomic_shift.copy_(shift)
        self.atomic_scale.copy_(scale)

    def set_repulsion(self, radii: dict[tuple[int, int], float] | None) -> None:
        """Put a ZBL pair repulsion under the student below ``radii`` ``{(Z_a, Z_b): r_off Å}`` (see
        :mod:`mlff_distiller.kernels.repulsion`; pairs left out get none), or remove it (None). Stored in the config,
        hence in a saved checkpoint."""
        rows = None if radii is None else [[za, zb, float(r)] for (za, zb), r in radii.items()]
        self.config = ModelConfig(**{**asdict(self.config), "repulsion": rows})
        self._build_repulsion()

    def _apply(self, fn, *args, **kwargs):
        # .to(), .double(), .cuda(): the wall's table is made again from the config in the new dtype (a cast of the
        # float32 table would keep its float32 rounding in a float64 model).
        # A call that changes neither keeps the tensor (an engine may have captured it).
        table = self.repulsion_table
        out = super()._apply(fn, *args, **kwargs)
        ref = self.atomic_scale
        if table is not None and (table.dtype != ref.dtype or table.device != ref.device):
            self._build_repulsion()
        else:
            self.repulsion_table = table
        return out

    def _build_repulsion(self) -> None:
        rows = self.config.repulsion
        if not rows:
            self.repulsion_table = None
            return
        ref = self.atomic_scale
        table = kernels.repulsion_table(self.config.species, {(za, zb): r for za, zb, r in rows}, dtype=ref.dtype)
        self.repulsion_table = table.to(ref.device)

    # ------------------------------------------------------------------------------------------ forward
    def forward(
        self,
        numbers: torch.Tensor,
        positions: torch.Tensor,
        edge_index: torch.Tensor,
        shift_vectors: torch.Tensor,
        batch: torch.Tensor,
        num_structures: int,
        symmetric_edges: bool = False,
    ) -> dict[str, torch.Tensor]:
        """Energies of a batch.

        Args:
            numbers: ``[N]`` atomic numbers (all must be in ``config.species``; see :meth:`check_species`).
            positions: ``[N, 3]`` Å.
            edge_index: ``[2, E]`` receiver i, sender j.
            shift_vectors: ``[E, 3]`` Å, so that r_ij = pos[j] − pos[i] + shift.
            batch: ``[N]`` structure index of each atom.
            num_structures: B.
            symmetric_edges: the caller promises a full neighbour list (every edge (i ← j) with its partner
                (j ← i) and the opposite shift, as :class:`~mlff_distiller.neighbors.NeighborList` is): the Triton
                message backward then needs no sender sort (see :func:`mlff_distiller.kernels.message_passing`).
                Not checked; the engine passes it for its own lists.
        Returns:
            ``{"energy": [B], "atomic_energies": [N]}`` in eV; the energies summed and returned in float64 (for a
            float32 model too, as nequip does: a float32 total is only good to its spacing, 0.125 eV for a
            24,000-atom water box), the atomic energies in the model's dtype.
        """
        c = self.config
        phi_table = self.first_phi_table()
        s = v = phi_rows = None
        if self.species_inputs_fused and type(self.embedding) is nn.Embedding and self.embedding.max_norm is None:
            weight = self.embedding.weight
            # The first layer's φ rows where it will not run from the radial moments (small graphs).
            need_phi = (
                phi_table is not None and self.first_layer_moment_weights(numbers.shape[0], edge_index.shape[1]) is None
            )
            if kernels.species_inputs_fusable(numbers, weight, phi_table if need_phi else None):
                # frozen weights: species index, embedding, v = 0 and the first φ rows in one kernel
                idx, s, v, phi_rows = kernels.species_inputs(
                    numbers, self.z_to_index, weight, phi_table if need_phi else None
                )
        if s is None:
            idx = self.z_to_index[numbers]
        table = self.repulsion_table
        # With a ZBL wall (kernels.repulsion) the basis comes times the wall's gate: inside the wall the student's
        # message fades out (the gate is exactly 1 outside it).
        dist, unit, rbf = kernels.edge_basis(
            positions,
            edge_index,
            shift_vectors,
            c.n_rbf,
            c.cutoff,
            c.basis,
            c.envelope,
            wall=None if table is None else (idx, table),
        )
        # The wall's energy (below) only where an edge lies inside it: on CPU tensors decided here, else always.
        wall = table is not None and kernels.wall_touched(dist, edge_index, idx, table)
        if s is None:
            s = self.embedding(idx)
            v = torch.zeros((s.shape[0], 3, s.shape[1]), dtype=s.dtype, device=s.device)
        # Inside a CUDA-graph capture the layers' ∂rbf, ∂u are summed on a second stream (kernels.defer_edge_grads).
        # Elsewhere (eager steps, large captures) an inference step's layers sum them into a sink on one stream.
        first = next(self.interactions.parameters(), None)
        inference = first is not None and not first.requires_grad
        rbf, unit, sink = kernels.defer_edge_grads(rbf, unit, one_stream=inference)
        for layer, (interaction, update) in enumerate(zip(self.interactions, self.updates, strict=True)):
            messages = getattr(interaction, "messages", None)
            if messages is None or not isinstance(update, PaiNNUpdate):  # a replaced block: its own residuals
                s, v = update(*interaction(s, v, rbf, unit, edge_index))
            else:  # s + ds, v + dv inside the update (no separate add kernels on the fused path)
                # The last layer's v' is read by nothing (the readout takes s): not made, nor its a_vv. (Asked of
                # our own forward only: a subclass that overrides it keeps its signature.)
                last = layer == len(self.updates) - 1 and self.last_update_scalars_only
                up = {"need_v": False} if last and type(update).forward is PaiNNUpdate.forward else {}
                # v_zero: the first layer's v is the zeros above (its message terms are skipped, not added).
                kw = {"v_zero": layer == 0}
                if layer == 0 and phi_table is not None:
                    # The first layer from species-resolved radial moments (large graphs), else its φ(s) as rows of
                    # the species table.
                    moments = self._first_layer_moments(idx, rbf, unit, edge_index, sink)
                    if moments is not None:
                        s, v = update(s, v, *moments, **up)
                        continue
                    kw["phi"] = phi_rows if phi_rows is not None else phi_table.index_select(0, idx)
                ours = type(interaction) in (PaiNNInteraction, CSRInteraction)
                if sink is not None and ours:
                    kw["edge_sink"] = sink
                if symmetric_edges and ours:
                    kw["symmetric"] = True
                if ours and layer > 0 and self.v_residual_alias:
                    # v' for v + dv: its gradient joins v's in the message backward's kernel
                    s, ds, dv, v = messages(s, v, rbf, unit, edge_index, v_residual=True, **kw)
                else:
                    s, ds, dv = messages(s, v, rbf, unit, edge_index, **kw)
                s, v = update(s, v, ds, dv, **up)
        first, last = self.readout[0], self.readout[2]
        params = (first.weight, first.bias, last.weight, last.bias, self.atomic_scale, self.atomic_shift)
        if type(first) is nn.Linear and type(last) is nn.Linear and kernels.gemm_fusable(s, *params):
            # Frozen weights on the Triton GEMMs: MLP, per-species scale and shift and the per-structure sum in two
            # GEMMs (no gather, mul, add, index_add kernels; nor their backward's gather and mul).
            energy, atomic = kernels.linear.readout(s, *params, idx, batch, num_structures)
        else:  # the same ops, through kernels.mlp (training, the torch backend, the 16-bit copies of precision)
            atomic = _mlp_call(self.readout, s).squeeze(-1) * self.atomic_scale[idx] + self.atomic_shift[idx]
            energy = kernels.linear.structure_sums(atomic, batch, num_structures, keep_wide=True)  # float64
        if wall:
            atomic, energy = kernels.add_pair_repulsion(atomic, energy, dist, edge_index, idx, table, batch)
        return {"energy": energy, "atomic_energies": atomic}

    def round_weights_tf32(self) -> int:
        """Round every ``nn.Linear`` weight (float32) to the nearest TF32 value in place (11 significant bits, ties
        away from zero); biases, the embedding and the energy reference stay as they are. Returns how many weights
        changed. A student on the TF32 grid is evaluated in float32 as before, to float32 accuracy, but on the GPU
        each product with such a weight takes two TF32 MMAs instead of tf32x3's three (the third, with W's low part,
        is zero; ``kernels._frozen.tf32_exact``): 1.07-1.12x a whole fp32 step on an H200
        (``benchmarks/results/stop59_gpu/``). The rounding changes the student's predictions by about as much as
        its weights' last 13 bits: the shipped 128 x 3 student's forces by 0.15 meV/Å on average (its error against
        GFN2-xTB is ~19 meV/Å). The trainer rounds its result (``TrainConfig.tf32_grid``); both shipped students
        are on the grid (stop 59)."""
        from mlff_distiller.kernels._frozen import round_tf32_, tf32_exact

        changed = 0
        for module in self.modules():
            if isinstance(module, nn.Linear) and module.weight.dtype == torch.float32:
                w = module.weight
                if not tf32_exact(w.detach()):
                    round_tf32_(w)  # (in place under no_grad: the version moves, kept forms are made again)
                    changed += 1
        return changed

    def on_tf32_grid(self) -> bool:
        """Whether every ``nn.Linear`` weight is float32 on the TF32 grid (see :meth:`round_weights_tf32`)."""
        from mlff_distiller.kernels._frozen import tf32_exact

        linears = [m.weight for m in self.modules() if isinstance(m, nn.Linear)]
        return bool(linears) and all(w.dtype == torch.float32 and tf32_exact(w.detach()) for w in linears)

    # ------------------------------------------------------------------------------------------ persistence
    def save(self, path: str | Path, metadata: dict | None = None) -> None:
        """Write a checkpoint (config, weights, species, cutoff, format version); load with ``load_model``."""
        from mlff_distiller.checkpoint import save_checkpoint

        save_checkpoint(self, path, metadata=metadata)

    def config_dict(self) -> dict:
        return asdict(self.config)
