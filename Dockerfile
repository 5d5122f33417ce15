# Two images from one source tree (the names the example job manifests use):
#   docker build --target operator -t disttrain-operator .   # kopf operator, no torch
#   docker build --target trainer  -t disttrain-trainer  .   # torch (CPU wheel by default), trainer, job agent, the
#                                                            # torchrun rendezvous handler "disttrain", examples/
# Both install the same wheel; the extras decide what comes with it. The trainer image is what worker pods and
# the job agent pod run: it must carry the `torchrun.handlers` entry point, which installing the wheel does.
# Your own training code goes in an image built FROM the trainer image: see examples/custom-image/.
# Both run as user 65532. Without docker or a registry: `make images` (buildah, a Debian base; scripts/images/).
#
# Build arguments (the defaults are what users want; `make images` overrides them to build without a registry):
#   PYTHON_IMAGE      a Debian-based image whose `python3` is CPython 3.10+ with the venv module
#   TORCH_INDEX_URL   extra pip index for torch; empty for PyPI only. CUDA: https://download.pytorch.org/whl/cu126
#   PIP_INSTALL_ARGS  more `pip install` options and requirements for the trainer, e.g. a local wheel directory
#                     mounted into the build: "--find-links /mnt torch==2.13.0". It is recorded in the
#                     image's history: never put a credential in a build argument.

ARG PYTHON_IMAGE=python:3.11-slim

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
RUN python3 -m venv /opt/venv

FROM venv AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY api ./api
COPY operator ./operator
COPY trainer ./trainer
COPY src ./src
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM venv AS operator-venv
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir "$(ls /wheels/disttrain-*.whl)[operator]"

FROM venv AS trainer-venv
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_INSTALL_ARGS=""
COPY --from=build /wheels /wheels
# The kubernetes client is for the job agent (it follows its job); kopf is not installed here.
RUN pip install --no-cache-dir ${TORCH_INDEX_URL:+--extra-index-url "${TORCH_INDEX_URL}"} ${PIP_INSTALL_ARGS} \
        "$(ls /wheels/disttrain-*.whl)[trainer]" "kubernetes>=29,<38"

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
