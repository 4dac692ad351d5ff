# syntax=docker/dockerfile:1
# engramd node daemon. Build: docker build -t engramd .
# Run beside inference engines (docs/operations.md, "Containers"): share the runtime folder (its two
# sockets) with them and give this container's /dev/shm room for the tables. No host IPC or PID
# namespace: slabs and tables reach the engines as file descriptors over the handle socket.
#
# BASE is the CUDA runtime image the engines run on; any Debian or Ubuntu image with apt builds
# the same way (tests/container/run.sh builds it from a plain Debian bookworm). TORCH pins torch;
# which build pip picks (CUDA from PyPI by default) follows its options: a pip.conf passed as the
# secret "pip" (an index, local wheels) applies to every pip run here, e.g.
#   docker build --secret id=pip,src=pip.conf -t engramd .
ARG BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG TORCH=2.13.0
FROM ${BASE} AS base

FROM base AS build
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-pip \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY client ./client
COPY server ./server
COPY kernels ./kernels
RUN --mount=type=secret,id=pip,target=/etc/pip.conf \
    python3 -m venv /opt/build && /opt/build/bin/pip install --no-cache-dir build \
    && /opt/build/bin/python -m build --wheel --outdir /wheels .

FROM base
ARG TORCH
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
# torch in a layer of its own, before engramd: the largest download stays cached across rebuilds.
RUN --mount=type=secret,id=pip,target=/etc/pip.conf \
    python3 -m venv /opt/engramd && /opt/engramd/bin/pip install --no-cache-dir "torch==${TORCH}"
COPY --from=build /wheels /wheels
RUN --mount=type=secret,id=pip,target=/etc/pip.conf \
    /opt/engramd/bin/pip install --no-cache-dir /wheels/*.whl "torch==${TORCH}" && rm -rf /wheels
COPY configs /etc/engramd
RUN useradd --system --uid 990 --user-group --home-dir /var/lib/engramd engramd \
    && mkdir -p /run/engramd /var/lib/engramd /tables \
    && chown engramd:engramd /run/engramd /var/lib/engramd
ENV PATH=/opt/engramd/bin:$PATH
USER 990:990
VOLUME ["/run/engramd", "/tables"]
HEALTHCHECK --interval=10s --timeout=5s --start-period=30m \
    CMD ["engramd", "health", "--socket", "/run/engramd/engramd.sock", "--timeout", "3"]
ENTRYPOINT ["engramd", "serve"]
CMD ["--config", "/etc/engramd/demo.toml", "--socket", "/run/engramd/engramd.sock"]
