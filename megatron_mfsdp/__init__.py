"""megatron-mfsdp: owner-sharded ZeRO-3 (MatrixFSDP) with communication-free Muon for
megatron-core. Entry points: ``runtime.MatrixFSDP`` (the model wrapper),
``optimizer.get_megatron_optimizer`` (the optimizer), ``pretrain_gpt.py`` (training)."""

__version__ = "0.1.0"
