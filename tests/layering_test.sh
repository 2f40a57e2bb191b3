#!/usr/bin/env bash
# A lower layer must never include a higher one (docs/architecture.md "Layers"):
# proto <- common <- {store, backends, client} <- engine <- server/{coordinator,sidecar}.
# (Not `! grep` under `set -e`: bash ignores -e for `!` pipelines.)
cd "${1:-$(dirname "$0")/..}" || exit 2
fail=0
forbid() {  # forbid <dir> <regex of include prefixes>
  if grep -rnE "#include [\"<]($2)" "$1" --include='*.h' --include='*.cc'; then
    echo "layering violation in $1" >&2
    fail=1
  fi
}
forbid common/              'collserve/v1/|collserve/client|server/|client/|store/|backends/'
forbid store/               'grpc|collserve/v1/|collserve/client|server/|client/|backends/|common/grpc_status'
forbid backends/            'grpc|collserve/v1/|collserve/client|server/|client/|store/|common/grpc_status'
# The collective engine: no transport or metrics types (gRPC, protobuf, prometheus).
forbid engine/              'backends/gloo|backends/nccl|gloo/|nccl|grpc|google/protobuf|prometheus|\.pb\.h|collserve/v1/|collserve/client|server/|client/|store/|common/grpc_status'
forbid client/              'server/|store/|backends/'
# The coordinator uses one thing of the SDK: its gRPC channel helper (client/channel.h, TLS
# towards the registry leader), whose header brings collserve/client.h's TlsOptions.
forbid server/coordinator/  'backends/|engine/|collserve/client|client/[^c]|client/c[^h]|gloo/|nccl|cuda'
forbid server/sidecar/      'store/|server/coordinator/'
forbid python/              'collserve/v1/|server/|store/|backends/|grpc|common/grpc_status'  # the public SDK only
# common/ may see gRPC only in grpc_status.*
if grep -rlnE '#include [<"]grpc' common/ | grep -v 'common/grpc_status\.'; then
  echo "layering violation: gRPC outside common/grpc_status" >&2
  fail=1
fi
[ $fail -eq 0 ] && echo "layering OK"
exit $fail
