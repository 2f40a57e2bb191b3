#include "server/coordinator/etcd_store.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <thread>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/grpc_status.h"
#include "common/pem.h"
#include "common/status_macros.h"
#include "etcd/etcdserverpb/rpc.grpc.pb.h"

namespace collserve::server {

std::string EtcdPrefixEnd(absl::string_view prefix) {
  std::string end(prefix);
  while (!end.empty()) {
    if (static_cast<unsigned char>(end.back()) < 0xff) {
      end.back() = static_cast<char>(static_cast<unsigned char>(end.back()) + 1);
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');
}

namespace {

namespace epb = etcdserverpb;

constexpr size_t kMaxListedKeys = 10;  // in a wait's timeout message

std::string Quote(absl::string_view key) {
  constexpr size_t kShown = 64;
  std::string out = absl::StrCat("\"", absl::CHexEscape(key.substr(0, kShown)), "\"");
  if (key.size() > kShown) absl::StrAppend(&out, "...");
  return out;
}

// The contents of a PEM file (CheckPemFile's checks first).
absl::StatusOr<std::string> ReadPem(const std::string& what, const std::string& path) {
  COLLSERVE_RETURN_IF_ERROR(CheckPemFile(what, path));
  std::ifstream in(path, std::ios::binary);
  std::stringstream contents;
  contents << in.rdbuf();
  if (!in.good() && !in.eof()) return absl::InvalidArgumentError(absl::StrCat(what, " ", path, " cannot be read"));
  return contents.str();
}

bool AllIpv4Literals(const std::vector<std::string>& endpoints) {
  for (const std::string& e : endpoints) {
    const size_t colon = e.rfind(':');
    if (colon == std::string::npos || colon == 0) return false;
    for (char c : e.substr(0, colon)) {
      if (!absl::ascii_isdigit(static_cast<unsigned char>(c)) && c != '.') return false;
    }
  }
  return true;
}

// The key as read at one revision: whether it exists, its value and its mod_revision.
struct Current {
  bool exists = false;
  std::string value;
  int64_t mod_revision = 0;
};

// What a read-modify-write does with the key it read (EtcdStore::Update).
struct Outcome {
  enum Kind { kNone, kPut, kDelete } kind = kNone;
  std::string value;   // kPut
  std::string answer;  // returned, and remembered with a request id when something is written
};

class EtcdStore final : public store::Store {
 public:
  bool ReadsMayBlock() const override { return true; }

  EtcdStore(const EtcdStoreOptions& options, std::shared_ptr<grpc::Channel> channel)
      : options_(options),
        target_(absl::StrJoin(options.endpoints, ",")),
        kv_prefix_(options.prefix + "kv/"),
        req_prefix_(options.prefix + "req/"),
        channel_(std::move(channel)),
        kv_(epb::KV::NewStub(channel_)),
        watch_(epb::Watch::NewStub(channel_)),
        lease_(epb::Lease::NewStub(channel_)) {}

  ~EtcdStore() override {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
      if (watch_ctx_ != nullptr) watch_ctx_->TryCancel();
    }
    if (watcher_.joinable()) watcher_.join();
    if (timer_.joinable()) timer_.join();
    std::map<store::WaitId, Waiter> left;
    {
      absl::MutexLock lock(&mu_);
      left.swap(waiters_);
      key_waiters_.clear();
    }
    for (auto& [id, w] : left) std::move(w.done)(absl::UnavailableError("the store is shutting down"));
  }

  // Checks that etcd answers, then starts the watch and the timer.
  absl::Status Start() {
    epb::RangeRequest req;
    req.set_key(kv_prefix_);
    req.set_range_end(EtcdPrefixEnd(kv_prefix_));
    req.set_count_only(true);
    epb::RangeResponse resp;
    auto ctx = Context();
    ctx->set_wait_for_ready(true);
    COLLSERVE_RETURN_IF_ERROR(FromEtcd(kv_->Range(ctx.get(), req, &resp), "Range"));
    watcher_ = std::thread([this] { WatchLoop(); });
    timer_ = std::thread([this] { TimerLoop(); });
    return absl::OkStatus();
  }

  absl::Status Set(absl::string_view key, absl::string_view value) override {
    COLLSERVE_RETURN_IF_ERROR(ValidateKey(key));
    COLLSERVE_RETURN_IF_ERROR(ValidateValue(key, value.size()));
    epb::PutRequest req;
    req.set_key(Full(key));
    req.set_value(std::string(value));
    epb::PutResponse resp;
    auto ctx = Context();
    return FromEtcd(kv_->Put(ctx.get(), req, &resp), "Put");
  }

  absl::StatusOr<std::string> Get(absl::string_view key, absl::Duration timeout) override {
    COLLSERVE_RETURN_IF_ERROR(ValidateKey(key));
    const absl::Time start = absl::Now();
    const absl::Time deadline = start + std::max(timeout, absl::ZeroDuration());
    const std::vector<std::string> keys = {std::string(key)};
    while (true) {
      COLLSERVE_ASSIGN_OR_RETURN(Current cur, Read(key));
      if (cur.exists) return cur.value;
      if (absl::Now() >= deadline) return TimedOut(keys, start, deadline);
      COLLSERVE_RETURN_IF_ERROR(WaitUntil(keys, deadline));
    }
  }

  absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta) override { return AddOnce(key, delta, ""); }

  absl::StatusOr<int64_t> AddOnce(absl::string_view key, int64_t delta, absl::string_view request_id) override {
    COLLSERVE_RETURN_IF_ERROR(ValidateKey(key));
    absl::Status error;
    COLLSERVE_ASSIGN_OR_RETURN(std::string answer, Update(key, request_id, [&](const Current& cur) {
      Outcome out;
      int64_t current = 0;
      int64_t result = 0;
      if (cur.exists && !absl::SimpleAtoi(cur.value, &current)) {
        error = absl::InvalidArgumentError(
            absl::StrCat("value of key ", Quote(key), " is not an integer: ", Quote(cur.value)));
      } else if (__builtin_add_overflow(current, delta, &result)) {
        error = absl::InvalidArgumentError(
            absl::StrCat("adding ", delta, " to key ", Quote(key), " (value ", current, ") overflows int64"));
      } else {
        out.kind = Outcome::kPut;
        out.value = absl::StrCat(result);
        out.answer = out.value;
      }
      return out;
    }, &error));
    int64_t result = 0;
    if (!absl::SimpleAtoi(answer, &result)) {
      return absl::InternalError(absl::StrCat("the remembered answer of an add is not an integer: ", Quote(answer)));
    }
    return result;
  }

  absl::StatusOr<std::string> CompareSet(absl::string_view key, absl::string_view expected,
                                         absl::string_view desired) override {
    return CompareSetOnce(key, expected, desired, "");
  }

  absl::StatusOr<std::string> CompareSetOnce(absl::string_view key, absl::string_view expected,
                                             absl::string_view desired, absl::string_view request_id) override {
    COLLSERVE_RETURN_IF_ERROR(ValidateKey(key));
    COLLSERVE_RETURN_IF_ERROR(ValidateValue(key, desired.size()));
    return Update(key, request_id, [&](const Current& cur) {
      // torch's compare_set (store.h).
      Outcome out;
      if (cur.exists ? cur.value == expected : expected.empty()) {
        out.kind = Outcome::kPut;
        out.value = std::string(desired);
        out.answer = out.value;
      } else {
        out.answer = cur.exists ? cur.value : std::string(expected);
      }
      return out;
    });
  }

  absl::StatusOr<bool> Check(const std::vector<std::string>& keys) override {
    COLLSERVE_RETURN_IF_ERROR(ValidateKeys(keys));
    COLLSERVE_ASSIGN_OR_RETURN(std::vector<bool> present, Exist(keys));
    return std::all_of(present.begin(), present.end(), [](bool b) { return b; });
  }

  absl::Status Wait(const std::vector<std::string>& keys, absl::Duration timeout) override {
    COLLSERVE_RETURN_IF_ERROR(ValidateKeys(keys));
    return WaitUntil(keys, absl::Now() + std::max(timeout, absl::ZeroDuration()));
  }

  absl::StatusOr<bool> DeleteKey(absl::string_view key) override {
    COLLSERVE_RETURN_IF_ERROR(ValidateKey(key));
    epb::DeleteRangeRequest req;
    req.set_key(Full(key));
    epb::DeleteRangeResponse resp;
    auto ctx = Context();
    COLLSERVE_RETURN_IF_ERROR(FromEtcd(kv_->DeleteRange(ctx.get(), req, &resp), "DeleteRange"));
    return resp.deleted() > 0;
  }

  absl::StatusOr<bool> DeleteKeyOnce(absl::string_view key, absl::string_view request_id) override {
    if (request_id.empty()) return DeleteKey(key);
    COLLSERVE_RETURN_IF_ERROR(ValidateKey(key));
    COLLSERVE_ASSIGN_OR_RETURN(std::string answer, Update(key, request_id, [](const Current& cur) {
      Outcome out;
      out.answer = cur.exists ? "1" : "0";
      if (cur.exists) out.kind = Outcome::kDelete;
      return out;
    }));
    return answer == "1";
  }

  absl::StatusOr<int64_t> NumKeys(absl::string_view prefix) override {
    epb::RangeRequest req;
    req.set_key(Full(prefix));
    req.set_range_end(EtcdPrefixEnd(Full(prefix)));
    req.set_count_only(true);
    epb::RangeResponse resp;
    auto ctx = Context();
    COLLSERVE_RETURN_IF_ERROR(FromEtcd(kv_->Range(ctx.get(), req, &resp), "Range"));
    return resp.count();
  }

  absl::StatusOr<std::vector<std::string>> MultiGet(const std::vector<std::string>& keys,
                                                    absl::Duration timeout) override {
    COLLSERVE_RETURN_IF_ERROR(ValidateKeys(keys));
    const absl::Time deadline = absl::Now() + std::max(timeout, absl::ZeroDuration());
    while (true) {
      COLLSERVE_RETURN_IF_ERROR(WaitUntil(keys, deadline));
      // One Txn per kMaxTxnOps keys, each a consistent read.
      std::vector<std::string> values;
      uint64_t bytes = 0;
      bool all = true;
      for (size_t first = 0; first < keys.size() && all; first += kMaxTxnOps) {
        epb::TxnRequest req;
        for (size_t i = first; i < std::min(keys.size(), first + kMaxTxnOps); ++i) {
          req.add_success()->mutable_request_range()->set_key(Full(keys[i]));
        }
        epb::TxnResponse resp;
        auto ctx = Context();
        COLLSERVE_RETURN_IF_ERROR(FromEtcd(kv_->Txn(ctx.get(), req, &resp), "Txn"));
        for (const epb::ResponseOp& op : resp.responses()) {
          if (op.response_range().kvs_size() == 0) {
            all = false;  // deleted since the wait: wait again
            break;
          }
          bytes += op.response_range().kvs(0).value().size();
          if (bytes > store::kMaxMultiGetBytes) return store::MultiGetTooLarge(keys.size(), bytes);
          values.push_back(op.response_range().kvs(0).value());
        }
      }
      if (all) return values;
    }
  }

  absl::Status MultiSet(const std::vector<std::string>& keys, const std::vector<std::string>& values) override {
    if (keys.size() != values.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("multi_set got ", keys.size(), " keys and ", values.size(), " values"));
    }
    if (keys.size() > static_cast<size_t>(kMaxTxnOps)) {
      return absl::InvalidArgumentError(absl::StrCat("multi_set of ", keys.size(), " keys: the etcd store writes at most ",
                                                     kMaxTxnOps, " at once (etcd's --max-txn-ops)"));
    }
    COLLSERVE_RETURN_IF_ERROR(ValidateKeys(keys));
    for (size_t i = 0; i < keys.size(); ++i) COLLSERVE_RETURN_IF_ERROR(ValidateValue(keys[i], values[i].size()));
    if (keys.empty()) return absl::OkStatus();
    epb::TxnRequest req;
    for (size_t i = 0; i < keys.size(); ++i) {
      epb::PutRequest* put = req.add_success()->mutable_request_put();
      put->set_key(Full(keys[i]));
      put->set_value(values[i]);
    }
    epb::TxnResponse resp;
    auto ctx = Context();
    return FromEtcd(kv_->Txn(ctx.get(), req, &resp), "Txn");
  }

  absl::Status Append(absl::string_view key, absl::string_view value) override { return AppendOnce(key, value, ""); }

  absl::Status AppendOnce(absl::string_view key, absl::string_view value, absl::string_view request_id) override {
    COLLSERVE_RETURN_IF_ERROR(ValidateKey(key));
    absl::Status error;
    return Update(
               key, request_id,
               [&](const Current& cur) {
                 Outcome out;
                 const size_t size = cur.value.size() + value.size();
                 if (size > static_cast<uint64_t>(options_.max_value_bytes)) {
                   error = absl::InvalidArgumentError(absl::StrCat("value for key ", Quote(key), " would be ", size,
                                                                   " bytes; the limit is ", options_.max_value_bytes));
                   return out;
                 }
                 out.kind = Outcome::kPut;
                 out.value = absl::StrCat(cur.value, value);
                 return out;
               },
               &error)
        .status();
  }

  store::WaitId WaitAsync(const std::vector<std::string>& keys, absl::Time deadline, WaitCallback done) override {
    if (absl::Status s = ValidateKeys(keys); !s.ok()) {
      std::move(done)(s);
      return 0;
    }
    std::set<std::string> missing;
    for (const std::string& k : keys) missing.insert(Full(k));
    if (missing.empty()) {
      std::move(done)(absl::OkStatus());
      return 0;
    }
    // Registered before the keys are read: a Put after the read reaches it through the watch.
    store::WaitId id;
    {
      absl::MutexLock lock(&mu_);
      if (stop_) {
        std::move(done)(absl::UnavailableError("the store is shutting down"));
        return 0;
      }
      id = next_wait_id_++;
      Waiter& w = waiters_[id];
      w.keys = keys;
      w.missing = missing;
      w.start = absl::Now();
      w.deadline = deadline;
      w.done = std::move(done);
      for (const std::string& k : missing) key_waiters_.emplace(k, id);
      waiters_changed_ = true;  // the timer looks at its deadline
    }
    Recheck({id});
    {
      // Its first read is done (a deadline already past is judged after it, not before).
      absl::MutexLock lock(&mu_);
      auto it = waiters_.find(id);
      if (it != waiters_.end()) it->second.read = true;
      waiters_changed_ = true;
    }
    return id;
  }

  void CancelWait(store::WaitId id) override {
    WaitCallback done;
    {
      absl::MutexLock lock(&mu_);
      auto it = waiters_.find(id);
      if (it == waiters_.end()) return;
      done = RemoveLocked(it);
    }
    std::move(done)(absl::CancelledError("wait cancelled"));
  }

  absl::StatusOr<std::vector<std::string>> ListKeys(absl::string_view prefix, absl::string_view start_after,
                                                    int64_t limit, bool* more) override {
    if (limit < 1 || limit > kMaxListKeys) {
      return absl::InvalidArgumentError(absl::StrCat("limit ", limit, " must be in [1, ", kMaxListKeys, "]"));
    }
    epb::RangeRequest req;
    std::string from = Full(prefix);
    if (!start_after.empty()) from = std::max(from, absl::StrCat(Full(start_after), std::string(1, '\0')));
    req.set_key(from);
    req.set_range_end(EtcdPrefixEnd(Full(prefix)));
    req.set_limit(limit);
    req.set_keys_only(true);
    req.set_sort_order(epb::RangeRequest::ASCEND);
    req.set_sort_target(epb::RangeRequest::KEY);
    epb::RangeResponse resp;
    auto ctx = Context();
    COLLSERVE_RETURN_IF_ERROR(FromEtcd(kv_->Range(ctx.get(), req, &resp), "Range"));
    std::vector<std::string> keys;
    for (const auto& kv : resp.kvs()) keys.push_back(kv.key().substr(kv_prefix_.size()));
    if (more != nullptr) *more = resp.more();
    return keys;
  }

  Stats GetStats() override {
    Stats s;
    absl::StatusOr<int64_t> keys = NumKeys("");
    if (keys.ok()) s.keys = *keys;
    absl::MutexLock lock(&mu_);
    s.pending_waits = static_cast<int64_t>(waiters_.size());
    return s;
  }

 private:
  struct Waiter {
    std::vector<std::string> keys;   // as asked (for the timeout's message)
    std::set<std::string> missing;   // full etcd keys not yet seen
    absl::Time start;
    absl::Time deadline;
    WaitCallback done;
    bool read = false;  // its keys were read once since it was registered
  };

  std::string Full(absl::string_view key) const { return absl::StrCat(kv_prefix_, key); }

  std::unique_ptr<grpc::ClientContext> Context() const {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->set_deadline(absl::ToChronoTime(absl::Now() + options_.call_timeout));
    return ctx;
  }

  absl::Status FromEtcd(const grpc::Status& s, absl::string_view call) const {
    if (s.ok()) return absl::OkStatus();
    if (s.error_code() == grpc::StatusCode::UNAVAILABLE || s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
      return absl::UnavailableError(absl::StrCat("etcd at ", target_, " did not answer ", call, " within ",
                                                 absl::FormatDuration(options_.call_timeout), ": ",
                                                 s.error_message()));
    }
    absl::Status st = FromGrpcStatus(s);
    return absl::Status(st.code(), absl::StrCat("etcd ", call, ": ", st.message()));
  }

  absl::Status ValidateKey(absl::string_view key) const {
    if (key.empty()) return absl::InvalidArgumentError("key is empty");
    if (static_cast<int64_t>(key.size()) > options_.max_key_bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("key ", Quote(key), " is ", key.size(), " bytes; the limit is ", options_.max_key_bytes));
    }
    return absl::OkStatus();
  }
  absl::Status ValidateKeys(const std::vector<std::string>& keys) const {
    COLLSERVE_RETURN_IF_ERROR(store::CheckKeyCount(keys.size(), "a request"));
    for (const std::string& key : keys) COLLSERVE_RETURN_IF_ERROR(ValidateKey(key));
    return absl::OkStatus();
  }
  absl::Status ValidateValue(absl::string_view key, size_t bytes) const {
    if (bytes > static_cast<uint64_t>(options_.max_value_bytes)) {
      return absl::InvalidArgumentError(absl::StrCat("value for key ", Quote(key), " is ", bytes,
                                                     " bytes; the limit is ", options_.max_value_bytes));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<Current> Read(absl::string_view key) {
    epb::RangeRequest req;
    req.set_key(Full(key));
    epb::RangeResponse resp;
    auto ctx = Context();
    COLLSERVE_RETURN_IF_ERROR(FromEtcd(kv_->Range(ctx.get(), req, &resp), "Range"));
    Current cur;
    if (resp.kvs_size() > 0) {
      cur.exists = true;
      cur.value = resp.kvs(0).value();
      cur.mod_revision = resp.kvs(0).mod_revision();
    }
    return cur;
  }

  // Whether each key exists now (one consistent read per kMaxTxnOps keys).
  absl::StatusOr<std::vector<bool>> Exist(const std::vector<std::string>& keys) {
    std::vector<bool> present;
    for (size_t first = 0; first < keys.size(); first += kMaxTxnOps) {
      epb::TxnRequest req;
      for (size_t i = first; i < std::min(keys.size(), first + kMaxTxnOps); ++i) {
        epb::RangeRequest* range = req.add_success()->mutable_request_range();
        range->set_key(Full(keys[i]));
        range->set_count_only(true);
      }
      epb::TxnResponse resp;
      auto ctx = Context();
      COLLSERVE_RETURN_IF_ERROR(FromEtcd(kv_->Txn(ctx.get(), req, &resp), "Txn"));
      for (const epb::ResponseOp& op : resp.responses()) present.push_back(op.response_range().count() > 0);
    }
    return present;
  }

  // The lease that request ids attach to: a new one each half TTL, so that an id lives for
  // between half and all of request_id_ttl.
  absl::StatusOr<int64_t> RequestLease() {
    absl::MutexLock lock(&lease_mu_);
    const absl::Time now = absl::Now();
    if (lease_id_ != 0 && now < lease_granted_ + options_.request_id_ttl / 2) return lease_id_;
    epb::LeaseGrantRequest req;
    req.set_ttl(std::max<int64_t>(1, absl::ToInt64Seconds(options_.request_id_ttl)));
    epb::LeaseGrantResponse resp;
    auto ctx = Context();
    COLLSERVE_RETURN_IF_ERROR(FromEtcd(lease_->LeaseGrant(ctx.get(), req, &resp), "LeaseGrant"));
    if (!resp.error().empty()) return absl::UnavailableError(absl::StrCat("etcd LeaseGrant: ", resp.error()));
    lease_id_ = resp.id();
    lease_granted_ = now;
    return lease_id_;
  }

  // Read-modify-write of `key` (see the header): `compute` decides from the key as read;
  // an error it leaves in *error is returned as is. With a request id, a remembered answer
  // is returned without calling `compute`, and a write remembers its answer.
  absl::StatusOr<std::string> Update(absl::string_view key, absl::string_view request_id,
                                     const std::function<Outcome(const Current&)>& compute,
                                     absl::Status* error = nullptr) {
    const std::string full = Full(key);
    const std::string req_key = absl::StrCat(req_prefix_, request_id);
    const absl::Time deadline = absl::Now() + options_.call_timeout;
    for (int attempt = 1;; ++attempt) {
      // The key and the request id's answer, at one revision.
      epb::TxnRequest read;
      read.add_success()->mutable_request_range()->set_key(full);
      if (!request_id.empty()) read.add_success()->mutable_request_range()->set_key(req_key);
      epb::TxnResponse got;
      auto ctx = Context();
      COLLSERVE_RETURN_IF_ERROR(FromEtcd(kv_->Txn(ctx.get(), read, &got), "Txn"));
      if (!request_id.empty() && got.responses_size() == 2 && got.responses(1).response_range().kvs_size() > 0) {
        return got.responses(1).response_range().kvs(0).value();  // applied before: its answer
      }
      Current cur;
      if (got.responses_size() > 0 && got.responses(0).response_range().kvs_size() > 0) {
        const auto& kv = got.responses(0).response_range().kvs(0);
        cur.exists = true;
        cur.value = kv.value();
        cur.mod_revision = kv.mod_revision();
      }
      Outcome out = compute(cur);
      if (error != nullptr && !error->ok()) return *error;
      if (out.kind == Outcome::kNone) return out.answer;
      if (out.kind == Outcome::kPut) COLLSERVE_RETURN_IF_ERROR(ValidateValue(key, out.value.size()));
      epb::TxnRequest write;
      epb::Compare* same = write.add_compare();
      same->set_key(full);
      same->set_result(epb::Compare::EQUAL);
      if (cur.exists) {
        same->set_target(epb::Compare::MOD);
        same->set_mod_revision(cur.mod_revision);
      } else {
        same->set_target(epb::Compare::CREATE);
        same->set_create_revision(0);
      }
      if (out.kind == Outcome::kPut) {
        epb::PutRequest* put = write.add_success()->mutable_request_put();
        put->set_key(full);
        put->set_value(out.value);
      } else {
        write.add_success()->mutable_request_delete_range()->set_key(full);
      }
      if (!request_id.empty()) {
        COLLSERVE_ASSIGN_OR_RETURN(int64_t lease, RequestLease());
        epb::Compare* fresh = write.add_compare();
        fresh->set_key(req_key);
        fresh->set_result(epb::Compare::EQUAL);
        fresh->set_target(epb::Compare::CREATE);
        fresh->set_create_revision(0);
        epb::PutRequest* remember = write.add_success()->mutable_request_put();
        remember->set_key(req_key);
        remember->set_value(out.answer);
        remember->set_lease(lease);
      }
      epb::TxnResponse wrote;
      auto wctx = Context();
      COLLSERVE_RETURN_IF_ERROR(FromEtcd(kv_->Txn(wctx.get(), write, &wrote), "Txn"));
      if (wrote.succeeded()) return out.answer;
      if (absl::Now() >= deadline) {
        return absl::AbortedError(absl::StrCat("key ", Quote(key), " changed under ", attempt,
                                               " read-modify-write attempts within ",
                                               absl::FormatDuration(options_.call_timeout)));
      }
    }
  }

  absl::Status TimedOut(const std::vector<std::string>& keys, absl::Time start, absl::Time deadline,
                        const std::set<std::string>* missing_full = nullptr) const {
    std::vector<std::string> listed;
    size_t missing = 0;
    for (const std::string& k : keys) {
      if (missing_full != nullptr && missing_full->count(Full(k)) == 0) continue;
      ++missing;
      if (listed.size() < kMaxListedKeys) listed.push_back(Quote(k));
    }
    std::string list = absl::StrJoin(listed, ", ");
    if (missing > listed.size()) absl::StrAppend(&list, ", ... and ", missing - listed.size(), " more");
    const absl::Duration waited = absl::Ceil(std::max(deadline - start, absl::ZeroDuration()), absl::Milliseconds(1));
    return absl::DeadlineExceededError(
        absl::StrCat("wait timed out after ", absl::FormatDuration(waited), "; missing keys: [", list, "]"));
  }

  // Blocks until every key was seen to exist or `deadline` (DEADLINE_EXCEEDED naming the
  // missing keys).
  absl::Status WaitUntil(const std::vector<std::string>& keys, absl::Time deadline) {
    struct Result {
      absl::Mutex mu;
      bool done ABSL_GUARDED_BY(mu) = false;
      absl::Status status ABSL_GUARDED_BY(mu);
    };
    auto result = std::make_shared<Result>();
    WaitAsync(keys, deadline, [result](absl::Status s) {
      absl::MutexLock lock(&result->mu);
      result->status = std::move(s);
      result->done = true;
    });
    absl::MutexLock lock(&result->mu);
    result->mu.Await(absl::Condition(&result->done));
    return result->status;
  }

  WaitCallback RemoveLocked(std::map<store::WaitId, Waiter>::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const std::string& k : it->second.missing) {
      auto [b, e] = key_waiters_.equal_range(k);
      for (auto i = b; i != e; ++i) {
        if (i->second == it->first) {
          key_waiters_.erase(i);
          break;
        }
      }
    }
    WaitCallback done = std::move(it->second.done);
    waiters_.erase(it);
    return done;
  }

  // `key` (full) exists: it is no longer missing for any wait; the finished ones are moved
  // to *ready.
  void SeenLocked(const std::string& key, std::vector<WaitCallback>* ready) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto [b, e] = key_waiters_.equal_range(key);
    std::vector<store::WaitId> ids;
    for (auto i = b; i != e; ++i) ids.push_back(i->second);
    key_waiters_.erase(b, e);
    for (store::WaitId id : ids) {
      auto it = waiters_.find(id);
      if (it == waiters_.end()) continue;
      it->second.missing.erase(key);
      if (it->second.missing.empty()) ready->push_back(RemoveLocked(it));
    }
  }

