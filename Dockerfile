# Sailor with the CUDA build of torch: the image `sailor launch --backend kubernetes` runs by default
# (--image sailor-train:<version>) and `--backend skypilot --image` runs every node in.
# Build from the repository root, then push it where the cluster pulls from (README "Container image"):
#   docker build -t sailor-train:0.1.0 .
#   docker tag sailor-train:0.1.0 REGISTRY/sailor-train:0.1.0 && docker push REGISTRY/sailor-train:0.1.0
# CUDA runtime + cuDNN on Ubuntu 24.04 (Python 3.12); https://hub.docker.com/r/nvidia/cuda. Its CUDA
# version is the torch build's (12.6 below): the image's NVIDIA_REQUIRE_CUDA (cuda>=<its version>), which
# NVIDIA's container toolkit checks against the host's driver at start, then asks no newer driver than
# the wheel does (a 12.8 base refused, e.g., a GeForce host on driver 560 that the cu126 wheel runs on).
ARG CUDA_IMAGE=nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

# The torch of the `train` extra (pyproject.toml), from PyTorch's CUDA 12.6 index by default: that
# build still carries Volta (sm_70) kernels, so one image runs every GPU type of the catalog (V100 to
# H200; README "GPU"). PyPI's default wheel is built with CUDA 13, which dropped Volta and needs
# driver >= 580; for Turing and newer only, `--build-arg TORCH_INDEX=https://pypi.org/simple` gives it.
# The wheel brings its own CUDA libraries; the host needs an NVIDIA driver that runs CUDA 12.6.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu126
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/sailor \
    PATH=/opt/sailor/bin:$PATH

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/sailor \
    && pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"

# Sailor itself as a wheel (not an editable checkout); `python3` on PATH is this venv's, which is
# what the generated launch commands call (--python python3).
COPY pyproject.toml README.md /tmp/sailor-src/
COPY sailor /tmp/sailor-src/sailor
RUN pip install "/tmp/sailor-src[train]" && rm -rf /tmp/sailor-src && sailor --version

WORKDIR /workspace
CMD ["sailor", "--help"]
