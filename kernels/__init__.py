"""Hot ops of the student: torch references and Triton kernels behind one dispatch point.

Select the backend with ``MLFF_DISTILLER_KERNELS=auto|triton|torch`` or :func:`set_backend` / :func:`use_backend`.
"""

from ._backend import BACKENDS, get_backend, resolve_backend, set_backend, triton_available, use_backend
from ._compile_ahead import compile_ahead, dry_run_active, dry_run_for_capture, precompile
from .edge_compact import edge_compact, edge_compact_reference
from .edge_features import edge_basis, edge_basis_reference, edge_features, edge_features_reference
from .linear import gemm, gemm_fusable, mlp, mlp_reference
from .message_passing import defer_edge_grads, message_passing, message_passing_reference, symmetric_walk
from .molecular_pairs import molecular_pairs_triton
from .painn_update import painn_update, painn_update_fusable, painn_update_reference
from .rbf_cutoff import BASES, ENVELOPES, rbf_cutoff, rbf_cutoff_reference
from .repulsion import (
    add_pair_repulsion,
    pair_repulsion,
    pair_repulsion_reference,
    repulsion_table,
    wall_gate_reference,
    wall_touched,
)
from .species_inputs import species_inputs, species_inputs_fusable, species_inputs_reference

__all__ = [
    "BACKENDS",
    "BASES",
    "ENVELOPES",
    "add_pair_repulsion",
    "compile_ahead",
    "defer_edge_grads",
    "dry_run_active",
    "dry_run_for_capture",
    "edge_basis",
    "edge_basis_reference",
    "edge_compact",
    "edge_compact_reference",
    "edge_features",
    "edge_features_reference",
    "gemm",
    "gemm_fusable",
    "get_backend",
    "message_passing",
    "message_passing_reference",
    "mlp",
    "mlp_reference",
    "molecular_pairs_triton",
    "painn_update",
    "painn_update_fusable",
    "painn_update_reference",
    "pair_repulsion",
    "pair_repulsion_reference",
    "precompile",
    "rbf_cutoff",
    "rbf_cutoff_reference",
    "repulsion_table",
    "resolve_backend",
    "set_backend",
    "species_inputs",
    "species_inputs_fusable",
    "species_inputs_reference",
    "symmetric_walk",
    "triton_available",
    "use_backend",
    "wall_gate_reference",
    "wall_touched",
]
