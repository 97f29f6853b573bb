"""Exact output distributions of randomised functions, by enumerating their torch draws.

Sampling only estimates a distribution: an acceptance rule that is off by 1e-3 passes any
affordable number of samples.  ``outcomes(fn)`` instead runs ``fn`` once per combination of
its random draws and weighs each result by that combination's probability, so the law of
the result is exact (up to float64 rounding).

Enumerable draws are the ones acceptance rules are made of: categorical draws
(``torch.multinomial``) and uniforms (``torch.rand``) that are only scaled by a constant and
compared once with a threshold (``torch.rand(()) * q[x] <= r[x]``).  Any other random call,
or any other use of a uniform, raises NotEnumerable rather than giving a wrong answer.
The function must depend on nothing random but these draws.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

T = TypeVar("T")

_CATEGORICAL = {torch.multinomial, Tensor.multinomial}
_UNIFORM = {torch.rand, torch.rand_like}
_OTHER_RANDOM = {
    torch.randn, torch.randn_like, torch.randint, torch.randint_like, torch.randperm, torch.bernoulli, torch.normal,
    torch.poisson, Tensor.bernoulli, Tensor.bernoulli_, Tensor.uniform_, Tensor.normal_, Tensor.exponential_,
    Tensor.geometric_, Tensor.cauchy_, Tensor.log_normal_, Tensor.random_,
}
_SCALE = {"mul", "__mul__", "__rmul__", "multiply"}
# comparison -> (is "less than" when the uniform is on the left, the same with the sides swapped)
_COMPARE = {
    "le": True, "__le__": True, "less_equal": True, "lt": True, "__lt__": True, "less": True,
    "ge": False, "__ge__": False, "greater_equal": False, "gt": False, "__gt__": False, "greater": False,
}
_HARMLESS = {"__get__", "dim", "size", "numel", "__len__"}


class NotEnumerable(RuntimeError):
    """The function draws randomness in a way ``outcomes`` cannot enumerate."""


class _Uniform:
    """A placeholder tensor standing for ``scale * U``, U uniform on [0, 1) elementwise."""

    def __init__(self, tensor: Tensor, scale: Tensor, base: int):
        self.tensor, self.scale, self.base = tensor, scale, base


class _Replay(TorchFunctionMode):
    """Runs a function with its draws fixed by ``path`` (one option index per choice point),
    taking option 0 at choice points beyond it, and records every choice point's options."""

    def __init__(self, path: list[int]):
        super().__init__()
        self.path, self.sizes, self.weight = list(path), [], 1.0
        self.uniforms: dict[int, _Uniform] = {}
        self.compared: set[int] = set()

    def _choose(self, options: list[tuple[Any, float]]) -> Any:
        options = [(value, weight) for value, weight in options if weight > 0]
        depth = len(self.sizes)
        if depth == len(self.path):
            self.path.append(0)
        self.sizes.append(len(options))
        value, weight = options[self.path[depth]]
        self.weight *= weight
        return value

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _CATEGORICAL:
            return self._categorical(*args, **kwargs)
        if func in _OTHER_RANDOM:
            raise NotEnumerable(f"{func.__name__} draws randomness that cannot be enumerated; use torch.multinomial or torch.rand")
        if func in _UNIFORM:
            out = func(*args, **kwargs).fill_(0.5)
            self.uniforms[id(out)] = _Uniform(out, torch.ones_like(out, dtype=torch.float64), id(out))
            return out
        symbolic = [a for a in (*args, *kwargs.values()) if isinstance(a, Tensor) and id(a) in self.uniforms]
        if not symbolic:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in _HARMLESS:
            return func(*args, **kwargs)
        if len(symbolic) == 1 and len(args) == 2 and not kwargs:
            left = id(args[0]) in self.uniforms
            uniform, other = self.uniforms[id(symbolic[0])], args[1] if left else args[0]
            if name in _SCALE:
                out = func(*args)
                if out.shape != uniform.tensor.shape:
                    raise NotEnumerable("a uniform draw is broadcast: its copies would be compared as independent draws")
                self.uniforms[id(out)] = _Uniform(out, uniform.scale * torch.as_tensor(other, dtype=torch.float64), uniform.base)
                return out
            if name in _COMPARE:
                zero_case = func(*(torch.zeros_like(a) if a is uniform.tensor else a for a in args))
                return self._compare(uniform, torch.as_tensor(other, dtype=torch.float64), _COMPARE[name] == left, zero_case)
        raise NotEnumerable(f"a uniform draw is used in {name or func}; only 'torch.rand(...) * a <= b' is enumerable")

    def _categorical(self, probs: Tensor, num_samples: int, replacement: bool = False, **_: Any) -> Tensor:
        rows = probs.detach().double().reshape(-1, probs.shape[-1])
        if not bool(torch.isfinite(rows).all()) or not bool((rows.sum(-1) > 0).all()) or bool((rows < 0).any()):
            raise ValueError("invalid multinomial distribution (nan, inf, negative, or no mass)")
        out = []
        for row in rows:
            row, drawn = row.clone(), []
            for _ in range(num_samples):
                token = self._choose(list(enumerate((row / row.sum()).tolist())))
                drawn.append(token)
                if not replacement:
                    row[token] = 0.0
            out.append(drawn)
        return torch.tensor(out, dtype=torch.long).reshape(*probs.shape[:-1], num_samples)

    def _compare(self, uniform: _Uniform, threshold: Tensor, below: bool, zero_case: Tensor) -> Tensor:
        """Each element of ``scale * U <= threshold`` (``below``, else ``>=``) is one binary
        choice; ``zero_case`` is the comparison's value where the scale is 0.  A uniform
        may be compared only once, or the choices would be dependent."""
        scale = uniform.scale
        if uniform.base in self.compared or torch.broadcast_shapes(scale.shape, threshold.shape) != scale.shape:
            raise NotEnumerable("a uniform draw is compared more than once")
        self.compared.add(uniform.base)
        ratio = threshold.expand_as(scale) / torch.where(scale == 0, 1.0, scale)
        p_below = torch.where(scale > 0, ratio.clamp(0, 1), (1 - ratio).clamp(0, 1))
        p_true = torch.where(scale == 0, zero_case.double(), p_below if below else 1 - p_below)
        result = [self._choose([(True, p), (False, 1 - p)]) for p in p_true.flatten().tolist()]
        return torch.tensor(result, dtype=torch.bool).reshape(scale.shape)


def outcomes(fn: Callable[[], T], limit: int = 100_000) -> list[tuple[float, T]]:
    """Every result of ``fn`` with its probability (results may repeat; the weights sum to
    1).  ``limit`` bounds the number of runs."""
    results: list[tuple[float, T]] = []
    path: list[int] = []
    while True:
        replay = _Replay(path)
        with replay:
            result = fn()
        if len(replay.sizes) < len(path) or any(i >= s for i, s in zip(path, replay.sizes)):
            raise NotEnumerable("the function's draws differ between replays: it uses randomness other than torch's draws")
        results.append((replay.weight, result))
        path, sizes = replay.path[: len(replay.sizes)], replay.sizes
        while path and path[-1] + 1 >= sizes[len(path) - 1]:
            path.pop()
        if not path:
            return results
        path[-1] += 1
        if len(results) >= limit:
            raise NotEnumerable(f"more than {limit} outcomes")