  // Reads the missing keys of waits `ids` (every wait when empty) and finishes those whose
  // keys all exist. A failed read leaves them to the watch and their deadline.
  void Recheck(std::vector<store::WaitId> ids) {
    std::vector<std::string> keys;  // short keys, as the store's callers name them
    {
      absl::MutexLock lock(&mu_);
      if (ids.empty()) {
        for (const auto& [id, w] : waiters_) ids.push_back(id);
      }
      std::set<std::string> all;
      for (store::WaitId id : ids) {
        auto it = waiters_.find(id);
        if (it == waiters_.end()) continue;
        for (const std::string& k : it->second.missing) all.insert(k.substr(kv_prefix_.size()));
      }
      keys.assign(all.begin(), all.end());
    }
    if (keys.empty()) return;
    absl::StatusOr<std::vector<bool>> present = Exist(keys);
    if (!present.ok()) return;
    std::vector<WaitCallback> ready;
    {
      absl::MutexLock lock(&mu_);
      for (size_t i = 0; i < keys.size(); ++i) {
        if ((*present)[i]) SeenLocked(Full(keys[i]), &ready);
      }
    }
    for (auto& done : ready) std::move(done)(absl::OkStatus());
  }

  // The store's watch: every Put under kv_prefix_, from the time the stream is created;
  // each time a stream is (re)created, every pending wait reads its keys again, so the Puts
  // made while no stream ran are not missed either.
  void WatchLoop() {
    absl::Duration backoff = absl::Milliseconds(50);
    while (true) {
      auto ctx = std::make_shared<grpc::ClientContext>();
      ctx->AddMetadata("hasleader", "true");  // etcd ends the stream when its member loses the leader
      {
        absl::MutexLock lock(&mu_);
        if (stop_) return;
        watch_ctx_ = ctx;
      }
      auto stream = watch_->Watch(ctx.get());
      epb::WatchRequest create;
      epb::WatchCreateRequest* c = create.mutable_create_request();
      c->set_key(kv_prefix_);
      c->set_range_end(EtcdPrefixEnd(kv_prefix_));
      c->add_filters(epb::WatchCreateRequest::NODELETE);
      epb::WatchResponse resp;
      if (stream->Write(create)) {
        while (stream->Read(&resp)) {
          if (resp.canceled()) break;
          if (resp.created()) {
            backoff = absl::Milliseconds(50);
            Recheck({});  // Puts while no stream ran
          }
          std::vector<WaitCallback> ready;
          {
            absl::MutexLock lock(&mu_);
            for (const auto& ev : resp.events()) {
              if (ev.type() == mvccpb::Event::PUT) SeenLocked(ev.kv().key(), &ready);
            }
          }
          for (auto& done : ready) std::move(done)(absl::OkStatus());
        }
      }
      ctx->TryCancel();
      (void)stream->Finish();
      absl::MutexLock lock(&mu_);
      watch_ctx_ = nullptr;
      if (stop_) return;
      auto stopping = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; };
      mu_.AwaitWithTimeout(absl::Condition(&stopping), backoff);
      backoff = std::min(backoff * 2, absl::Seconds(1));
    }
  }

  // Ends waits whose deadline passed (DEADLINE_EXCEEDED naming their missing keys).
  void TimerLoop() {
    while (true) {
      std::vector<std::pair<WaitCallback, absl::Status>> expired;
      {
        absl::MutexLock lock(&mu_);
        if (stop_) return;
        const absl::Time now = absl::Now();
        absl::Time next = now + absl::Milliseconds(100);
        for (auto it = waiters_.begin(); it != waiters_.end();) {
          if (!it->second.read) {
            ++it;
          } else if (it->second.deadline <= now) {
            absl::Status s = TimedOut(it->second.keys, it->second.start, it->second.deadline, &it->second.missing);
            auto gone = it++;
            expired.emplace_back(RemoveLocked(gone), std::move(s));
          } else {
            next = std::min(next, it->second.deadline);
            ++it;
          }
        }
        if (expired.empty()) {
          auto wake = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || waiters_changed_; };
          mu_.AwaitWithDeadline(absl::Condition(&wake), next);
          waiters_changed_ = false;
        }
      }
      for (auto& [done, s] : expired) std::move(done)(std::move(s));
    }
  }

  const EtcdStoreOptions options_;
  const std::string target_;
  const std::string kv_prefix_;
  const std::string req_prefix_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<epb::KV::Stub> kv_;
  std::unique_ptr<epb::Watch::Stub> watch_;
  std::unique_ptr<epb::Lease::Stub> lease_;

  absl::Mutex lease_mu_;
  int64_t lease_id_ ABSL_GUARDED_BY(lease_mu_) = 0;
  absl::Time lease_granted_ ABSL_GUARDED_BY(lease_mu_);

  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool waiters_changed_ ABSL_GUARDED_BY(mu_) = false;
  std::shared_ptr<grpc::ClientContext> watch_ctx_ ABSL_GUARDED_BY(mu_);
  store::WaitId next_wait_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<store::WaitId, Waiter> waiters_ ABSL_GUARDED_BY(mu_);
  std::multimap<std::string, store::WaitId> key_waiters_ ABSL_GUARDED_BY(mu_);
  std::thread watcher_;
  std::thread timer_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<store::Store>> NewEtcdStore(const EtcdStoreOptions& options) {
  if (options.endpoints.empty()) return absl::InvalidArgumentError("the etcd store needs at least one endpoint");
  if (options.max_key_bytes <= 0 || options.max_value_bytes < 0 || options.call_timeout <= absl::ZeroDuration() ||
      options.request_id_ttl < absl::Seconds(2)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "etcd store limits must be positive: max_key_bytes=", options.max_key_bytes, " max_value_bytes=",
        options.max_value_bytes, " call_timeout=", absl::FormatDuration(options.call_timeout),
        " request_id_ttl=", absl::FormatDuration(options.request_id_ttl), " (at least 2s)"));
  }
  COLLSERVE_ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel, NewEtcdChannel(options));
  auto store = std::make_unique<EtcdStore>(options, std::move(channel));
  COLLSERVE_RETURN_IF_ERROR(store->Start());
  return store;
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> NewEtcdChannel(const EtcdStoreOptions& options) {
  if (options.endpoints.empty()) return absl::InvalidArgumentError("the etcd store needs at least one endpoint");
  grpc::ChannelArguments args;
  // A connection that went silent (a partitioned member) is found within about 15 s
  // (etcd's server permits pings every 5 s: --grpc-keepalive-min-time).
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, 64 << 20);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  const std::string target = AllIpv4Literals(options.endpoints)
                                 ? absl::StrCat("ipv4:", absl::StrJoin(options.endpoints, ","))
                                 : options.endpoints.front();
  std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
  if (!options.ca_file.empty() || !options.cert_file.empty() || !options.key_file.empty()) {
    if (options.ca_file.empty() || options.cert_file.empty() != options.key_file.empty()) {
      return absl::InvalidArgumentError(
          "etcd TLS needs a CA file, and a client certificate and its key together (or neither)");
    }
    grpc::SslCredentialsOptions ssl;
    COLLSERVE_ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadPem("etcd CA file", options.ca_file));
    if (!options.cert_file.empty()) {
      COLLSERVE_ASSIGN_OR_RETURN(ssl.pem_cert_chain, ReadPem("etcd client certificate", options.cert_file));
      COLLSERVE_ASSIGN_OR_RETURN(ssl.pem_private_key, ReadPem("etcd client key", options.key_file));
    }
    credentials = grpc::SslCredentials(ssl);
  }
  return grpc::CreateCustomChannel(target, credentials, args);
}

}  // namespace collserve::server
