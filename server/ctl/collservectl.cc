// collservectl: the operator's tool for a collserve coordinator (docs/operations.md).
//
//   collservectl [--coordinator=host:port] [--job=J] [--json] COMMAND [ARGS]
//
//   health               the coordinator's health services, and per host of the job's groups
//                        how fresh its sidecar's ledger is
//   groups               the job's groups: members, generation, state, the last collective
//                        every rank completed and the oldest one in flight
//   describe GROUP       one group's members
//   wait [GROUP]         blocks until GROUP (without one: any group of the job) is formed (exit 0) or --wait_timeout passes
//                        (exit 1), printing every --progress_interval how many ranks joined
//                        and which are missing: a Kubernetes init container or exec
//                        readiness probe for "my job's group is up". A group re-formed
//                        in place (collserve.reconfigure) keeps its name at the next
//                        generation: wait follows it while it re-forms
//   diagnose GROUP       why GROUP is stuck, from every host's ledger (Registry.DiagnoseGroup)
//   dump GROUP           the flight recorder: GROUP's last collectives with every rank's
//                        arrival, the arrival skew and the last rank; the stragglers
//   jobs                 every job: its keys, bytes and groups (admin token required)
//   keys [PREFIX]        the job's keys (that start with PREFIX), in byte order
//   get KEY              one key's value
//   delete-group GROUP   ends GROUP's generation for every member and removes it
//   delete-keys PREFIX   deletes the job's keys that start with PREFIX (not empty)
//   drain                --sidecar=unix:ADMIN_SOCKET: no new sessions there; waits until its
//                        sessions ended (exit 0) or --drain_timeout (exit 1, naming them)
//   undrain              --sidecar=unix:ADMIN_SOCKET: accepts sessions again
//   delete-job           a finished job's cleanup: every group and key of --job
//                        (refused while one of its groups is FORMED, unless --force)
//   version              collservectl's, the coordinator's and each --sidecar's version
//   mint-token           a new token for --job (admin token required)
//   revoke-tokens        revokes --job's minted tokens (admin token required)
// The token comes from COLLSERVE_TOKEN or COLLSERVE_TOKEN_FILE (the job's, or the admin
// token), TLS from COLLSERVE_TLS_CA/CERT/KEY/SERVER_NAME, as for every collserve client.
// Exit codes: 0 success, 1 the call failed (its status on standard error), 2 bad usage.
#include <grpcpp/grpcpp.h>
#include <openssl/crypto.h>
#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <cstdlib>
#include <iomanip>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "client/channel.h"
#include "collserve/v1/auth.grpc.pb.h"
#include "collserve/v1/info.grpc.pb.h"
#include "collserve/v1/store.grpc.pb.h"
#include "collserve/v1/registry.grpc.pb.h"
#include "collserve/v1/sidecar_admin.grpc.pb.h"
#include "common/grpc_status.h"
#include "common/types.h"

ABSL_FLAG(std::string, coordinator, "",
          "host:port of the coordinator; default $COLLSERVE_COORDINATOR, else 127.0.0.1:29400.");
ABSL_FLAG(std::string, job, "", "The job; default $COLLSERVE_JOB, else \"default\".");
ABSL_FLAG(bool, json, false, "Print the coordinator's answers as JSON (one object per line) instead of tables.");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(10), "Deadline of each call.");
ABSL_FLAG(std::vector<std::string>, sidecar, {},
          "Sidecars (unix:PATH or host:port, comma-separated) whose health and version `health` and `version` "
          "also show; TLS as for the coordinator (a unix socket is plaintext).");
ABSL_FLAG(int64_t, limit, 100000, "keys: print at most this many keys.");
ABSL_FLAG(absl::Duration, wait_timeout, absl::Minutes(5), "wait: give up after this long (exit 1).");
ABSL_FLAG(absl::Duration, progress_interval, absl::Seconds(5), "wait: print progress this often.");
ABSL_FLAG(absl::Duration, drain_timeout, absl::Minutes(10),
          "drain: how long to wait for the sidecar's sessions to end (exit 1 with what still runs after it).");
ABSL_FLAG(bool, force, false, "delete-job: also delete groups that are FORMED (their ranks fail at once).");

namespace collserve::ctl {
namespace {

namespace pb = ::collserve::v1;

std::string EnvOr(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::string(v) : fallback;
}

// Calls of one command: the stubs, the token and the deadline.
class Ctl {
 public:
  static absl::StatusOr<Ctl> Connect() {
    Ctl c;
    c.address_ = absl::GetFlag(FLAGS_coordinator);
    if (c.address_.empty()) c.address_ = EnvOr("COLLSERVE_COORDINATOR", "127.0.0.1:29400");
    c.job_ = absl::GetFlag(FLAGS_job);
    if (c.job_.empty()) c.job_ = EnvOr("COLLSERVE_JOB", "default");
    auto tls = client::TlsOptions::FromEnv();
    if (!tls.ok()) return tls.status();
    auto token = client::JobTokenFromEnv();
    if (!token.ok()) return token.status();
    c.token_ = *token;
    auto channel = client::CreateChannel(c.address_, *tls, grpc::ChannelArguments());
    if (!channel.ok()) return channel.status();
    c.channel_ = *channel;
    c.registry_ = pb::Registry::NewStub(c.channel_);
    c.auth_ = pb::Auth::NewStub(c.channel_);
    c.store_ = pb::Store::NewStub(c.channel_);
    c.info_ = pb::Info::NewStub(c.channel_);
    c.tls_ = *tls;
    return c;
  }
  // A channel to a sidecar (`address`: unix:PATH, plaintext, or host:port with the TLS
  // settings of the coordinator's).
  absl::StatusOr<std::shared_ptr<grpc::Channel>> SidecarChannel(const std::string& address) const {
    return client::CreateChannel(address, absl::StartsWith(address, "unix:") ? client::TlsOptions() : tls_,
                                 grpc::ChannelArguments());
  }

  // A context with the deadline and the token.
  std::unique_ptr<grpc::ClientContext> Context() const {
    auto ctx = std::make_unique<grpc::ClientContext>();
    ctx->set_deadline(absl::ToChronoTime(absl::Now() + absl::GetFlag(FLAGS_timeout)));
    client::AddJobToken(*ctx, token_);
    return ctx;
  }
  absl::Status Check(const grpc::Status& s, const std::string& what) const {
    if (s.ok()) return absl::OkStatus();
    absl::Status st = FromGrpcStatus(s);
    return absl::Status(st.code(), absl::StrCat(what, " at ", address_, ": ", st.message()));
  }

  const std::string& job() const { return job_; }
  const std::string& address() const { return address_; }
  std::shared_ptr<grpc::Channel> channel() const { return channel_; }
  pb::Registry::Stub& registry() const { return *registry_; }
  pb::Auth::Stub& auth() const { return *auth_; }
  pb::Store::Stub& store() const { return *store_; }
  pb::Info::Stub& info() const { return *info_; }

