"""Adaptations of megatron-core to machines it was not written for: ``cpu.py`` is the
one place where its CUDA assumptions are bent for CPU runs; ``moe.py`` repairs two defects of its
MoE layer that bite on any device; ``jit.py`` defers the compilation of its fusions from import to
first call."""
