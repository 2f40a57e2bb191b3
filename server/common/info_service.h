// collserve.v1.Info (proto/collserve/v1/info.proto) for a daemon: its kind, version and
// identity, served without a credential. Thread-safe (the answer is fixed at construction).
#ifndef COLLSERVE_SERVER_COMMON_INFO_SERVICE_H_
#define COLLSERVE_SERVER_COMMON_INFO_SERVICE_H_

#include <grpcpp/grpcpp.h>

#include <string>

#include "absl/time/clock.h"
#include "collserve/v1/info.grpc.pb.h"
#include "server/common/daemon.h"

namespace collserve::server {

class InfoService final : public collserve::v1::Info::CallbackService {
 public:
  // `daemon`: "coordinator" or "sidecar"; `host_id`: a sidecar's (else "").
  InfoService(const std::string& daemon, const std::string& host_id) {
    info_.set_daemon(daemon);
    info_.set_version(CollserveVersion());
    info_.set_host_id(host_id);
    info_.set_started_unix_s(absl::ToUnixSeconds(absl::Now()));
  }
  grpc::ServerUnaryReactor* GetInfo(grpc::CallbackServerContext* ctx, const collserve::v1::GetInfoRequest*,
                                    collserve::v1::GetInfoResponse* resp) override {
    *resp = info_;
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

 private:
  collserve::v1::GetInfoResponse info_;
};

}  // namespace collserve::server

#endif  // COLLSERVE_SERVER_COMMON_INFO_SERVICE_H_