 private:
  std::string address_, job_, token_;
  std::shared_ptr<grpc::Channel> channel_;
  std::shared_ptr<pb::Registry::Stub> registry_;
  std::shared_ptr<pb::Auth::Stub> auth_;
  std::shared_ptr<pb::Store::Stub> store_;
  std::shared_ptr<pb::Info::Stub> info_;
  client::TlsOptions tls_;
};

bool Json() { return absl::GetFlag(FLAGS_json); }

// `s` as a JSON string, quoted and escaped by protobuf's JSON printer (names and error texts
// come from the daemons and the job's members: quotes, backslashes and control characters
// in them once made `health --json` print invalid JSON). Not UTF-8: hex escapes, quoted.
std::string JsonQuote(absl::string_view s) {
  google::protobuf::Value v;
  v.set_string_value(std::string(s));
  std::string out;
  if (!google::protobuf::util::MessageToJsonString(v, &out).ok()) {
    out = absl::StrCat("\"", absl::CHexEscape(s), "\"");
  }
  return out;
}

void PrintJson(const google::protobuf::Message& m) {
  std::string out;
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  (void)google::protobuf::util::MessageToJsonString(m, &out, options);
  std::cout << out << "\n";
}

// Prints rows as columns padded to their widest cell.
void PrintTable(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> width;
  for (const auto& row : rows) {
    for (size_t i = 0; i < row.size(); ++i) {
      if (width.size() <= i) width.push_back(0);
      width[i] = std::max(width[i], row[i].size());
    }
  }
  for (const auto& row : rows) {
    std::string line;
    for (size_t i = 0; i < row.size(); ++i) {
      line += row[i];
      if (i + 1 < row.size()) line += std::string(width[i] - row[i].size() + 2, ' ');
    }
    std::cout << line << "\n";
  }
}

std::string Ago(int64_t ms) {
  if (ms < 100) return "just now";
  return absl::StrCat(absl::FormatDuration(absl::Milliseconds(ms / 100 * 100)), " ago");
}

absl::StatusOr<pb::DiagnoseGroupResponse> DiagnoseCall(const Ctl& c, const std::string& group) {
  pb::DiagnoseGroupRequest req;
  req.set_job(c.job());
  req.set_group(group);
  pb::DiagnoseGroupResponse resp;
  auto ctx = c.Context();
  if (absl::Status s = c.Check(c.registry().DiagnoseGroup(ctx.get(), req, &resp), "DiagnoseGroup"); !s.ok()) return s;
  return resp;
}

absl::StatusOr<pb::ListResponse> ListCall(const Ctl& c) {
  pb::ListRequest req;
  req.set_job(c.job());
  pb::ListResponse resp;
  auto ctx = c.Context();
  if (absl::Status s = c.Check(c.registry().List(ctx.get(), req, &resp), "List"); !s.ok()) return s;
  return resp;
}

// "12.5 ms": microseconds as a person reads them.
std::string Micros(int64_t us) {
  return absl::FormatDuration(absl::Trunc(absl::Microseconds(us), absl::Microseconds(us < 1000000 ? 100 : 10000)));
}

// The ranks that called last, if any, under a heading.
void PrintStragglers(const google::protobuf::RepeatedPtrField<pb::StragglerStats>& stragglers) {
  if (stragglers.empty()) return;
  std::cout << "\nstragglers (the last rank to call a collective, at least the coordinator's "
               "--straggler_threshold after the first)\n";
  std::vector<std::vector<std::string>> rows = {{"RANK", "HOST", "LAST IN", "MEDIAN SKEW"}};
  for (const pb::StragglerStats& s : stragglers) {
    rows.push_back({absl::StrCat(s.rank()), s.host_id(), absl::StrCat(s.last_count(), " of ", s.records()),
                    Micros(s.median_skew_us())});
  }
  PrintTable(rows);
}

absl::Status Diagnose(const Ctl& c, const std::string& group) {
  auto d = DiagnoseCall(c, group);
  if (!d.ok()) return d.status();
  if (Json()) {
    PrintJson(*d);
    return absl::OkStatus();
  }
  std::cout << "group \"" << d->group().group() << "\" (job " << c.job() << "): generation " << d->group().generation()
            << ", " << d->group().world_size() << " ranks, " << d->group().state() << "\n"
            << d->summary() << "\n\n";
  std::vector<std::vector<std::string>> rows = {
      {"RANK", "HOST", "ISSUED", "OP", "COUNT", "DTYPE", "CALLED", "COMPLETED", "STATUS", "LEDGER"}};
  for (const pb::RankDiagnosis& r : d->ranks()) {
    if (!r.reported()) {
      rows.push_back({absl::StrCat(r.rank()), r.host_id().empty() ? "-" : r.host_id(), "?", "", "", "", "", "", "",
                      "no report"});
      continue;
    }
    const pb::RankProgress& p = r.progress();
    const bool issued = p.issued_seq() >= 0;
    rows.push_back({absl::StrCat(r.rank()), r.host_id(), issued ? absl::StrCat("#", p.issued_seq()) : "-",
                    issued ? CollectiveOpName(p.op()) : "", issued ? absl::StrCat(p.count()) : "",
                    issued ? std::string(DataTypeName(static_cast<DataType>(p.dtype()))) : "",
                    issued ? Ago(p.issued_age_ms()) : "",
                    p.completed_seq() >= 0 ? absl::StrCat("#", p.completed_seq()) : "-",
                    p.completed_seq() < 0 ? "" : (p.completed_status().empty() ? "OK" : p.completed_status()),
                    absl::StrCat(r.host_state(), r.host_draining_since_unix_ms() > 0 ? ", draining" : "", ", ",
                                 Ago(r.report_age_ms()))});
  }
  PrintTable(rows);
  PrintStragglers(d->stragglers());
  return absl::OkStatus();
}

absl::Status Dump(const Ctl& c, const std::string& group) {
  pb::DumpGroupRequest req;
  req.set_job(c.job());
  req.set_group(group);
  pb::DumpGroupResponse resp;
  auto ctx = c.Context();
  if (absl::Status s = c.Check(c.registry().DumpGroup(ctx.get(), req, &resp), "DumpGroup"); !s.ok()) return s;
  if (Json()) {
    PrintJson(resp);
    return absl::OkStatus();
  }
  std::cout << "group \"" << resp.group().group() << "\" (job " << c.job() << "): generation "
            << resp.group().generation() << ", " << resp.group().world_size() << " ranks; the flight recorder's last "
            << resp.records_size() << " collectives as the sidecars published them\n\n";
  std::vector<std::vector<std::string>> rows = {
      {"SEQ", "OP", "COUNT", "DTYPE", "BYTES", "ALGORITHM", "STATUS", "STARTED", "DURATION", "SKEW", "LAST RANK"}};
  for (const pb::FlightRecord& f : resp.records()) {
    int64_t first_arrival = f.started_unix_us();
    for (const pb::RankArrival& a : f.arrivals()) first_arrival = std::min(first_arrival, a.arrived_unix_us());
    rows.push_back({absl::StrCat("#", f.seq()), CollectiveOpName(f.op()), absl::StrCat(f.count()),
                    f.dtype() == 0 ? "-" : std::string(DataTypeName(static_cast<DataType>(f.dtype()))),
                    absl::StrCat(f.bytes()), f.algorithm().empty() ? "-" : f.algorithm(), f.status(),
                    absl::FormatTime("%H:%M:%E3S", absl::FromUnixMicros(f.started_unix_us()), absl::UTCTimeZone()),
                    Micros(f.completed_unix_us() - first_arrival),
                    f.last_rank() < 0 ? "-" : Micros(f.arrival_skew_us()),
                    f.last_rank() < 0 ? "-" : absl::StrCat(f.last_rank())});
  }
  PrintTable(rows);
  for (const pb::FlightRecord& f : resp.records()) {
    if (!f.error().empty()) std::cout << "#" << f.seq() << ": " << f.error() << "\n";
  }
  PrintStragglers(resp.stragglers());
  return absl::OkStatus();
}

absl::Status Groups(const Ctl& c) {
  auto list = ListCall(c);
  if (!list.ok()) return list.status();
  if (Json()) {
    for (const pb::GroupInfo& g : list->groups()) {
      auto d = DiagnoseCall(c, g.group());
      if (d.ok()) PrintJson(*d);
      else PrintJson(g);
    }
    return absl::OkStatus();
  }
  std::vector<std::vector<std::string>> rows = {
      {"GROUP", "GENERATION", "STATE", "RANKS", "HOSTS", "COMPLETED", "IN FLIGHT"}};
  for (const pb::GroupInfo& g : list->groups()) {
    std::set<std::string> hosts;
    for (const pb::Member& m : g.members()) hosts.insert(m.host_id());
    std::string completed = "-", in_flight = "-";
    if (auto d = DiagnoseCall(c, g.group()); d.ok()) {
      int64_t low = -1;
      bool any = false;
      for (const pb::RankDiagnosis& r : d->ranks()) {
        if (!r.reported()) continue;
        low = any ? std::min(low, r.progress().completed_seq()) : r.progress().completed_seq();
        any = true;
      }
      if (any && low >= 0) completed = absl::StrCat("#", low);
      if (d->oldest_incomplete_seq() >= 0) {
        in_flight = absl::StrCat(CollectiveOpName(d->oldest_incomplete_op()), " #", d->oldest_incomplete_seq(), " (",
                                 d->missing_size(), " missing)");
      }
    }
    rows.push_back({g.group(), absl::StrCat(g.generation()), g.state(),
                    absl::StrCat(g.members_size(), "/", g.world_size()), absl::StrJoin(hosts, ","), completed,
                    in_flight});
  }
  PrintTable(rows);
  return absl::OkStatus();
}

absl::Status Describe(const Ctl& c, const std::string& group) {
  pb::DescribeRequest req;
  req.set_job(c.job());
  req.set_group(group);
  pb::DescribeResponse resp;
  auto ctx = c.Context();
  if (absl::Status s = c.Check(c.registry().Describe(ctx.get(), req, &resp), "Describe"); !s.ok()) return s;
  if (Json()) {
    PrintJson(resp);
    return absl::OkStatus();
  }
  std::cout << "group \"" << resp.group().group() << "\" (job " << c.job() << "): generation "
            << resp.group().generation() << ", " << resp.group().state() << "\n";
  std::vector<std::vector<std::string>> rows = {{"RANK", "HOST", "ADDRESS", "BACKEND"}};
  for (const pb::Member& m : resp.group().members()) {
    rows.push_back({absl::StrCat(m.rank()), m.host_id(), m.host_address(), m.backend().empty() ? "-" : m.backend()});
  }
  PrintTable(rows);
  return absl::OkStatus();
}

// "n of m ranks joined; missing ranks [..]" for a group that is not formed (at most 16
// missing ranks are listed).
std::string JoinProgress(const pb::GroupInfo& g) {
  std::set<int> joined;
  for (const pb::Member& m : g.members()) joined.insert(m.rank());
  std::vector<int> missing;
  int more = 0;
  for (int r = 0; r < g.world_size(); ++r) {
    if (joined.count(r) != 0) continue;
    if (missing.size() < 16) {
      missing.push_back(r);
    } else {
      ++more;
    }
  }
  return absl::StrCat(joined.size(), " of ", g.world_size(), " ranks joined; missing ranks [",
                      absl::StrJoin(missing, ", "), more > 0 ? absl::StrCat(", ... and ", more, " more") : "", "]");
}

// Polls Registry.List every second until `group` is FORMED (a later generation of it when
// it re-forms in place meanwhile: collserve.reconfigure); `group` "": until any group of the
// job is (the progress then names the groups forming, at most 3).
// The group the launchers of a several-node `collserve launch` form to agree on a run id.
constexpr std::string_view kLauncherGroup = "collserve.launch";

absl::Status Wait(const Ctl& c, const std::string& group) {
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + absl::GetFlag(FLAGS_wait_timeout);
  absl::Time next_progress = start + absl::GetFlag(FLAGS_progress_interval);  // quiet when it forms at once
  const bool any = group.empty();
  const std::string none = any ? absl::StrCat("the coordinator has no group of job ", c.job(), " yet")
                               : "the coordinator has no such group yet";
  const std::string what = any ? std::string("the job's groups") : absl::StrCat("group \"", group, "\"");
  std::string last = none;
  for (;;) {
    pb::ListRequest req;
    req.set_job(c.job());
    pb::ListResponse resp;
    auto ctx = c.Context();
    const grpc::Status s = c.registry().List(ctx.get(), req, &resp);
    if (s.ok() && any) {
      std::vector<std::string> forming;
      for (const pb::GroupInfo& g : resp.groups()) {
        // Several nodes' `collserve launch` form this group of their own before they start
        // the ranks (python/collserve/launch.py, agree_run_id): not one of the job's.
        if (g.group() == kLauncherGroup) continue;
        if (g.state() == "FORMED") {
          std::set<std::string> hosts;
          for (const pb::Member& m : g.members()) hosts.insert(m.host_id());
          std::cout << "group \"" << g.group() << "\" (job " << c.job() << ") formed: generation " << g.generation()
                    << ", " << g.world_size() << " ranks on " << hosts.size() << " host(s)" << std::endl;
          return absl::OkStatus();
        }
        if (forming.size() < 3) {
          forming.push_back(absl::StrCat("group \"", g.group(), "\" generation ", g.generation(), ": ",
                                         g.state() == "BROKEN" ? "BROKEN (a rank left or was lost)" : JoinProgress(g)));
        }
      }
      last = forming.empty() ? none : absl::StrJoin(forming, "; ");
    } else if (s.ok()) {
      const pb::GroupInfo* found = nullptr;
      for (const pb::GroupInfo& g : resp.groups()) {
        if (g.group() == group) found = &g;
      }
      if (found != nullptr) {
        const pb::GroupInfo& g = *found;
        if (g.state() == "FORMED") {
          std::set<std::string> hosts;
          for (const pb::Member& m : g.members()) hosts.insert(m.host_id());
          std::cout << "group \"" << group << "\" (job " << c.job() << ") formed: generation " << g.generation()
                    << ", " << g.world_size() << " ranks on " << hosts.size() << " host(s)" << std::endl;
          return absl::OkStatus();
        }
        last = g.state() == "BROKEN"
                   ? absl::StrCat("generation ", g.generation(), " is BROKEN (a rank left or was lost)")
                   : absl::StrCat("generation ", g.generation(), ": ", JoinProgress(g));
      } else {
        last = none;
      }
    } else if (s.error_code() != grpc::StatusCode::UNAVAILABLE) {
      return c.Check(s, "List");
    } else {
      last = absl::StrCat("the coordinator does not answer: ", s.error_message());
    }
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      const std::string waited = absl::FormatDuration(absl::GetFlag(FLAGS_wait_timeout));
      return absl::DeadlineExceededError(
          any ? absl::StrCat("no group of job ", c.job(), " formed within ", waited, ": ", last)
              : absl::StrCat("group \"", group, "\" (job ", c.job(), ") did not form within ", waited, ": ", last));
    }
    if (now >= next_progress) {
      std::cout << "waiting for " << what << " (" << absl::FormatDuration(absl::Trunc(now - start, absl::Seconds(1)))
                << "): " << last << std::endl;
      next_progress = now + absl::GetFlag(FLAGS_progress_interval);
    }
    absl::SleepFor(std::min(absl::Seconds(1), deadline - now));
  }
}

// The sidecars to probe: each --sidecar, then each sidecar serving the job's groups that
// told the coordinator its address (Member.sidecar_address), once each: (host id or "-",
// address).
std::vector<std::pair<std::string, std::string>> KnownSidecars(const Ctl& c,
                                                               const absl::StatusOr<pb::ListResponse>& list) {
  std::vector<std::pair<std::string, std::string>> out;
  std::set<std::string> seen;
  for (const std::string& address : absl::GetFlag(FLAGS_sidecar)) {
    if (seen.insert(address).second) out.push_back({"-", address});
  }
  if (list.ok()) {
    for (const pb::GroupInfo& g : list->groups()) {
      for (const pb::Member& m : g.members()) {
        if (!m.sidecar_address().empty() && seen.insert(m.sidecar_address()).second) {
          out.push_back({m.host_id(), m.sidecar_address()});
        }
      }
    }
  }
  return out;
}

// `health`: the coordinator's gRPC health services, each known sidecar's readiness and
// liveness (--sidecar, and the sidecars of the job's groups), and the hosts of the job's
// groups with the age of their last ledger report. OK only when every service and sidecar
// checked is SERVING; UNAVAILABLE naming each one that is not (exit 1), like etcdctl's
// `endpoint health`, so that a probe or a script can use it.
absl::Status Health(const Ctl& c) {
  std::map<std::string, std::string> services;
  for (const char* s : {"", "liveness", "collserve.v1.Store", "collserve.v1.Registry", "collserve.v1.Auth"}) {
    services[*s == '\0' ? "(server)" : s] = client::CheckHealth(c.channel(), s, absl::GetFlag(FLAGS_timeout));
  }
  // The hosts of the job's groups: the age of each host's freshest ledger, the groups, and
  // since when its sidecar drains (Unix ms, from that ledger; 0 = not draining).
  struct HostRow {
    int64_t age_ms = -1;
    std::vector<std::string> groups;
    int64_t draining_since_unix_ms = 0;
  };
  std::map<std::string, HostRow> hosts;
  auto list = ListCall(c);
  if (list.ok()) {
    for (const pb::GroupInfo& g : list->groups()) {
      auto d = DiagnoseCall(c, g.group());
      for (const pb::Member& m : g.members()) {
        HostRow& h = hosts[m.host_id()];
        if (std::find(h.groups.begin(), h.groups.end(), g.group()) == h.groups.end()) h.groups.push_back(g.group());
        if (!d.ok()) continue;
        for (const pb::RankDiagnosis& r : d->ranks()) {
          if (r.host_id() == m.host_id() && r.reported() && (h.age_ms < 0 || r.report_age_ms() < h.age_ms)) {
            h.age_ms = r.report_age_ms();
            h.draining_since_unix_ms = r.host_draining_since_unix_ms();
          }
        }
      }
    }
  }
  // Each known sidecar's readiness (its coordinator reachable) and liveness.
  std::vector<std::vector<std::string>> sidecars;  // host, address, ready, live
  for (const auto& [host, address] : KnownSidecars(c, list)) {
    auto channel = c.SidecarChannel(address);
    if (!channel.ok()) {
      sidecars.push_back({host, address, std::string(channel.status().message()), ""});
      continue;
    }
    sidecars.push_back({host, address, client::CheckHealth(*channel, "", absl::GetFlag(FLAGS_timeout)),
                        client::CheckHealth(*channel, "liveness", absl::GetFlag(FLAGS_timeout))});
  }
  // Healthy: every coordinator service and every sidecar it checked is SERVING. Anything
  // else (unreachable, NOT_SERVING, unknown) is named in the error, which exits 1.
  std::vector<std::string> unhealthy;
  std::map<std::string, std::vector<std::string>> by_state;  // a state -> the services in it
  for (const auto& [name, state] : services) {
    if (state != "SERVING") by_state[state].push_back(name);
  }
  for (const auto& [state, names] : by_state) {
    unhealthy.push_back(absl::StrCat("coordinator ", c.address(), " ", absl::StrJoin(names, ", "), ": ", state));
  }
  for (const auto& s : sidecars) {
    if (s[2] != "SERVING") unhealthy.push_back(absl::StrCat("sidecar ", s[1], " readiness: ", s[2]));
    if (s[3] != "SERVING") unhealthy.push_back(absl::StrCat("sidecar ", s[1], " liveness: ", s[3].empty() ? "not checked" : s[3]));
  }
  const absl::Status verdict =
      unhealthy.empty() ? absl::OkStatus()
                        : absl::UnavailableError(absl::StrCat("not healthy: ", absl::StrJoin(unhealthy, "; ")));
  if (Json()) {
    std::cout << "{\"healthy\":" << (unhealthy.empty() ? "true" : "false") << ",\"coordinator\":" << JsonQuote(c.address())
              << ",\"sidecars\":[";
    for (size_t i = 0; i < sidecars.size(); ++i) {
      std::cout << (i ? "," : "") << "{\"host_id\":" << JsonQuote(sidecars[i][0]) << ",\"address\":"
                << JsonQuote(sidecars[i][1]) << ",\"readiness\":" << JsonQuote(sidecars[i][2])
                << ",\"liveness\":" << JsonQuote(sidecars[i][3]) << "}";
    }
    std::cout << "],\"services\":{";
    bool first = true;
    for (const auto& [name, state] : services) {
      std::cout << (first ? "" : ",") << JsonQuote(name) << ":" << JsonQuote(state);
      first = false;
    }
    std::cout << "},\"hosts\":[";
    first = true;
    for (const auto& [host, info] : hosts) {
      std::vector<std::string> groups;
      for (const std::string& g : info.groups) groups.push_back(JsonQuote(g));
      std::cout << (first ? "" : ",") << "{\"host_id\":" << JsonQuote(host) << ",\"ledger_age_ms\":" << info.age_ms
                << ",\"draining_since_unix_ms\":" << info.draining_since_unix_ms << ",\"groups\":["
                << absl::StrJoin(groups, ",") << "]}";
      first = false;
    }
    std::cout << "]" << (list.ok() ? "" : ",\"hosts_error\":\"cannot list groups\"") << "}\n";
    return verdict;
  }
  std::cout << "coordinator " << c.address() << "\n";
  std::vector<std::vector<std::string>> rows = {{"SERVICE", "HEALTH"}};
  for (const auto& [name, state] : services) rows.push_back({name, state});
  PrintTable(rows);
  if (!sidecars.empty()) {
    std::cout << "\n";
    rows = {{"SIDECAR", "ADDRESS", "READINESS", "LIVENESS"}};
    for (const auto& s : sidecars) rows.push_back(s);
    PrintTable(rows);
  }
  if (!list.ok()) {
    std::cout << "\nhosts of job " << c.job() << ": " << list.status().message() << "\n";
    return verdict;
  }
  std::cout << "\nsidecars serving job " << c.job() << " (the age of their last ledger report: a sidecar reports "
            << "while its groups' collectives change)\n";
  rows = {{"HOST", "LEDGER", "DRAINING", "GROUPS"}};
  for (const auto& [host, info] : hosts) {
    rows.push_back({host, info.age_ms < 0 ? "none" : Ago(info.age_ms),
                    info.draining_since_unix_ms > 0
                        ? absl::StrCat("since ", absl::FormatTime("%H:%M:%S UTC",
                                                                  absl::FromUnixMillis(info.draining_since_unix_ms),
                                                                  absl::UTCTimeZone()))
                        : "no",
                    absl::StrJoin(info.groups, ",")});
  }
  PrintTable(rows);
  return verdict;
}

// One daemon's Info, or the error as a row.
absl::StatusOr<pb::GetInfoResponse> InfoOf(pb::Info::Stub& stub) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::GetFlag(FLAGS_timeout)));
  pb::GetInfoResponse resp;
  grpc::Status s = stub.GetInfo(&ctx, pb::GetInfoRequest(), &resp);
  if (!s.ok()) return FromGrpcStatus(s);
  return resp;
}

