"""specimg: speculative decoding with relaxed acceptance for autoregressive image models.

Everything a user or a method plugin's author needs is here: ``import specimg`` (the
engine and its settings; the hook marker, the method spec, and the step's types and
helpers that the hooks take and return)."""

from specimg.accept import chain_acceptance
from specimg.config import Sampling, TreeConfig
from specimg.engine import Engine, Generation
from specimg.errors import SpecimgError
from specimg.hookspecs import hookimpl
from specimg.methods import MethodSpec
from specimg.models.base import Target
from specimg.neighbours import CODEBOOKS, codebook_donors, embedding_donors
from specimg.relax import candidate_rows, transfer
from specimg.step import Acceptance, Scores, Step
from specimg.tree import DraftSession, DraftTree, build_static

__all__ = [
    "CODEBOOKS", "Acceptance", "DraftSession", "DraftTree", "Engine", "Generation", "MethodSpec", "Sampling", "Scores",
    "SpecimgError", "Step", "Target", "TreeConfig", "build_static", "candidate_rows", "chain_acceptance", "codebook_donors", "embedding_donors", "hookimpl", "transfer",
]
__version__ = "0.1.0"
