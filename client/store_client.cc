// StoreClient over the coordinator's collserve.v1.Store gRPC service.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <chrono>

#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/channel.h"
#include "collserve/client.h"
#include "collserve/v1/store.grpc.pb.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"

namespace collserve::client {
namespace {

namespace pb = ::collserve::v1;

// Extra time past a server-side wait timeout, so the server's DEADLINE_EXCEEDED (which
// names the missing keys) arrives before the transport deadline.
constexpr absl::Duration kWaitGrace = absl::Seconds(5);
// Pause before the first retry of a call the coordinator did not answer, doubled per retry
// up to kMaxBackoff, each drawn uniformly from [0.5, 1.5) times that ("full jitter" would
// also do; the point is that a restarted coordinator is not hit by every rank at once).
constexpr absl::Duration kFirstBackoff = absl::Milliseconds(50);
constexpr absl::Duration kMaxBackoff = absl::Seconds(1);
// Keys per Store.ListKeys page of DeleteKeysWithPrefix (the server allows up to 10000).
constexpr int64_t kDeletePageKeys = 1000;

// `s` (an error of DeleteKeysWithPrefix) saying how many keys went before it, if any.
absl::Status AfterDeleting(const absl::Status& s, int64_t deleted) {
  if (deleted == 0) return s;
  return absl::Status(s.code(), absl::StrCat(s.message(), " (after deleting ", deleted, " keys)"));
}

int64_t TimeoutMs(absl::Duration d) {
  // The protocol reads 0 as "server default" and < 0 as "do not wait".
  if (d <= absl::ZeroDuration()) return -1;
  return std::max<int64_t>(1, absl::ToInt64Milliseconds(d));
}

class GrpcStoreClient : public StoreClient {
 public:
  GrpcStoreClient(std::shared_ptr<grpc::Channel> channel, std::string address, StoreClientOptions options)
      : channel_(channel),
        stub_(pb::Store::NewStub(channel)),
        address_(std::move(address)),
        options_(std::move(options)),
        client_id_(absl::StrFormat("%016x", absl::Uniform<uint64_t>(bitgen_))) {}

  absl::Status Set(absl::string_view key, absl::string_view value) override {
    pb::SetRequest req;
    req.set_job(options_.job);
    req.set_key(std::string(key));
    req.set_value(std::string(value));
    pb::SetResponse resp;
    return Call("set", WriteDeadline(), [&](grpc::ClientContext* ctx) { return stub_->Set(ctx, req, &resp); });
  }

  absl::StatusOr<std::string> Get(absl::string_view key) override { return Get(key, options_.timeout); }
  absl::StatusOr<std::string> Get(absl::string_view key, absl::Duration timeout) override {
    pb::GetRequest req;
    req.set_job(options_.job);
    req.set_key(std::string(key));
    pb::GetResponse resp;
    const absl::Time wait_end = absl::Now() + std::max(timeout, absl::ZeroDuration());
    COLLSERVE_RETURN_IF_ERROR(Call("get", wait_end + kWaitGrace, [&](grpc::ClientContext* ctx) {
      req.set_timeout_ms(TimeoutMs(wait_end - absl::Now()));
      return stub_->Get(ctx, req, &resp);
    }));
    return std::move(*resp.mutable_value());
  }

  absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta) override {
    pb::AddRequest req;
    req.set_job(options_.job);
    req.set_key(std::string(key));
    req.set_delta(delta);
    req.set_request_id(NextRequestId());
    pb::AddResponse resp;
    COLLSERVE_RETURN_IF_ERROR(
        Call("add", WriteDeadline(), [&](grpc::ClientContext* ctx) { return stub_->Add(ctx, req, &resp); }));
    return resp.value();
  }

  absl::StatusOr<std::string> CompareSet(absl::string_view key, absl::string_view expected,
                                         absl::string_view desired) override {
    pb::CompareSetRequest req;
    req.set_job(options_.job);
    req.set_key(std::string(key));
    req.set_expected(std::string(expected));
    req.set_desired(std::string(desired));
    req.set_request_id(NextRequestId());
    pb::CompareSetResponse resp;
    COLLSERVE_RETURN_IF_ERROR(Call("compare_set", WriteDeadline(),
                                   [&](grpc::ClientContext* ctx) { return stub_->CompareSet(ctx, req, &resp); }));
    return std::move(*resp.mutable_value());
  }

