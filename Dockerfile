# Two images from one source tree:
#   docker build --target operator -t disttrain/operator .   # kopf operator, no torch (~150 MB)
#   docker build --target trainer  -t disttrain/trainer  .   # torch (CPU wheel by default), trainer, job agent,
#                                                            # and the torchrun rendezvous handler "disttrain"
# Both install the same wheel; the extras decide what comes with it. The trainer image is what worker pods and
# the job agent pod run: it must carry the `torchrun.handlers` entry point, which installing the wheel does.

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY api ./api
COPY operator ./operator
COPY trainer ./trainer
COPY src ./src
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE} AS operator
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
COPY --from=build /wheels /wheels
RUN wheel="$(ls /wheels/disttrain-*.whl)" && pip install --no-cache-dir "${wheel}[operator]" && rm -rf /wheels
USER 65532:65532
EXPOSE 9090 8080
ENTRYPOINT ["disttrain", "operator"]
CMD ["--all-namespaces"]

FROM ${PYTHON_IMAGE} AS trainer
# CPU wheels by default; for CUDA, build with --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
COPY --from=build /wheels /wheels
RUN wheel="$(ls /wheels/disttrain-*.whl)" \
 && pip install --no-cache-dir --extra-index-url "${TORCH_INDEX_URL}" "${wheel}[trainer]" "kubernetes>=29" \
 && rm -rf /wheels
# The kubernetes client is for the job agent (it follows its job); kopf is not installed here.
WORKDIR /workspace
USER 65532:65532
