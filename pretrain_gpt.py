"""Pretrain a megatron-core GPT with MatrixFSDP (owner-sharded ZeRO-3 + Muon).

    torchrun --nproc-per-node 2 pretrain_gpt.py            # embedded default, CPU
    torchrun --nproc-per-node 8 pretrain_gpt.py --use-matrix-fsdp --data-path ... --bf16

See --help for the flags (Megatron-LM's names, plus --use-matrix-fsdp, --muon-*, --mfsdp-*).
"""

import sys

from megatron_mfsdp.training.arguments import parse_args
from megatron_mfsdp.training.loop import pretrain

if __name__ == "__main__":
    args = parse_args(sys.argv[1:])
    pretrain(args)