absl::Status Version(const Ctl& c) {
  std::vector<std::vector<std::string>> rows = {{"DAEMON", "ADDRESS", "VERSION", "HOST", "STARTED"}};
  std::vector<std::string> json;
  auto add = [&](const std::string& address, const absl::StatusOr<pb::GetInfoResponse>& info) {
    if (!info.ok()) {
      rows.push_back({"?", address, std::string(info.status().message()), "", ""});
      json.push_back(absl::StrCat("{\"address\":", JsonQuote(address), ",\"error\":",
                                  JsonQuote(info.status().message()), "}"));
      return;
    }
    rows.push_back({info->daemon(), address, info->version(), info->host_id().empty() ? "-" : info->host_id(),
                    absl::FormatTime("%Y-%m-%d %H:%M:%S UTC", absl::FromUnixSeconds(info->started_unix_s()),
                                     absl::UTCTimeZone())});
    json.push_back(absl::StrCat("{\"address\":", JsonQuote(address), ",\"daemon\":", JsonQuote(info->daemon()),
                                ",\"version\":", JsonQuote(info->version()), ",\"host_id\":",
                                JsonQuote(info->host_id()), ",\"started_unix_s\":", info->started_unix_s(), "}"));
  };
  add(c.address(), InfoOf(c.info()));
  for (const auto& [host, address] : KnownSidecars(c, ListCall(c))) {
    auto channel = c.SidecarChannel(address);
    if (!channel.ok()) {
      add(address, channel.status());
      continue;
    }
    auto stub = pb::Info::NewStub(*channel);
    add(address, InfoOf(*stub));
  }
  if (Json()) {
    std::cout << "{\"collservectl\":\"" << COLLSERVE_VERSION << "\",\"daemons\":[" << absl::StrJoin(json, ",")
              << "]}\n";
  } else {
    std::cout << "collservectl " << COLLSERVE_VERSION << "\n";
    PrintTable(rows);
  }
  return absl::OkStatus();
}

