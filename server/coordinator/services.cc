#include "server/coordinator/services.h"

#include "server/coordinator/job_policies.h"

#include <glog/logging.h>

#include <algorithm>
#include <map>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "server/common/ledger_proto.h"
#include "server/coordinator/ledger.h"
#include "server/common/waiting_reactor.h"

namespace collserve::server {
namespace {

namespace pb = ::collserve::v1;

// Keys of job J are stored as "J/<key>"; job names cannot contain '/', so namespaces never
// overlap.
std::string NsKey(const std::string& job, const std::string& key) {
  return absl::StrCat(JobOf(job), "/", key);
}

std::vector<std::string> NsKeys(const std::string& job,
                                const google::protobuf::RepeatedPtrField<std::string>& keys) {
  std::vector<std::string> out;
  out.reserve(keys.size());
  for (const auto& k : keys) out.push_back(NsKey(job, k));
  return out;
}

absl::Status CheckKey(const std::string& key) {
  if (key.empty()) return absl::InvalidArgumentError("empty key");
  return absl::OkStatus();
}

// Longest request id of an exactly-once write (store.proto, AddRequest.request_id).
constexpr size_t kMaxRequestIdBytes = 64;

// CheckKey, plus the request id's size. The store remembers ids per job: "<job>/<id>".
absl::Status CheckKeyAndRequestId(const std::string& key, const std::string& request_id) {
  if (request_id.size() > kMaxRequestIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat("request_id of ", request_id.size(), " bytes; at most ",
                                                   kMaxRequestIdBytes, " are accepted"));
  }
  return CheckKey(key);
}
std::string RequestKey(const std::string& job, const std::string& request_id) {
  return request_id.empty() ? std::string() : NsKey(job, request_id);
}

// Where a wait ends: the request's timeout (0 = default, < 0 = now), capped by the call's
// own deadline.
absl::Time WaitDeadline(grpc::CallbackServerContext* ctx, int64_t timeout_ms) {
  absl::Time deadline;
  if (timeout_ms == 0) deadline = absl::Now() + kDefaultWaitTimeout;
  else if (timeout_ms < 0) deadline = absl::Now();
  else deadline = absl::Now() + absl::Milliseconds(timeout_ms);
  const absl::Time call_deadline = absl::FromChrono(ctx->deadline());
  return std::min(deadline, call_deadline);
}

// Error messages from the store name namespaced keys; strip the "job/" prefix.
absl::Status StripJob(const absl::Status& s, const std::string& job) {
  if (s.ok()) return s;
  std::string msg(s.message());
  const std::string prefix = absl::StrCat("\"", JobOf(job), "/");
  for (size_t pos; (pos = msg.find(prefix)) != std::string::npos;) msg.replace(pos, prefix.size(), "\"");
  return absl::Status(s.code(), msg);
}

// Finishes a unary call now, recording it.
grpc::ServerUnaryReactor* FinishNow(grpc::CallbackServerContext* ctx, RpcMetrics& metrics, const char* method,
                                    absl::Time start, const absl::Status& status) {
  metrics.Record(method, status, absl::Now() - start);
  auto* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

}  // namespace

std::string AuthorizationOf(const grpc::CallbackServerContext& ctx) {
  const auto& md = ctx.client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) return "";
  return std::string(it->second.data(), it->second.size());
}

absl::Status AuthorizeJob(const grpc::CallbackServerContext& ctx, const JobCredentials& credentials,
                          const std::string& job) {
  if (absl::Status s = ValidateJob(job); !s.ok()) return s;
  return credentials.Authorize(AuthorizationOf(ctx), job).status();
}

grpc::ServerUnaryReactor* StoreService::Done(grpc::CallbackServerContext* ctx, const char* method,
                                             absl::Time start, const absl::Status& status) {
  return FinishNow(ctx, metrics_, method, start, status);
}

grpc::ServerUnaryReactor* StoreService::Write(grpc::CallbackServerContext* ctx, const char* method,
                                              absl::Time start, const std::string& job,
                                              absl::AnyInvocable<absl::Status() &&> write) {
  if (writes_ == nullptr) return Done(ctx, method, start, StripJob(std::move(write)(), job));
  auto* reactor = ctx->DefaultReactor();
  writes_->Run([this, reactor, method, start, job, write = std::move(write)]() mutable {
    const absl::Status s = StripJob(std::move(write)(), job);
    metrics_.Record(method, s, absl::Now() - start);
    reactor->Finish(ToGrpcStatus(s));
  });
  return reactor;
}

