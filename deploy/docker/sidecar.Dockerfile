# collserve-sidecar: the per-node agent that runs the collectives (shared memory on the
# node, Gloo between nodes). Build from the repository root (see deploy/docker/README.md):
#   podman build -f deploy/docker/sidecar.Dockerfile -t collserve/sidecar:0.1.0 .
# The "example" stage is an image with the all_reduce example client, used by
# deploy/k8s/examples/:
#   podman build -f deploy/docker/sidecar.Dockerfile --target example -t collserve/example:0.1.0 .
# The "trainer" stage is a torch image with the Python SDK, used by helm/examples/:
#   podman build -f deploy/docker/sidecar.Dockerfile --target trainer -t collserve/trainer:0.1.0 .
# Where no registry is reachable, build the base image offline first
# (deploy/docker/build_base_image.sh) and add --build-arg DEBIAN_IMAGE=collserve/debian:12.

# The Debian 12 (bookworm) image every stage starts from.
ARG DEBIAN_IMAGE=debian:12
# The collserve version the images are labelled with: project(collserve VERSION ...) in
# CMakeLists.txt (the build stage refuses another one, so the label cannot drift from the
# version the binary reports with --version). A suffix is allowed: 0.1.0-rc1, 0.1.0+abc.
ARG COLLSERVE_VERSION=0.1.0

# ---- build: the sidecar's build dependencies only, then only the needed targets.
FROM ${DEBIAN_IMAGE} AS build
ARG COLLSERVE_VERSION
# Parallel compile jobs; empty (default) = every CPU of the build machine (nproc).
ARG BUILD_JOBS=
WORKDIR /src
# Its own layer, before the sources: editing sources does not reinstall the toolchain.
# The sidecar's compiler and libraries (Gloo included), plus libbenchmark-dev, which it
# does not link but the configure step requires (find_package(benchmark REQUIRED) in
# bench/). No Python, pybind11 or torch: CMake skips the Python SDK and the c10d backend
# without them, and COLLSERVE_BUILD_TESTS=OFF skips the tests (GTest). CPU only: no CUDA
# toolkit, so no NCCL backend and no CUDA tensors in this image.
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      cmake g++ make pkg-config \
      libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler \
      libabsl-dev prometheus-cpp-dev libmicrohttpd-dev libgoogle-glog-dev libssl-dev zlib1g-dev \
      libgloo-dev libbenchmark-dev \
 && rm -rf /var/lib/apt/lists/*
COPY . .
RUN project_version=$(sed -n 's/^project(collserve VERSION \([0-9.]*\).*/\1/p' CMakeLists.txt); \
    [ -n "${project_version}" ] || { echo "no project(collserve VERSION ...) in CMakeLists.txt" >&2; exit 1; }; \
    case "${COLLSERVE_VERSION}" in \
      "${project_version}" | "${project_version}"[-+]*) ;; \
      *) echo "COLLSERVE_VERSION=${COLLSERVE_VERSION}, but CMakeLists.txt is version ${project_version}:" \
              "build with --build-arg COLLSERVE_VERSION=${project_version}" >&2; exit 1 ;; \
    esac
RUN cmake -S . -B /build -DCMAKE_BUILD_TYPE=Release \
      -DCOLLSERVE_BUILD_TESTS=OFF -DCOLLSERVE_WITH_NCCL=OFF -DCOLLSERVE_WITH_CUDA=OFF \
 && cmake --build /build --target collserve-sidecar collservectl -j"${BUILD_JOBS:-$(nproc)}" \
 && strip /build/server/collserve-sidecar /build/server/collservectl

