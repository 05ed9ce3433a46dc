"""Data sharding that does not depend on the world size: global batch s is a pure function of (seed, s)."""

from __future__ import annotations

import torch


class GlobalBatches:
    """The global batch of each step, split into contiguous shares over whichever ranks are alive.

    Samples are drawn epoch by epoch from a permutation seeded by ``(seed, epoch)``; step ``s`` takes
    positions ``[s * global_batch, (s + 1) * global_batch)`` of that endless sequence. The same step
    gives the same samples with 4 ranks or 3, so a run that lost a worker sees the data a fault-free
    run sees. Normalise the loss by :attr:`global_batch` (sum per sample, divide) so the summed
    gradient does not depend on the world size either.
    """

    def __init__(self, num_samples: int, global_batch: int, seed: int = 0) -> None:
        if num_samples < 1 or global_batch < 1:
            raise ValueError("num_samples and global_batch must be positive")
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.seed = seed
        self._epoch_cache: tuple[int, torch.Tensor] | None = None

    def _epoch(self, epoch: int) -> torch.Tensor:
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch_cache = (epoch, torch.randperm(self.num_samples, generator=generator))
        return self._epoch_cache[1]

    def batch(self, step: int) -> torch.Tensor:
        """Indices of every sample in step ``step``'s global batch, in a fixed order."""
        parts, position, needed = [], step * self.global_batch, self.global_batch
        while needed:
            epoch, offset = divmod(position, self.num_samples)
            take = min(needed, self.num_samples - offset)
            parts.append(self._epoch(epoch)[offset : offset + take])
            position, needed = position + take, needed - take
        return torch.cat(parts)

    def share(self, step: int, rank: int, world_size: int) -> torch.Tensor:
        """Rank ``rank``'s contiguous share of step ``step``'s global batch (sizes differ by at most 1)."""
        return torch.tensor_split(self.batch(step), world_size)[rank]
