# syntax=docker/dockerfile:1
# biggraph trainer image.
#   docker build -t biggraph:0.1.0-cpu .
#   docker build --build-arg TORCH_VARIANT=cu124 -t biggraph:0.1.0-cu124 .
# The CUDA variant bundles the CUDA runtime through torch's nvidia-* wheels: nodes need only the
# NVIDIA driver and device plugin (nvidia.com/gpu), not a CUDA base image.
# tests/test_image.py builds this file with buildah (tests/image.sh) and runs the result as the Job's
# pods do: uid 10001, read-only root, `biggraph demo` and a two-node torchrun.
ARG PYTHON_IMAGE=python:3.11-slim

# ---- optional local torch wheels ---------------------------------------------------------------
# Empty unless the build supplies a directory for it, e.g. an offline mirror or a cached wheel:
#   docker buildx build --build-context torch-wheels=DIR .      (buildah: the same flag)
# A torch-${TORCH_VERSION}+${TORCH_VARIANT} wheel found there is installed instead of the PyTorch index's
# (its dependencies still come from the package index). A named context replaces a stage of that name.
FROM scratch AS torch-wheels

# ---- builder: a venv with torch from the matching PyTorch index and the biggraph wheel ----------
FROM ${PYTHON_IMAGE} AS builder
ARG TORCH_VARIANT=cpu
ARG TORCH_VERSION=2.13.0
# Bytecode only where a pod's start-up pays for it: pip installs with --no-compile, and the last builder step
# compiles the packages every import, eval or export pod loads (BYTECODE_PACKAGES: ~25 MB of .pyc, ~0.15 s of CPU
# a process, on a root filesystem too read-only to cache it). torch's 160 MB of .pyc (an eighth of the CPU image,
# about 1 s of CPU a trainer's start) stay out: a warm spare imports torch during the rendezvous (docs/kubernetes.md).
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PATH=/opt/venv/bin:$PATH
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /src
# Every dependency at the version requirements.lock pins, the versions the tests ran with and
# tests/audit.sh audits; torch's own pin is left out, so that TORCH_VERSION decides it.
COPY requirements.lock ./
# A C compiler for job/native's kernels, which `pip wheel` below compiles into the wheel (setup.py), with per-CPU
# clones of the hot loops, so the library runs at its best on whatever node the image lands on (the runtime stage
# gets the library, not the compiler). Debian's own gcc of the base image's release: its version follows the base image.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
RUN --mount=type=bind,from=torch-wheels,target=/tmp/torch-wheels \
    case "${TORCH_VARIANT}" in cpu|cu[0-9]*) ;; \
      *) echo "TORCH_VARIANT must be cpu or cuXYZ (e.g. cu124), not '${TORCH_VARIANT}'" >&2; exit 1 ;; \
    esac \
 && grep -v '^torch==' requirements.lock > /src/constraints.txt \
 && python -m venv /opt/venv \
 && if ls /tmp/torch-wheels/torch-"${TORCH_VERSION}+${TORCH_VARIANT}"-*.whl >/dev/null 2>&1; then \
      pip install --no-cache-dir --no-compile -c /src/constraints.txt --find-links /tmp/torch-wheels "torch==${TORCH_VERSION}+${TORCH_VARIANT}"; \
    else \
      pip install --no-cache-dir --no-compile -c /src/constraints.txt --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}" "torch==${TORCH_VERSION}"; \
    fi
# only what the wheel needs (see .dockerignore): metadata first, then the packages, the chart, which setup.py copies
# into the wheel (biggraph submit renders it), and k8s/base, which the sdist carries (MANIFEST.in)
COPY pyproject.toml setup.py MANIFEST.in README.md ./
COPY job ./job
COPY storage_adapters ./storage_adapters
COPY charts ./charts
COPY k8s ./k8s
# DL3013: this installs the local wheel file; its dependencies are bounded by pyproject.toml
# hadolint ignore=DL3013
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
 && whl=$(ls /wheels/biggraph-*.whl) \
 && pip install --no-cache-dir --no-compile -c /src/constraints.txt "${whl}[s3,k8s,prometheus]" \
 && python -P -c "import job, job.native, storage_adapters, s3fs, kubernetes, torch; k = job.native.loaded(); assert k and k.origin == 'package' and '/site-packages/job/native/_ext/' in str(k.path), k; print(k.describe()); print('biggraph', job.__version__, 'torch', torch.__version__)"
# What only building needs goes before the COPY into the runtime stage: torch's C++ headers, protoc
# and C++ test binaries (torch_shm_manager stays: torch.multiprocessing uses it), the packages' own
# test suites, and the bytecode ensurepip compiled for pip and setuptools. pip itself stays:
# `biggraph demo` downloads its graphs with it. Then the bytecode of BYTECODE_PACKAGES (above), checked against
# its source by nothing but its presence (unchecked-hash: the image's files never change, and COPY need not keep
# their times).
ARG BYTECODE_PACKAGES="job storage_adapters numpy h5py pyarrow fsspec s3fs aiobotocore botocore aiohttp yaml"
RUN site=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
 && rm -rf "${site}/torch/include" "${site}"/torch/bin/protoc* "${site}"/torch/bin/test_* "${site}"/torch/bin/*Test \
 && find /opt/venv -depth -type d \( -name __pycache__ -o -name tests -path '*/site-packages/*' \) -exec rm -rf {} + \
 && python -c "import job.cli, torch.distributed.run, numpy, h5py, pyarrow, s3fs, kubernetes" \
 && for package in ${BYTECODE_PACKAGES}; do \
      python -m compileall -q -j 0 --invalidation-mode unchecked-hash "${site}/${package}" >/dev/null || exit 1; \
    done

# ---- runtime: slim python + the venv, non-root, read-only-root friendly ------------------------
FROM ${PYTHON_IMAGE} AS runtime
ARG TORCH_VARIANT=cpu
LABEL org.opencontainers.image.title="biggraph" \
      org.opencontainers.image.description="PyTorch-BigGraph-compatible graph embedding trainer (torchrun entrypoint)" \
      org.opencontainers.image.licenses="BSD-3-Clause" \
      io.biggraph.torch-variant="${TORCH_VARIANT}"
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    BIGGRAPH_CHART=/opt/biggraph/charts/biggraph
RUN groupadd --gid 10001 biggraph \
 && useradd --uid 10001 --gid 10001 --no-log-init --no-create-home --home-dir /tmp --shell /usr/sbin/nologin biggraph
COPY --from=builder /opt/venv /opt/venv
# the chart and plain manifests, so that `biggraph submit` also works from inside the image
COPY charts /opt/biggraph/charts
COPY k8s /opt/biggraph/k8s
# file mode 0755 is kept from the repository
COPY docker/entrypoint.sh /usr/local/bin/biggraph-entrypoint
USER 10001:10001
WORKDIR /tmp
# A batch job, not a service: there is nothing to probe. Health is the entrypoint's log lines
# (start, rank, exit code) and the container's exit status, which the Kubernetes Job acts on.
HEALTHCHECK NONE
ENTRYPOINT ["/usr/local/bin/biggraph-entrypoint"]
# arguments are torchrun's (a single node by default); a first argument that is not an option is
# run as a command instead, e.g. `docker run IMAGE biggraph export ...`
CMD ["--nnodes=1", "--nproc-per-node=1", "-m", "job", "train", "/etc/biggraph/config.yaml"]