  absl::StatusOr<bool> Check(const std::vector<std::string>& keys) override {
    pb::CheckRequest req;
    req.set_job(options_.job);
    for (const auto& k : keys) req.add_keys(k);
    pb::CheckResponse resp;
    COLLSERVE_RETURN_IF_ERROR(
        Call("check", WriteDeadline(), [&](grpc::ClientContext* ctx) { return stub_->Check(ctx, req, &resp); }));
    return resp.ready();
  }

  absl::Status Wait(const std::vector<std::string>& keys) override { return Wait(keys, options_.timeout); }
  absl::Status Wait(const std::vector<std::string>& keys, absl::Duration timeout) override {
    pb::WaitRequest req;
    req.set_job(options_.job);
    for (const auto& k : keys) req.add_keys(k);
    pb::WaitResponse resp;
    const absl::Time wait_end = absl::Now() + std::max(timeout, absl::ZeroDuration());
    return Call("wait", wait_end + kWaitGrace, [&](grpc::ClientContext* ctx) {
      req.set_timeout_ms(TimeoutMs(wait_end - absl::Now()));
      return stub_->Wait(ctx, req, &resp);
    });
  }

  absl::StatusOr<bool> DeleteKey(absl::string_view key) override {
    pb::DeleteKeyRequest req;
    req.set_job(options_.job);
    req.set_key(std::string(key));
    req.set_request_id(NextRequestId());
    pb::DeleteKeyResponse resp;
    COLLSERVE_RETURN_IF_ERROR(Call("delete_key", WriteDeadline(),
                                   [&](grpc::ClientContext* ctx) { return stub_->DeleteKey(ctx, req, &resp); }));
    return resp.deleted();
  }

  absl::StatusOr<int64_t> DeleteKeysWithPrefix(absl::string_view prefix) override {
    if (prefix.empty()) {
      return absl::InvalidArgumentError("delete_keys_with_prefix: the prefix may not be empty");
    }
    int64_t deleted = 0;
    for (;;) {
      pb::ListKeysRequest req;
      req.set_job(options_.job);
      req.set_prefix(std::string(prefix));
      req.set_limit(kDeletePageKeys);
      pb::ListKeysResponse resp;
      absl::Status listed =
          Call("list_keys", WriteDeadline(), [&](grpc::ClientContext* ctx) { return stub_->ListKeys(ctx, req, &resp); });
      if (!listed.ok()) return AfterDeleting(listed, deleted);
      if (resp.keys().empty()) return deleted;
      for (const std::string& key : resp.keys()) {
        absl::StatusOr<bool> one = DeleteKey(key);
        if (!one.ok()) return AfterDeleting(one.status(), deleted);
        deleted += *one ? 1 : 0;
      }
    }
  }

  absl::StatusOr<int64_t> NumKeys(absl::string_view prefix) override {
    pb::NumKeysRequest req;
    req.set_job(options_.job);
    req.set_prefix(std::string(prefix));
    pb::NumKeysResponse resp;
    COLLSERVE_RETURN_IF_ERROR(
        Call("num_keys", WriteDeadline(), [&](grpc::ClientContext* ctx) { return stub_->NumKeys(ctx, req, &resp); }));
    return resp.count();
  }

  absl::StatusOr<std::vector<std::string>> MultiGet(const std::vector<std::string>& keys,
                                                    absl::Duration timeout) override {
    pb::MultiGetRequest req;
    req.set_job(options_.job);
    for (const auto& k : keys) req.add_keys(k);
    pb::MultiGetResponse resp;
    const absl::Time wait_end = absl::Now() + std::max(timeout, absl::ZeroDuration());
    COLLSERVE_RETURN_IF_ERROR(Call("multi_get", wait_end + kWaitGrace, [&](grpc::ClientContext* ctx) {
      req.set_timeout_ms(TimeoutMs(wait_end - absl::Now()));
      return stub_->MultiGet(ctx, req, &resp);
    }));
    return std::vector<std::string>(resp.values().begin(), resp.values().end());
  }

