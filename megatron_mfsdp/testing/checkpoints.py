"""A MatrixFSDP chunk and its optimizer through megatron-core dist_checkpointing, as the tests
save and load them (the training loop adds the common state, checkpoint/job.py), and a job built
from pretrain_gpt.py's flags without training, for the checkpoint tests and benchmarks."""

from __future__ import annotations

import os

import torch


def dist_checkpoint(ddp, opt, path: str, save: bool) -> dict:
    """Save (rank 0 makes ``path``) or load weights and optimizer state by megatron-core's keys
    (checkpoint/dist.py); FP8 units' weights travel as their fp32 masters. Returns the request."""
    from ..checkpoint import dist as torch_dist

    request = torch_dist.sharded_model([ddp], megatron_ddp=False)
    request["optimizer"] = torch_dist.sharded_optimizer(opt, request, megatron_ddp=False, is_loading=not save)
    if save:
        if torch.distributed.get_rank() == 0:
            os.makedirs(path)
        torch.distributed.barrier()
        torch_dist.save_state_dict(request, path)
        return request
    loaded = torch_dist.load_state_dict(request, path, "raise_all")
    torch_dist.copy_loaded(request["model"], loaded["model"])
    opt.load_sharded_state_dict(loaded["optimizer"]["state"])  # ends in opt.rederive_fp8_payload()
    opt.load_common_state_dict(loaded["optimizer"]["common"])
    return request


def build_job(argv: list[str], world: int):
    """(args, groups, chunks, optimizer, scheduler) of pretrain_gpt.py's flags, set up as its loop sets
    them up (process groups, micro-batches, data, model, optimizer), its start-up lines silenced."""
    import contextlib
    import io

    from ..training import loop, schedule
    from ..training.arguments import parse_args
    from ..training.setup import build_model_and_optimizer, configure_schedule

    args = parse_args(list(argv), world_size=world)
    with contextlib.redirect_stdout(io.StringIO()):
        loop.initialize_distributed(args)
        schedule.init_microbatches(args)
        schedule.update_train_iters(args)
        loop.prepare_data(args)
        _, groups, chunks, optimizer, scheduler = build_model_and_optimizer(args, args.padded_vocab_size)
        configure_schedule(args, chunks, optimizer)
    return args, groups, chunks, optimizer, scheduler
