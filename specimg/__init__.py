"""specimg: speculative decoding with relaxed acceptance for autoregressive image models."""

from specimg.config import Sampling, TreeConfig
from specimg.engine import Engine, Generation
from specimg.errors import SpecimgError
from specimg.hookspecs import hookimpl
from specimg.methods import MethodSpec
from specimg.tree import DraftTree

__all__ = ["DraftTree", "Engine", "Generation", "MethodSpec", "Sampling", "SpecimgError", "TreeConfig", "hookimpl"]
__version__ = "0.1.0"
