# Three images from one source tree (the names the example job manifests use):
#   docker build --target operator -t disttrain-operator .   # kopf operator, no torch
#   docker build --target trainer  -t disttrain-trainer  .   # torch (CPU wheel by default), trainer, job agent, the
#                                                            # torchrun rendezvous handler "disttrain", examples/
#   docker build --target trainer-cuda -t disttrain-trainer-cuda \   # the trainer for GPU nodes (Linux x86-64):
#     --build-arg TORCH_LOCK=requirements/torch-cuda.txt \             # PyPI's CUDA torch and its nvidia-* libraries
#     --build-arg TORCH_INDEX_URL=https://pypi.org/simple .
# They install the same wheel; the extras decide what comes with it. The trainer image is what worker pods and
# the job agent pod run: it must carry the `torchrun.handlers` entry point, which installing the wheel does.
# Your own training code goes in an image built FROM the trainer image: see examples/custom-image/.
# All run as user 65532. Without docker or a registry: `make images` (operator, trainer) and `make image-cuda`
# (buildah, a Debian base; scripts/images/).
#
# Supply chain: every package comes from a lock with the SHA-256 of each file (requirements/*.txt, made by
# `make locks`), installed with `pip install --require-hashes --no-deps`, one index per pip call and never an extra
# one: a package of the same name on another index has another hash and is refused. The base is pinned by digest.
#
# Build arguments (the defaults are what users want; `make images` overrides them to build without a registry):
#   PYTHON_IMAGE      a Debian-based image whose `python3` is CPython 3.11 (the locks are resolved for it) with the
#                     venv module, by digest: NAME@sha256:... (tests/images/test_locks.py refuses a bare tag)
#   INDEX_URL         the one index for every package but torch (a mirror of PyPI serves the same files)
#   TORCH_INDEX_URL   the one index for torch, in a pip call of its own: PyTorch's CPU index, the only one with a
#                     torch 2.13.0+cpu. Ignored when TORCH_FIND_LINKS is set.
#   TORCH_FIND_LINKS  a folder (or page) of torch wheels to take torch from instead, no index at all; e.g. a local
#                     wheel folder mounted into the build (`make images` mounts one at /mnt). The hash still holds.
#   TORCH_LOCK        the torch lock in the build context (default requirements/torch-cpu.txt). The CUDA build's is
#                     requirements/torch-cuda.txt: PyPI's torch with every file's hash, and its nvidia-*, cuda-* and
#                     triton dependencies (TORCH_INDEX_URL=https://pypi.org/simple, or a mirror of it).
# Build arguments are recorded in the image's history: never put a credential in one.

# The digest was taken from a public record of 2026-08-24 (no registry is reachable where this was written, so
# it was not fetched here; a wrong one fails the build, it cannot swap the base). To move it: `docker buildx
# imagetools inspect python:3.11-slim-bookworm` (or `skopeo inspect`) and replace the digest below.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:2e32f7d302adc1c37428355c1e646897c0c53f4fd60b6a551245fb90ee129f91

# What every image shares: the unprivileged user, the venv on PATH, no bytecode or pip cache written at run time.
FROM ${PYTHON_IMAGE} AS python
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN groupadd --gid 65532 disttrain \
 && useradd --uid 65532 --gid 65532 --create-home --home-dir /home/disttrain --shell /usr/sbin/nologin disttrain

# Packages go into a venv built in a stage of its own; the images copy the finished venv, so none of their
# layers holds a wheel, a pip cache or anything mounted into the build. A venv because Debian's own python3
# refuses system-wide pip installs, and one layout on every base keeps the images alike.
FROM python AS venv
# No pip configuration file of the base's can add an index (stages of the build only: the images keep none of it).
ENV PIP_CONFIG_FILE=/dev/null
RUN python3 -m venv /opt/venv

FROM venv AS build
ARG INDEX_URL=https://pypi.org/simple
WORKDIR /src
# The build backend from its lock, and no build isolation: isolation would fetch setuptools again, unhashed.
COPY requirements/build.txt /requirements/
RUN pip install --no-cache-dir --index-url "${INDEX_URL}" --require-hashes --no-deps -r /requirements/build.txt
COPY pyproject.toml README.md ./
COPY api ./api
COPY common ./common
COPY operator ./operator
COPY trainer ./trainer
COPY src ./src
RUN pip wheel --no-cache-dir --no-build-isolation --no-deps --wheel-dir /wheels .

FROM venv AS operator-venv
ARG INDEX_URL=https://pypi.org/simple
COPY requirements/operator.txt /requirements/
RUN pip install --no-cache-dir --index-url "${INDEX_URL}" --require-hashes --no-deps -r /requirements/operator.txt
# The project itself, built above from this tree: no index, nothing else pulled in.
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --no-deps /wheels/disttrain-*.whl

FROM venv AS trainer-venv
ARG INDEX_URL=https://pypi.org/simple
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_FIND_LINKS=""
ARG TORCH_LOCK=requirements/torch-cpu.txt
# torch first, from its one source; then, from the other, torch's dependencies and those of disttrain[trainer,agent,s3]
# (the agent extra is the kubernetes client the job agent follows its job with, s3 the bucket client of checkpoints
# in object storage; kopf is not installed here), as
# scripts/images/lock.sh resolved them into requirements/trainer.txt.
COPY ${TORCH_LOCK} /requirements/torch.txt
RUN if [ -n "${TORCH_FIND_LINKS}" ]; then torch_from="--no-index --find-links ${TORCH_FIND_LINKS}"; \
    else torch_from="--index-url ${TORCH_INDEX_URL}"; fi \
 && pip install --no-cache-dir ${torch_from} --require-hashes --no-deps -r /requirements/torch.txt
COPY requirements/trainer.txt /requirements/
RUN pip install --no-cache-dir --index-url "${INDEX_URL}" --require-hashes --no-deps -r /requirements/trainer.txt
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --no-deps /wheels/disttrain-*.whl

FROM python AS operator
COPY --from=operator-venv /opt/venv /opt/venv
USER 65532:65532
EXPOSE 9090 8080
ENTRYPOINT ["disttrain", "operator"]
CMD ["--all-namespaces"]

FROM python AS trainer
ENV TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
COPY --from=trainer-venv /opt/venv /opt/venv
# Job manifests run `python -u examples/tinylm/train.py` from here. The folder is the user's (a plain run writes
# runs/ next to the examples); the shipped files stay root's, read-only to it.
RUN install -d -o 65532 -g 65532 /workspace
WORKDIR /workspace
COPY examples ./examples
USER 65532:65532

# The trainer for GPU nodes: the image above, its venv built with the CUDA lock by the build arguments at the top of
# this file (so torch is in the image once, in the venv). ~2.7 GB of wheels, an image of ~5.3 GB.
FROM trainer AS trainer-cuda
# For the NVIDIA container runtime: the driver's compute libraries and nvidia-smi, and every GPU of the container.
# The Kubernetes device plugin (and `docker run --gpus`) replaces NVIDIA_VISIBLE_DEVICES with the GPUs given.
ENV NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility
# Without those arguments the venv holds the CPU torch: no CUDA image is made of it.
RUN python -c 'assert __import__("torch").version.cuda, "trainer-cuda: a CPU torch, see the build arguments"'
