#include "server/coordinator/registry_replication.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "etcd/etcdserverpb/rpc.grpc.pb.h"
#include <glog/logging.h>

namespace collserve::server {

namespace epb = etcdserverpb;

struct RegistryReplication::Stubs {
  explicit Stubs(const std::shared_ptr<grpc::Channel>& channel)
      : kv(epb::KV::NewStub(channel)), lease(epb::Lease::NewStub(channel)) {}
  std::unique_ptr<epb::KV::Stub> kv;
  std::unique_ptr<epb::Lease::Stub> lease;
};

absl::Status CheckReplicaTls(const client::TlsOptions& tls) {
  // CreateChannel checks the options and files, and does not connect.
  if (auto probe = client::CreateChannel("localhost:1", tls, grpc::ChannelArguments()); !probe.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("TLS between coordinator replicas: ", probe.status().message()));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<RegistryReplication>> RegistryReplication::Start(std::shared_ptr<grpc::Channel> etcd,
                                                                                 RegistryReplicationOptions options) {
  if (etcd == nullptr) return absl::InvalidArgumentError("registry replication needs a channel to etcd");
  if (options.key.empty()) return absl::InvalidArgumentError("registry replication needs a leader key");
  if (options.advertise_address.empty()) {
    return absl::InvalidArgumentError("registry replication needs this replica's address (--advertise_address)");
  }
  if (options.lease_ttl < absl::Seconds(2) || options.poll_interval <= absl::ZeroDuration() ||
      options.call_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("registry replication: lease_ttl must be at least 2s (got ", absl::FormatDuration(options.lease_ttl),
                     "), poll_interval and call_timeout positive"));
  }
  if (absl::Status s = CheckReplicaTls(options.tls); !s.ok()) return s;
  std::unique_ptr<RegistryReplication> r(new RegistryReplication(std::move(etcd), std::move(options)));
  r->Campaign();
  r->thread_ = std::thread([p = r.get()] { p->Loop(); });
  return r;
}

RegistryReplication::RegistryReplication(std::shared_ptr<grpc::Channel> etcd, RegistryReplicationOptions options)
    : options_(std::move(options)), etcd_(std::move(etcd)), stubs_(std::make_unique<Stubs>(etcd_)) {}

RegistryReplication::~RegistryReplication() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
  Revoke();
}

void RegistryReplication::Loop() {
  for (;;) {
    bool leading;
    {
      absl::MutexLock lock(&mu_);
      leading = leading_;
      const absl::Duration pause = leading ? options_.lease_ttl / 3 : options_.poll_interval;
      auto stopped = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; };
      if (mu_.AwaitWithTimeout(absl::Condition(&stopped), pause)) return;
      leading = leading_;
    }
    if (leading) {
      KeepAlive();
    } else {
      Poll();
    }
  }
}

// One campaign: create the key under a fresh lease if it does not exist; otherwise learn
// the leader from it.
void RegistryReplication::Campaign() {
  {
    absl::MutexLock lock(&mu_);
    if (lost_ || stop_) return;
  }
  const absl::Time start = absl::Now();
  grpc::ClientContext grant_ctx;
  grant_ctx.set_deadline(absl::ToChronoTime(start + options_.call_timeout));
  epb::LeaseGrantRequest grant;
  grant.set_ttl(std::max<int64_t>(2, absl::ToInt64Seconds(options_.lease_ttl)));
  epb::LeaseGrantResponse granted;
  grpc::Status s = stubs_->lease->LeaseGrant(&grant_ctx, grant, &granted);
  if (!s.ok() || !granted.error().empty()) {
    LOG(WARNING) << "registry election: etcd LeaseGrant failed: " << (s.ok() ? granted.error() : s.error_message());
    return;
  }
  epb::TxnRequest txn;
  auto* cmp = txn.add_compare();
  cmp->set_key(options_.key);
  cmp->set_target(epb::Compare::CREATE);
  cmp->set_result(epb::Compare::EQUAL);
  cmp->set_create_revision(0);
  auto* put = txn.add_success()->mutable_request_put();
  put->set_key(options_.key);
  put->set_value(options_.advertise_address);
  put->set_lease(granted.id());
  txn.add_failure()->mutable_request_range()->set_key(options_.key);
  epb::TxnResponse resp;
  grpc::ClientContext txn_ctx;
  txn_ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.call_timeout));
  s = stubs_->kv->Txn(&txn_ctx, txn, &resp);
  if (!s.ok() || !resp.succeeded()) {
    // Not ours: give the unused lease back (it would expire on its own).
    grpc::ClientContext revoke_ctx;
    revoke_ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.call_timeout));
    epb::LeaseRevokeRequest revoke;
    revoke.set_id(granted.id());
    epb::LeaseRevokeResponse revoked;
    (void)stubs_->lease->LeaseRevoke(&revoke_ctx, revoke, &revoked);
  }
  if (!s.ok()) {
    LOG(WARNING) << "registry election: etcd Txn failed: " << s.error_message();
    return;
  }
  if (resp.succeeded() && options_.on_elected) options_.on_elected();
  absl::MutexLock lock(&mu_);
  if (resp.succeeded()) {
    leading_ = true;
    lease_id_ = granted.id();
    renewed_ = start;
    leader_ = options_.advertise_address;
    LOG(INFO) << "registry election: this replica (" << leader_ << ") leads the group registry (etcd key "
              << options_.key << ", lease " << granted.id() << ")";
    return;
  }
  std::string leader;
  if (resp.responses_size() > 0 && resp.responses(0).response_range().kvs_size() > 0) {
    leader = resp.responses(0).response_range().kvs(0).value();
  }
  if (leader != leader_) LOG(INFO) << "registry election: the leader is " << (leader.empty() ? "unknown" : leader);
  leader_ = leader;
}

