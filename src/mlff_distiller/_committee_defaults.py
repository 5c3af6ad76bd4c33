"""The committee's defaults (:mod:`mlff_distiller.committee` exports them), in a module that imports nothing, so
that the command line's parser can show them without importing torch."""

# The shipped students: the same labels and recipe, 128 and 64 features.
DEFAULT_COMMITTEE = ("builtin:chno-gfn2", "builtin:chno-gfn2-small")
# meV/Å: a structure whose students' forces differ by more than this (mean absolute) is flagged.
DISAGREEMENT_THRESHOLD = 50.0
