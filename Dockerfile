# engramd node daemon. Build: docker build -t engramd .
# Run beside inference engines (see README, "Containers"): share the runtime folder (its two
# sockets) with them and give this container's /dev/shm room for the tables. No host IPC or PID
# namespace: slabs and tables reach the engines as file descriptors over the handle socket.
FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04 AS base

FROM base AS build
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-pip \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY client ./client
COPY server ./server
COPY kernels ./kernels
RUN python3 -m venv /opt/build && /opt/build/bin/pip install --no-cache-dir build \
    && /opt/build/bin/python -m build --wheel --outdir /wheels .

FROM base
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /wheels /wheels
RUN python3 -m venv /opt/engramd && /opt/engramd/bin/pip install --no-cache-dir /wheels/*.whl \
    && rm -rf /wheels
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
