# collserve-coordinator: the rendezvous store and group registry.
# Build from the repository root (see deploy/docker/README.md):
#   podman build -f deploy/docker/coordinator.Dockerfile -t collserve/coordinator:0.1.0 .
# Where no registry is reachable, build the base image offline first
# (deploy/docker/build_base_image.sh) and add --build-arg DEBIAN_IMAGE=collserve/debian:12.

# The Debian 12 (bookworm) image both stages start from.
ARG DEBIAN_IMAGE=debian:12
# The collserve version the image is labelled with: project(collserve VERSION ...) in
# CMakeLists.txt (the build stage refuses another one, so the label cannot drift from the
# version the binary reports with --version). A suffix is allowed: 0.1.0-rc1, 0.1.0+abc.
ARG COLLSERVE_VERSION=0.1.0

# ---- build: the coordinator's build dependencies only, then only its target.
FROM ${DEBIAN_IMAGE} AS build
ARG COLLSERVE_VERSION
# Parallel compile jobs; empty (default) = every CPU of the build machine (nproc).
ARG BUILD_JOBS=
WORKDIR /src
# Its own layer, before the sources: editing sources does not reinstall the toolchain.
# The coordinator's compiler and libraries, plus libgloo-dev and libbenchmark-dev, which
# the coordinator does not link but the configure step requires (find_package(Gloo
# REQUIRED) in CMakeLists.txt, find_package(benchmark REQUIRED) in bench/). No Python,
# pybind11 or torch: CMake skips the Python SDK and the c10d backend without them, and
# COLLSERVE_BUILD_TESTS=OFF skips the tests (GTest).
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
 && cmake --build /build --target collserve-coordinator collservectl -j"${BUILD_JOBS:-$(nproc)}" \
 && strip /build/server/collserve-coordinator /build/server/collservectl

# ---- runtime: the shared libraries only (their dependencies come with them).
FROM ${DEBIAN_IMAGE}
ARG DEBIAN_IMAGE
ARG COLLSERVE_VERSION
# OCI image labels. Add the commit and the repository at build time, e.g.
#   --label org.opencontainers.image.revision=$(git rev-parse HEAD)
#   --label org.opencontainers.image.source=<repository URL>
LABEL org.opencontainers.image.title="collserve-coordinator" \
      org.opencontainers.image.description="collserve coordinator: the rendezvous key-value store and group registry of collserve's collectives service" \
      org.opencontainers.image.version="${COLLSERVE_VERSION}" \
      org.opencontainers.image.base.name="${DEBIAN_IMAGE}"
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      libgrpc++1.51 libprotobuf32 libabsl20220623 \
      libprometheus-cpp-core1.0 libmicrohttpd12 libgoogle-glog0v6 \
      libssl3 zlib1g \
 && rm -rf /var/lib/apt/lists/*
# A fixed numeric non-root user, so Kubernetes' runAsNonRoot can verify it.
RUN groupadd --system --gid 65532 collserve \
 && useradd --system --uid 65532 --gid collserve --no-create-home \
      --home-dir /var/lib/collserve --shell /usr/sbin/nologin collserve \
 && install -d -o collserve -g collserve -m 0750 /var/lib/collserve
COPY --from=build /build/server/collserve-coordinator /usr/local/bin/collserve-coordinator
# The operator's tool (kubectl exec ... collservectl health | groups | mint-token | ...).
COPY --from=build /build/server/collservectl /usr/local/bin/collservectl
USER 65532:65532
# The write-ahead log and snapshots (--data_dir).
VOLUME ["/var/lib/collserve"]
# gRPC API (Store, Registry, Auth, grpc.health.v1) and Prometheus /metrics.
EXPOSE 29400 9464
# The coordinator stops cleanly on SIGTERM, also as PID 1 (it sigwait()s for it).
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/collserve-coordinator"]
# It refuses to start without a credential source: add --job_tokens_dir and/or
# --admin_token_file (mounted files), or --allow_unauthenticated on a trusted network.
CMD ["--data_dir=/var/lib/collserve"]
