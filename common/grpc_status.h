// Mapping between absl::Status and grpc::Status. The canonical codes are numbered
// identically in both, so the mapping is a cast plus the message. This is the only
// file in common/ that sees gRPC.
#ifndef COLLSERVE_COMMON_GRPC_STATUS_H_
#define COLLSERVE_COMMON_GRPC_STATUS_H_

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace collserve {

// Thread-safe, pure functions.
grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace collserve

#endif  // COLLSERVE_COMMON_GRPC_STATUS_H_
