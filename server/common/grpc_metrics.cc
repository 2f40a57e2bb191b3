#include "server/common/grpc_metrics.h"

#include <google/protobuf/descriptor.h>

#include <atomic>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace collserve::server {
namespace {

using grpc::experimental::InterceptionHookPoints;
using grpc::experimental::ServerRpcInfo;

const prometheus::Histogram::BucketBoundaries& HandlingBuckets() {
  // Never destroyed: an RPC that ends while exit() runs must still find it.
  static const auto* const kBuckets = new prometheus::Histogram::BucketBoundaries{
      0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30, 300, 3600};
  return *kBuckets;
}

const char* TypeName(ServerRpcInfo::Type type) {
  switch (type) {
    case ServerRpcInfo::Type::UNARY: return "unary";
    case ServerRpcInfo::Type::CLIENT_STREAMING: return "client_stream";
    case ServerRpcInfo::Type::SERVER_STREAMING: return "server_stream";
    case ServerRpcInfo::Type::BIDI_STREAMING: return "bidi_stream";
  }
  return "unknown";
}

}  // namespace

// Named (not anonymous) so that ThreadSanitizer reports show, and tests/sanitizers/tsan.supp
// can match, its qualified name.
namespace grpc_metrics_internal {

// Records one RPC: started at creation; messages as they pass; handled and its duration
// when the status is sent, or as Canceled when the call ends without one.
//
// gRPC creates the interceptor on one thread and runs its hooks and its destructor on
// others, handing it over inside gRPC core; its state is atomic so that every access is
// ordered on its own, whatever that hand-off.
class MetricsInterceptor : public grpc::experimental::Interceptor {
 public:
  explicit MetricsInterceptor(GrpcServerMetrics::Method& m) : m_(&m), start_ns_(absl::GetCurrentTimeNanos()) {
    m.started->Increment();
  }
  ~MetricsInterceptor() override { Record(static_cast<int>(grpc::StatusCode::CANCELLED)); }

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    GrpcServerMetrics::Method* m = m_.load(std::memory_order_acquire);
    // A read that found the end of the stream also passes POST_RECV_MESSAGE, with no message.
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_MESSAGE) &&
        methods->GetRecvMessage() != nullptr) {
      m->received->Increment();
    }
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_MESSAGE)) m->sent->Increment();
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      Record(static_cast<int>(methods->GetSendStatus().error_code()));
    }
    methods->Proceed();
  }

 private:
  // Once per RPC: the first call wins.
  void Record(int code) {
    if (recorded_.exchange(true, std::memory_order_acq_rel)) return;
    GrpcServerMetrics::Method* m = m_.load(std::memory_order_acquire);
    if (code < 0 || code > 16) code = static_cast<int>(grpc::StatusCode::UNKNOWN);
    m->handled[code]->Increment();
    m->handling->Observe(
        static_cast<double>(absl::GetCurrentTimeNanos() - start_ns_.load(std::memory_order_relaxed)) * 1e-9);
  }

  std::atomic<GrpcServerMetrics::Method*> m_;
  std::atomic<int64_t> start_ns_;
  std::atomic<bool> recorded_{false};
};

}  // namespace grpc_metrics_internal

namespace {

class Factory : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit Factory(GrpcServerMetrics* metrics) : metrics_(metrics) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(ServerRpcInfo* info) override {
    return metrics_->CreateServerInterceptor(info);
  }

 private:
  GrpcServerMetrics* const metrics_;
};

}  // namespace

std::string GrpcCodeName(int code) {
  static const char* const kNames[] = {"OK",
                                       "Canceled",
                                       "Unknown",
                                       "InvalidArgument",
                                       "DeadlineExceeded",
                                       "NotFound",
                                       "AlreadyExists",
                                       "PermissionDenied",
                                       "ResourceExhausted",
                                       "FailedPrecondition",
                                       "Aborted",
                                       "OutOfRange",
                                       "Unimplemented",
                                       "Internal",
                                       "Unavailable",
                                       "DataLoss",
                                       "Unauthenticated"};
  if (code < 0 || code > 16) return absl::StrCat("Code(", code, ")");
  return kNames[code];
}

GrpcServerMetrics::GrpcServerMetrics(prometheus::Registry& registry)
    : started_(prometheus::BuildCounter()
                   .Name("grpc_server_started_total")
                   .Help("RPCs started on the server, by type, service and method.")
                   .Register(registry)),
      handled_(prometheus::BuildCounter()
                   .Name("grpc_server_handled_total")
                   .Help("RPCs completed on the server, by type, service, method and status code.")
                   .Register(registry)),
      handling_(prometheus::BuildHistogram()
                    .Name("grpc_server_handling_seconds")
                    .Help("Time from an RPC's start to its status (a stream: its whole life), seconds.")
                    .Register(registry)),
      received_(prometheus::BuildCounter()
                    .Name("grpc_server_msg_received_total")
                    .Help("Messages received from clients, by type, service and method.")
                    .Register(registry)),
      sent_(prometheus::BuildCounter()
                .Name("grpc_server_msg_sent_total")
                .Help("Messages sent to clients, by type, service and method.")
                .Register(registry)) {}

GrpcServerMetrics::Method& GrpcServerMetrics::MethodOf(const char* full_name, ServerRpcInfo::Type type) {
  const std::string name = full_name != nullptr ? full_name : "";
  const std::string key = absl::StrCat(TypeName(type), " ", name);
  absl::MutexLock lock(&mu_);
  auto it = methods_.find(key);
  if (it != methods_.end()) return *it->second;
  // "/package.Service/Method"
  std::string service = "unknown", method = "unknown";
  const size_t slash = name.rfind('/');
  if (methods_.size() < kMaxMethods && name.size() > 1 && name[0] == '/' && slash != std::string::npos && slash > 1) {
    service = name.substr(1, slash - 1);
    method = name.substr(slash + 1);
    // Only methods a proto defines (collserve.v1's; gRPC's health and reflection, whose
    // descriptors are not in protobuf's pool): a client's made-up method name never
    // becomes a label.
    const bool known = google::protobuf::DescriptorPool::generated_pool()->FindMethodByName(
                           absl::StrCat(service, ".", method)) != nullptr ||
                       service == "grpc.health.v1.Health" || service == "grpc.reflection.v1alpha.ServerReflection";
    if (!known) service = method = "unknown";
  }
  const std::string bucket_key = service == "unknown" ? std::string("unknown") : key;
  if (auto b = methods_.find(bucket_key); b != methods_.end()) return *b->second;
  auto m = std::make_unique<Method>();
  const std::map<std::string, std::string> labels = {
      {"grpc_type", TypeName(type)}, {"grpc_service", service}, {"grpc_method", method}};
  m->started = &started_.Add(labels);
  m->received = &received_.Add(labels);
  m->sent = &sent_.Add(labels);
  m->handling = &handling_.Add(labels, HandlingBuckets());
  for (int code = 0; code <= 16; ++code) {
    auto with_code = labels;
    with_code["grpc_code"] = GrpcCodeName(code);
    m->handled[code] = &handled_.Add(with_code);
  }
  Method& ref = *m;
  methods_.emplace(bucket_key, std::move(m));
  return ref;
}

grpc::experimental::Interceptor* GrpcServerMetrics::CreateServerInterceptor(ServerRpcInfo* info) {
  return new grpc_metrics_internal::MetricsInterceptor(MethodOf(info->method(), info->type()));
}

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> InterceptorFactory(GrpcServerMetrics* metrics) {
  return std::make_unique<Factory>(metrics);
}

}  // namespace collserve::server