  absl::Status MultiSet(const std::vector<std::string>& keys,
                        const std::vector<std::string>& values) override {
    pb::MultiSetRequest req;
    req.set_job(options_.job);
    for (const auto& k : keys) req.add_keys(k);
    for (const auto& v : values) req.add_values(v);
    pb::MultiSetResponse resp;
    return Call("multi_set", WriteDeadline(),
                [&](grpc::ClientContext* ctx) { return stub_->MultiSet(ctx, req, &resp); });
  }

  absl::Status Append(absl::string_view key, absl::string_view value) override {
    pb::AppendRequest req;
    req.set_job(options_.job);
    req.set_key(std::string(key));
    req.set_value(std::string(value));
    req.set_request_id(NextRequestId());
    pb::AppendResponse resp;
    return Call("append", WriteDeadline(), [&](grpc::ClientContext* ctx) { return stub_->Append(ctx, req, &resp); });
  }

 private:
  // Calls that do not wait for keys end at the store timeout, as in torch's TCPStore.
  absl::Time WriteDeadline() const { return absl::Now() + std::max(options_.timeout, absl::Seconds(1)); }

  // "<client id>-<n>": unique per write of this client (the client id is 64 random bits).
  std::string NextRequestId() { return absl::StrCat(client_id_, "-", next_request_.fetch_add(1) + 1); }

  // Runs `attempt` (one RPC on the context it is given) until it gets an answer other than
  // UNAVAILABLE, or until `deadline`. A coordinator that restarts answers nothing for a
  // while: the RPC in flight fails with UNAVAILABLE ("Socket closed"), and the calls made
  // while it is down wait for the channel to reconnect (wait_for_ready; gRPC reconnects
  // with its own backoff, CreateChannel bounds it at 1 s). Retried writes are safe: set and
  // multi_set are idempotent, and add, compare_set, append and delete_key carry a request
  // id the coordinator answers once. DEADLINE_EXCEEDED from the server (a wait that timed
  // out; it names the keys) is returned as it is; the deadline passing while no
  // coordinator answers is UNAVAILABLE naming the address, the operation and the time.
  template <typename Attempt>
  absl::Status Call(const char* op, absl::Time deadline, Attempt attempt) {
    const absl::Time start = absl::Now();
    absl::Duration backoff = kFirstBackoff;
    for (int attempts = 1;; ++attempts) {
      grpc::ClientContext ctx;
      ctx.set_deadline(absl::ToChronoTime(deadline));
      ctx.set_wait_for_ready(true);
      AddJobToken(ctx, options_.token);
      const grpc::Status s = attempt(&ctx);
      if (s.ok()) return absl::OkStatus();
      const bool unanswered = s.error_code() == grpc::StatusCode::UNAVAILABLE ||
                              (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED &&
                               channel_->GetState(false) != GRPC_CHANNEL_READY);
      if (!unanswered) return FromGrpcStatus(s);
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration() || s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
        return absl::UnavailableError(absl::StrCat(
            "the coordinator at ", address_, " did not answer ", op, " within ",
            absl::FormatDuration(absl::Trunc(absl::Now() - start, absl::Milliseconds(1))), " (", attempts,
            attempts == 1 ? " attempt" : " attempts", "; the store timeout bounds the retries): ",
            s.error_message()));
      }
      double jitter;
      {
        absl::MutexLock lock(&bitgen_mu_);
        jitter = absl::Uniform(bitgen_, 0.5, 1.5);
      }
      absl::SleepFor(std::min(left, backoff * jitter));
      backoff = std::min(backoff * 2, kMaxBackoff);
    }
  }

  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<pb::Store::Stub> stub_;
  const std::string address_;
  StoreClientOptions options_;
  absl::Mutex bitgen_mu_;
  absl::BitGen bitgen_ ABSL_GUARDED_BY(bitgen_mu_);
  const std::string client_id_;
  std::atomic<uint64_t> next_request_{0};
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
  return std::unique_ptr<StoreClient>(new GrpcStoreClient(std::move(channel), address, options));
}

}  // namespace collserve::client
