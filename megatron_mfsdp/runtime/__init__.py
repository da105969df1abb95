"""The runtime: the MatrixFSDP wrapper (unit life cycle and hooks), its shard domains (each
one shard group's plan, comm and gradient scaling: domain), the owner-segment communication
behind start/wait (comm), and megatron-core's schedules driving the wrapped chunks (pipeline)."""