void RegistryReplication::Poll() {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.call_timeout));
  epb::RangeRequest req;
  req.set_key(options_.key);
  epb::RangeResponse resp;
  const grpc::Status s = stubs_->kv->Range(&ctx, req, &resp);
  if (!s.ok()) {
    // etcd unreachable: keep the last leader seen; calls forwarded to a dead one fail
    // UNAVAILABLE and are retried by their callers.
    return;
  }
  if (resp.kvs_size() == 0) {
    {
      absl::MutexLock lock(&mu_);
      if (!leader_.empty()) LOG(INFO) << "registry election: leader " << leader_ << " is gone; campaigning";
      leader_.clear();
    }
    Campaign();
    return;
  }
  absl::MutexLock lock(&mu_);
  if (resp.kvs(0).value() != leader_) LOG(INFO) << "registry election: the leader is " << resp.kvs(0).value();
  leader_ = resp.kvs(0).value();
}

void RegistryReplication::KeepAlive() {
  int64_t id;
  {
    absl::MutexLock lock(&mu_);
    id = lease_id_;
  }
  const absl::Time start = absl::Now();
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(start + options_.call_timeout));
  epb::LeaseKeepAliveRequest req;
  req.set_id(id);
  epb::LeaseKeepAliveResponse resp;
  auto stream = stubs_->lease->LeaseKeepAlive(&ctx);
  bool ok = stream->Write(req) && stream->Read(&resp);
  stream->WritesDone();
  grpc::Status s = stream->Finish();
  absl::Status lost;
  {
    absl::MutexLock lock(&mu_);
    if (ok && resp.ttl() > 0) {
      renewed_ = start;
      return;
    }
    if (ok) {
      lost = absl::UnavailableError(absl::StrCat("the registry leader's etcd lease ", id, " expired"));
    } else if (absl::Now() - renewed_ >= options_.lease_ttl) {
      lost = absl::UnavailableError(absl::StrCat("the registry leader could not renew its etcd lease for ",
                                                 absl::FormatDuration(absl::Now() - renewed_), " (lease_ttl ",
                                                 absl::FormatDuration(options_.lease_ttl), "): ", s.error_message()));
    } else {
      return;  // retried at the next tick, while the lease may still be alive
    }
    leading_ = false;
    lost_ = true;
    leader_.clear();
    lease_id_ = 0;
  }
  LOG(ERROR) << "registry election: this replica no longer leads the group registry: " << lost;
  if (options_.on_lost) options_.on_lost(lost);
}

void RegistryReplication::Revoke() {
  int64_t id;
  {
    absl::MutexLock lock(&mu_);
    if (!leading_) return;
    id = lease_id_;
    leading_ = false;
    leader_.clear();
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.call_timeout));
  epb::LeaseRevokeRequest req;
  req.set_id(id);
  epb::LeaseRevokeResponse resp;
  const grpc::Status s = stubs_->lease->LeaseRevoke(&ctx, req, &resp);
  if (!s.ok()) LOG(WARNING) << "registry election: could not revoke the leader's lease: " << s.error_message();
}

absl::StatusOr<std::shared_ptr<collserve::v1::Registry::Stub>> RegistryReplication::Route(bool forwarded) {
  absl::MutexLock lock(&mu_);
  if (leading_) return std::shared_ptr<collserve::v1::Registry::Stub>();
  if (forwarded) {
    return absl::UnavailableError(absl::StrCat("this coordinator replica (", options_.advertise_address,
                                               ") does not lead the group registry (the leader is ",
                                               leader_.empty() ? "being elected" : leader_, "); retry"));
  }
  if (leader_.empty() || leader_ == options_.advertise_address) {
    return absl::UnavailableError("no coordinator replica leads the group registry yet (an election is under way); retry");
  }
  if (leader_stubs_.size() >= 8 && leader_stubs_.count(leader_) == 0) leader_stubs_.clear();  // leaders seen
  auto& stub = leader_stubs_[leader_];
  if (stub == nullptr) {
    grpc::ChannelArguments args;  // (CreateChannel bounds the reconnect backoff to 100 ms .. 1 s)
    args.SetInt(GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, 64 << 20);
    auto channel = client::CreateChannel(leader_, options_.tls, std::move(args));
    if (!channel.ok()) {  // the files were valid at Start: one was removed or replaced since
      leader_stubs_.erase(leader_);
      return absl::UnavailableError(absl::StrCat("cannot reach the registry leader ", leader_, ": ",
                                                 channel.status().message()));
    }
    stub = collserve::v1::Registry::NewStub(*channel);
  }
  return stub;
}

bool RegistryReplication::leading() const {
  absl::MutexLock lock(&mu_);
  return leading_;
}

std::string RegistryReplication::leader() const {
  absl::MutexLock lock(&mu_);
  return leader_;
}

bool RegistryReplication::AwaitLeader(absl::Duration timeout) const {
  absl::MutexLock lock(&mu_);
  auto known = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !leader_.empty(); };
  return mu_.AwaitWithTimeout(absl::Condition(&known), timeout);
}

}  // namespace collserve::server