# ---- runtime base: the shared libraries of the sidecar and of the SDK.
FROM ${DEBIAN_IMAGE} AS runtime
ARG DEBIAN_IMAGE
ARG COLLSERVE_VERSION
# OCI image labels (the example stage overrides title and description). Add the commit
# and the repository at build time, e.g.
#   --label org.opencontainers.image.revision=$(git rev-parse HEAD)
#   --label org.opencontainers.image.source=<repository URL>
LABEL org.opencontainers.image.title="collserve-sidecar" \
      org.opencontainers.image.description="collserve sidecar: the per-node agent that runs collserve's collectives (shared memory on a node, Gloo between nodes)" \
      org.opencontainers.image.version="${COLLSERVE_VERSION}" \
      org.opencontainers.image.base.name="${DEBIAN_IMAGE}"
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      libgrpc++1.51 libprotobuf32 libabsl20220623 libgloo0 \
      libprometheus-cpp-core1.0 libmicrohttpd12 libgoogle-glog0v6 \
 && rm -rf /var/lib/apt/lists/*

# ---- example: the all_reduce example client (built only when this target is asked for).
FROM build AS example-build
ARG BUILD_JOBS=
RUN cmake --build /build --target allreduce_example -j"${BUILD_JOBS:-$(nproc)}" \
 && strip /build/examples/allreduce_example

# Runs as root by default, like the sidecar whose socket it connects to; set runAsUser
# to the sidecar's user where that is another one. Needs its job's token
# (COLLSERVE_TOKEN or COLLSERVE_TOKEN_FILE) and COLLSERVE_JOB, like any client.
FROM runtime AS example
LABEL org.opencontainers.image.title="collserve-example" \
      org.opencontainers.image.description="collserve all_reduce example client (deploy/k8s/examples)"
COPY --from=example-build /build/examples/allreduce_example /usr/local/bin/allreduce_example
ENTRYPOINT ["/usr/local/bin/allreduce_example"]

# ---- trainer: a torch training image with the collserve Python SDK and its c10d backend
# ("collserve" in torch.distributed), and examples/digits_sgd.py; used by
# helm/examples/pytorchjob.yaml (built only when this target is asked for):
#   podman build -f deploy/docker/sidecar.Dockerfile --target trainer -t collserve/trainer:0.1.0 .
# It holds no sidecar: it uses its node's (COLLSERVE_SIDECAR). Debian 12's torch (1.13, CPU).
FROM build AS trainer-build
ARG BUILD_JOBS=
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      python3-dev pybind11-dev python3-numpy python3-torch libtorch-dev \
 && rm -rf /var/lib/apt/lists/*
RUN cmake -S . -B /build \
 && cmake --build /build --target _collserve _collserve_torch collserve_python_sources -j"${BUILD_JOBS:-$(nproc)}" \
 && test -f /build/python/collserve/__init__.py \
 && ls /build/python/collserve/_collserve_torch*.so

FROM runtime AS trainer
LABEL org.opencontainers.image.title="collserve-trainer" \
      org.opencontainers.image.description="torch with the collserve Python SDK and c10d backend, and the digits example (helm/examples)"
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      python3 python3-numpy python3-torch python3-sklearn \
 && rm -rf /var/lib/apt/lists/*
COPY --from=trainer-build /build/python/collserve /usr/lib/python3/dist-packages/collserve
COPY examples/digits_sgd.py /opt/collserve/examples/digits_sgd.py
# Runs as root by default, like the node's sidecar whose socket it connects to. No
# entrypoint: the PyTorchJob gives the command (python3 /opt/collserve/examples/...).

# ---- sidecar (the default target: the last stage).
FROM runtime
# Runs as root by default: on a node (DaemonSet) it creates its socket in a root-owned
# host directory and opens segments that training processes create with mode 0600.
# In the in-pod pattern the pod's securityContext runs it as the trainer's user instead.
# It has no token of its own: it forwards each client session's token to the coordinator.
RUN install -d -m 0755 /run/collserve
COPY --from=build /build/server/collserve-sidecar /usr/local/bin/collserve-sidecar
# The operator's tool: its probes (collservectl --sidecar=unix:... health) and drains.
COPY --from=build /build/server/collservectl /usr/local/bin/collservectl
# gRPC on TCP when --listen_address is set (the DaemonSet uses 29500), /metrics.
EXPOSE 29500 9465
# The sidecar stops cleanly on SIGTERM, also as PID 1 (it sigwait()s for it).
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/collserve-sidecar"]
