# collserve-sidecar: the per-node agent that runs the collectives (shared memory on the
# node, Gloo between nodes). Build from the repository root (see deploy/docker/README.md):
#   podman build -f deploy/docker/sidecar.Dockerfile -t collserve/sidecar:0.1.0 .
# The "example" stage is an image with the all_reduce example client, used by
# deploy/k8s/examples/:
#   podman build -f deploy/docker/sidecar.Dockerfile --target example -t collserve/example:0.1.0 .
ARG DEBIAN_IMAGE=debian:12

# ---- build: the Debian toolchain and -dev packages, then only the needed targets.
FROM ${DEBIAN_IMAGE} AS build
WORKDIR /src
# The package list is its own layer: editing sources does not reinstall the toolchain.
COPY scripts/install_deps.sh scripts/install_deps.sh
RUN bash scripts/install_deps.sh && rm -rf /var/lib/apt/lists/*
COPY . .
RUN cmake -S . -B /build -DCMAKE_BUILD_TYPE=Release \
      -DCOLLSERVE_BUILD_TESTS=OFF -DCOLLSERVE_WITH_NCCL=OFF \
 && cmake --build /build --target collserve-sidecar -j2 \
 && strip /build/server/collserve-sidecar

# ---- runtime base: the shared libraries of the sidecar and of the SDK.
FROM ${DEBIAN_IMAGE} AS runtime
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      libgrpc++1.51 libprotobuf32 libabsl20220623 libgloo0 \
      libprometheus-cpp-core1.0 libprometheus-cpp-pull1.0 libgoogle-glog0v6 \
 && rm -rf /var/lib/apt/lists/*

# ---- example: the all_reduce example client (built only when this target is asked for).
FROM build AS example-build
RUN cmake --build /build --target allreduce_example -j2 \
 && strip /build/examples/allreduce_example

# Runs as root by default, like the sidecar whose socket it connects to; set runAsUser
# to the sidecar's user where that is another one.
FROM runtime AS example
COPY --from=example-build /build/examples/allreduce_example /usr/local/bin/allreduce_example
ENTRYPOINT ["/usr/local/bin/allreduce_example"]

# ---- sidecar (the default target: the last stage).
FROM runtime
# Runs as root by default: on a node (DaemonSet) it creates its socket in a root-owned
# host directory and opens segments that training processes create with mode 0600.
# In the in-pod pattern the pod's securityContext runs it as the trainer's user instead.
RUN install -d -m 0755 /tmp/collserve
COPY --from=build /build/server/collserve-sidecar /usr/local/bin/collserve-sidecar
# gRPC on TCP when --listen_address is set (the DaemonSet uses 29500), /metrics.
EXPOSE 29500 9465
# The sidecar stops cleanly on SIGTERM, also as PID 1 (it sigwait()s for it).
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/collserve-sidecar"]
