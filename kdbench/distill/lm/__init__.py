"""Language-model distillation: token-level divergences (:mod:`.divergences`, their formulas in
:mod:`.token_losses`), the loss implementations (:mod:`.impls`), the cell's whole LM loss (:mod:`.loss`), the
token-level methods' base (:mod:`.terms`) and the offline top-k teacher (:mod:`.topk`)."""

# The method registry first: its package imports every method module, and the token-level ones import
# ``.terms``, which imports the registry; a module that imports ``.terms`` before anything else (a user's
# divergence) would otherwise find it half-initialised.
import kdbench.distill.losses  # noqa: F401
