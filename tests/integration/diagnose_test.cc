// The collective ledger against real daemons (issue 16): a rank that never calls is named,
// with its host, the op and the sequence number, by Registry.DiagnoseGroup and
// `collservectl diagnose` within 5 s of the others arriving, while every process is alive;
// the ranks that time out get the same diagnosis in their error; collservectl's other
// commands answer in tables and JSON.
#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>

#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/channel.h"
#include "collserve/client.h"
#include "collserve/v1/registry.grpc.pb.h"
#include "tests/testing/process.h"
#include "tests/testing/sanitizers.h"
#include "tests/testing/wait_for.h"

namespace collserve::testing {
namespace {

namespace pb = ::collserve::v1;
using ::testing::HasSubstr;
using ::testing::Not;

// Runs collservectl with `args` against `cluster` (its job token, or `token`); returns
// (exit code, output).
std::pair<int, std::string> Ctl(Cluster& cluster, const std::vector<std::string>& args, std::string token = "") {
  std::vector<std::string> argv = {CollservectlBinary(), absl::StrCat("--coordinator=", cluster.coordinator_address())};
  argv.insert(argv.end(), args.begin(), args.end());
  auto p = Process::Start(argv, {{"COLLSERVE_TOKEN", token.empty() ? cluster.job_token() : token}},
                          absl::StrCat(cluster.dir(), "/ctl-", absl::ToUnixNanos(absl::Now()), ".log"));
  if (!p.ok()) return {-1, std::string(p.status().message())};
  auto code = (*p)->Wait(absl::Seconds(30));
  return {code.ok() ? *code : -1, (*p)->Output()};
}

// Polls Registry.DiagnoseGroup of group "world" (4 ranks) until it names one rank missing and
// three arrived (30 s at most); the last answer in *named.
bool AwaitOneOfFourMissing(Cluster& cluster, pb::DiagnoseGroupResponse* named) {
  auto stub = pb::Registry::NewStub(grpc::CreateChannel(cluster.coordinator_address(), grpc::InsecureChannelCredentials()));
  return WaitFor(
      [&] {
        grpc::ClientContext ctx;
        client::AddJobToken(ctx, cluster.job_token());
        pb::DiagnoseGroupRequest req;
        req.set_group("world");
        return stub->DiagnoseGroup(&ctx, req, named).ok() && named->missing_size() == 1 && named->arrived_size() == 3;
      },
      absl::Seconds(30), absl::Milliseconds(100));
}

// Starts ranks 0-3 of group "world", ranks 0 and 1 on host0 and 2 and 3 on host1: ranks 0-2
// run rank_main with `args`, rank 3 joins and then never calls (idle). `env(r)` is rank r's
// environment. The processes, or the first error starting one.
absl::StatusOr<std::vector<std::unique_ptr<Process>>> StartFourRank3Idle(
    Cluster& cluster, const std::vector<std::string>& args,
    const std::function<std::map<std::string, std::string>(int)>& env) {
  std::vector<std::unique_ptr<Process>> ranks;
  for (int r = 0; r < 4; ++r) {
    auto p = cluster.StartRank(r, 4, r / 2, r == 3 ? std::vector<std::string>{"--mode=idle", "--iters=40"} : args,
                               env(r));
    if (!p.ok()) return p.status();
    ranks.push_back(std::move(*p));
  }
  return ranks;
}

TEST(DiagnoseTest, ARankThatNeverCallsIsNamedWithin5SecondsAndInTheTimeoutError) {
  auto started = Cluster::Start(2);
  ASSERT_TRUE(started.ok()) << started.status();
  Cluster& cluster = **started;
  // Ranks 0 and 1 on host0, 2 and 3 on host1; rank 3 joins and then never calls.
  auto started_ranks = StartFourRank3Idle(cluster, {"--mode=loop", "--iters=1", "--count=1000"}, [](int) {
    return std::map<std::string, std::string>{{"COLLSERVE_OP_TIMEOUT_S", "12"}};
  });
  ASSERT_TRUE(started_ranks.ok()) << started_ranks.status();
  std::vector<std::unique_ptr<Process>>& ranks = *started_ranks;
  pb::DiagnoseGroupResponse named;
  const bool found = AwaitOneOfFourMissing(cluster, &named);
  ASSERT_TRUE(found) << cluster.Logs();
  EXPECT_EQ(named.missing(0), 3);
  EXPECT_EQ(named.oldest_incomplete_seq(), 0);
  EXPECT_EQ(named.oldest_incomplete_op(), pb::ALL_REDUCE);
  // The first time the ledger names the missing rank, the first caller has waited for less
  // than 5 s (the sidecars report about every second).
  EXPECT_LE(named.waiting_ms(), 5000) << named.summary();
  std::printf("named rank 3 %lld ms after the first rank called: %s\n", static_cast<long long>(named.waiting_ms()),
              named.summary().c_str());
  EXPECT_THAT(named.summary(), HasSubstr("all_reduce #0 of group \"world\" (generation 1): ranks [3] (host host1) "
                                         "have not called it; ranks [0, 1, 2] have"));

  // The same through collservectl, as a table and as JSON.
  auto [code, table] = Ctl(cluster, {"diagnose", "world"});
  EXPECT_EQ(code, 0) << table;
  std::printf("collservectl diagnose world:\n%s\n", table.c_str());
  EXPECT_THAT(table, HasSubstr("ranks [3] (host host1) have not called it"));
  EXPECT_THAT(table, HasSubstr("RANK  HOST"));
  auto [jcode, json] = Ctl(cluster, {"--json", "diagnose", "world"});
  EXPECT_EQ(jcode, 0) << json;
  EXPECT_THAT(json, HasSubstr("\"missing\":[3]"));
  EXPECT_THAT(json, HasSubstr("\"oldest_incomplete_op\":\"ALL_REDUCE\""));
  auto [gcode, groups] = Ctl(cluster, {"groups"});
  EXPECT_EQ(gcode, 0) << groups;
  EXPECT_THAT(groups, HasSubstr("all_reduce #0 (1 missing)"));
  auto [hcode, health] = Ctl(cluster, {"health"});
  EXPECT_EQ(hcode, 0) << health;
  EXPECT_THAT(health, HasSubstr("collserve.v1.Store"));
  EXPECT_THAT(health, HasSubstr("SERVING"));
  EXPECT_THAT(health, HasSubstr("host0"));
  EXPECT_THAT(health, HasSubstr("host1"));

  // At the op timeout the callers fail; host0's ranks learn who was missing from the ledger.
  for (int r = 0; r < 3; ++r) {
    auto c = ranks[r]->Wait(absl::Seconds(60));
    ASSERT_TRUE(c.ok()) << "rank " << r << " hung: " << ranks[r]->Output();
    EXPECT_EQ(*c, 3) << ranks[r]->Output();
  }
  EXPECT_THAT(ranks[2]->Output(), HasSubstr("all_reduce #0 of group \"world\" timed out on host host1 after 12s: "
                                            "local ranks [3] did not call it (local ranks [2] did)"));
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(ranks[r]->Output(), HasSubstr("the coordinator's ledger: all_reduce #0 of group \"world\""));
    EXPECT_THAT(ranks[r]->Output(), HasSubstr("ranks [3] (host host1) have not called it"));
  }
}

// One GPU per rank (COLLSERVE_CUDA_PATH=nccl): the ranks run NCCL themselves, and the
// records of their collectives (collserve.v1.Collective.in_rank) keep the ledger. Ranks 0-2
// wait inside the stand-in for NCCL (tests/testing/store_rank_comm.h) for rank 3, which never
// calls; the coordinator names it as it does for collectives through the sidecars.
TEST(DiagnoseTest, RanksRunningNcclThemselvesKeepTheLedger) {
  auto started = Cluster::Start(2);
  ASSERT_TRUE(started.ok()) << started.status();
  Cluster& cluster = **started;
  auto started_ranks =
      StartFourRank3Idle(cluster, {"--mode=rank_nccl_hang"}, [](int) { return std::map<std::string, std::string>{}; });
  ASSERT_TRUE(started_ranks.ok()) << started_ranks.status();
  std::vector<std::unique_ptr<Process>>& ranks = *started_ranks;
  pb::DiagnoseGroupResponse named;
  const bool found = AwaitOneOfFourMissing(cluster, &named);
  ASSERT_TRUE(found) << named.summary() << cluster.Logs();
  EXPECT_EQ(named.missing(0), 3);
  EXPECT_EQ(named.oldest_incomplete_op(), pb::ALL_REDUCE);
  EXPECT_LE(named.waiting_ms(), 5000) << named.summary();
  EXPECT_THAT(named.summary(), HasSubstr("all_reduce #0 of group \"world\" (generation 1): ranks [3] (host host1) "
                                         "have not called it; ranks [0, 1, 2] have"));
  for (int r = 0; r < 3; ++r) {
    // Still waiting in NCCL's stand-in (the test's cleanup ends them).
    EXPECT_THAT(ranks[r]->Output(), Not(HasSubstr("all_reduce:"))) << ranks[r]->Output();
  }
}

// The other host gives up first (its op timeout is shorter, or its clock ran ahead under
// load): its ranks leave, and this host's exchange fails with their departure before its own
// timeout. The error still carries the ledger's diagnosis, so the user learns who never
// called, not only who left.
TEST(DiagnoseTest, ThePeerHostLeavingAtItsOwnTimeoutStillGivesTheLedgerDiagnosis) {
  auto started = Cluster::Start(2);
  ASSERT_TRUE(started.ok()) << started.status();
  Cluster& cluster = **started;
  // Ranks 0 and 1 on host0 (op timeout 30 s), 2 and 3 on host1 (6 s); rank 3 never calls.
  auto started_ranks = StartFourRank3Idle(cluster, {"--mode=loop", "--iters=1", "--count=1000"}, [](int r) {
    return std::map<std::string, std::string>{{"COLLSERVE_OP_TIMEOUT_S", r < 2 ? "30" : "6"}};
  });
  ASSERT_TRUE(started_ranks.ok()) << started_ranks.status();
  std::vector<std::unique_ptr<Process>>& ranks = *started_ranks;
  for (int r = 0; r < 3; ++r) {
    auto c = ranks[r]->Wait(absl::Seconds(60));
    ASSERT_TRUE(c.ok()) << "rank " << r << " hung: " << ranks[r]->Output();
    EXPECT_EQ(*c, 3) << ranks[r]->Output();
  }
  EXPECT_THAT(ranks[2]->Output(), HasSubstr("all_reduce #0 of group \"world\" timed out on host host1 after 6s: "
                                            "local ranks [3] did not call it (local ranks [2] did)"));
  for (int r = 0; r < 2; ++r) {
    std::printf("rank %d: %s\n", r, ranks[r]->Output().c_str());
    // Who left, and what the ledger says.
    EXPECT_THAT(ranks[r]->Output(), HasSubstr("rank 2 left"));
    EXPECT_THAT(ranks[r]->Output(), HasSubstr("the coordinator's ledger: all_reduce #0 of group \"world\""));
    EXPECT_THAT(ranks[r]->Output(), HasSubstr("ranks [3] (host host1) have not called it"));
    EXPECT_THAT(ranks[r]->Output(), Not(HasSubstr("(host )")));
  }
}

TEST(DiagnoseTest, ARankDelayed200MsPerStepIsNamedAsTheStragglerWithin5Seconds) {
  // Ranks 0 and 1 on host0, 2 and 3 on host1; rank 2 calls each all_reduce 200 ms late.
  // The sidecars log their flight recorder when a collective takes over 150 ms.
  auto started = Cluster::Start(2, {}, {"--flight_recorder_log_threshold=150ms"});
  ASSERT_TRUE(started.ok()) << started.status();
  Cluster& cluster = **started;
  std::vector<std::unique_ptr<Process>> ranks;
  for (int r = 0; r < 4; ++r) {
    std::vector<std::string> args = {"--mode=loop", "--iters=60", "--count=1000"};
    if (r == 2) args.push_back("--delay_ms=200");
    auto p = cluster.StartRank(r, 4, r / 2, args);
    ASSERT_TRUE(p.ok()) << p.status();
    ranks.push_back(std::move(*p));
  }
  // From the first step that completes, collservectl diagnose names rank 2 within 5 s.
  absl::Time first_step = absl::InfiniteFuture();
  std::string table;
  const bool named = WaitFor(
      [&] {
        if (first_step == absl::InfiniteFuture() && absl::StrContains(ranks[0]->Output(), "iter 0 ok")) {
          first_step = absl::Now();
        }
        auto [code, out] = Ctl(cluster, {"diagnose", "world"});
        table = out;
        const bool found = code == 0 && absl::StrContains(out, "straggler: rank 2 (host host1) called last in");
        // On a loaded machine collservectl can name the straggler before this loop read rank
        // 0's "iter 0 ok": the step completed while diagnose ran, so it was named at once.
        if (found && first_step == absl::InfiniteFuture()) first_step = absl::Now();
        return found;
      },
      absl::Seconds(60), absl::Milliseconds(200));
  ASSERT_TRUE(named) << table << cluster.Logs();
  const absl::Duration took = absl::Now() - first_step;
  std::printf("rank 2 named as the straggler %lld ms after the first step completed:\n%s\n",
              static_cast<long long>(absl::ToInt64Milliseconds(took)), table.c_str());
  EXPECT_LE(took, absl::Seconds(5));
  EXPECT_THAT(table, HasSubstr("stragglers (the last rank to call a collective"));

  // The flight recorder through collservectl: a table, and JSON with every rank's arrival.
  auto [dcode, dump] = Ctl(cluster, {"dump", "world"});
  EXPECT_EQ(dcode, 0) << dump;
  std::printf("collservectl dump world:\n%s\n", dump.c_str());
  EXPECT_THAT(dump, HasSubstr("SEQ  OP"));
  EXPECT_THAT(dump, HasSubstr("all_reduce  1000"));
  // Each sidecar publishes its host's arrivals with its own progress report, so a dump taken
  // right after the first collective may hold one host's half; wait until both have arrived.
  std::string json;
  const bool both_hosts = WaitFor(
      [&] {
        auto [jcode, out] = Ctl(cluster, {"--json", "dump", "world"});
        json = out;
        return jcode == 0 && absl::StrContains(out, "{\"rank\":3,\"arrived_unix_us\":\"") &&
               absl::StrContains(out, "{\"rank\":0,\"arrived_unix_us\":\"");
      },
      absl::Seconds(10), absl::Milliseconds(100));
  EXPECT_TRUE(both_hosts) << json;
  EXPECT_THAT(json, HasSubstr("\"last_rank\":2"));
  // Rank 2 is among the stragglers (a slow start can make another rank last once).
  EXPECT_THAT(json, HasSubstr("{\"rank\":2,\"host_id\":\"host1\",\"last_count\":"));
  EXPECT_THAT(json, HasSubstr("{\"rank\":3,\"arrived_unix_us\":\""));
  EXPECT_THAT(json, HasSubstr("\"host_id\":\"host0\""));
  // The coordinator knows the group's sidecars' addresses (Member.sidecar_address):
  // health and version reach them without --sidecar.
  auto [hcode, health] = Ctl(cluster, {"health"});
  EXPECT_EQ(hcode, 0) << health;
  EXPECT_THAT(health, ::testing::ContainsRegex("host0 +127.0.0.1:[0-9]+ +SERVING +SERVING"));
  EXPECT_THAT(health, ::testing::ContainsRegex("host1 +127.0.0.1:[0-9]+ +SERVING +SERVING"));
  auto [vcode, version] = Ctl(cluster, {"version"});
  EXPECT_EQ(vcode, 0) << version;
  EXPECT_THAT(version, ::testing::ContainsRegex("sidecar +127.0.0.1:[0-9]+ +[0-9.]+ +host1"));
  for (auto& r : ranks) {
    auto c = r->Wait(absl::Seconds(60));
    ASSERT_TRUE(c.ok()) << r->Output();
    EXPECT_EQ(*c, 0) << r->Output();
  }
  // Every step took over 150 ms from its first call: the sidecars logged their records.
  EXPECT_THAT(cluster.sidecar(1).Output(), HasSubstr("flight recorder of group \"world\" of job \"default\""));
  EXPECT_THAT(cluster.sidecar(1).Output(), HasSubstr("over the flight recorder's log threshold of 150ms): {"));
  EXPECT_THAT(cluster.sidecar(0).Output(), HasSubstr("\"last_rank\":2"));
}

// A rank that calls the collective with another count (or op, or root: DesyncTest covers
// each kind's error) is caught by the argument exchange at once: every rank's error names
// the ranks, the op and the sequence number, the group stays usable, and the flight
// recorder keeps the failed collective for `collservectl dump` while the ranks live.
TEST(DiagnoseTest, ARankWithAnotherCountIsNamedInTheErrorAndTheDumpWithin5Seconds) {
  auto started = Cluster::Start(2);
  ASSERT_TRUE(started.ok()) << started.status();
  Cluster& cluster = **started;
  std::vector<std::unique_ptr<Process>> ranks;
  const absl::Time start = absl::Now();
  for (int r = 0; r < 4; ++r) {
    auto p = cluster.StartRank(r, 4, r / 2,
                               {"--mode=loop", "--iters=1", r == 3 ? "--count=999" : "--count=1000", "--hold_s=30"});
    ASSERT_TRUE(p.ok()) << p.status();
    ranks.push_back(std::move(*p));
  }
  std::string dump;
  const bool named = WaitFor(
      [&] {
        auto [code, out] = Ctl(cluster, {"dump", "world"});
        dump = out;
        return code == 0 && absl::StrContains(out, "INVALID_ARGUMENT");
      },
      absl::Seconds(60), absl::Milliseconds(200));
  ASSERT_TRUE(named) << dump << cluster.Logs();
  // From the processes' start (their rendezvous included) to the dump naming it.
  EXPECT_LE(absl::Now() - start, absl::Seconds(10));
  std::printf("collservectl dump world, %lld ms after the ranks started:\n%s\n",
              static_cast<long long>(absl::ToInt64Milliseconds(absl::Now() - start)), dump.c_str());
  EXPECT_THAT(dump, HasSubstr("#0: ranks disagree: count=999 on ranks [3] but count=1000 on ranks [0, 1, 2]"));
  for (int r = 0; r < 4; ++r) {
    EXPECT_THAT(ranks[r]->Output(), HasSubstr("all_reduce #0 of group \"world\": ranks disagree: count=999 on ranks "
                                              "[3] but count=1000 on ranks [0, 1, 2]"))
        << ranks[r]->Output();
  }
}

TEST(DiagnoseTest, CollservectlListsKeysGetsValuesAndShowsVersionsAndSidecarHealth) {
  auto started = Cluster::Start(1);
  ASSERT_TRUE(started.ok()) << started.status();
  Cluster& cluster = **started;
  client::StoreClientOptions o;
  o.token = cluster.job_token();
  auto store = client::StoreClient::Connect(cluster.coordinator_address(), o);
  ASSERT_TRUE(store.ok()) << store.status();
  for (int i = 0; i < 25; ++i) ASSERT_TRUE((*store)->Set(absl::StrCat("ckpt/step", 100 + i), "x").ok());
  ASSERT_TRUE((*store)->Set("lr", "0.001").ok());
  ASSERT_TRUE((*store)->Set("bin", std::string("a\0b", 3)).ok());

  // keys pages through the store (--limit 10: several pages of ListKeys are not needed to
  // see 10, but the prefix and the order are the store's).
  auto [kcode, keys] = Ctl(cluster, {"keys", "ckpt/"});
  EXPECT_EQ(kcode, 0) << keys;
  EXPECT_THAT(keys, HasSubstr("ckpt/step100\nckpt/step101\n"));
  EXPECT_THAT(keys, HasSubstr("ckpt/step124\n"));
  EXPECT_THAT(keys, ::testing::Not(HasSubstr("lr")));
  auto [lcode, limited] = Ctl(cluster, {"--limit=3", "keys"});
  EXPECT_EQ(lcode, 0) << limited;
  EXPECT_THAT(limited, HasSubstr("bin\nckpt/step100\nckpt/step101\n"));
  EXPECT_THAT(limited, HasSubstr("more keys match; raise --limit"));
  auto [jcode, json] = Ctl(cluster, {"--json", "keys", "l"});
  EXPECT_EQ(jcode, 0) << json;
  EXPECT_THAT(json, HasSubstr("{\"keys\":[\"bHI=\"],\"more\":false}"));  // bytes are base64 in JSON
  auto [gcode, value] = Ctl(cluster, {"get", "lr"});
  EXPECT_EQ(gcode, 0) << value;
  EXPECT_EQ(value, "0.001\n");
  auto [bcode, binary] = Ctl(cluster, {"get", "bin"});
  EXPECT_EQ(bcode, 0) << binary;
  EXPECT_EQ(binary, "a\\x00\\x62\n");  // C-escaped (absl::CHexEscape: no hex digit may follow an escape)
  auto [ncode, none] = Ctl(cluster, {"get", "nope"});
  EXPECT_EQ(ncode, 1);
  EXPECT_THAT(none, HasSubstr("NOT_FOUND: job default has no key \"nope\""));

  // version: collservectl's, the coordinator's and the sidecar's; health: the sidecar's
  // readiness and liveness.
  const std::string sidecar = absl::StrCat("--sidecar=", cluster.sidecar_address(0), ",", cluster.sidecar_tcp_address(0));
  auto [vcode, version] = Ctl(cluster, {sidecar, "version"});
  EXPECT_EQ(vcode, 0) << version;
  EXPECT_THAT(version, HasSubstr("DAEMON       ADDRESS"));
  EXPECT_THAT(version, ::testing::ContainsRegex("coordinator +127.0.0.1:[0-9]+ +[0-9]+\\.[0-9]+\\.[0-9]+ +-"));
  EXPECT_THAT(version, ::testing::ContainsRegex("sidecar +unix:[^ ]+ +[0-9]+\\.[0-9]+\\.[0-9]+ +host0"));
  EXPECT_THAT(version, ::testing::ContainsRegex("sidecar +127.0.0.1:[0-9]+ +[0-9.]+ +host0"));
  auto [hcode, health] = Ctl(cluster, {sidecar, "health"});
  EXPECT_EQ(hcode, 0) << health;
  EXPECT_THAT(health, ::testing::ContainsRegex("unix:[^ ]+ +SERVING +SERVING"));
  // jobs: with the admin token only.
  auto [jobs_code, jobs] = Ctl(cluster, {"jobs"}, cluster.admin_token());
  EXPECT_EQ(jobs_code, 0) << jobs;
  EXPECT_THAT(jobs, ::testing::ContainsRegex("JOB +KEYS +BYTES +GROUPS\ndefault +27 +[0-9]+ +0\n"));
  EXPECT_THAT(jobs, ::testing::Not(HasSubstr("#auth")));
  auto [denied_code, denied] = Ctl(cluster, {"jobs"});
  EXPECT_EQ(denied_code, 1) << denied;
  EXPECT_THAT(denied, ::testing::ContainsRegex("PERMISSION_DENIED|UNAUTHENTICATED"));
  auto [vjcode, vjson] = Ctl(cluster, {sidecar, "--json", "version"});
  EXPECT_THAT(vjson, HasSubstr("\"daemon\":\"sidecar\""));
  EXPECT_THAT(vjson, HasSubstr("\"host_id\":\"host0\""));
}

// health is usable as a probe: exit 0 only when everything it checked serves, 1 when the
// coordinator or a sidecar is unreachable (naming it), 2 for a usage error.
TEST(DiagnoseTest, HealthExitsOneWhenTheCoordinatorOrASidecarIsUnreachable) {
  // A host id with a quote and a backslash: the JSON output escapes it.
  auto started = Cluster::Start(1, {}, {}, {{"--host_id=host\"0\\x"}});
  ASSERT_TRUE(started.ok()) << started.status();
  Cluster& cluster = **started;
  const std::string sidecar = absl::StrCat("--sidecar=", cluster.sidecar_address(0));
  auto [up_code, up] = Ctl(cluster, {sidecar, "health"});
  EXPECT_EQ(up_code, 0) << up;
  auto [json_code, json] = Ctl(cluster, {sidecar, "--json", "health"});
  EXPECT_EQ(json_code, 0) << json;
  EXPECT_THAT(json, HasSubstr("{\"healthy\":true,"));
  auto [version_code, version] = Ctl(cluster, {sidecar, "--json", "version"});
  EXPECT_EQ(version_code, 0) << version;
  EXPECT_THAT(version, HasSubstr(R"("host_id":"host\"0\\x")"));

  auto [down_code, down] = Ctl(cluster, {"--coordinator=127.0.0.1:1", "--timeout=2s", "health"});
  EXPECT_EQ(down_code, 1) << down;
  EXPECT_THAT(down, HasSubstr("not healthy: coordinator 127.0.0.1:1"));
  auto [nosc_code, nosc] = Ctl(cluster, {"--sidecar=unix:/nope.sock", "--timeout=2s", "health"});
  EXPECT_EQ(nosc_code, 1) << nosc;
  EXPECT_THAT(nosc, HasSubstr("sidecar unix:/nope.sock readiness"));
  auto [njson_code, njson] = Ctl(cluster, {"--sidecar=unix:/nope.sock", "--timeout=2s", "--json", "health"});
  EXPECT_EQ(njson_code, 1) << njson;
  EXPECT_THAT(njson, HasSubstr("{\"healthy\":false,"));
  // Both first lines are JSON objects (names and error texts are escaped by protobuf's JSON
  // printer; they were once pasted in raw); the verdict follows on stderr.
  for (const std::string& text : {json, version, njson}) {
    google::protobuf::Struct parsed;
    const auto parsed_status = google::protobuf::util::JsonStringToMessage(text.substr(0, text.find('\n')), &parsed);
    EXPECT_TRUE(parsed_status.ok()) << parsed_status << "\n" << text;
  }

  // A sidecar that was serving and died.
  cluster.sidecar(0).Kill(SIGKILL);
  ASSERT_TRUE(cluster.sidecar(0).Wait(absl::Seconds(10)).ok());
  auto [dead_code, dead] = Ctl(cluster, {sidecar, "--timeout=2s", "health"});
  EXPECT_EQ(dead_code, 1) << dead;

  auto [usage_code, usage] = Ctl(cluster, {});
  EXPECT_EQ(usage_code, 2) << usage;
  auto [unknown_code, unknown] = Ctl(cluster, {"no-such-command"});
  EXPECT_EQ(unknown_code, 2) << unknown;
}

TEST(DiagnoseTest, CollservectlRefusesWithoutAToken) {
  auto started = Cluster::Start(0);
  ASSERT_TRUE(started.ok()) << started.status();
  auto p = Process::Start({CollservectlBinary(), absl::StrCat("--coordinator=", (*started)->coordinator_address()),
                           "groups"},
                          {}, (*started)->dir() + "/ctl.log");
  ASSERT_TRUE(p.ok());
  auto code = (*p)->Wait(absl::Seconds(30));
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 1);
  EXPECT_THAT((*p)->Output(), HasSubstr("UNAUTHENTICATED"));
}

// collservectl wait: a readiness gate for "the job's group is formed". It reports who is
// missing while it waits, fails at --wait_timeout, and succeeds once every rank joined.
TEST(DiagnoseTest, CollservectlWaitReportsMissingRanksAndReturnsOnceTheGroupFormed) {
  auto started = Cluster::Start(1);
  ASSERT_TRUE(started.ok()) << started.status();
  Cluster& cluster = **started;
  std::vector<std::unique_ptr<Process>> ranks;
  for (int r = 0; r < 2; ++r) {
    auto p = cluster.StartRank(r, 3, 0, {"--mode=idle", "--iters=30"}, {{"COLLSERVE_INIT_TIMEOUT_S", "60"}});
    ASSERT_TRUE(p.ok()) << p.status();
    ranks.push_back(std::move(*p));
  }
  auto [code, out] = Ctl(cluster, {"--wait_timeout=3s", "--progress_interval=500ms", "wait", "world"});
  EXPECT_EQ(code, 1) << out;
  EXPECT_THAT(out, HasSubstr("2 of 3 ranks joined; missing ranks [2]"));
  EXPECT_THAT(out, HasSubstr("DEADLINE_EXCEEDED: group \"world\" (job default) did not form within 3s"));
  // Without a group (what collserve launch runs): any group of the job, whatever its name,
  // but the launchers' own (collserve.launch, formed here by one rank of its own).
  auto launchers = cluster.StartRank(0, 1, 0, {"--mode=idle", "--iters=30", "--group=collserve.launch"});
  ASSERT_TRUE(launchers.ok()) << launchers.status();
  auto [formed_code, formed] = Ctl(cluster, {"--wait_timeout=20s", "wait", "collserve.launch"});
  ASSERT_EQ(formed_code, 0) << formed;
  auto [any_code, any_out] = Ctl(cluster, {"--wait_timeout=2s", "--progress_interval=500ms", "wait"});
  EXPECT_EQ(any_code, 1) << any_out;
  EXPECT_THAT(any_out, ::testing::ContainsRegex("waiting for the job's groups \\([0-9]+s\\): group \"world\" "
                                                "generation 1: 2 of 3 ranks joined; missing ranks \\[2\\]"));
  EXPECT_THAT(any_out, HasSubstr("DEADLINE_EXCEEDED: no group of job default formed within 2s: group \"world\""));
  auto last = cluster.StartRank(2, 3, 0, {"--mode=idle", "--iters=30"});
  ASSERT_TRUE(last.ok()) << last.status();
  auto [ok_code, ok_out] = Ctl(cluster, {"--wait_timeout=20s", "wait", "world"});
  EXPECT_EQ(ok_code, 0) << ok_out;
  EXPECT_THAT(ok_out, HasSubstr("group \"world\" (job default) formed: generation"));
  EXPECT_THAT(ok_out, HasSubstr("3 ranks on 1 host(s)"));
  auto [any_ok_code, any_ok] = Ctl(cluster, {"--wait_timeout=20s", "wait"});
  EXPECT_EQ(any_ok_code, 0) << any_ok;
  EXPECT_THAT(any_ok, HasSubstr("group \"world\" (job default) formed: generation 1"));
}

// A group re-formed in place keeps its name at the next generation (collserve.reconfigure):
// the first rank of generation 2 ends generation 1 for its members, and wait follows the
// name, reporting the new generation's progress.
TEST(DiagnoseTest, CollservectlWaitFollowsAGroupReformedInPlace) {
  auto started = Cluster::Start(1);
  ASSERT_TRUE(started.ok()) << started.status();
  Cluster& cluster = **started;
  std::vector<std::unique_ptr<Process>> ranks;
  auto start = [&](int rank, int world, const std::string& group, int64_t generation = 0) {
    auto p = cluster.StartRank(rank, world, 0,
                               {"--mode=idle", "--iters=30", "--group=" + group,
                                absl::StrCat("--generation=", generation)},
                               {{"COLLSERVE_INIT_TIMEOUT_S", "60"}});
    ASSERT_TRUE(p.ok()) << p.status();
    ranks.push_back(std::move(*p));
  };
  start(0, 2, "world");
  start(1, 2, "world");
  auto [first_code, first_out] = Ctl(cluster, {"--wait_timeout=20s", "wait", "world"});
  EXPECT_EQ(first_code, 0) << first_out;
  EXPECT_THAT(first_out, HasSubstr("formed: generation 1, 2 ranks"));
  start(0, 3, "world", 2);
  // Once its join reached the coordinator (the rank process starts first).
  WaitFor([&] { return absl::StrContains(Ctl(cluster, {"describe", "world"}).second, "generation 2"); },
          absl::Seconds(20), absl::Milliseconds(100));
  auto [code, out] = Ctl(cluster, {"--wait_timeout=3s", "--progress_interval=500ms", "wait", "world"});
  EXPECT_EQ(code, 1) << out;
  EXPECT_THAT(out, HasSubstr("generation 2: 1 of 3 ranks joined; missing ranks [1, 2]"));
  start(1, 3, "world", 2);
  start(2, 3, "world", 2);
  auto [ok_code, ok_out] = Ctl(cluster, {"--wait_timeout=20s", "wait", "world"});
  EXPECT_EQ(ok_code, 0) << ok_out;
  EXPECT_THAT(ok_out, HasSubstr("group \"world\" (job default) formed: generation 2, 3 ranks on 1 host(s)"));
  auto [d_code, d_out] = Ctl(cluster, {"describe", "world"});
  EXPECT_EQ(d_code, 0) << d_out;
  EXPECT_THAT(d_out, HasSubstr("group \"world\" (job default): generation 2, FORMED"));
}

// Issue 40: collservectl's help lists every command, has a page per command, and prints no
// build path (absl's --help grouped flags under their source file's path).
TEST(CollservectlTest, HelpListsEveryCommandWithAPageEachAndNoBuildPath) {
  auto started = Cluster::Start(0);
  ASSERT_TRUE(started.ok()) << started.status();
  Cluster& cluster = **started;
  auto [code, help] = Ctl(cluster, {"--help"});
  EXPECT_EQ(code, 0) << help;
  for (const char* command : {"health", "groups", "describe GROUP", "wait [GROUP]", "diagnose GROUP", "dump GROUP",
                              "jobs", "keys [PREFIX]", "get KEY", "delete-group GROUP", "delete-keys PREFIX",
                              "delete-job", "drain", "undrain", "version", "mint-token", "revoke-tokens"}) {
    EXPECT_THAT(help, HasSubstr(absl::StrCat("\n  ", command, " "))) << command;
  }
  EXPECT_THAT(help, HasSubstr("--coordinator="));
  EXPECT_THAT(help, HasSubstr("Exit status: 0"));
  auto [page_code, page] = Ctl(cluster, {"help", "delete-keys"});
  EXPECT_EQ(page_code, 0) << page;
  EXPECT_THAT(page, HasSubstr("Usage: collservectl [FLAGS] delete-keys PREFIX\n"));
  auto [flag_code, flag_page] = Ctl(cluster, {"health", "--help"});
  EXPECT_EQ(flag_code, 0) << flag_page;
  EXPECT_THAT(flag_page, HasSubstr("Usage: collservectl [FLAGS] health\n"));
  auto [full_code, full] = Ctl(cluster, {"--helpfull"});
  EXPECT_EQ(full_code, 1) << full;  // (absl's --helpfull exits 1)
  for (const std::string& out : {help, page, flag_page, full}) {
    EXPECT_THAT(out, Not(HasSubstr("server/ctl/"))) << out;  // the source file's build path
  }
  auto [missing_code, missing] = Ctl(cluster, {"describe"});
  EXPECT_EQ(missing_code, 2) << missing;
  EXPECT_THAT(missing, HasSubstr("collservectl describe: missing argument\nUsage: collservectl [FLAGS] describe GROUP"));
  auto [empty_code, empty] = Ctl(cluster, {"delete-keys", ""});
  EXPECT_EQ(empty_code, 2) << empty;
  EXPECT_THAT(empty, HasSubstr("PREFIX may not be empty"));
}

// delete-group ends a running group for its ranks at once, naming the deletion; delete-keys
// deletes a prefix; delete-job, a finished job's cleanup, is refused while a group is FORMED
// and then deletes every group and key. Another job's groups need the admin token.
TEST(CollservectlTest, DeleteGroupDeleteKeysAndDeleteJobExitCodes) {
  auto started = Cluster::Start(1);
  ASSERT_TRUE(started.ok()) << started.status();
  Cluster& cluster = **started;
  client::StoreClientOptions o;
  o.token = cluster.job_token();
  auto store = client::StoreClient::Connect(cluster.coordinator_address(), o);
  ASSERT_TRUE(store.ok()) << store.status();
  for (int i = 0; i < 1200; ++i) ASSERT_TRUE((*store)->Set(absl::StrCat("ckpt/", 1000 + i), "x").ok());
  ASSERT_TRUE((*store)->Set("lr", "0.001").ok());

  // Two ranks that run allreduces until an error: the deletion is that error.
  std::vector<std::unique_ptr<Process>> ranks;
  for (int r = 0; r < 2; ++r) {
    auto p = cluster.StartRank(r, 2, 0, {"--mode=loop", "--count=16", "--iters=0"});
    ASSERT_TRUE(p.ok()) << p.status();
    ranks.push_back(std::move(*p));
  }
  ASSERT_TRUE(WaitFor([&] { return absl::StrContains(Ctl(cluster, {"groups"}).second, "FORMED"); },
                      absl::Seconds(30), absl::Milliseconds(100)))
      << cluster.Logs();
  auto [refused_code, refused] = Ctl(cluster, {"delete-job"});
  EXPECT_EQ(refused_code, 1) << refused;
  EXPECT_THAT(refused, HasSubstr("FAILED_PRECONDITION: job default has formed groups: world (2 ranks)"));
  auto [other_code, other] = Ctl(cluster, {"--job=other", "delete-group", "world"});
  EXPECT_EQ(other_code, 1) << other;
  EXPECT_THAT(other, ::testing::ContainsRegex("PERMISSION_DENIED|UNAUTHENTICATED"));

  auto [del_code, del] = Ctl(cluster, {"delete-group", "world"});
  EXPECT_EQ(del_code, 0) << del;
  EXPECT_THAT(del, HasSubstr("deleted group world of job default: generation 1, FORMED, 2 rank(s)"));
  for (auto& rank : ranks) {
    auto code = rank->Wait(absl::Seconds(30));
    ASSERT_TRUE(code.ok()) << code.status();
    EXPECT_NE(*code, 0) << rank->Output();
    EXPECT_THAT(rank->Output(), HasSubstr("an operator deleted the group (collservectl delete-group)"));
  }
  auto [again_code, again] = Ctl(cluster, {"delete-group", "world"});
  EXPECT_EQ(again_code, 1) << again;
  EXPECT_THAT(again, HasSubstr("NOT_FOUND: DeleteGroup at"));

  auto [keys_code, keys] = Ctl(cluster, {"delete-keys", "ckpt/"});
  EXPECT_EQ(keys_code, 0) << keys;
  EXPECT_THAT(keys, HasSubstr("deleted 1200 key(s) of job default starting with \"ckpt/\""));
  EXPECT_EQ(Ctl(cluster, {"keys"}).second, "lr\n");

  // A group that never formed (one of two ranks), then the whole job.
  auto lone = cluster.StartRank(0, 2, 0, {"--mode=idle", "--iters=30", "--group=half"},
                                {{"COLLSERVE_INIT_TIMEOUT_S", "60"}});
  ASSERT_TRUE(lone.ok()) << lone.status();
  ASSERT_TRUE(WaitFor([&] { return absl::StrContains(Ctl(cluster, {"groups"}).second, "FORMING"); },
                      absl::Seconds(30), absl::Milliseconds(100)));
  auto [job_code, job] = Ctl(cluster, {"delete-job"});
  EXPECT_EQ(job_code, 0) << job;
  EXPECT_THAT(job, HasSubstr("deleted job default: 1 group(s), 1 key(s)"));
  auto lone_code = (*lone)->Wait(absl::Seconds(30));
  ASSERT_TRUE(lone_code.ok());
  EXPECT_THAT((*lone)->Output(), HasSubstr("was deleted by an operator"));
  auto [jobs_code, jobs] = Ctl(cluster, {"jobs"}, cluster.admin_token());
  EXPECT_EQ(jobs_code, 0) << jobs;
  EXPECT_THAT(jobs, Not(HasSubstr("\ndefault ")));
}

// Issue 40: a one-host group is leased like one across hosts, so a sidecar killed with
// SIGKILL leaves no FORMED group behind: it is gone from `collservectl groups` within the
// lease (the coordinator's --lease_grace, 3 s, after the sidecar's last watch ended; the
// watch is renewed every --lease_renewal, 2 s). A sidecar restarted with the same host id is
// a new host: its ranks form the group again at once, and the earlier process is named lost.
TEST(CollservectlTest, AKilledSidecarsOneHostGroupIsGoneWithinTheLeaseAndARestartIsANewHost) {
  auto started = Cluster::Start(1, {kMeasuredLeaseGraceFlag});
  ASSERT_TRUE(started.ok()) << started.status();
  Cluster& cluster = **started;
  std::vector<std::unique_ptr<Process>> ranks;
  auto start_ranks = [&](const std::string& group) {
    for (int r = 0; r < 2; ++r) {
      auto p = cluster.StartRank(r, 2, 0, {"--mode=idle", "--iters=60", "--group=" + group});
      ASSERT_TRUE(p.ok()) << p.status();
      ranks.push_back(std::move(*p));
    }
  };
  start_ranks("world");
  auto formed = [&](const std::string& group) {
    return WaitFor(
        [&] {
          auto out = Ctl(cluster, {"describe", group}).second;
          return absl::StrContains(out, "FORMED") && absl::StrContains(out, "generation");
        },
        absl::Seconds(30), absl::Milliseconds(100));
  };
  ASSERT_TRUE(formed("world")) << cluster.Logs();
  cluster.sidecar(0).Kill(SIGKILL);
  const absl::Time killed = absl::Now();
  ASSERT_TRUE(cluster.sidecar(0).Wait(absl::Seconds(10)).ok());
  ASSERT_TRUE(WaitFor([&] { return !absl::StrContains(Ctl(cluster, {"groups"}).second, "world"); },
                      absl::Seconds(30), absl::Milliseconds(100)))
      << cluster.Logs();
  const absl::Duration gone = absl::Now() - killed;
  EXPECT_LT(gone, absl::Seconds(5) + absl::Seconds(2)) << "documented: --lease_grace 3 s + --lease_renewal 2 s";
  std::printf("one-host group gone %s after its sidecar's SIGKILL\n", absl::FormatDuration(gone).c_str());
  ranks.clear();

  // A restart within the lease: the earlier process's group is taken as lost at the new
  // one's first join, and the group forms again (generation 2) without waiting it out.
  cluster.RestartSidecar(0).IgnoreError();
  start_ranks("again");
  ASSERT_TRUE(formed("again"));
  ranks.clear();
  cluster.sidecar(0).Kill(SIGKILL);
  ASSERT_TRUE(cluster.sidecar(0).Wait(absl::Seconds(10)).ok());
  ASSERT_TRUE(cluster.RestartSidecar(0).ok());
  const absl::Time restarted = absl::Now();
  start_ranks("again");
  ASSERT_TRUE(WaitFor([&] { return absl::StrContains(Ctl(cluster, {"describe", "again"}).second, "generation 2"); },
                      absl::Seconds(30), absl::Milliseconds(100)))
      << Ctl(cluster, {"describe", "again"}).second << cluster.Logs();
  EXPECT_TRUE(formed("again"));
  EXPECT_LT(absl::Now() - restarted, absl::Seconds(20));
}

// Issue 40: draining a sidecar (before an upgrade) refuses new sessions with an error that
// names the drain and turns it not ready, while the job attached runs to its end; drain
// waits for it, or names what still runs at --drain_timeout. Only the admin socket (mode
// 0600) serves it.
TEST(CollservectlTest, DrainLetsTheRunningJobFinishAndRefusesNewSessionsNamingTheDrain) {
  auto started = Cluster::Start(1);
  ASSERT_TRUE(started.ok()) << started.status();
  Cluster& cluster = **started;
  const std::string socket = cluster.sidecar_address(0).substr(5);  // (after "unix:")
  const std::string admin = absl::StrCat("--sidecar=unix:", socket, ".admin");
  struct stat st {};
  ASSERT_EQ(stat((socket + ".admin").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);

  std::vector<std::unique_ptr<Process>> ranks;
  for (int r = 0; r < 2; ++r) {
    auto p = cluster.StartRank(r, 2, 0, {"--mode=loop", "--count=16", "--iters=300", "--delay_ms=30"});
    ASSERT_TRUE(p.ok()) << p.status();
    ranks.push_back(std::move(*p));
  }
  ASSERT_TRUE(ranks[0]->WaitForOutput("iter 0 ok", absl::Seconds(30))) << ranks[0]->Output() << cluster.Logs();

  auto [short_code, short_out] = Ctl(cluster, {admin, "--drain_timeout=1s", "drain"});
  EXPECT_EQ(short_code, 1) << short_out;
  EXPECT_THAT(short_out, HasSubstr("is draining but 2 session(s) are still attached after 1s: job default group "
                                   "world (generation 1, ranks [0, 1], ready)"));
  // A new session is refused, naming the drain; the sidecar is not ready.
  auto refused = cluster.StartRank(0, 1, 0, {"--mode=single", "--group=late"});
  ASSERT_TRUE(refused.ok()) << refused.status();
  auto refused_code = (*refused)->Wait(absl::Seconds(30));
  ASSERT_TRUE(refused_code.ok());
  EXPECT_NE(*refused_code, 0) << (*refused)->Output();
  EXPECT_THAT((*refused)->Output(), HasSubstr("sidecar host0 is draining (collservectl drain, since "));
  auto [health_code, health] = Ctl(cluster, {absl::StrCat("--sidecar=", cluster.sidecar_address(0)), "health"});
  EXPECT_EQ(health_code, 1) << health;
  EXPECT_THAT(health, HasSubstr("NOT_SERVING"));
  // The coordinator hears of the drain with the sidecar's next ledger report (its progress
  // interval is 1 s): diagnose names it, and health's hosts table says since when.
  std::string diagnosis;
  EXPECT_TRUE(WaitFor(
      [&] {
        diagnosis = Ctl(cluster, {"diagnose", "world"}).second;
        return absl::StrContains(diagnosis, "host host0's sidecar is draining (collservectl drain) since ");
      },
      absl::Seconds(10), absl::Milliseconds(200)))
      << diagnosis << cluster.Logs();
  EXPECT_THAT(diagnosis, HasSubstr("ready, draining, "));
  auto [drained_health_code, drained_health] =
      Ctl(cluster, {absl::StrCat("--sidecar=", cluster.sidecar_address(0)), "health"});
  EXPECT_EQ(drained_health_code, 1) << drained_health;
  EXPECT_THAT(drained_health, ::testing::ContainsRegex("since [0-9]+:[0-9]+:[0-9]+ UTC +world"));
  auto [json_health_code, json_health] =
      Ctl(cluster, {"--json", absl::StrCat("--sidecar=", cluster.sidecar_address(0)), "health"});
  EXPECT_EQ(json_health_code, 1) << json_health;
  EXPECT_THAT(json_health, ::testing::ContainsRegex("\"host_id\":\"host0\",\"ledger_age_ms\":[0-9]+,"
                                                    "\"draining_since_unix_ms\":[1-9][0-9]*,"));

  // The job attached runs to its end, and drain returns then.
  auto [drain_code, drained] = Ctl(cluster, {admin, "--drain_timeout=60s", "--progress_interval=1s", "drain"});
  EXPECT_EQ(drain_code, 0) << drained;
  EXPECT_THAT(drained, HasSubstr("sidecar host0 drained: no sessions attached"));
  for (auto& rank : ranks) {
    auto code = rank->Wait(absl::Seconds(60));
    ASSERT_TRUE(code.ok());
    EXPECT_EQ(*code, 0) << rank->Output();
    EXPECT_THAT(rank->Output(), HasSubstr("iter 299 ok"));
  }

  auto [undrain_code, undrained] = Ctl(cluster, {admin, "undrain"});
  EXPECT_EQ(undrain_code, 0) << undrained;
  EXPECT_THAT(undrained, HasSubstr("sidecar host0 undrained"));
  auto later = cluster.StartRank(0, 1, 0, {"--mode=single", "--group=later"});
  ASSERT_TRUE(later.ok()) << later.status();
  auto later_code = (*later)->Wait(absl::Seconds(30));
  ASSERT_TRUE(later_code.ok());
  EXPECT_EQ(*later_code, 0) << (*later)->Output();
  EXPECT_TRUE(WaitFor([&] { return Ctl(cluster, {absl::StrCat("--sidecar=", cluster.sidecar_address(0)), "health"}).first == 0; },
                      absl::Seconds(10), absl::Milliseconds(200)));

  // Not over the clients' socket nor TCP: only the admin socket serves SidecarAdmin.
  auto [tcp_code, tcp] = Ctl(cluster, {absl::StrCat("--sidecar=", cluster.sidecar_tcp_address(0)), "drain"});
  EXPECT_EQ(tcp_code, 1) << tcp;
  EXPECT_THAT(tcp, HasSubstr("need one --sidecar=unix:PATH"));
  auto [client_code, client] = Ctl(cluster, {absl::StrCat("--sidecar=", cluster.sidecar_address(0)), "drain"});
  EXPECT_EQ(client_code, 1) << client;
  EXPECT_THAT(client, HasSubstr("UNIMPLEMENTED"));
}

}  // namespace
}  // namespace collserve::testing
