"""Tiny models run fastest on one thread; more threads only contend on a shared machine."""

import torch

torch.set_num_threads(1)