absl::Status Jobs(const Ctl& c) {
  pb::ListJobsResponse resp;
  auto ctx = c.Context();
  if (absl::Status s = c.Check(c.registry().ListJobs(ctx.get(), pb::ListJobsRequest(), &resp), "ListJobs"); !s.ok()) {
    return s;
  }
  if (Json()) {
    PrintJson(resp);
    return absl::OkStatus();
  }
  std::vector<std::vector<std::string>> rows = {{"JOB", "KEYS", "BYTES", "GROUPS"}};
  for (const pb::JobSummary& j : resp.jobs()) {
    rows.push_back({j.job(), absl::StrCat(j.keys()), absl::StrCat(j.bytes()), absl::StrCat(j.groups())});
  }
  PrintTable(rows);
  return absl::OkStatus();
}

// The job's keys that start with `prefix`, a page at a time, at most --limit of them.
absl::Status Keys(const Ctl& c, const std::string& prefix) {
  const int64_t limit = std::max<int64_t>(absl::GetFlag(FLAGS_limit), 0);
  std::vector<std::string> keys;
  bool more = true;
  std::string after;
  while (more && static_cast<int64_t>(keys.size()) < limit) {
    pb::ListKeysRequest req;
    req.set_job(c.job());
    req.set_prefix(prefix);
    req.set_start_after(after);
    req.set_limit(std::min<int64_t>(limit - static_cast<int64_t>(keys.size()), 10000));
    pb::ListKeysResponse resp;
    auto ctx = c.Context();
    if (absl::Status s = c.Check(c.store().ListKeys(ctx.get(), req, &resp), "ListKeys"); !s.ok()) return s;
    for (const std::string& k : resp.keys()) keys.push_back(k);
    more = resp.more() && resp.keys_size() > 0;
    if (!resp.keys().empty()) after = resp.keys(resp.keys_size() - 1);
  }
  if (Json()) {
    pb::ListKeysResponse all;
    for (const std::string& k : keys) all.add_keys(k);
    all.set_more(more);
    PrintJson(all);
    return absl::OkStatus();
  }
  for (const std::string& k : keys) std::cout << absl::CHexEscape(k) << "\n";
  if (more) std::cerr << "collservectl: more keys match; raise --limit to see them\n";
  return absl::OkStatus();
}

