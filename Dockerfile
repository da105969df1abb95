# megatron-mfsdp on an NGC PyTorch image (CUDA, NCCL, Transformer Engine and Apex preinstalled).
# Build:  docker build -t megatron-mfsdp .
# Check:  docker run --gpus all --ipc=host --rm megatron-mfsdp bash benchmarks/gpu_check.sh
# Train:  docker run --gpus all --ipc=host --rm -it -e DATA_PATH=... -e TOKENIZER_MODEL=... \
#             -v /data:/data megatron-mfsdp bash examples/pretrain_gpt_1.3b_single_node.sh
# nvcr.io/nvidia/pytorch:25.09-py3 is the image megatron-core 0.16.1's LTS CI builds on
# (Megatron-LM core_v0.16.1: docker/.ngc_version.lts, .gitlab/stages/01.build.yml).
FROM nvcr.io/nvidia/pytorch:25.09-py3

# NGC images pin every preinstalled package with a pip constraints file (PIP_CONSTRAINT=/etc/pip/constraint.txt,
# since 25.03). Megatron-LM unsets it to install megatron-core: docs/get-started/install.md ("we will unset
# the variable", docker run -e PIP_CONSTRAINT=) and docker/Dockerfile.ci.dev (ENV PIP_CONSTRAINT="").
ENV PIP_CONSTRAINT=""

WORKDIR /workspace/megatron-mfsdp
COPY pyproject.toml README.md ./
COPY megatron_mfsdp ./megatron_mfsdp
# The image's torch (CUDA build) satisfies torch>=2.4, so pip keeps it; megatron-core comes from PyPI at
# the version CI tests (0.16.1, pinned in pyproject.toml: newer ones change flags we match). Transformer
# Engine and NVIDIA Apex are already in the image; Apex is never taken from PyPI (the PyPI package of
# that name is an unrelated project). pytest runs benchmarks/gpu_check.sh's exactness step.
RUN pip install --no-cache-dir -e . "megatron-core==0.16.1" "pytest>=7"
# A pair that works together, or no image: megatron-core 0.16.1 with a Transformer Engine it is tested with,
# 2.7 (the TE of its LTS CI image above) <= TE < 2.12 (its pyproject.toml: transformer-engine>=2.9.0a0,<2.12.0
# in the dev extra). Versions come from the package metadata: importing TE needs a GPU driver, a build has none.
RUN python -c "import sys; from importlib.metadata import version; from importlib.util import find_spec; \
    from packaging.version import Version; \
    mc = version('megatron-core'); \
    sys.exit(f'megatron-core {mc} is installed; megatron-mfsdp needs megatron-core 0.16.1 (pyproject.toml)') if mc != '0.16.1' else None; \
    sys.exit('Transformer Engine is not installed: use an NGC PyTorch image (25.09) or install transformer-engine[pytorch]>=2.7,<2.12') if find_spec('transformer_engine') is None else None; \
    te = version('transformer_engine'); \
    sys.exit(f'Transformer Engine {te} does not work with megatron-core 0.16.1 here: need 2.7 <= TE < 2.12 (megatron-core 0.16.1 is tested from NGC 25.09 TE up to its dev extra <2.12.0); change the base image or install a TE in range') if not Version('2.7') <= Version(te) < Version('2.12') else None; \
    print(f'megatron-core {mc} with Transformer Engine {te}: in range')"
RUN python -c "import megatron.core, megatron_mfsdp"
COPY pretrain_gpt.py ./
COPY tools ./tools
COPY examples ./examples
# benchmarks/gpu_check.sh runs pretrain_gpt.py, benchmarks/*.py and tests/distributed/test_dp_exactness.py.
COPY benchmarks ./benchmarks
COPY tests ./tests
ENV PYTHONWARNINGS=ignore
