#include "server/coordinator/registry_journal.h"

#include <algorithm>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "collserve/v1/registry.pb.h"
#include "etcd/etcdserverpb/rpc.grpc.pb.h"
#include "server/coordinator/etcd_store.h"
#include <glog/logging.h>

namespace collserve::server {

namespace epb = etcdserverpb;

struct EtcdRegistryJournal::Stubs {
  explicit Stubs(const std::shared_ptr<grpc::Channel>& channel) : kv(epb::KV::NewStub(channel)) {}
  std::unique_ptr<epb::KV::Stub> kv;
};

absl::StatusOr<std::unique_ptr<EtcdRegistryJournal>> EtcdRegistryJournal::Create(std::shared_ptr<grpc::Channel> etcd,
                                                                                   RegistryJournalOptions options) {
  if (etcd == nullptr) return absl::InvalidArgumentError("the registry journal needs a channel to etcd");
  if (options.prefix.empty()) return absl::InvalidArgumentError("the registry journal needs a key prefix");
  if (options.call_timeout <= absl::ZeroDuration() || options.max_value_bytes <= 0) {
    return absl::InvalidArgumentError("the registry journal's call_timeout and max_value_bytes must be positive");
  }
  return std::unique_ptr<EtcdRegistryJournal>(new EtcdRegistryJournal(std::move(etcd), std::move(options)));
}

EtcdRegistryJournal::EtcdRegistryJournal(std::shared_ptr<grpc::Channel> etcd, RegistryJournalOptions options)
    : options_(std::move(options)), etcd_(std::move(etcd)), stubs_(std::make_unique<Stubs>(etcd_)) {
  thread_ = std::thread([this] { Loop(); });
}

EtcdRegistryJournal::~EtcdRegistryJournal() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    stop_by_ = absl::Now() + options_.call_timeout;
  }
  thread_.join();
}

std::string EtcdRegistryJournal::Key(const std::string& job, const std::string& group) const {
  return absl::StrCat(options_.prefix, job.size(), ":", job, "/", group);
}

bool EtcdRegistryJournal::ParseKey(const std::string& key, std::string* job, std::string* group) const {
  if (key.compare(0, options_.prefix.size(), options_.prefix) != 0) return false;
  const size_t colon = key.find(':', options_.prefix.size());
  size_t n = 0;
  if (colon == std::string::npos ||
      !absl::SimpleAtoi(absl::string_view(key).substr(options_.prefix.size(), colon - options_.prefix.size()), &n) ||
      key.size() < colon + 1 + n + 2 || key[colon + 1 + n] != '/') {
    return false;
  }
  *job = key.substr(colon + 1, n);
  *group = key.substr(colon + 2 + n);
  return true;
}

void EtcdRegistryJournal::Formed(const std::string& job, std::shared_ptr<const GroupView> view) {
  absl::MutexLock lock(&mu_);
  const std::string key = Key(job, view->group);
  formed_[key] = view->generation;
  auto [it, added] = pending_.try_emplace(key);
  if (!added) ++written_;  // the queued change is superseded: never written
  it->second = Change{view->generation, std::move(view)};
  ++queued_;
}

void EtcdRegistryJournal::Ended(const std::string& job, const std::string& group, int64_t generation) {
  absl::MutexLock lock(&mu_);
  const std::string key = Key(job, group);
  auto formed = formed_.find(key);
  if (formed != formed_.end()) {
    // A later generation was recorded (queued, or written already): keep it.
    if (formed->second > generation) return;
    formed_.erase(formed);
  }
  auto [it, added] = pending_.try_emplace(key);
  if (!added) {
    if (it->second.generation > generation) return;  // a later generation is queued: keep it
    ++written_;
  }
  it->second = Change{generation, nullptr};
  ++queued_;
}

void EtcdRegistryJournal::Loop() {
  for (;;) {
    std::map<std::string, Change> batch;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !pending_.empty(); };
      mu_.Await(absl::Condition(&ready));
      if (pending_.empty()) return;  // stopping, nothing left to write
      batch.swap(pending_);
    }
    Stats done;
    for (const auto& [key, change] : batch) {
      switch (Write(key, change)) {
        case Outcome::kWritten: ++done.written; break;
        case Outcome::kFailed: ++done.failed; break;
        case Outcome::kTooLarge: ++done.too_large; break;
      }
    }
    absl::MutexLock lock(&mu_);
    written_ += batch.size();
    stats_.written += done.written;
    stats_.failed += done.failed;
    stats_.too_large += done.too_large;
  }
}

