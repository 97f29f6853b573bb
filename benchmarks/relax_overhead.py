"""Time the relaxation step of each method against a verification forward.

One decode step's relax phase (the engine's ``relax.fold``, budget checks included) for a
60-node LANTERN++-shaped tree at LlamaGen scale: V = 16384, GPT-B hidden size 768, p with
its mass spread over a top-2000, random hidden states and embeddings, a random
L2-normalised 16384 x 8 codebook (VQ-16).  The reference is one GPT-B forward over the
same 60-node tree with CFG (two rows), when specimg.models.llamagen is present (on a GPU
the compiled forward the engine runs there).

    python benchmarks/relax_overhead.py [--device cpu] [--repeats 10] [--threads 1]

The contract checks run as in the engine: on, unless SPECIMG_RELAX_CHECKS=0.  Each stack
is timed twice: eagerly, and compiled by torch.compile as the engine's compiled path runs
it (captured as a CUDA graph on a GPU; ``--no-compile`` skips it on a CPU, where inductor
compiles for a minute a stack).

On the CPU it counts this process's CPU time with ``--threads`` torch threads (default
one), which other work on a shared machine barely disturbs; on a GPU, wall time.

The codebook's neighbour table is built once (seconds) and cached in $SPECIMG_CACHE_DIR.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from torch import Tensor

from specimg import DraftTree, Sampling
from specimg.compiled import run
from specimg.plugins import PluginManager
from specimg.relax import checks_enabled, fold_on_device
from specimg.sampling import probabilities
from specimg.step import Scores
from specimg_plugins.lantern_pp import TREES

VOCAB, HIDDEN, TOP_K, CODE_DIM = 16384, 768, 2000, 8
STACKS = (("lantern",), ("lantern++",), ("gsd",), ("cascade",), ("cascade", "lantern"), ("lantern", "gsd"))


class RandomTarget:
    def __init__(self, generator: torch.Generator, device: str):
        self.embeddings = torch.randn(VOCAB, HIDDEN, generator=generator).to(device)

    def input_embeddings(self) -> torch.Tensor:
        return self.embeddings


class RandomTokenizer:
    vocab_size = VOCAB

    def __init__(self, generator: torch.Generator, device: str):
        self.codebook = torch.nn.functional.normalize(torch.randn(VOCAB, CODE_DIM, generator=generator), dim=-1).to(device)

    def codebook_vectors(self) -> torch.Tensor:
        return self.codebook


def random_tree(generator: torch.Generator) -> DraftTree:
    """The 60-node default LANTERN++ tree with distinct random tokens."""
    paths = sorted(TREES["default"], key=lambda p: (len(p), p))
    node = {(): 0}
    parents = [-1]
    for path in paths:
        node[path] = len(parents)
        parents.append(node[path[:-1]])
    return DraftTree.from_parents(torch.randperm(VOCAB, generator=generator)[: len(parents)].tolist(), parents)


def timed(fn: Callable[[], object], repeats: int, device: str) -> float:
    """Best-of-``repeats`` milliseconds of ``fn`` after two warm-up calls."""
    gpu = device.startswith("cuda")
    clock = time.perf_counter if gpu else time.process_time
    times = []
    for i in range(repeats + 2):
        if gpu:
            torch.cuda.synchronize()
        start = clock()
        fn()
        if gpu:
            torch.cuda.synchronize()
        if i >= 2:
            times.append(1e3 * (clock() - start))
    return min(times)


def stack_fold(pm: PluginManager, names: tuple[str, ...], target: object, tokenizer: object) -> Callable[[DraftTree, Scores], tuple[Tensor, ...]]:
    """The engine's relax phase for a stack with default options (stack delta = the
    largest) as a program of one step's tree and scores: q_R and the contract's verdicts."""
    specs = [pm.methods()[name] for name in names]
    callers = [pm.caller("build_relaxed_dist", [spec.plugin], with_defaults=False) for spec in specs]
    stack_delta = max(float(spec.defaults.delta) for spec in specs)

    def program(tree: DraftTree, scores: Scores) -> tuple[Tensor, ...]:
        def member(caller: Callable[..., list[Tensor | None]], options: object) -> Callable[..., Tensor | None]:
            def relax(dist: Tensor, budget: Tensor) -> Tensor | None:
                results = caller(dist=dist, target_dist=scores.probs, budget=budget, tree=tree, scores=scores,
                                 target=target, tokenizer=tokenizer, options=options)
                return next((r for r in results if r is not None), None)
            return relax

        members = [(spec.name, float(spec.defaults.delta), member(caller, spec.defaults)) for spec, caller in zip(specs, callers)]
        dist, breaches = fold_on_device(scores.probs, members, stack_delta, check=checks_enabled())
        return (dist,) if breaches is None else (dist, breaches)

    return program


def relax_step(program: Callable[[DraftTree, Scores], tuple[Tensor, ...]], tree: DraftTree, scores: Scores,
               compiled: bool = False) -> Callable[[], object]:
    """One relax phase as the engine runs it: the fold, eagerly or compiled, then the one
    read of its verdicts."""
    def step() -> object:
        dist, *breaches = run(program, tree, scores, compiled=compiled)
        return [bool(breaches[0].any())] if breaches else dist
    return step


def verify_ms(tree: DraftTree, repeats: int, device: str) -> float | None:
    try:
        from specimg.models.llamagen import build_target
    except ImportError:
        return None
    target = build_target("GPT-B").to(device)
    if device.startswith("cuda"):
        target.set_step_mode("compiled")  # the step a GPU run takes
    target.prefill(0, cfg=True)
    tokens, depths, mask = (t.to(device) for t in (tree.tokens, tree.depths, tree.mask))
    return timed(lambda: target.forward_tree(tokens, depths, mask), repeats, device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="time the eager fold alone")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    tree = random_tree(g)
    logits = (2.0 * torch.randn(1, tree.size, VOCAB, generator=g)).to(args.device)
    probs = probabilities(logits, Sampling(top_k=TOP_K))
    scores = Scores(probs=probs, hidden=torch.randn(1, tree.size, HIDDEN, generator=g).to(args.device), logits=logits)
    target, tokenizer = RandomTarget(g, args.device), RandomTokenizer(g, args.device)
    pm = PluginManager()

    start = time.perf_counter()
    gpu = args.device.startswith("cuda")
    relax_step(stack_fold(pm, ("lantern",), target, tokenizer), tree, scores)()
    clock = "wall" if gpu else f"CPU time, {args.threads} thread(s)"
    print(f"tree: {tree.size} nodes, {sum(map(bool, tree.children))} with children; V={VOCAB}, D={HIDDEN}, top-k {TOP_K}")
    print(f"device {args.device}, {clock}, best of {args.repeats}, contract checks {'on' if checks_enabled() else 'off'}")
    print(f"first lantern step (neighbour table build or cache read): {time.perf_counter() - start:.2f} s")
    reference = verify_ms(tree, max(3, args.repeats // 2), args.device)
    if reference is not None:
        print(f"{'verify: GPT-B forward, 60 nodes, CFG':<40} {reference:9.2f} ms" + (" (compiled)" if gpu else ""))
    for names in STACKS:
        program = stack_fold(pm, names, target, tokenizer)
        runs = [("eager", relax_step(program, tree, scores))]
        if args.compile:  # the compiled path: the fold as one program, as the engine runs it there
            runs.append(("compiled", relax_step(program, tree, scores, compiled=True)))
        for how, step in runs:
            ms = timed(step, args.repeats, args.device)
            share = f"  ({100 * ms / reference:5.1f}% of verify)" if reference else ""
            print(f"{'relax: ' + '+'.join(names) + ' (' + how + ')':<40} {ms:9.2f} ms{share}")


if __name__ == "__main__":
    main()
