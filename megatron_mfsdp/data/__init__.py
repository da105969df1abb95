"""Data: megatron-core tokenizers and GPT datasets with DP-invariant micro-batching
(datasets), tokenization into indexed datasets (preprocess), and the embedded default
corpus built from this machine's Python sources (corpus). megatron-core is imported
lazily, so importing this package is cheap."""
