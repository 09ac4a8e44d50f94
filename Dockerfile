# syntax=docker/dockerfile:1
# GPU image: NGC PyTorch + Megatron-LM (tag core_v0.17.1) with our patch series applied, plus
# this repo's harness, scripts and tests. The build fails if the series does not apply or the
# fast unit tests fail.
#
#   docker build -t megatron-layerwise-ag:core_v0.17.1 .
#   docker run --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 --rm -it \
#       megatron-layerwise-ag:core_v0.17.1 scripts/launch_pretrain_gpt.sh --accumulate-allreduce-grads-in-fp32
#   docker run --gpus all --ipc=host --ulimit memlock=-1 --rm -v "$PWD/gpu-results:/results" \
#       megatron-layerwise-ag:core_v0.17.1 scripts/gpu_check.sh /results/run1
#
# Base image: nvcr.io/nvidia/pytorch:25.12-py3, pinned by tag (BASE_IMAGE). Its digest is not
# recorded here: we have not pulled it. To pin it by digest as well, pull it once and pass both:
#   docker pull nvcr.io/nvidia/pytorch:25.12-py3
#   docker build --build-arg BASE_IMAGE="nvcr.io/nvidia/pytorch:25.12-py3@$(docker inspect \
#       --format '{{index .RepoDigests 0}}' nvcr.io/nvidia/pytorch:25.12-py3 | cut -d@ -f2)" ...
# Why this release:
#   - Python 3.12: NVIDIA's 25.12 release notes install torch under
#     /usr/local/lib/python3.12/dist-packages (Ubuntu 24.04). megatron-core 0.17.1 needs
#     Python >= 3.12 (its wheel is cp312, Requires-Python >= 3.12); the 24.xx images have 3.10.
#   - PyTorch 2.10.0a0 (per the same notes); megatron-core 0.17.1 needs torch >= 2.6. CUDA 13.1,
#     the same major version as our CPU-side lock (torch 2.11.0+cu130); it needs an R580+
#     driver.
#   - Transformer Engine is preinstalled in NGC PyTorch images since 22.09 (TE's install guide),
#     and apex ships in them as well; the first RUN below fails the build if either is missing.
#   - Megatron's install guide recommends a previous NGC release over the latest one. 25.12 is
#     the newest release whose contents we could confirm from NVIDIA's release notes. To try
#     another tag, pass --build-arg BASE_IMAGE=... and rebuild: the checks and tests below run again.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.12-py3
FROM ${BASE_IMAGE}
ARG BASE_IMAGE

LABEL org.opencontainers.image.title="megatron-layerwise-ag" \
      org.opencontainers.image.base.name="${BASE_IMAGE}" \
      io.megatron-layerwise-ag.python="3.12" \
      io.megatron-layerwise-ag.megatron-core="0.17.1"

# Megatron-LM source and ref (a tag or branch; `git clone --branch` takes either): the base.
# core_v0.17.1 (default) gets patches/0.17.1/, core_v0.19.0 patches/0.19/ (apply_patches.sh
# picks the series by the clone's version): --build-arg MEGATRON_LM_REF=core_v0.19.0. The
# clone's commit must be requirements/megatron-lm.lock's MLM_COMMIT / MLM_019_COMMIT for those
# tags; for another ref give the commit you expect (empty: not checked, with a warning).
ARG MEGATRON_LM_REPO=https://github.com/NVIDIA/Megatron-LM.git
ARG MEGATRON_LM_REF=core_v0.17.1
ARG MEGATRON_LM_COMMIT=
# Which unit tests run as a build step (markers from pytest.ini). gloo tests spawn CPU ranks and
# slow ones train; both stay for scripts/test.sh and scripts/gpu_check.sh.
ARG UNIT_TEST_MARKERS="not slow and not gloo"

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PYTHONUNBUFFERED=1 \
    CUDA_DEVICE_MAX_CONNECTIONS=1 \
    MEGATRON_LM=/workspace/Megatron-LM \
    HARNESS=/workspace/megatron-layerwise-ag

# Every step is scripts/image_build.sh STEP (see its header); CI runs the same steps on a copy
# of this build context (tests/unit_tests/test_dockerfile.py).
# 1-3. What we rely on from the base, the harness's packages, Megatron-LM at the locked commit.
#      Only the script and requirements/ are copied first, so that a change elsewhere in the
#      repo does not redo the pip install and the clone.
COPY scripts/image_build.sh ${HARNESS}/scripts/image_build.sh
COPY requirements ${HARNESS}/requirements
WORKDIR ${HARNESS}
RUN bash scripts/image_build.sh base requirements megatron-lm

# 4-7. This repo; the pristine copy and the series applied to the clone; the megatron-core wheel
#      (pip, sha256 from requirements/megatron-core.lock) and the training data made from it; the
#      fast unit tests.
COPY . ${HARNESS}
RUN bash scripts/image_build.sh trees wheel data
RUN bash scripts/image_build.sh unit-tests

CMD ["bash"]
