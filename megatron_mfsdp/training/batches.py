"""Micro-batches as Megatron-LM's pretraining sampler cuts them, through a torch DataLoader
(--num-workers worker processes).

The t-th micro-batch of DP rank r holds samples [start + t*mbs*dp + r*mbs, +mbs): the global
batch of an iteration is a contiguous run of samples whatever the DP size (and whatever the
ramp-up), so any layout sees the same data in the same order.
"""

from __future__ import annotations

import itertools

import torch


class MicroBatchSampler(torch.utils.data.Sampler):
    """Endless index lists of one DP rank's micro-batches, from ``start`` samples on; indices
    wrap around the dataset (a dataset built for fewer samples repeats)."""

    def __init__(self, num_samples: int, start: int, micro_batch_size: int, dp_rank: int, dp_size: int):
        self.n, self.start, self.mbs, self.rank, self.dp = num_samples, start, micro_batch_size, dp_rank, dp_size

    def __iter__(self):
        for t in itertools.count():
            first = self.start + t * self.mbs * self.dp + self.rank * self.mbs
            yield [(first + i) % self.n for i in range(self.mbs)]


def micro_batches(args, dataset, start: int, dp_rank: int, dp_size: int):
    """An endless iterator of collated micro-batches (dicts of tensors) for this DP rank. The loader
    draws its workers' base seed from a generator of its own: from the global one (torch's default)
    every new iterator would move the CPU generator that dropout draws from on a CPU, so a run resumed
    from a checkpoint (its generator states restored, then its iterators built) would drop other units
    than the uninterrupted run (tests/e2e/test_checkpoint_resume.py)."""
    from ..data.datasets import collate_samples

    sampler = MicroBatchSampler(len(dataset), start, args.micro_batch_size, dp_rank, dp_size)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=args.num_workers,
        collate_fn=collate_samples,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=args.num_workers > 0,
        generator=torch.Generator().manual_seed(args.seed),
    )
    return iter(loader)


class StepIterators:
    """The micro-batches of one step, one iterator per model chunk (virtual stage), each reading the
    same micro-batches (megatron's schedules pull them per chunk)."""

    def __init__(self, args, dataset, start: int, dp_rank: int, dp_size: int, chunks: int):
        self.sources = [micro_batches(args, dataset, start, dp_rank, dp_size) for _ in range(chunks)]

    def step(self, num_microbatches: int):
        iterators = [iter([next(source) for _ in range(num_microbatches)]) for source in self.sources]
        return iterators if len(iterators) > 1 else iterators[0]