absl::Status Get(const Ctl& c, const std::string& key) {
  pb::GetRequest req;
  req.set_job(c.job());
  req.set_key(key);
  req.set_timeout_ms(1);  // the key now, never a wait for it
  pb::GetResponse resp;
  auto ctx = c.Context();
  grpc::Status s = c.store().Get(ctx.get(), req, &resp);
  if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    return absl::NotFoundError(absl::StrCat("job ", c.job(), " has no key \"", absl::CHexEscape(key), "\""));
  }
  if (absl::Status st = c.Check(s, "Get"); !st.ok()) return st;
  if (Json()) {
    PrintJson(resp);
  } else {
    std::cout << absl::CHexEscape(resp.value()) << "\n";
  }
  return absl::OkStatus();
}

absl::Status MintToken(const Ctl& c) {
  pb::MintJobTokenRequest req;
  req.set_job(c.job());
  pb::MintJobTokenResponse resp;
  auto ctx = c.Context();
  if (absl::Status s = c.Check(c.auth().MintJobToken(ctx.get(), req, &resp), "MintJobToken"); !s.ok()) return s;
  if (Json()) {
    PrintJson(resp);
  } else {
    std::cout << resp.token() << "\n";
  }
  return absl::OkStatus();
}

absl::Status RevokeTokens(const Ctl& c) {
  pb::RevokeJobTokensRequest req;
  req.set_job(c.job());
  pb::RevokeJobTokensResponse resp;
  auto ctx = c.Context();
  if (absl::Status s = c.Check(c.auth().RevokeJobTokens(ctx.get(), req, &resp), "RevokeJobTokens"); !s.ok()) return s;
  if (Json()) {
    PrintJson(resp);
  } else {
    std::cout << "revoked " << resp.revoked() << " minted token(s) of job " << c.job() << "\n";
  }
  return absl::OkStatus();
}

