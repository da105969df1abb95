"""What a training job's save and load need from the run (job.py, local.py, resume.py): Megatron-LM's
checkpoint flags by their argparse dests, and the run's arguments as the checkpoint stores them.
training/configs.py builds it from the parsed namespace (checkpoint_settings_from_args); nothing
below training/ reads the namespace."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class CheckpointSettings:
    """The checkpoint flags of one run; defaults are Megatron-LM's (megatron/training/arguments.py)."""

    save: str | None = None  # --save: the folder saves go to
    load: str | None = None  # --load: the folder loads read
    ckpt_format: str = "torch_dist"  # --ckpt-format: torch_dist (any layout) or torch (per-rank files)
    ckpt_step: int | None = None  # --ckpt-step: the iteration to load instead of the tracker's
    async_save: bool = False  # --async-save: write in a background thread from a host copy
    no_save_optim: bool = False  # --no-save-optim: leave the optimizer and scheduler out
    no_save_rng: bool = False  # --no-save-rng: leave the generator states out
    save_retain_interval: int | None = None  # --save-retain-interval: keep only these iterations' saves
    log_progress: bool = False  # --log-progress: note a retired checkpoint in progress.txt
    finetune: bool = False  # --finetune: load the weights only, start at iteration 0
    no_load_optim: bool = False  # --no-load-optim: do not load the optimizer and scheduler
    no_load_rng: bool = False  # --no-load-rng: do not load the generator states
    dist_ckpt_strictness: str = "assume_ok_unexpected"  # --dist-ckpt-strictness: dist_checkpointing's key check
    verify_checkpoint_integrity: bool = True  # --no-verify-checkpoint-integrity sets False: manifest only
    override_opt_param_scheduler: bool = False  # --override-opt_param-scheduler: this run's schedule wins
    use_checkpoint_opt_param_scheduler: bool = False  # --use-checkpoint-opt_param-scheduler: the checkpoint's wins
    run_args: dict = dataclasses.field(default_factory=dict)  # the run's arguments as saved (state.args_dict)
