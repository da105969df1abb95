"""The runtime: the MatrixFSDP wrapper (unit life cycle and hooks), the owner-segment
communication behind start/wait (comm), and megatron-core's schedules driving the
wrapped chunks (pipeline)."""
