// StoreClient over the coordinator's collserve.v1.Store gRPC service.
#include <grpcpp/grpcpp.h>

#include <chrono>

#include "absl/strings/str_cat.h"
#include "client/channel.h"
#include "collserve/client.h"
#include "collserve/v1/store.grpc.pb.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"

namespace collserve::client {
namespace {

namespace pb = ::collserve::v1;

// Deadline for calls that do not wait for keys.
constexpr absl::Duration kRpcTimeout = absl::Seconds(30);
// Extra time past a server-side wait timeout, so the server's DEADLINE_EXCEEDED (which
// names the missing keys) arrives before the transport deadline.
constexpr absl::Duration kWaitGrace = absl::Seconds(5);

// Sets the call's deadline, `d` from now, and its job token.
void Prepare(grpc::ClientContext& ctx, const std::string& token, absl::Duration d) {
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(absl::ToInt64Milliseconds(d)));
  AddJobToken(ctx, token);
}

int64_t TimeoutMs(absl::Duration d) {
  // The protocol reads 0 as "server default" and < 0 as "do not wait".
  if (d <= absl::ZeroDuration()) return -1;
  return std::max<int64_t>(1, absl::ToInt64Milliseconds(d));
}

class GrpcStoreClient : public StoreClient {
 public:
  GrpcStoreClient(std::shared_ptr<grpc::Channel> channel, StoreClientOptions options)
      : stub_(pb::Store::NewStub(channel)), options_(std::move(options)) {}

  absl::Status Set(absl::string_view key, absl::string_view value) override {
    pb::SetRequest req;
    req.set_job(options_.job);
    req.set_key(std::string(key));
    req.set_value(std::string(value));
    pb::SetResponse resp;
    grpc::ClientContext ctx;
    Prepare(ctx, options_.token, kRpcTimeout);
    return FromGrpcStatus(stub_->Set(&ctx, req, &resp));
  }

  absl::StatusOr<std::string> Get(absl::string_view key) override {
    return Get(key, options_.timeout);
  }
  absl::StatusOr<std::string> Get(absl::string_view key, absl::Duration timeout) override {
    pb::GetRequest req;
    req.set_job(options_.job);
    req.set_key(std::string(key));
    req.set_timeout_ms(TimeoutMs(timeout));
    pb::GetResponse resp;
    grpc::ClientContext ctx;
    Prepare(ctx, options_.token, std::max(timeout, absl::ZeroDuration()) + kWaitGrace);
    absl::Status s = FromGrpcStatus(stub_->Get(&ctx, req, &resp));
    if (!s.ok()) return s;
    return std::move(*resp.mutable_value());
  }

  absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta) override {
    pb::AddRequest req;
    req.set_job(options_.job);
    req.set_key(std::string(key));
    req.set_delta(delta);
    pb::AddResponse resp;
    grpc::ClientContext ctx;
    Prepare(ctx, options_.token, kRpcTimeout);
    absl::Status s = FromGrpcStatus(stub_->Add(&ctx, req, &resp));
    if (!s.ok()) return s;
    return resp.value();
  }

  absl::StatusOr<std::string> CompareSet(absl::string_view key, absl::string_view expected,
                                         absl::string_view desired) override {
    pb::CompareSetRequest req;
    req.set_job(options_.job);
    req.set_key(std::string(key));
    req.set_expected(std::string(expected));
    req.set_desired(std::string(desired));
    pb::CompareSetResponse resp;
    grpc::ClientContext ctx;
    Prepare(ctx, options_.token, kRpcTimeout);
    absl::Status s = FromGrpcStatus(stub_->CompareSet(&ctx, req, &resp));
    if (!s.ok()) return s;
    return std::move(*resp.mutable_value());
  }

  absl::StatusOr<bool> Check(const std::vector<std::string>& keys) override {
    pb::CheckRequest req;
    req.set_job(options_.job);
    for (const auto& k : keys) req.add_keys(k);
    pb::CheckResponse resp;
    grpc::ClientContext ctx;
    Prepare(ctx, options_.token, kRpcTimeout);
    absl::Status s = FromGrpcStatus(stub_->Check(&ctx, req, &resp));
    if (!s.ok()) return s;
    return resp.ready();
  }