absl::StatusOr<pb::DeleteGroupResponse> DeleteGroupCall(const Ctl& c, const std::string& group) {
  pb::DeleteGroupRequest req;
  req.set_job(c.job());
  req.set_group(group);
  pb::DeleteGroupResponse resp;
  auto ctx = c.Context();
  if (absl::Status s = c.Check(c.registry().DeleteGroup(ctx.get(), req, &resp), "DeleteGroup"); !s.ok()) return s;
  return resp;
}

// Registry.DeleteGroup of one group; prints what ended.
absl::Status DeleteGroup(const Ctl& c, const std::string& group) {
  absl::StatusOr<pb::DeleteGroupResponse> deleted = DeleteGroupCall(c, group);
  if (!deleted.ok()) return deleted.status();
  const pb::DeleteGroupResponse& resp = *deleted;
  if (Json()) {
    PrintJson(resp);
  } else {
    std::cout << "deleted group " << group << " of job " << c.job() << ": generation " << resp.generation() << ", "
              << resp.state() << ", " << resp.members() << " rank(s)\n";
  }
  return absl::OkStatus();
}

// Deletes the job's keys that start with `prefix` ("" = every key), a page at a time;
// *deleted counts them.
absl::Status DeleteKeysWithPrefix(const Ctl& c, const std::string& prefix, int64_t* deleted) {
  *deleted = 0;
  for (;;) {
    pb::ListKeysRequest req;
    req.set_job(c.job());
    req.set_prefix(prefix);
    req.set_limit(1000);
    pb::ListKeysResponse resp;
    auto ctx = c.Context();
    if (absl::Status s = c.Check(c.store().ListKeys(ctx.get(), req, &resp), "ListKeys"); !s.ok()) return s;
    if (resp.keys().empty()) return absl::OkStatus();
    for (const std::string& k : resp.keys()) {
      pb::DeleteKeyRequest del;
      del.set_job(c.job());
      del.set_key(k);
      pb::DeleteKeyResponse done;
      auto dctx = c.Context();
      if (absl::Status s = c.Check(c.store().DeleteKey(dctx.get(), del, &done), "DeleteKey"); !s.ok()) {
        return absl::Status(s.code(), absl::StrCat(s.message(), " (after deleting ", *deleted, " keys)"));
      }
      *deleted += done.deleted() ? 1 : 0;
    }
  }
}

absl::Status DeleteKeys(const Ctl& c, const std::string& prefix) {
  int64_t deleted = 0;
  if (absl::Status s = DeleteKeysWithPrefix(c, prefix, &deleted); !s.ok()) return s;
  if (Json()) {
    std::cout << "{\"job\":\"" << absl::CHexEscape(c.job()) << "\",\"deleted_keys\":" << deleted << "}\n";
  } else {
    std::cout << "deleted " << deleted << " key(s) of job " << c.job() << " starting with \"" << absl::CHexEscape(prefix)
              << "\"\n";
  }
  return absl::OkStatus();
}

// "job default group world (generation 1, ranks [0, 1], ready)" for each attached group.
std::string AttachedText(const pb::DrainResponse& r) {
  std::vector<std::string> parts;
  for (const pb::AttachedGroup& g : r.groups()) {
    parts.push_back(absl::StrCat("job ", g.job(), " group ", g.group(), " (generation ", g.generation(), ", ranks [",
                                 absl::StrJoin(g.ranks(), ", "), "], ", g.state(), ")"));
  }
  return absl::StrJoin(parts, "; ");
}

// SidecarAdmin.Drain on the one --sidecar (its admin socket); with `undrain`, once.
absl::Status DrainSidecar(const Ctl& c, bool undrain) {
  const std::vector<std::string> sidecars = absl::GetFlag(FLAGS_sidecar);
  if (sidecars.size() != 1 || !absl::StartsWith(sidecars[0], "unix:")) {
    return absl::InvalidArgumentError(
        "drain and undrain need one --sidecar=unix:PATH: the sidecar's admin socket (its --admin_socket, by "
        "default its socket's path plus .admin, e.g. unix:/run/collserve/sidecar.sock.admin)");
  }
  auto channel = c.SidecarChannel(sidecars[0]);
  if (!channel.ok()) return channel.status();
  auto admin = pb::SidecarAdmin::NewStub(*channel);
  const absl::Time start = absl::Now();
  const absl::Time deadline = start + absl::GetFlag(FLAGS_drain_timeout);
  absl::Time next_progress = start;
  for (;;) {
    pb::DrainRequest req;
    req.set_undrain(undrain);
    pb::DrainResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::GetFlag(FLAGS_timeout)));
    const grpc::Status s = admin->Drain(&ctx, req, &resp);
    if (!s.ok()) {
      absl::Status st = FromGrpcStatus(s);
      return absl::Status(st.code(), absl::StrCat("SidecarAdmin.Drain at ", sidecars[0], ": ", st.message()));
    }
    const absl::Time now = absl::Now();
    if (undrain || resp.sessions() == 0) {
      if (Json()) {
        PrintJson(resp);
      } else if (undrain) {
        std::cout << "sidecar " << resp.host_id() << " undrained: accepting sessions (" << resp.sessions()
                  << " attached)\n";
      } else {
        std::cout << "sidecar " << resp.host_id() << " drained: no sessions attached (waited "
                  << absl::FormatDuration(absl::Trunc(now - start, absl::Milliseconds(100))) << ")\n";
      }
      return absl::OkStatus();
    }
    if (now >= deadline) {
      if (Json()) PrintJson(resp);
      return absl::DeadlineExceededError(absl::StrCat(
          "sidecar ", resp.host_id(), " is draining but ", resp.sessions(), " session(s) are still attached after ",
          absl::FormatDuration(absl::GetFlag(FLAGS_drain_timeout)), ": ", AttachedText(resp)));
    }
    if (now >= next_progress && !Json()) {
      std::cout << "draining sidecar " << resp.host_id() << " ("
                << absl::FormatDuration(absl::Trunc(now - start, absl::Seconds(1))) << "): " << resp.sessions()
                << " session(s) attached: " << AttachedText(resp) << std::endl;
      next_progress = now + absl::GetFlag(FLAGS_progress_interval);
    }
    absl::SleepFor(std::min(absl::Seconds(1), deadline - now));
  }
}

