# collserve-coordinator: the rendezvous store and group registry.
# Build from the repository root (see deploy/docker/README.md):
#   podman build -f deploy/docker/coordinator.Dockerfile -t collserve/coordinator:0.1.0 .
ARG DEBIAN_IMAGE=debian:12

# ---- build: the Debian toolchain and -dev packages, then only the coordinator target.
FROM ${DEBIAN_IMAGE} AS build
WORKDIR /src
# The package list is its own layer: editing sources does not reinstall the toolchain.
COPY scripts/install_deps.sh scripts/install_deps.sh
RUN bash scripts/install_deps.sh && rm -rf /var/lib/apt/lists/*
COPY . .
RUN cmake -S . -B /build -DCMAKE_BUILD_TYPE=Release \
      -DCOLLSERVE_BUILD_TESTS=OFF -DCOLLSERVE_WITH_NCCL=OFF \
 && cmake --build /build --target collserve-coordinator -j2 \
 && strip /build/server/collserve-coordinator

# ---- runtime: the shared libraries only (their dependencies come with them).
FROM ${DEBIAN_IMAGE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      libgrpc++1.51 libprotobuf32 libabsl20220623 \
      libprometheus-cpp-core1.0 libprometheus-cpp-pull1.0 libgoogle-glog0v6 \
 && rm -rf /var/lib/apt/lists/*
# A fixed numeric non-root user, so Kubernetes' runAsNonRoot can verify it.
RUN groupadd --system --gid 65532 collserve \
 && useradd --system --uid 65532 --gid collserve --no-create-home \
      --home-dir /var/lib/collserve --shell /usr/sbin/nologin collserve \
 && install -d -o collserve -g collserve -m 0750 /var/lib/collserve
COPY --from=build /build/server/collserve-coordinator /usr/local/bin/collserve-coordinator
USER 65532:65532
# The write-ahead log and snapshots (--data_dir).
VOLUME ["/var/lib/collserve"]
# gRPC API (Store, Registry, grpc.health.v1) and Prometheus /metrics.
EXPOSE 29400 9464
# The coordinator stops cleanly on SIGTERM, also as PID 1 (it sigwait()s for it).
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/collserve-coordinator"]
CMD ["--data_dir=/var/lib/collserve"]
