"""Megatron-style GPT pretraining on MatrixFSDP: arguments, model/data providers, the loop."""