// A finished job's cleanup: every group (refusing FORMED ones without --force), then every key.
absl::Status DeleteJob(const Ctl& c) {
  auto list = ListCall(c);
  if (!list.ok()) return list.status();
  std::vector<std::string> running;
  for (const pb::GroupInfo& g : list->groups()) {
    if (g.state() == "FORMED") running.push_back(absl::StrCat(g.group(), " (", g.members_size(), " ranks)"));
  }
  if (!running.empty() && !absl::GetFlag(FLAGS_force)) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", c.job(), " has formed groups: ", absl::StrJoin(running, ", "),
                     "; they are running (or their hosts' leases have not ended yet). Stop the job first, or "
                     "pass --force to end them"));
  }
  int groups = 0;
  for (const pb::GroupInfo& g : list->groups()) {
    absl::Status s = DeleteGroupCall(c, g.group()).status();
    if (s.ok()) {
      ++groups;
    } else if (!absl::IsNotFound(s)) {  // (it ended meanwhile)
      return s;
    }
  }
  int64_t keys = 0;
  if (absl::Status s = DeleteKeysWithPrefix(c, "", &keys); !s.ok()) return s;
  if (Json()) {
    std::cout << "{\"job\":\"" << absl::CHexEscape(c.job()) << "\",\"deleted_groups\":" << groups
              << ",\"deleted_keys\":" << keys << "}\n";
  } else {
    std::cout << "deleted job " << c.job() << ": " << groups << " group(s), " << keys << " key(s)\n";
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace collserve::ctl

namespace collserve::ctl {
namespace {

// One command: its arguments, a line for the command list, and its whole help.
struct Command {
  const char* name;
  const char* args;  // as the synopsis shows them ("" = none)
  int required;      // positional arguments it needs
  const char* summary;
  const char* help;  // what it does, its flags and its exit status
  absl::Status (*run)(const Ctl& c, const std::string& arg);
};

const std::vector<Command>& Commands() {
  static const auto* commands = new std::vector<Command>{
      {"health", "", 0, "the coordinator's and each --sidecar's health; per host how fresh its ledger is",
       "Checks the coordinator's gRPC health services (overall, Store, Registry) and each --sidecar's, and\n"
       "lists the job's groups with how long ago each member host last reported its ledger.\n"
       "Exit status: 0 when everything checked is SERVING, 1 when anything is unreachable or not\n"
       "serving (named on standard error), 2 usage. --json: one object with \"healthy\". A probe:\n"
       "  collservectl --coordinator=HOST:29400 --sidecar=unix:/run/collserve/sidecar.sock health",
       [](const Ctl& c, const std::string&) { return Health(c); }},
      {"groups", "", 0, "the job's groups: generation, state, ranks, hosts, progress",
       "Lists --job's groups: members, generation, state (FORMING, FORMED, BROKEN), the last collective\n"
       "every rank completed and the oldest one in flight. --json: each group's diagnosis.",
       [](const Ctl& c, const std::string&) { return Groups(c); }},
      {"describe", "GROUP", 1, "one group's members",
       "Prints GROUP's generation, state and every member: rank, host id, host and sidecar address.\n"
       "Exit status 1 with NOT_FOUND when the job has no such group.",
       [](const Ctl& c, const std::string& g) { return Describe(c, g); }},
      {"wait", "[GROUP]", 0,
       "blocks until GROUP (or any group of the job but the launchers' collserve.launch) is formed, or "
       "--wait_timeout",
       "Blocks until GROUP is FORMED (exit 0) or --wait_timeout passes (exit 1), printing every\n"
       "--progress_interval how many ranks joined and which are missing: an init container or exec\n"
       "readiness probe for \"my job's group is up\". A group re-formed in place (reconfigure) keeps\n"
       "its name at the next generation: wait follows it while it re-forms. Without GROUP: until any\n"
       "group of --job is FORMED (torch's groups are named torch/0, torch/1, ...), the progress\n"
       "naming the groups forming (collserve launch runs this).",
       [](const Ctl& c, const std::string& g) { return Wait(c, g); }},
      {"diagnose", "GROUP", 1, "why GROUP is stuck, from every host's ledger",
       "The oldest collective some rank called and not every rank completed: who has and has not\n"
       "called it, with their hosts and since when; ranks that called it with other arguments; each\n"
       "rank's last issued and completed collective (Registry.DiagnoseGroup).",
       [](const Ctl& c, const std::string& g) { return Diagnose(c, g); }},
      {"dump", "GROUP", 1, "the flight recorder: GROUP's last collectives and the stragglers",
       "GROUP's last collectives (at most 32 per host) with every rank's arrival, the arrival skew\n"
       "and the last rank, merged from the member hosts' ledgers; then the ranks that called last\n"
       "most often (Registry.DumpGroup).",
       [](const Ctl& c, const std::string& g) { return Dump(c, g); }},
      {"jobs", "", 0, "every job: its keys, bytes and groups (admin token)",
       "Every job with keys in the store or groups in the registry. Needs the admin token.",
       [](const Ctl& c, const std::string&) { return Jobs(c); }},
      {"keys", "[PREFIX]", 0, "the job's keys (that start with PREFIX), in byte order",
       "Prints --job's keys that start with PREFIX (all without one), C-escaped, in byte order; at most\n"
       "--limit of them (a note on standard error says when more match).",
       [](const Ctl& c, const std::string& prefix) { return Keys(c, prefix); }},
      {"get", "KEY", 1, "one key's value",
       "Prints KEY's value, C-escaped, without waiting for it: exit status 1 with NOT_FOUND when the\n"
       "job has no such key.",
       [](const Ctl& c, const std::string& k) { return Get(c, k); }},
      {"delete-group", "GROUP", 1, "ends GROUP's generation for every member and removes it",
       "Deletes GROUP (Registry.DeleteGroup): its current generation ends at once for every member, as\n"
       "if every rank had left; its ranks' collectives fail with an error naming the deletion, and\n"
       "their pending joins fail with ABORTED. The name forms again at the next generation. For a\n"
       "stuck rendezvous or a stale group. The job's token deletes its own groups, the admin token\n"
       "any job's (--job). Exit status 1 with NOT_FOUND when there is no such group.",
       [](const Ctl& c, const std::string& g) { return DeleteGroup(c, g); }},
      {"delete-keys", "PREFIX", 1, "deletes the job's keys that start with PREFIX",
       "Deletes --job's keys that start with PREFIX (not empty: delete-job deletes every key), a page\n"
       "of 1000 at a time, and prints how many. Not atomic: keys set meanwhile may be left, and a\n"
       "failure names how many were deleted before it. Job token for its own job, admin for any.",
       [](const Ctl& c, const std::string& prefix) { return DeleteKeys(c, prefix); }},
      {"delete-job", "", 0, "a finished job's cleanup: every group and key of --job",
       "Deletes every group of --job, then every key (the store's quota is per coordinator: the\n"
       "CollserveStoreNearQuota runbook). Refused (exit 1, FAILED_PRECONDITION naming them) while a\n"
       "group of the job is FORMED, i.e. running or with a host whose lease has not ended yet (about\n"
       "5 s after its sidecar died), unless --force, which ends those too.",
       [](const Ctl& c, const std::string&) { return DeleteJob(c); }},
      {"drain", "", 0, "--sidecar=unix:ADMIN_SOCKET: no new sessions; waits for those attached to end",
       "Drains the sidecar whose admin socket is --sidecar=unix:PATH (its --admin_socket, by default its\n"
       "socket's path plus .admin; mode 0600, so run it as the sidecar's user, e.g. kubectl exec into\n"
       "the sidecar's container): the sidecar accepts no new sessions (a rank attaching gets\n"
       "UNAVAILABLE naming the drain) and turns not ready, while the sessions attached run on. Waits,\n"
       "printing what is attached every --progress_interval, until none is (exit 0) or --drain_timeout\n"
       "(exit 1, naming each group and rank still attached). Calling it again is harmless. Before an\n"
       "upgrade: drain, then delete the sidecar's pod (docs/operations.md, \"Upgrading and rolling back\").",
       [](const Ctl& c, const std::string&) { return DrainSidecar(c, /*undrain=*/false); }},
      {"undrain", "", 0, "--sidecar=unix:ADMIN_SOCKET: accepts sessions again",
       "Ends a drain of the sidecar whose admin socket is --sidecar=unix:PATH: it accepts sessions again\n"
       "and is ready when its coordinator answers. A restarted sidecar does not drain.",
       [](const Ctl& c, const std::string&) { return DrainSidecar(c, /*undrain=*/true); }},
      {"version", "", 0, "collservectl's, the coordinator's and each --sidecar's version",
       "Prints the versions and build details of collservectl, the coordinator and each --sidecar.",
       [](const Ctl& c, const std::string&) { return Version(c); }},
      {"mint-token", "", 0, "a new token for --job (admin token)",
       "Prints a new token for --job (Auth.MintJobToken): give it to the job's pods as\n"
       "COLLSERVE_TOKEN or a file named by COLLSERVE_TOKEN_FILE. Needs the admin token.",
       [](const Ctl& c, const std::string&) { return MintToken(c); }},
      {"revoke-tokens", "", 0, "revokes --job's minted tokens (admin token)",
       "Revokes every token minted for --job (Auth.RevokeJobTokens) and prints how many.",
       [](const Ctl& c, const std::string&) { return RevokeTokens(c); }},
  };
  return *commands;
}

const Command* FindCommand(const std::string& name) {
  for (const Command& c : Commands()) {
    if (name == c.name) return &c;
  }
  return nullptr;
}

// collservectl's own flags (this file's), as `--name=DEFAULT  help` lines.
std::string FlagsHelp() {
  std::vector<std::string> lines;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (!absl::EndsWith(flag->Filename(), "collservectl.cc")) continue;
    lines.push_back(absl::StrCat("  --", name, "=", flag->DefaultValue(), "\n      ", flag->Help()));
  }
  std::sort(lines.begin(), lines.end());
  return absl::StrJoin(lines, "\n");
}

std::string Usage() {
  std::string out =
      "collservectl: the operator's tool for a collserve coordinator and its sidecars.\n\n"
      "Usage: collservectl [FLAGS] COMMAND [ARGS]\n"
      "       collservectl help COMMAND   (or COMMAND --help): one command's help\n\nCommands:\n";
  for (const Command& c : Commands()) {
    const std::string head = absl::StrCat(c.name, *c.args != '\0' ? " " : "", c.args);
    absl::StrAppend(&out, "  ", head, std::string(head.size() < 20 ? 20 - head.size() : 1, ' '), c.summary, "\n");
  }
  absl::StrAppend(&out, "\nFlags:\n", FlagsHelp(),
                  "\n\nEnvironment: COLLSERVE_COORDINATOR, COLLSERVE_JOB (the defaults of --coordinator and --job);\n"
                  "the token from COLLSERVE_TOKEN or COLLSERVE_TOKEN_FILE (the job's, or the admin token); TLS from\n"
                  "COLLSERVE_TLS_CA, COLLSERVE_TLS_CERT, COLLSERVE_TLS_KEY, COLLSERVE_TLS_SERVER_NAME.\n"
                  "Exit status: 0 done (health: everything checked is SERVING), 1 the command failed, its status on\n"
                  "standard error (health: something is unreachable or not serving), 2 usage.\n"
                  "docs/operations.md describes each command.");
  return out;
}

std::string CommandUsage(const Command& c) {
  return absl::StrCat("Usage: collservectl [FLAGS] ", c.name, *c.args != '\0' ? " " : "", c.args, "\n\n", c.help,
                      "\n\nFlags (every command takes them; `collservectl --help` says more):\n", FlagsHelp());
}

bool IsHelpFlag(const std::string& a) { return a == "--help" || a == "-help" || a == "-h" || a == "--helpshort"; }

}  // namespace
}  // namespace collserve::ctl

