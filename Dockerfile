# syntax=docker/dockerfile:1
# GPU image: NGC PyTorch + Megatron-LM (tag core_v0.17.1) with our patch series applied, plus
# this repo's harness, scripts and tests. The build fails if the series does not apply or the
# fast unit tests fail.
#
#   docker build -t megatron-layerwise-ag:core_v0.17.1 .
#   docker run --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 --rm -it \
#       megatron-layerwise-ag:core_v0.17.1 scripts/launch_pretrain_gpt.sh --accumulate-allreduce-grads-in-fp32
#   docker run --gpus all --ipc=host --rm -v "$PWD/gpu-results:/results" \
#       megatron-layerwise-ag:core_v0.17.1 scripts/gpu_check.sh /results/run1
#
# Base image: nvcr.io/nvidia/pytorch:25.12-py3, pinned by tag. Why this one:
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
#     another tag, change FROM and the LABEL and rebuild: the checks and tests below run again.
FROM nvcr.io/nvidia/pytorch:25.12-py3

LABEL org.opencontainers.image.title="megatron-layerwise-ag" \
      org.opencontainers.image.base.name="nvcr.io/nvidia/pytorch:25.12-py3" \
      io.megatron-layerwise-ag.python="3.12" \
      io.megatron-layerwise-ag.megatron-core="0.17.1"

# Megatron-LM source and ref (a tag or branch; `git clone --branch` takes either).
ARG MEGATRON_LM_REPO=https://github.com/NVIDIA/Megatron-LM.git
ARG MEGATRON_LM_REF=core_v0.17.1
# Which unit tests run as a build step (markers from pytest.ini). gloo tests spawn CPU ranks and
# slow ones train; both stay for scripts/test.sh and scripts/gpu_check.sh.
ARG UNIT_TEST_MARKERS="not slow and not gloo"

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PYTHONUNBUFFERED=1 \
    CUDA_DEVICE_MAX_CONNECTIONS=1 \
    MEGATRON_LM=/workspace/Megatron-LM \
    HARNESS=/workspace/megatron-layerwise-ag

# 1. What we rely on from the base: Python >= 3.12, torch, Transformer Engine, apex. Checked by
#    presence (find_spec): importing TE needs a GPU driver, which a build does not have.
RUN python3 -c "import sys; assert sys.version_info >= (3, 12), 'need Python >= 3.12, base has ' + sys.version" \
 && python3 -c "import importlib.util as u, torch; missing = [m for m in ('transformer_engine', 'apex') if u.find_spec(m) is None]; assert not missing, f'base image lacks {missing}'; print('torch', torch.__version__)"

# 2. The harness's own packages (not torch: the base has it, and its pip constraints keep it).
COPY requirements/docker.txt /tmp/requirements-docker.txt
RUN python3 -m pip install --no-cache-dir -r /tmp/requirements-docker.txt

# 3. Megatron-LM at the pinned ref, with the C++ dataset helpers built now (not at first run).
RUN git clone --depth 1 --branch "${MEGATRON_LM_REF}" "${MEGATRON_LM_REPO}" "${MEGATRON_LM}" \
 && make -C "${MEGATRON_LM}/megatron/core/datasets"

# 4. This repo. The harness finds the pristine tree in build/upstream/megatron: copy it from the
#    clone before the series goes in.
COPY . ${HARNESS}
WORKDIR ${HARNESS}
RUN mkdir -p build/upstream \
 && cp -a "${MEGATRON_LM}/megatron" build/upstream/megatron

# 5. Apply the series (git am: one commit per patch). apply_patches.sh exits non-zero, and so
#    fails the build, unless every patch applies with no fuzz and no offset; --check confirms.
#    The repo's megatron/ then points at the patched checkout, as scripts/setup.sh's would.
RUN export GIT_COMMITTER_NAME="megatron-layerwise-ag image" GIT_COMMITTER_EMAIL="image@invalid" \
 && bash scripts/apply_patches.sh "${MEGATRON_LM}" \
 && bash scripts/apply_patches.sh "${MEGATRON_LM}" --check \
 && ln -sfn "${MEGATRON_LM}/megatron" megatron

# 6. The functional tests' training data (build/data), so that scripts/gpu_check.sh and
#    scripts/run_functional_test.sh train at once.
RUN PYTHONPATH="${HARNESS}" python3 -m harness.data

# 7. The fast unit tests, as a build step.
RUN PYTHONPATH="${HARNESS}" python3 -m pytest tests/unit_tests -q \
        -p no:cacheprovider -m "${UNIT_TEST_MARKERS}"

CMD ["bash"]