grpc::ServerUnaryReactor* StoreService::WaitThen(grpc::CallbackServerContext* ctx, const char* method,
                                                 const std::string& job,
                                                 const std::vector<std::string>& keys,
                                                 int64_t timeout_ms,
                                                 std::function<absl::Status()> then) {
  const absl::Time start = absl::Now();
  auto* reactor = new WaitingReactor();
  store::WaitId id = store_.WaitAsync(
      keys, WaitDeadline(ctx, timeout_ms),
      [this, reactor, method, start, job, then = std::move(then)](absl::Status s) mutable {
        auto finish = [this, reactor, method, start, job](absl::Status s) {
          s = StripJob(s, job);
          metrics_.Record(method, s, absl::Now() - start);
          reactor->Finish(ToGrpcStatus(s));
        };
        if (s.ok() && store_.ReadsMayBlock() && writes_ != nullptr) {
          // The etcd store's reads are etcd calls (seconds, at worst): not on the one thread
          // that wakes every job's waiters, which this callback runs on.
          writes_->Run([then = std::move(then), finish]() mutable { finish(then()); });
          return;
        }
        if (s.ok()) s = then();
        finish(std::move(s));
      });
  store::Store* store = &store_;
  reactor->SetCancel([store, id] { store->CancelWait(id); });
  reactor->Started();
  return reactor;
}

grpc::ServerUnaryReactor* StoreService::Set(grpc::CallbackServerContext* ctx, const pb::SetRequest* req,
                                            pb::SetResponse*) {
  const absl::Time start = absl::Now();
  absl::Status s = AuthorizeJob(*ctx, credentials_, req->job());
  if (s.ok()) s = CheckKey(req->key());
  if (!s.ok()) return Done(ctx, "Set", start, s);
  return Write(ctx, "Set", start, req->job(), [this, req] { return store_.Set(NsKey(req->job(), req->key()), req->value()); });
}

