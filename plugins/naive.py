"""naive: exact speculative decoding with the EAGLE tree and no relaxation (delta = 0).

It registers the method and leaves every hook to the core: the default tree, one target
forward, and exact acceptance (sample-and-match, or recursive rejection for sampled trees).
"""

from specimg import MethodSpec, hookimpl


@hookimpl
def register_methods(register):
    register(MethodSpec("naive", description="exact speculative decoding (no relaxation, delta 0)", paper={}))