int main(int argc, char** argv) {
  namespace ctl = collserve::ctl;
  // As the daemons' KeepOpenSslStateUntilExit (server/common/daemon.h): OpenSSL's exit handler
  // would orphan the per-thread state of gRPC threads that end after it.
  OPENSSL_init_crypto(OPENSSL_INIT_NO_ATEXIT, nullptr);
  absl::FlagsUsageConfig usage_config;
  usage_config.normalize_filename = [](absl::string_view file) {  // no build paths in --helpfull
    const size_t slash = file.rfind('/');
    return std::string(slash == absl::string_view::npos ? file : file.substr(slash + 1));
  };
  usage_config.version_string = [] { return std::string("collservectl " COLLSERVE_VERSION "\n"); };
  absl::SetFlagsUsageConfig(usage_config);
  absl::SetProgramUsageMessage(ctl::Usage());
  // Help is ours (absl's --help would list flags by source file): `help [COMMAND]`,
  // `--help`, `COMMAND --help`. --helpfull stays absl's (every library's flags).
  {
    bool help = false;
    const ctl::Command* about = nullptr;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if (ctl::IsHelpFlag(a) || (a == "help" && about == nullptr)) help = true;
      if (about == nullptr) about = ctl::FindCommand(a);
    }
    if (help) {
      std::cout << (about != nullptr ? ctl::CommandUsage(*about) : ctl::Usage()) << "\n";
      return 0;
    }
  }
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() < 2) {
    std::cerr << ctl::Usage() << "\n";
    return 2;
  }
  const std::string command = args[1];
  const ctl::Command* c = ctl::FindCommand(command);
  if (c == nullptr) {
    std::cerr << "collservectl: unknown command \"" << command << "\"; `collservectl --help` lists them\n";
    return 2;
  }
  if (static_cast<int>(args.size()) - 2 < c->required || args.size() > 3) {
    std::cerr << "collservectl " << command << ": " << (args.size() > 3 ? "too many arguments" : "missing argument")
              << "\n"
              << ctl::CommandUsage(*c) << "\n";
    return 2;
  }
  const std::string arg = args.size() > 2 ? args[2] : "";
  if (command == "delete-keys" && arg.empty()) {
    std::cerr << "collservectl delete-keys: PREFIX may not be empty (delete-job deletes every key of a job)\n";
    return 2;
  }
  auto conn = ctl::Ctl::Connect();
  if (!conn.ok()) {
    std::cerr << "collservectl: " << conn.status() << "\n";
    return 2;
  }
  if (absl::Status s = c->run(*conn, arg); !s.ok()) {
    std::cerr << "collservectl: " << s << "\n";
    return 1;
  }
  return 0;
}
