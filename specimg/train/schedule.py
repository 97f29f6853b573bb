"""The learning-rate schedule of every trainer here: linear warm-up, then a cosine decay."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LRScheduler


class WarmupCosine(LRScheduler):
    """Sets every group's learning rate for optimizer step k (0-based) to ``lr * (k + 1) /
    warmup`` during the warm-up, then decays it along a cosine to ``lr * min_lr_ratio`` at
    step ``steps``; call ``step()`` after each optimizer step.  The rate depends on the step
    alone, so a checkpoint need not hold the scheduler: ``start`` places it at the step a
    resumed run continues from."""

    def __init__(self, optimizer: torch.optim.Optimizer, lr: float, steps: int, warmup: int, min_lr_ratio: float = 0.0, start: int = 0):
        self.steps, self.warmup, self.min_lr_ratio = steps, warmup, min_lr_ratio
        for group in optimizer.param_groups:
            group["initial_lr"] = lr
        super().__init__(optimizer, last_epoch=start - 1)

    def get_lr(self) -> list[float]:
        step = self.last_epoch
        if step < self.warmup:
            return [lr * (step + 1) / self.warmup for lr in self.base_lrs]
        progress = min(1.0, (step - self.warmup) / max(1, self.steps - self.warmup))
        m = self.min_lr_ratio
        return [lr * (m + (1 - m) * 0.5 * (1 + math.cos(math.pi * progress))) for lr in self.base_lrs]
