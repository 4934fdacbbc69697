"""The engine side's ranks: agreement through torch.distributed, prefetch
coordination, launching a model instance's ranks as processes, and an engine
simulator. Modules past ``launch`` import torch."""

from hicached.ranks.launch import RankError, launch

__all__ = ["RankError", "launch"]