EtcdRegistryJournal::Stats EtcdRegistryJournal::GetStats() {
  absl::MutexLock lock(&mu_);
  return stats_;
}

EtcdRegistryJournal::Outcome EtcdRegistryJournal::Write(const std::string& key, const Change& change) {
  absl::Time deadline = absl::Now() + options_.call_timeout;
  {
    absl::MutexLock lock(&mu_);
    deadline = std::min(deadline, stop_by_);
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(deadline));
  ctx.set_wait_for_ready(true);  // an etcd (re)connecting is waited for, within the deadline
  grpc::Status s;
  if (change.view == nullptr) {
    epb::DeleteRangeRequest req;
    req.set_key(key);
    epb::DeleteRangeResponse resp;
    s = stubs_->kv->DeleteRange(&ctx, req, &resp);
  } else {
    const GroupView& v = *change.view;
    collserve::v1::JoinResponse record;  // the compact join answer
    record.set_generation(v.generation);
    for (const MemberInfo& h : v.hosts) {
      auto* host = record.add_hosts();
      host->set_host_id(h.host_id);
      host->set_host_address(h.host_address);
      host->set_sidecar_address(h.sidecar_address);
      host->set_backend(h.backend);
    }
    record.mutable_rank_host()->Assign(v.rank_host.begin(), v.rank_host.end());
    epb::PutRequest req;
    req.set_key(key);
    if (!record.SerializeToString(req.mutable_value())) return Outcome::kFailed;
    if (static_cast<int64_t>(req.value().size()) > options_.max_value_bytes) {
      LOG(WARNING) << "registry journal: generation " << v.generation << " of " << key << " is not recorded: its "
                   << req.value().size() << " bytes exceed " << options_.max_value_bytes
                   << " (a new registry leader learns it from its sidecars' watches)";
      return Outcome::kTooLarge;
    }
    epb::PutResponse resp;
    s = stubs_->kv->Put(&ctx, req, &resp);
  }
  if (!s.ok()) {
    LOG(WARNING) << "registry journal: could not " << (change.view == nullptr ? "delete" : "write") << " " << key
                 << " (generation " << change.generation << ") in etcd: " << s.error_message();
    return Outcome::kFailed;
  }
  return Outcome::kWritten;
}

absl::StatusOr<std::vector<EtcdRegistryJournal::Record>> EtcdRegistryJournal::Load() {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.call_timeout));
  ctx.set_wait_for_ready(true);
  epb::RangeRequest req;
  req.set_key(options_.prefix);
  req.set_range_end(EtcdPrefixEnd(options_.prefix));
  epb::RangeResponse resp;
  const grpc::Status s = stubs_->kv->Range(&ctx, req, &resp);
  if (!s.ok()) {
    return absl::UnavailableError(absl::StrCat("the registry journal could not be read from etcd: ", s.error_message()));
  }
  std::vector<Record> records;
  for (const auto& kv : resp.kvs()) {
    Record r;
    collserve::v1::JoinResponse record;
    bool ok = ParseKey(kv.key(), &r.job, &r.view.group) && record.ParseFromString(kv.value()) &&
              record.generation() > 0;
    for (int rank = 0; ok && rank < record.rank_host_size(); ++rank) {
      const int32_t h = record.rank_host(rank);
      ok = h >= 0 && h < record.hosts_size();
      if (!ok) break;
      MemberInfo m;
      m.rank = rank;
      m.host_id = record.hosts(h).host_id();
      m.host_address = record.hosts(h).host_address();
      m.sidecar_address = record.hosts(h).sidecar_address();
      m.backend = record.hosts(h).backend().substr(0, 32);
      r.view.members.push_back(std::move(m));
    }
    if (!ok || r.view.members.empty()) {
      LOG(WARNING) << "registry journal: skipping the record " << kv.key() << " in etcd: not a formed generation";
      continue;
    }
    r.view.generation = record.generation();
    r.view.world_size = static_cast<int>(r.view.members.size());
    r.view.state = "FORMED";
    records.push_back(std::move(r));
  }
  return records;
}

bool EtcdRegistryJournal::Flush(absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  const uint64_t target = queued_;
  auto done = [this, target]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return written_ >= target; };
  return mu_.AwaitWithTimeout(absl::Condition(&done), timeout);
}

}  // namespace collserve::server
