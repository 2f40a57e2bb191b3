// gRPC server metrics under the names existing gRPC dashboards query (go-grpc-prometheus /
// java grpc-prometheus: grpc_server_started_total, grpc_server_handled_total,
// grpc_server_handling_seconds, grpc_server_msg_received_total, grpc_server_msg_sent_total,
// with labels grpc_type, grpc_service, grpc_method and, on handled, grpc_code in their
// spelling: "OK", "Canceled", "InvalidArgument", ...), recorded by a server interceptor on
// every RPC of a daemon (collserve_build_info is in metrics.h).
//
// Label values are bounded: grpc_service/grpc_method come from the method the server
// dispatched when a proto defines it (collserve.v1's services, gRPC's health and
// reflection), else "unknown"; after kMaxMethods distinct methods any further one is
// counted as "unknown" too.
//
// Thread-safe. The registry must outlive the factory and every server it is installed on.
#ifndef COLLSERVE_SERVER_COMMON_GRPC_METRICS_H_
#define COLLSERVE_SERVER_COMMON_GRPC_METRICS_H_

#include <grpcpp/support/server_interceptor.h>
#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <map>
#include <memory>
#include <string>

#include "absl/synchronization/mutex.h"

namespace collserve::server {

class GrpcServerMetrics : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  static constexpr size_t kMaxMethods = 128;

  explicit GrpcServerMetrics(prometheus::Registry& registry);

  // One interceptor per RPC (called by gRPC).
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) override;

  // The series of one method, created on its first RPC.
  struct Method {
    prometheus::Counter* started = nullptr;
    prometheus::Counter* received = nullptr;
    prometheus::Counter* sent = nullptr;
    prometheus::Histogram* handling = nullptr;
    prometheus::Counter* handled[17] = {};  // by grpc::StatusCode (0..16)
  };

 private:
  Method& MethodOf(const char* full_name, grpc::experimental::ServerRpcInfo::Type type);

  prometheus::Family<prometheus::Counter>& started_;
  prometheus::Family<prometheus::Counter>& handled_;
  prometheus::Family<prometheus::Histogram>& handling_;
  prometheus::Family<prometheus::Counter>& received_;
  prometheus::Family<prometheus::Counter>& sent_;
  absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<Method>> methods_ ABSL_GUARDED_BY(mu_);
};

// The factory to hand to grpc::ServerBuilder::experimental().SetInterceptorCreators, sharing
// `metrics` (which must outlive the server).
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> InterceptorFactory(GrpcServerMetrics* metrics);

// gRPC's status code as go-grpc-prometheus spells it ("OK", "Canceled", "InvalidArgument",
// "DeadlineExceeded", ...); "Code(<n>)" outside 0..16.
std::string GrpcCodeName(int code);

}  // namespace collserve::server

#endif  // COLLSERVE_SERVER_COMMON_GRPC_METRICS_H_
