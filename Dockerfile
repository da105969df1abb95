# megatron-mfsdp on an NGC PyTorch image (CUDA, NCCL, Transformer Engine and Apex preinstalled).
# Build:  docker build -t megatron-mfsdp .
# Run:    docker run --gpus all --ipc=host --rm -it megatron-mfsdp bash examples/pretrain_gpt_1.3b_single_node.sh
FROM nvcr.io/nvidia/pytorch:25.09-py3

WORKDIR /workspace/megatron-mfsdp
COPY pyproject.toml README.md ./
COPY megatron_mfsdp ./megatron_mfsdp
# The image's torch (CUDA build) satisfies torch>=2.4, so pip keeps it; megatron-core comes
# from PyPI at the version CI tests (0.16.1, pinned in pyproject.toml: newer ones need Python
# 3.12 and change flags we match). Transformer Engine and NVIDIA Apex are already in the
# image; Apex is never taken from PyPI (the PyPI package of that name is an unrelated project).
RUN pip install --no-cache-dir -e . "megatron-core==0.16.1" && python -c "import megatron.core as m; assert m.__version__ == '0.16.1', m.__version__"
COPY pretrain_gpt.py ./
COPY tools ./tools
COPY examples ./examples
COPY benchmarks ./benchmarks
ENV PYTHONWARNINGS=ignore
