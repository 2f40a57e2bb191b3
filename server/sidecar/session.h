// The sidecar's view of one client session (a Collectives/Session stream).
#ifndef COLLSERVE_SERVER_SIDECAR_SESSION_H_
#define COLLSERVE_SERVER_SIDECAR_SESSION_H_

#include "absl/status/status.h"
#include "collserve/v1/collectives.pb.h"

namespace collserve::server {

// Thread-safe. Outlives the stream: after the stream is done, calls are no-ops.
class Session {
 public:
  virtual ~Session() = default;
  // Queues a message; messages are written in the order queued.
  virtual void Send(collserve::v1::SessionResponse response) = 0;
  // Ends the stream with `status` once queued messages are written. Idempotent.
  virtual void Close(const absl::Status& status) = 0;
};

}  // namespace collserve::server

#endif  // COLLSERVE_SERVER_SIDECAR_SESSION_H_