  absl::Status Wait(const std::vector<std::string>& keys) override {
    return Wait(keys, options_.timeout);
  }
  absl::Status Wait(const std::vector<std::string>& keys, absl::Duration timeout) override {
    pb::WaitRequest req;
    req.set_job(options_.job);
    for (const auto& k : keys) req.add_keys(k);
    req.set_timeout_ms(TimeoutMs(timeout));
    pb::WaitResponse resp;
    grpc::ClientContext ctx;
    Prepare(ctx, options_.token, std::max(timeout, absl::ZeroDuration()) + kWaitGrace);
    return FromGrpcStatus(stub_->Wait(&ctx, req, &resp));
  }

  absl::StatusOr<bool> DeleteKey(absl::string_view key) override {
    pb::DeleteKeyRequest req;
    req.set_job(options_.job);
    req.set_key(std::string(key));
    pb::DeleteKeyResponse resp;
    grpc::ClientContext ctx;
    Prepare(ctx, options_.token, kRpcTimeout);
    absl::Status s = FromGrpcStatus(stub_->DeleteKey(&ctx, req, &resp));
    if (!s.ok()) return s;
    return resp.deleted();
  }

  absl::StatusOr<int64_t> NumKeys(absl::string_view prefix) override {
    pb::NumKeysRequest req;
    req.set_job(options_.job);
    req.set_prefix(std::string(prefix));
    pb::NumKeysResponse resp;
    grpc::ClientContext ctx;
    Prepare(ctx, options_.token, kRpcTimeout);
    absl::Status s = FromGrpcStatus(stub_->NumKeys(&ctx, req, &resp));
    if (!s.ok()) return s;
    return resp.count();
  }

  absl::StatusOr<std::vector<std::string>> MultiGet(const std::vector<std::string>& keys,
                                                    absl::Duration timeout) override {
    pb::MultiGetRequest req;
    req.set_job(options_.job);
    for (const auto& k : keys) req.add_keys(k);
    req.set_timeout_ms(TimeoutMs(timeout));
    pb::MultiGetResponse resp;
    grpc::ClientContext ctx;
    Prepare(ctx, options_.token, std::max(timeout, absl::ZeroDuration()) + kWaitGrace);
    absl::Status s = FromGrpcStatus(stub_->MultiGet(&ctx, req, &resp));
    if (!s.ok()) return s;
    return std::vector<std::string>(resp.values().begin(), resp.values().end());
  }

  absl::Status MultiSet(const std::vector<std::string>& keys,
                        const std::vector<std::string>& values) override {
    pb::MultiSetRequest req;
    req.set_job(options_.job);
    for (const auto& k : keys) req.add_keys(k);
    for (const auto& v : values) req.add_values(v);
    pb::MultiSetResponse resp;
    grpc::ClientContext ctx;
    Prepare(ctx, options_.token, kRpcTimeout);
    return FromGrpcStatus(stub_->MultiSet(&ctx, req, &resp));
  }

  absl::Status Append(absl::string_view key, absl::string_view value) override {
    pb::AppendRequest req;
    req.set_job(options_.job);
    req.set_key(std::string(key));
    req.set_value(std::string(value));
    pb::AppendResponse resp;
    grpc::ClientContext ctx;
    Prepare(ctx, options_.token, kRpcTimeout);
    return FromGrpcStatus(stub_->Append(&ctx, req, &resp));
  }

 private:
  std::unique_ptr<pb::Store::Stub> stub_;
  StoreClientOptions options_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<StoreClient>> StoreClient::Connect(
    const std::string& address, const StoreClientOptions& options) {
  if (address.empty()) return absl::InvalidArgumentError("empty coordinator address");
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(256 << 20);
  args.SetMaxSendMessageSize(256 << 20);
  COLLSERVE_ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel, CreateChannel(address, options.tls, args));
  auto deadline = std::chrono::system_clock::now() +
                  std::chrono::milliseconds(absl::ToInt64Milliseconds(options.connect_timeout));
  if (!channel->WaitForConnected(deadline)) {
    return absl::UnavailableError(absl::StrCat("cannot reach the coordinator at ", address,
                                               " within ",
                                               absl::FormatDuration(options.connect_timeout)));
  }
  return std::unique_ptr<StoreClient>(new GrpcStoreClient(std::move(channel), options));
}

}  // namespace collserve::client