grpc::ServerUnaryReactor* StoreService::Get(grpc::CallbackServerContext* ctx, const pb::GetRequest* req,
                                            pb::GetResponse* resp) {
  const absl::Time start = absl::Now();
  absl::Status s = AuthorizeJob(*ctx, credentials_, req->job());
  if (s.ok()) s = CheckKey(req->key());
  if (!s.ok()) return Done(ctx, "Get", start, s);
  const std::string key = NsKey(req->job(), req->key());
  return WaitThen(ctx, "Get", req->job(), {key}, req->timeout_ms(), [this, key, resp] {
    absl::StatusOr<std::string> v = store_.Get(key, absl::ZeroDuration());
    if (!v.ok()) return v.status();
    resp->set_value(std::move(*v));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* StoreService::Add(grpc::CallbackServerContext* ctx, const pb::AddRequest* req,
                                            pb::AddResponse* resp) {
  const absl::Time start = absl::Now();
  absl::Status s = AuthorizeJob(*ctx, credentials_, req->job());
  if (s.ok()) s = CheckKeyAndRequestId(req->key(), req->request_id());
  if (!s.ok()) return Done(ctx, "Add", start, s);
  return Write(ctx, "Add", start, req->job(), [this, req, resp] {
    absl::StatusOr<int64_t> v =
        store_.AddOnce(NsKey(req->job(), req->key()), req->delta(), RequestKey(req->job(), req->request_id()));
    if (v.ok()) resp->set_value(*v);
    return v.status();
  });
}

grpc::ServerUnaryReactor* StoreService::CompareSet(grpc::CallbackServerContext* ctx,
                                                   const pb::CompareSetRequest* req,
                                                   pb::CompareSetResponse* resp) {
  const absl::Time start = absl::Now();
  absl::Status s = AuthorizeJob(*ctx, credentials_, req->job());
  if (s.ok()) s = CheckKeyAndRequestId(req->key(), req->request_id());
  if (!s.ok()) return Done(ctx, "CompareSet", start, s);
  return Write(ctx, "CompareSet", start, req->job(), [this, req, resp] {
    absl::StatusOr<std::string> v = store_.CompareSetOnce(NsKey(req->job(), req->key()), req->expected(),
                                                          req->desired(), RequestKey(req->job(), req->request_id()));
    if (v.ok()) resp->set_value(std::move(*v));
    return v.status();
  });
}

grpc::ServerUnaryReactor* StoreService::Check(grpc::CallbackServerContext* ctx, const pb::CheckRequest* req,
                                              pb::CheckResponse* resp) {
  const absl::Time start = absl::Now();
  absl::Status s = AuthorizeJob(*ctx, credentials_, req->job());
  if (s.ok()) s = store::CheckKeyCount(static_cast<size_t>(req->keys_size()), "check");
  if (s.ok()) {
    absl::StatusOr<bool> v = store_.Check(NsKeys(req->job(), req->keys()));
    if (v.ok()) resp->set_ready(*v);
    s = v.status();
  }
  return Done(ctx, "Check", start, StripJob(s, req->job()));
}

grpc::ServerUnaryReactor* StoreService::Wait(grpc::CallbackServerContext* ctx, const pb::WaitRequest* req,
                                             pb::WaitResponse*) {
  const absl::Time start = absl::Now();
  absl::Status s = AuthorizeJob(*ctx, credentials_, req->job());
  if (s.ok()) s = store::CheckKeyCount(static_cast<size_t>(req->keys_size()), "wait");
  for (const auto& k : req->keys()) {
    if (s.ok()) s = CheckKey(k);
  }
  if (!s.ok()) return Done(ctx, "Wait", start, s);
  return WaitThen(ctx, "Wait", req->job(), NsKeys(req->job(), req->keys()), req->timeout_ms(),
                  [] { return absl::OkStatus(); });
}

grpc::ServerUnaryReactor* StoreService::DeleteKey(grpc::CallbackServerContext* ctx,
                                                  const pb::DeleteKeyRequest* req,
                                                  pb::DeleteKeyResponse* resp) {
  const absl::Time start = absl::Now();
  absl::Status s = AuthorizeJob(*ctx, credentials_, req->job());
  if (s.ok()) s = CheckKeyAndRequestId(req->key(), req->request_id());
  if (!s.ok()) return Done(ctx, "DeleteKey", start, s);
  return Write(ctx, "DeleteKey", start, req->job(), [this, req, resp] {
    absl::StatusOr<bool> v =
        store_.DeleteKeyOnce(NsKey(req->job(), req->key()), RequestKey(req->job(), req->request_id()));
    if (v.ok()) resp->set_deleted(*v);
    return v.status();
  });
}

grpc::ServerUnaryReactor* StoreService::NumKeys(grpc::CallbackServerContext* ctx,
                                                const pb::NumKeysRequest* req, pb::NumKeysResponse* resp) {
  const absl::Time start = absl::Now();
  absl::Status s = AuthorizeJob(*ctx, credentials_, req->job());
  if (s.ok()) {
    absl::StatusOr<int64_t> v = store_.NumKeys(absl::StrCat(JobOf(req->job()), "/", req->prefix()));
    if (v.ok()) resp->set_count(*v);
    s = v.status();
  }
  return Done(ctx, "NumKeys", start, s);
}

grpc::ServerUnaryReactor* StoreService::ListKeys(grpc::CallbackServerContext* ctx, const pb::ListKeysRequest* req,
                                                 pb::ListKeysResponse* resp) {
  const absl::Time start = absl::Now();
  absl::Status s = AuthorizeJob(*ctx, credentials_, req->job());
  if (s.ok()) {
    const std::string ns = absl::StrCat(JobOf(req->job()), "/");
    bool more = false;
    absl::StatusOr<std::vector<std::string>> keys =
        store_.ListKeys(absl::StrCat(ns, req->prefix()), req->start_after().empty() ? "" : absl::StrCat(ns, req->start_after()),
                        req->limit() == 0 ? 1000 : req->limit(), &more);
    if (keys.ok()) {
      for (const std::string& k : *keys) resp->add_keys(k.substr(ns.size()));
      resp->set_more(more);
    }
    s = keys.status();
  }
  return Done(ctx, "ListKeys", start, s);
}

grpc::ServerUnaryReactor* StoreService::MultiGet(grpc::CallbackServerContext* ctx,
                                                 const pb::MultiGetRequest* req,
                                                 pb::MultiGetResponse* resp) {
  const absl::Time start = absl::Now();
  absl::Status s = AuthorizeJob(*ctx, credentials_, req->job());
  if (s.ok()) s = store::CheckKeyCount(static_cast<size_t>(req->keys_size()), "multi_get");
  for (const auto& k : req->keys()) {
    if (s.ok()) s = CheckKey(k);
  }
  if (!s.ok()) return Done(ctx, "MultiGet", start, s);
  std::vector<std::string> keys = NsKeys(req->job(), req->keys());
  return WaitThen(ctx, "MultiGet", req->job(), keys, req->timeout_ms(), [this, keys, resp] {
    absl::StatusOr<std::vector<std::string>> v = store_.MultiGet(keys, absl::ZeroDuration());
    if (!v.ok()) return v.status();
    for (auto& value : *v) resp->add_values(std::move(value));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* StoreService::MultiSet(grpc::CallbackServerContext* ctx,
                                                 const pb::MultiSetRequest* req, pb::MultiSetResponse*) {
  const absl::Time start = absl::Now();
  absl::Status s = AuthorizeJob(*ctx, credentials_, req->job());
  if (s.ok()) s = store::CheckKeyCount(static_cast<size_t>(req->keys_size()), "multi_set");
  for (const auto& k : req->keys()) {
    if (s.ok()) s = CheckKey(k);
  }
  if (s.ok() && req->keys_size() != req->values_size()) {
    s = absl::InvalidArgumentError(absl::StrCat("multi_set got ", req->keys_size(), " keys and ",
                                                req->values_size(), " values"));
  }
  if (!s.ok()) return Done(ctx, "MultiSet", start, s);
  return Write(ctx, "MultiSet", start, req->job(), [this, req] {
    return store_.MultiSet(NsKeys(req->job(), req->keys()),
                           std::vector<std::string>(req->values().begin(), req->values().end()));
  });
}

grpc::ServerUnaryReactor* StoreService::Append(grpc::CallbackServerContext* ctx,
                                               const pb::AppendRequest* req, pb::AppendResponse*) {
  const absl::Time start = absl::Now();
  absl::Status s = AuthorizeJob(*ctx, credentials_, req->job());
  if (s.ok()) s = CheckKeyAndRequestId(req->key(), req->request_id());
  if (!s.ok()) return Done(ctx, "Append", start, s);
  return Write(ctx, "Append", start, req->job(), [this, req] {
    return store_.AppendOnce(NsKey(req->job(), req->key()), req->value(), RequestKey(req->job(), req->request_id()));
  });
}

// ---- Registry ----

namespace {

void ToProto(const MemberInfo& m, pb::Member* out) {
  out->set_rank(m.rank);
  out->set_host_id(m.host_id);
  out->set_host_address(m.host_address);
  out->set_sidecar_address(m.sidecar_address);
  out->set_incarnation(m.incarnation);
  out->set_backend(m.backend);
  out->set_rendezvous_ids(m.rendezvous_ids);
}

// Longest host_id and host_address a member may name, in bytes: each is stored with every
// rank and copied into every joiner's answer.
constexpr size_t kMaxMemberFieldBytes = 256;

// OK, or INVALID_ARGUMENT naming the field of `m` longer than kMaxMemberFieldBytes or
// holding an ASCII control character (they are printed in collservectl's tables).
absl::Status ValidateMember(const pb::Member& m) {
  for (const auto& [field, value] : {std::pair<const char*, const std::string*>{"host_id", &m.host_id()},
                                     {"host_address", &m.host_address()}}) {
    if (value->size() > kMaxMemberFieldBytes) {
      return absl::InvalidArgumentError(absl::StrCat("member's ", field, " of ", value->size(),
                                                     " bytes is longer than the limit (", kMaxMemberFieldBytes,
                                                     " bytes)"));
    }
    if (std::any_of(value->begin(), value->end(),
                    [](char c) { return static_cast<unsigned char>(c) < 0x20 || c == 0x7f; })) {
      return absl::InvalidArgumentError(
          absl::StrCat("member's ", field, " \"", absl::CHexEscape(*value), "\" holds a control character"));
    }
  }
  return absl::OkStatus();
}

MemberInfo MemberOf(const pb::Member& m) {
  MemberInfo out;
  out.rank = m.rank();
  out.host_id = m.host_id();
  out.host_address = m.host_address();
  out.sidecar_address = m.sidecar_address().substr(0, 256);
  out.incarnation = m.incarnation();
  out.backend = m.backend().substr(0, 32);
  out.rendezvous_ids = m.rendezvous_ids();
  return out;
}

void ToProto(const GroupView& v, pb::GroupInfo* out) {
  out->set_group(v.group);
  out->set_world_size(v.world_size);
  out->set_generation(v.generation);
  out->set_state(v.state);
  for (const auto& m : v.members) ToProto(m, out->add_members());
}

}  // namespace

// The async stub's methods, through which a replica forwards Registry calls to the leader.
using RegistryAsync = pb::Registry::StubInterface::async_interface;

template <typename Req, typename Resp>
grpc::ServerUnaryReactor* RegistryService::Forwarded(grpc::CallbackServerContext* ctx, const char* method,
                                                     const Req* req, Resp* resp, ForwardCall<Req, Resp> call) {
  if (replication_ == nullptr) return nullptr;
  const bool forwarded = ctx->client_metadata().count(RegistryReplication::kForwardedHeader) > 0;
  absl::StatusOr<std::shared_ptr<pb::Registry::Stub>> leader = replication_->Route(forwarded);
  if (leader.ok() && *leader == nullptr) return nullptr;  // this replica leads
  const absl::Time start = absl::Now();
  if (!leader.ok()) return FinishNow(ctx, metrics_, method, start, leader.status());
  struct Forward {
    grpc::ClientContext ctx;
    std::shared_ptr<pb::Registry::Stub> stub;
  };
  auto forward = std::make_shared<Forward>();
  forward->stub = *std::move(leader);
  // The caller's deadline and credentials; no wait_for_ready, so that a call to a leader
  // that just died fails at once (UNAVAILABLE) and its caller retries with a fresh route.
  forward->ctx.set_deadline(ctx->deadline());
  if (const std::string authorization = AuthorizationOf(*ctx); !authorization.empty()) {
    forward->ctx.AddMetadata("authorization", authorization);
  }
  forward->ctx.AddMetadata(RegistryReplication::kForwardedHeader, "1");
  auto* reactor = new WaitingReactor();
  (forward->stub->async()->*call)(&forward->ctx, req, resp, [this, reactor, forward, method, start](grpc::Status s) {
    metrics_.Record(method, FromGrpcStatus(s), absl::Now() - start);
    reactor->Finish(s);
  });
  reactor->SetCancel([forward] { forward->ctx.TryCancel(); });
  reactor->Started();
  return reactor;
}

grpc::ServerUnaryReactor* RegistryService::Join(grpc::CallbackServerContext* ctx, const pb::JoinRequest* req,
                                                pb::JoinResponse* resp) {
  if (auto* forwarded = Forwarded(ctx, "Join", req, resp, &RegistryAsync::Join)) return forwarded;
  const absl::Time start = absl::Now();
  absl::Status s = AuthorizeJob(*ctx, credentials_, req->job());
  if (s.ok()) s = ValidateMember(req->member());
  if (!s.ok()) return FinishNow(ctx, metrics_, "Join", start, s);
  const MemberInfo member = MemberOf(req->member());
  auto* reactor = new WaitingReactor();
  uint64_t id = registry_.JoinAsync(
      JobOf(req->job()), req->group(), req->world_size(), member, WaitDeadline(ctx, req->timeout_ms()),
      [this, reactor, resp, start, compact = req->compact()](absl::StatusOr<std::shared_ptr<const GroupView>> view) {
        absl::Status st = view.status();
        if (view.ok()) {
          const GroupView& v = **view;
          resp->set_generation(v.generation);
          resp->set_rendezvous_id(v.rendezvous_id);
          if (compact) {
            for (const MemberInfo& host : v.hosts) {
              pb::MemberHost* out = resp->add_hosts();
              out->set_host_id(host.host_id);
              out->set_host_address(host.host_address);
              out->set_sidecar_address(host.sidecar_address);
              out->set_backend(host.backend);
            }
            resp->mutable_rank_host()->Add(v.rank_host.begin(), v.rank_host.end());
          } else {
            for (const auto& m : v.members) ToProto(m, resp->add_members());
          }
        }
        metrics_.Record("Join", st, absl::Now() - start);
        reactor->Finish(ToGrpcStatus(st));
      },
      req->generation());
  GroupRegistry* registry = &registry_;
  reactor->SetCancel([registry, id] { registry->CancelJoin(id); });
  reactor->Started();
  return reactor;
}

grpc::ServerUnaryReactor* RegistryService::WatchGroup(grpc::CallbackServerContext* ctx,
                                                      const pb::WatchGroupRequest* req, pb::WatchGroupResponse* resp) {
  if (auto* forwarded = Forwarded(ctx, "WatchGroup", req, resp, &RegistryAsync::WatchGroup)) return forwarded;
  const absl::Time start = absl::Now();
  absl::Status s = AuthorizeJob(*ctx, credentials_, req->job());
  if (!s.ok()) return FinishNow(ctx, metrics_, "WatchGroup", start, s);
  // The membership a restarted coordinator may adopt the generation from (bounded first).
  std::vector<MemberInfo> members;
  if (req->members_size() == req->world_size() && req->world_size() <= registry_.limits().max_world_size &&
      std::all_of(req->members().begin(), req->members().end(),
                  [](const pb::Member& m) { return ValidateMember(m).ok(); })) {
    for (const pb::Member& m : req->members()) members.push_back(MemberOf(m));
  }
  auto* reactor = new WaitingReactor();
  const uint64_t id = registry_.WatchAsync(
      JobOf(req->job()), req->group(), req->generation(), req->host_id(), req->known(),
      absl::Milliseconds(req->wait_ms()), [this, reactor, resp, start](absl::StatusOr<GroupEvents> events) {
        if (events.ok()) {
          resp->set_generation(events->generation);
          resp->set_state(events->state);
          for (const Departure& d : events->departures) {
            pb::Departure* out = resp->add_departures();
            out->set_rank(d.rank);
            out->set_host_id(d.host_id);
            out->set_reason(d.reason);
            out->set_host_lost(d.host_lost);
          }
        }
        metrics_.Record("WatchGroup", events.status(), absl::Now() - start);
        reactor->Finish(ToGrpcStatus(events.status()));
      },
      members);
  GroupRegistry* registry = &registry_;
  if (id != 0) reactor->SetCancel([registry, id] { registry->CancelWatch(id); });
  reactor->Started();
  return reactor;
}

grpc::ServerUnaryReactor* RegistryService::Leave(grpc::CallbackServerContext* ctx, const pb::LeaveRequest* req,
                                                 pb::LeaveResponse* resp) {
  if (auto* forwarded = Forwarded(ctx, "Leave", req, resp, &RegistryAsync::Leave)) return forwarded;
  const absl::Time start = absl::Now();
  absl::Status s = AuthorizeJob(*ctx, credentials_, req->job());
  if (s.ok()) s = registry_.Leave(JobOf(req->job()), req->group(), req->rank(), req->generation());
  return FinishNow(ctx, metrics_, "Leave", start, s);
}

grpc::ServerUnaryReactor* RegistryService::DeleteGroup(grpc::CallbackServerContext* ctx,
                                                       const pb::DeleteGroupRequest* req,
                                                       pb::DeleteGroupResponse* resp) {
  if (auto* forwarded = Forwarded(ctx, "DeleteGroup", req, resp, &RegistryAsync::DeleteGroup)) return forwarded;
  const absl::Time start = absl::Now();
  absl::Status s = AuthorizeJob(*ctx, credentials_, req->job());
  if (s.ok()) {
    absl::StatusOr<GroupView> v =
        registry_.Delete(JobOf(req->job()), req->group(), absl::StrCat("an operator (", ctx->peer(), ")"));
    if (v.ok()) {
      resp->set_generation(v->generation);
      resp->set_state(v->state);
      resp->set_members(static_cast<int32_t>(v->members.size()));
      LOG(INFO) << "group \"" << req->group() << "\" of job \"" << JobOf(req->job()) << "\" generation "
                << v->generation << " (" << v->state << ", " << v->members.size() << " ranks) deleted by "
                << ctx->peer();
    }
    s = v.status();
  }
  return FinishNow(ctx, metrics_, "DeleteGroup", start, s);
}

grpc::ServerUnaryReactor* RegistryService::Describe(grpc::CallbackServerContext* ctx,
                                                    const pb::DescribeRequest* req,
                                                    pb::DescribeResponse* resp) {
  if (auto* forwarded = Forwarded(ctx, "Describe", req, resp, &RegistryAsync::Describe)) return forwarded;
  const absl::Time start = absl::Now();
  absl::Status s = AuthorizeJob(*ctx, credentials_, req->job());
  if (s.ok()) {
    absl::StatusOr<GroupView> v = registry_.Describe(JobOf(req->job()), req->group());
    if (v.ok()) ToProto(*v, resp->mutable_group());
    s = v.status();
  }
  return FinishNow(ctx, metrics_, "Describe", start, s);
}

grpc::ServerUnaryReactor* RegistryService::List(grpc::CallbackServerContext* ctx, const pb::ListRequest* req,
                                                pb::ListResponse* resp) {
  if (auto* forwarded = Forwarded(ctx, "List", req, resp, &RegistryAsync::List)) return forwarded;
  const absl::Time start = absl::Now();
  absl::Status s = AuthorizeJob(*ctx, credentials_, req->job());
  if (s.ok()) {
    for (const GroupView& v : registry_.List(JobOf(req->job()))) ToProto(v, resp->add_groups());
  }
  return FinishNow(ctx, metrics_, "List", start, s);
}

namespace {

RankLedger FromProto(const pb::RankProgress& p) {
  RankLedger r;
  r.rank = p.rank();
  r.issued_seq = p.issued_seq();
  r.op = p.op();
  r.dtype = p.dtype();
  r.count = p.count();
  r.root = p.root();
  r.reduce_op = p.reduce_op();
  r.issued_age = absl::Milliseconds(std::max<int64_t>(p.issued_age_ms(), 0));
  r.completed_seq = p.completed_seq();
  r.completed_age = absl::Milliseconds(std::max<int64_t>(p.completed_age_ms(), 0));
  r.completed_status = p.completed_status().substr(0, 64);
  return r;
}

void ToProto(const Straggler& s, pb::StragglerStats* out) {
  out->set_rank(s.rank);
  out->set_host_id(s.host_id);
  out->set_last_count(s.last_count);
  out->set_records(s.records);
  out->set_median_skew_us(absl::ToInt64Microseconds(s.median_skew));
}

// Bounds on a report's strings (the sidecar sends short ones; anything else is cut).
constexpr size_t kMaxReportString = 1024;

}  // namespace

grpc::ServerUnaryReactor* RegistryService::ReportProgress(grpc::CallbackServerContext* ctx,
                                                          const pb::ReportProgressRequest* req,
                                                          pb::ReportProgressResponse* resp) {
  if (auto* forwarded = Forwarded(ctx, "ReportProgress", req, resp, &RegistryAsync::ReportProgress)) return forwarded;
  const absl::Time start = absl::Now();
  absl::Status s = AuthorizeJob(*ctx, credentials_, req->job());
  HostLedger ledger;
  if (s.ok()) {
    ledger.generation = req->generation();
    ledger.state = req->state().substr(0, kMaxReportString);
    ledger.failure = req->failure().substr(0, kMaxReportString);
    ledger.draining_since_unix_ms = std::max<int64_t>(req->draining_since_unix_ms(), 0);
    for (const pb::RankProgress& r : req->ranks()) ledger.ranks.push_back(FromProto(r));
    if (static_cast<size_t>(req->records_size()) > kMaxReportedFlightRecords) {
      s = absl::InvalidArgumentError(absl::StrCat("a ledger of ", req->records_size(),
                                                  " flight records; the most one report may carry is ",
                                                  kMaxReportedFlightRecords));
    }
    for (const pb::FlightRecord& r : req->records()) ledger.records.push_back(FlightRecordFromProto(r));
  }
  if (s.ok()) {
    s = registry_.ReportProgress(JobOf(req->job()), req->group(), req->host_id(), std::move(ledger));
  }
  return FinishNow(ctx, metrics_, "ReportProgress", start, s);
}

grpc::ServerUnaryReactor* RegistryService::DiagnoseGroup(grpc::CallbackServerContext* ctx,
                                                         const pb::DiagnoseGroupRequest* req,
                                                         pb::DiagnoseGroupResponse* resp) {
  if (auto* forwarded = Forwarded(ctx, "DiagnoseGroup", req, resp, &RegistryAsync::DiagnoseGroup)) return forwarded;
  const absl::Time start = absl::Now();
  absl::Status s = AuthorizeJob(*ctx, credentials_, req->job());
  if (s.ok()) {
    auto ledgers = registry_.Ledgers(JobOf(req->job()), req->group());
    s = ledgers.status();
    if (ledgers.ok()) {
      Diagnosis d = Diagnose(ledgers->first, ledgers->second, absl::Now(), registry_.limits().straggler_threshold);
      ToProto(d.group, resp->mutable_group());
      resp->set_oldest_incomplete_seq(d.oldest_incomplete_seq);
      resp->set_oldest_incomplete_op(static_cast<pb::CollectiveOp>(d.oldest_incomplete_op));
      for (int r : d.arrived) resp->add_arrived(r);
      for (int r : d.missing) resp->add_missing(r);
      for (int r : d.unknown) resp->add_unknown(r);
      resp->set_waiting_ms(absl::ToInt64Milliseconds(d.waiting));
      resp->set_disagreement(d.disagreement);
      for (const RankDiagnosis& rd : d.ranks) {
        pb::RankDiagnosis* out = resp->add_ranks();
        out->set_rank(rd.rank);
        out->set_host_id(rd.host_id);
        out->set_reported(rd.reported);
        out->set_report_age_ms(absl::ToInt64Milliseconds(rd.report_age));
        if (rd.reported) RankProgressToProto(rd.progress, out->mutable_progress());
        out->set_host_state(rd.host_state);
        out->set_host_failure(rd.host_failure);
        out->set_host_draining_since_unix_ms(rd.host_draining_since_unix_ms);
      }
      resp->set_summary(d.summary);
      for (const Straggler& st : d.stragglers) ToProto(st, resp->add_stragglers());
    }
  }
  return FinishNow(ctx, metrics_, "DiagnoseGroup", start, s);
}

grpc::ServerUnaryReactor* RegistryService::DumpGroup(grpc::CallbackServerContext* ctx, const pb::DumpGroupRequest* req,
                                                     pb::DumpGroupResponse* resp) {
  if (auto* forwarded = Forwarded(ctx, "DumpGroup", req, resp, &RegistryAsync::DumpGroup)) return forwarded;
  const absl::Time start = absl::Now();
  absl::Status s = AuthorizeJob(*ctx, credentials_, req->job());
  if (s.ok()) {
    auto ledgers = registry_.Ledgers(JobOf(req->job()), req->group());
    s = ledgers.status();
    if (ledgers.ok()) {
      const absl::Duration threshold = registry_.limits().straggler_threshold;
      GroupDump dump = MergeFlightRecords(ledgers->first, ledgers->second, threshold);
      ToProto(dump.group, resp->mutable_group());
      std::map<int, std::string> hosts;
      for (const MemberInfo& m : dump.group.members) hosts[m.rank] = m.host_id;
      for (const FlightRecord& f : dump.records) FlightRecordToProto(f, resp->add_records(), hosts);
      for (const Straggler& st : dump.stragglers) ToProto(st, resp->add_stragglers());
      resp->set_straggler_threshold_us(absl::ToInt64Microseconds(threshold));
    }
  }
  return FinishNow(ctx, metrics_, "DumpGroup", start, s);
}

grpc::ServerUnaryReactor* RegistryService::ListJobs(grpc::CallbackServerContext* ctx, const pb::ListJobsRequest* req,
                                                    pb::ListJobsResponse* resp) {
  if (auto* forwarded = Forwarded(ctx, "ListJobs", req, resp, &RegistryAsync::ListJobs)) return forwarded;
  const absl::Time start = absl::Now();
  absl::Status s = credentials_.AuthorizeAdmin(AuthorizationOf(*ctx), "ListJobs");
  if (s.ok()) {
    std::map<std::string, pb::JobSummary> jobs;
    for (const store::Store::JobUsage& u : store_.ListJobs()) {
      pb::JobSummary& j = jobs[u.job];
      j.set_keys(u.keys);
      j.set_bytes(u.bytes);
    }
    for (const auto& [job, groups] : registry_.GroupsByJob()) jobs[job].set_groups(groups);
    for (auto& [name, j] : jobs) {
      if (absl::StartsWith(name, "#")) continue;  // the coordinator's own (minted token digests)
      j.set_job(name);
      *resp->add_jobs() = std::move(j);
    }
  }
  return FinishNow(ctx, metrics_, "ListJobs", start, s);
}

// ---- Auth ----

grpc::ServerUnaryReactor* AuthService::Authenticate(grpc::CallbackServerContext* ctx,
                                                    const pb::AuthenticateRequest* req,
                                                    pb::AuthenticateResponse* resp) {
  const absl::Time start = absl::Now();
  absl::Status s = ValidateJob(req->job());
  if (s.ok()) {
    absl::StatusOr<Principal> p = credentials_.Authorize(AuthorizationOf(*ctx), req->job());
    if (p.ok()) {
      switch (*p) {
        case Principal::kJob:
          resp->set_principal(pb::AuthenticateResponse::PRINCIPAL_JOB);
          break;
        case Principal::kAdmin:
          resp->set_principal(pb::AuthenticateResponse::PRINCIPAL_ADMIN);
          break;
        case Principal::kUnauthenticated:
          resp->set_principal(pb::AuthenticateResponse::PRINCIPAL_UNAUTHENTICATED);
          break;
      }
    }
    s = p.status();
    if (s.ok()) *resp->mutable_policy() = PolicyFor(policies_, req->job());
  }
  return FinishNow(ctx, metrics_, "Authenticate", start, s);
}

grpc::ServerUnaryReactor* AuthService::MintJobToken(grpc::CallbackServerContext* ctx,
                                                    const pb::MintJobTokenRequest* req,
                                                    pb::MintJobTokenResponse* resp) {
  const absl::Time start = absl::Now();
  absl::Status s = ValidateJob(req->job());
  if (s.ok()) s = credentials_.AuthorizeAdmin(AuthorizationOf(*ctx), "MintJobToken");
  if (s.ok()) {
    absl::StatusOr<std::string> token = credentials_.Mint(req->job());
    if (token.ok()) resp->set_token(std::move(*token));
    s = token.status();
  }
  return FinishNow(ctx, metrics_, "MintJobToken", start, s);
}

grpc::ServerUnaryReactor* AuthService::RevokeJobTokens(grpc::CallbackServerContext* ctx,
                                                       const pb::RevokeJobTokensRequest* req,
                                                       pb::RevokeJobTokensResponse* resp) {
  const absl::Time start = absl::Now();
  absl::Status s = ValidateJob(req->job());
  if (s.ok()) s = credentials_.AuthorizeAdmin(AuthorizationOf(*ctx), "RevokeJobTokens");
  if (s.ok()) {
    absl::StatusOr<int> revoked = credentials_.Revoke(req->job());
    if (revoked.ok()) resp->set_revoked(*revoked);
    s = revoked.status();
  }
  return FinishNow(ctx, metrics_, "RevokeJobTokens", start, s);
}

}  // namespace collserve::server
