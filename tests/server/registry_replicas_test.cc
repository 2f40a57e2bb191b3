// Coordinator replicas over one etcd (server/coordinator/registry_replication.h): three
// collserve-coordinator processes with --etcd_endpoints and --advertise_address elect one
// leader of the group registry; Registry calls reaching the others are forwarded to it.
// Tests: a group whose ranks join through different replicas forms once; a leader killed
// with SIGKILL during a rendezvous is replaced and the rendezvous completes, while store
// writes through a client given every replica's address lose nothing acknowledged; a leader
// that stops (SIGTERM) hands over at once (it revokes its lease); with TLS on the API
// (mutual TLS included), the followers forward to the leader over TLS and a follower that
// does not trust the leader's certificate forwards nothing; bad configurations are refused
// at start.
#include <grpcpp/grpcpp.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <iostream>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "collserve/client.h"
#include "collserve/v1/registry.grpc.pb.h"
#include "etcd/etcdserverpb/rpc.grpc.pb.h"
#include "server/coordinator/coordinator.h"
#include "server/coordinator/etcd_store.h"
#include "tests/testing/etcd_cluster.h"
#include "tests/testing/pki.h"
#include "tests/testing/process.h"
#include "tests/testing/sanitizers.h"
#include "tests/testing/store_conformance.h"
#include "tests/testing/wait_for.h"

namespace collserve::testing {
namespace {

namespace pb = ::collserve::v1;
using ::testing::HasSubstr;

struct FailoverTrial;

class RegistryReplicasTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto etcd = EtcdCluster::Start(1);
    ASSERT_TRUE(etcd.ok()) << etcd.status() << " (scripts/install_deps.sh installs etcd-server)";
    etcd_ = std::move(*etcd);
    char tmpl[] = "/tmp/collserve-replicas.XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    prefix_ = absl::StrCat("replicas-", getpid(), "/");
  }
  void TearDown() override {
    replicas_.clear();
    etcd_.reset();
    std::system(absl::StrCat("rm -rf ", dir_).c_str());
  }

  // Starts replica i (a process) with `flags` added; returns its port.
  int StartReplica(int i, absl::Duration lease_ttl = absl::Seconds(2), const std::vector<std::string>& flags = {}) {
    const std::string port_file = absl::StrCat(dir_, "/replica", i, ".port");
    unlink(port_file.c_str());
    std::vector<std::string> argv = {
        CoordinatorBinary(), "--listen_address=127.0.0.1:0", "--metrics_address=", "--allow_unauthenticated",
        absl::StrCat("--port_file=", port_file), absl::StrCat("--etcd_endpoints=", absl::StrJoin(etcd_->endpoints(), ",")),
        absl::StrCat("--etcd_prefix=", prefix_), "--advertise_address=127.0.0.1:0",
        absl::StrCat("--registry_lease_ttl=", absl::FormatDuration(lease_ttl))};
    argv.insert(argv.end(), flags.begin(), flags.end());
    auto p = Process::Start(argv, {}, absl::StrCat(dir_, "/replica", i, ".log"));
    EXPECT_TRUE(p.ok()) << p.status();
    if (!p.ok()) return 0;
    auto port = ReadPortFile(port_file, **p, absl::Seconds(30));
    EXPECT_TRUE(port.ok()) << port.status();
    if (replicas_.size() <= static_cast<size_t>(i)) replicas_.resize(i + 1);
    replicas_[i] = std::move(*p);
    if (ports_.size() <= static_cast<size_t>(i)) ports_.resize(i + 1);
    ports_[i] = port.ok() ? *port : 0;
    return ports_[i];
  }

  // The leader key's value in etcd ("" = none).
  std::string LeaderAddress() {
    auto kv = etcdserverpb::KV::NewStub(
        grpc::CreateChannel(etcd_->endpoints().front(), grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    etcdserverpb::RangeRequest req;
    req.set_key(absl::StrCat(prefix_, "registry/leader"));
    etcdserverpb::RangeResponse resp;
    if (!kv->Range(&ctx, req, &resp).ok() || resp.kvs_size() == 0) return "";
    return resp.kvs(0).value();
  }

  // The registry journal's records in etcd (registry_journal.h): their keys.
  std::vector<std::string> JournalKeys() {
    auto kv = etcdserverpb::KV::NewStub(
        grpc::CreateChannel(etcd_->endpoints().front(), grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    etcdserverpb::RangeRequest req;
    req.set_key(absl::StrCat(prefix_, "registry/groups/"));
    req.set_range_end(server::EtcdPrefixEnd(req.key()));
    req.set_keys_only(true);
    etcdserverpb::RangeResponse resp;
    std::vector<std::string> keys;
    if (!kv->Range(&ctx, req, &resp).ok()) return {"(etcd did not answer)"};
    for (const auto& k : resp.kvs()) keys.push_back(k.key().substr(req.key().size()));
    return keys;
  }
  // Waits up to `timeout` for JournalKeys() to be `want`.
  bool AwaitJournalKeys(const std::vector<std::string>& want, absl::Duration timeout) {
    return WaitFor([&] { return JournalKeys() == want; }, timeout, absl::Milliseconds(50));
  }

  // The index of the replica that leads, waiting up to `timeout` for one (-1: none).
  int AwaitLeader(absl::Duration timeout, int not_this = -1) {
    int found = -1;
    WaitFor(
        [&] {
          const std::string leader = LeaderAddress();
          for (size_t i = 0; i < ports_.size(); ++i) {
            if (static_cast<int>(i) != not_this && leader == absl::StrCat("127.0.0.1:", ports_[i])) found = i;
          }
          return found >= 0;
        },
        timeout, absl::Milliseconds(50));
    return found;
  }

  std::string Logs() {
    std::string out = etcd_->Logs();
    for (size_t i = 0; i < replicas_.size(); ++i) {
      if (replicas_[i] != nullptr) absl::StrAppend(&out, "\n--- replica ", i, ":\n", replicas_[i]->Output());
    }
    return out;
  }

  FailoverTrial RunFailoverTrial(int world_size);

  std::unique_ptr<EtcdCluster> etcd_;
  std::string dir_;
  std::string prefix_;
  std::vector<std::unique_ptr<Process>> replicas_;
  std::vector<int> ports_;
};

// One rank's join of group "g" of `world_size` through `target` (with `credentials`;
// default plaintext), retried on UNAVAILABLE until `deadline` as the sidecars do
// (coordinator_link.cc).
absl::StatusOr<pb::JoinResponse> Join(const std::string& target, int rank, int world_size, absl::Time deadline,
                                      std::shared_ptr<grpc::ChannelCredentials> credentials = nullptr) {
  if (credentials == nullptr) credentials = grpc::InsecureChannelCredentials();
  auto stub = pb::Registry::NewStub(grpc::CreateChannel(target, credentials));
  pb::JoinRequest req;
  req.set_job("replicas");
  req.set_group("g");
  req.set_world_size(world_size);
  req.set_compact(true);
  req.mutable_member()->set_rank(rank);
  req.mutable_member()->set_host_id(absl::StrCat("host-", rank));
  req.mutable_member()->set_host_address(absl::StrCat("10.0.0.", rank + 1));
  grpc::Status s;
  for (int attempt = 1;; ++attempt) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(deadline));
    ctx.set_wait_for_ready(true);
    pb::JoinResponse resp;
    s = stub->Join(&ctx, req, &resp);
    if (s.ok()) return resp;
    if (s.error_code() != grpc::StatusCode::UNAVAILABLE || absl::Now() >= deadline) break;
    absl::SleepFor(absl::Milliseconds(std::min(20 * attempt, 500)));  // the retry's backoff, as the sidecars
  }
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

// The ranks joined so far to group "g" of job "replicas" at `target` (0 if it cannot say).
int JoinedRanks(const std::string& target) {
  auto stub = pb::Registry::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  pb::DescribeRequest req;
  req.set_job("replicas");
  req.set_group("g");
  pb::DescribeResponse resp;
  return stub->Describe(&ctx, req, &resp).ok() ? resp.group().members_size() : 0;
}

// Joins ranks [0, world_size), rank r through targets[r % targets.size()]: all but the last
// at once, then `while_joining` (which runs while they wait for the last), then the last.
// OK if every answer is the same formation of `world_size` members; else the first problem.
absl::Status JoinAll(const std::vector<std::string>& targets, int world_size, absl::Duration timeout,
                     const std::function<void()>& while_joining = nullptr,
                     const std::shared_ptr<grpc::ChannelCredentials>& credentials = nullptr) {
  const absl::Time deadline = absl::Now() + timeout;
  std::vector<absl::StatusOr<pb::JoinResponse>> answers(world_size, absl::UnknownError("not run"));
  std::vector<std::thread> ranks;
  auto start = [&](int r) {
    ranks.emplace_back(
        [&, r] { answers[r] = Join(targets[r % targets.size()], r, world_size, deadline, credentials); });
  };
  for (int r = 0; r + 1 < world_size; ++r) start(r);
  if (while_joining) while_joining();
  start(world_size - 1);
  for (auto& t : ranks) t.join();
  for (int r = 0; r < world_size; ++r) {
    if (!answers[r].ok()) {
      return absl::Status(answers[r].status().code(), absl::StrCat("rank ", r, ": ", answers[r].status().message()));
    }
    if (answers[r]->rank_host_size() != world_size || answers[r]->hosts_size() != world_size ||
        answers[r]->generation() != answers[0]->generation()) {
      return absl::InternalError(absl::StrCat("rank ", r, "'s answer differs: ", answers[r]->DebugString()));
    }
  }
  return absl::OkStatus();
}

TEST_F(RegistryReplicasTest, AGroupJoinedThroughEveryReplicaFormsOnce) {
  for (int i = 0; i < 3; ++i) ASSERT_GT(StartReplica(i), 0) << Logs();
  const int leader = AwaitLeader(absl::Seconds(20));
  ASSERT_GE(leader, 0) << Logs();
  std::vector<std::string> targets;
  for (int port : ports_) targets.push_back(absl::StrCat("127.0.0.1:", port));
  ASSERT_THAT(JoinAll(targets, 6, absl::Seconds(30)), IsOk()) << Logs();
  // The followers forwarded: the leader holds the group, any replica describes it.
  for (const std::string& target : targets) {
    auto stub = pb::Registry::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    pb::ListRequest req;
    req.set_job("replicas");
    pb::ListResponse resp;
    ASSERT_TRUE(stub->List(&ctx, req, &resp).ok()) << target;
    ASSERT_EQ(resp.groups_size(), 1) << target << ": " << resp.DebugString();
  }
  EXPECT_EQ(AwaitLeader(absl::Seconds(1)), leader) << "the leader changed with no failure";
}

// One failover trial (issue 18): 3 replicas; `world_size` ranks rendezvous, half through a
// client given every replica (leader first, as a Service resolving to every replica), half
// through a follower (forwarded); store adds loop through the same client; the leader is
// killed with SIGKILL while all ranks but the last are parked at it, then the last joins.
struct FailoverTrial {
  absl::Status rendezvous = absl::UnknownError("not run");
  int new_leader = -1;
  int64_t acknowledged = 0;
  int64_t failed = 0;
  int64_t value = -1;  // the counter afterwards
};

FailoverTrial RegistryReplicasTest::RunFailoverTrial(int world_size) {
  FailoverTrial t;
  for (int i = 0; i < 3; ++i) {
    if (StartReplica(i) == 0) return t;
  }
  const int leader = AwaitLeader(absl::Seconds(20));
  if (leader < 0) {
    t.rendezvous = absl::DeadlineExceededError("no leader elected");
    return t;
  }
  std::vector<std::string> parts = {absl::StrCat("127.0.0.1:", ports_[leader])};
  for (int i = 0; i < 3; ++i) {
    if (i != leader) parts.push_back(absl::StrCat("127.0.0.1:", ports_[i]));
  }
  const std::string all = absl::StrCat("ipv4:", absl::StrJoin(parts, ","));
  client::StoreClientOptions o;
  o.job = "replicas";
  auto store = client::StoreClient::Connect(all, o);
  if (!store.ok()) {
    t.rendezvous = store.status();
    return t;
  }
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    while (!stop.load()) {
      if ((*store)->Add("n", 1).ok()) {
        ++t.acknowledged;
      } else {
        ++t.failed;
      }
    }
  });
  t.rendezvous = JoinAll({all, parts[1]}, world_size, absl::Seconds(60), [&] {
    // Until every rank but the last is parked at the leader.
    EXPECT_TRUE(
        WaitFor([&] { return JoinedRanks(parts[0]) == world_size - 1; }, absl::Seconds(20), absl::Milliseconds(20)))
        << "the ranks were not parked at the leader before it was killed";
    replicas_[leader]->Kill(SIGKILL);
    (void)replicas_[leader]->Wait(absl::Seconds(10));
  });
  t.new_leader = AwaitLeader(absl::Seconds(20), leader);
  stop = true;
  writer.join();
  auto n = (*store)->Get("n", absl::Seconds(10));
  if (n.ok() && !absl::SimpleAtoi(*n, &t.value)) t.value = -1;
  return t;
}

// COLLSERVE_REPLICA_FAILOVER_TRIALS trials (default 1; the closing note of issue 18 ran 10)
// of 64 ranks; prints the counts.
TEST_F(RegistryReplicasTest, AKilledLeaderIsReplacedDuringA64RankRendezvousAndNoAcknowledgedWriteIsLost) {
  int trials = 1;
  if (const char* env = std::getenv("COLLSERVE_REPLICA_FAILOVER_TRIALS")) {
    ASSERT_TRUE(absl::SimpleAtoi(env, &trials) && trials >= 1 && trials <= 100) << env;
  }
  const std::string base = prefix_;
  int completed = 0, replaced = 0;
  int64_t acknowledged = 0, lost = 0, failed = 0;
  for (int i = 0; i < trials; ++i) {
    replicas_.clear();
    ports_.clear();
    prefix_ = absl::StrCat(base, "trial", i, "/");
    const FailoverTrial t = RunFailoverTrial(64);
    if (t.rendezvous.ok()) {
      ++completed;
    } else {
      ADD_FAILURE() << "trial " << i << ": " << t.rendezvous << Logs();
    }
    if (t.new_leader >= 0) ++replaced;
    acknowledged += t.acknowledged;
    failed += t.failed;
    // Every acknowledged add is there once; a failed one may or may not have been applied.
    lost += std::max<int64_t>(0, t.acknowledged - t.value);
    EXPECT_LE(t.value, t.acknowledged + t.failed) << "trial " << i << ": an add applied twice";
    EXPECT_GT(t.acknowledged, 0) << "trial " << i;
  }
  std::cout << "replica failover: " << trials << " trials of 64 ranks: rendezvous completed " << completed
            << ", leader replaced " << replaced << ", store adds acknowledged " << acknowledged << " (failed "
            << failed << "), acknowledged adds lost " << lost << std::endl;
  EXPECT_EQ(completed, trials);
  EXPECT_EQ(replaced, trials);
  EXPECT_EQ(lost, 0);
}

TEST_F(RegistryReplicasTest, ALeaderThatStopsHandsOverAtOnce) {
  // A lease of 60 s: a handover faster than that comes from the stopping leader revoking it.
  for (int i = 0; i < 2; ++i) ASSERT_GT(StartReplica(i, absl::Seconds(60)), 0) << Logs();
  const int leader = AwaitLeader(absl::Seconds(20));
  ASSERT_GE(leader, 0) << Logs();
  replicas_[leader]->Kill(SIGTERM);
  ASSERT_TRUE(replicas_[leader]->Wait(absl::Seconds(30)).ok());
  const int next = AwaitLeader(absl::Seconds(20), leader);
  ASSERT_EQ(next, 1 - leader) << Logs();
  EXPECT_THAT(JoinAll({absl::StrCat("127.0.0.1:", ports_[next])}, 2, absl::Seconds(20)), IsOk()) << Logs();
}

// A running job on 2 sidecars (4 ranks in the store_loop of the rank binary: all_reduce
// and exactly-once store writes, each answer checked) whose sidecars and ranks are given
// every replica (--coordinator / COLLSERVE_COORDINATOR as an ipv4: list). Replica 0, which
// they all talk to first, leads; it is killed with SIGKILL mid-loop. The ranks finish with
// correct results: the data path never needed it, the store fails over to another replica,
// and the sidecars' watches move to the new leader, which adopts the running group.
TEST_F(RegistryReplicasTest, AJobOnTwoSidecarsSurvivesTheReplicaItTalksToAndLeadsBeingKilled) {
  std::vector<int> ports;
  while (ports.size() < 3) {
    const int p = UnusedPort();
    ASSERT_GT(p, 0);
    if (std::find(ports.begin(), ports.end(), p) == ports.end()) ports.push_back(p);
  }
  std::vector<std::string> addresses;
  for (int p : ports) addresses.push_back(absl::StrCat("127.0.0.1:", p));
  const std::string all = absl::StrCat("ipv4:", absl::StrJoin(addresses, ","));
  const std::vector<std::string> replica = {absl::StrCat("--etcd_endpoints=", absl::StrJoin(etcd_->endpoints(), ",")),
                                            absl::StrCat("--etcd_prefix=", prefix_),
                                            "--advertise_address=127.0.0.1:0", "--registry_lease_ttl=2s",
                                            // Under TSan on a loaded CI machine a sidecar once
                                            // renewed its group lease later than the default 3 s
                                            // grace after the failover, and its host was taken as
                                            // lost: this test is about the failover, not that
                                            // (a sanitizer's grace, as Cluster gives the first).
                                            kLeaseGraceFlag};
  std::vector<std::string> first = replica;
  first.push_back(absl::StrCat("--listen_address=", addresses[0]));
  auto started = Cluster::Start(2, first, {absl::StrCat("--coordinator=", all)});
  ASSERT_TRUE(started.ok()) << started.status();
  Cluster& c = **started;
  ports_ = ports;
  ASSERT_EQ(AwaitLeader(absl::Seconds(20)), 0) << c.Logs();
  for (int i = 1; i < 3; ++i) {
    std::vector<std::string> argv = {CoordinatorBinary(), absl::StrCat("--listen_address=", addresses[i]),
                                     absl::StrCat("--port_file=", dir_, "/replica", i, ".port"), "--metrics_address="};
    for (const std::string& f : c.credential_flags()) argv.push_back(f);
    argv.insert(argv.end(), replica.begin(), replica.end());
    auto p = Process::Start(argv, {}, absl::StrCat(dir_, "/replica", i, ".log"));
    ASSERT_TRUE(p.ok()) << p.status();
    ASSERT_TRUE(ReadPortFile(absl::StrCat(dir_, "/replica", i, ".port"), **p, absl::Seconds(30)).ok()) << Logs();
    if (replicas_.size() <= static_cast<size_t>(i)) replicas_.resize(i + 1);
    replicas_[i] = std::move(*p);
  }
  std::vector<std::unique_ptr<Process>> ranks;
  for (int r = 0; r < 4; ++r) {
    auto p = c.StartRank(r, 4, r % 2, {"--mode=store_loop", "--iters=300", "--delay_ms=5", "--key_prefix=replicas"},
                         {{"COLLSERVE_COORDINATOR", all}, {"COLLSERVE_OP_TIMEOUT_S", "60"},
                          {"COLLSERVE_INIT_TIMEOUT_S", "60"}});
    ASSERT_TRUE(p.ok()) << p.status();
    ranks.push_back(std::move(*p));
  }
  for (auto& p : ranks) {  // the group formed and the loop runs
    WaitFor([&] { return p->Output().find("iter 50 ok") != std::string::npos; }, absl::Seconds(60));
  }
  c.coordinator().Kill(SIGKILL);
  EXPECT_GT(AwaitLeader(absl::Seconds(20), 0), 0) << Logs() << c.Logs();
  for (int r = 0; r < 4; ++r) {
    absl::StatusOr<int> code = ranks[r]->Wait(absl::Seconds(120));
    EXPECT_TRUE(code.ok() && *code == 0) << "rank " << r << " (" << (code.ok() ? absl::StrCat("exit ", *code) : "hung")
                                         << "):\n" << ranks[r]->Output() << Logs() << c.Logs();
  }
}

// Issue 18: the group registry's formed generations live in etcd too (registry_journal.h),
// so a new leader knows the groups formed under the old one at once, before any of their
// hosts watches (the ranks here have no sidecars, so nothing else could tell it); the
// record goes when the generation ends.
TEST_F(RegistryReplicasTest, ANewLeaderKnowsTheGroupsFormedUnderTheOldOneFromEtcd) {
  for (int i = 0; i < 3; ++i) ASSERT_GT(StartReplica(i), 0) << Logs();
  const int leader = AwaitLeader(absl::Seconds(20));
  ASSERT_GE(leader, 0) << Logs();
  std::vector<std::string> targets;
  for (int port : ports_) targets.push_back(absl::StrCat("127.0.0.1:", port));
  ASSERT_THAT(JoinAll(targets, 4, absl::Seconds(30)), IsOk()) << Logs();
  ASSERT_TRUE(AwaitJournalKeys({"8:replicas/g"}, absl::Seconds(10))) << absl::StrJoin(JournalKeys(), ",") << Logs();
  replicas_[leader]->Kill(SIGKILL);
  ASSERT_TRUE(replicas_[leader]->Wait(absl::Seconds(10)).ok());
  const int next = AwaitLeader(absl::Seconds(20), leader);
  ASSERT_GE(next, 0) << Logs();
  // Every surviving replica answers with the restored generation (a follower forwards).
  for (int i = 0; i < 3; ++i) {
    if (i == leader) continue;
    auto stub = pb::Registry::NewStub(grpc::CreateChannel(targets[i], grpc::InsecureChannelCredentials()));
    pb::ListResponse resp;
    grpc::Status s;
    WaitFor(  // UNAVAILABLE while the new leader restores
        [&] {
          grpc::ClientContext ctx;
          ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
          pb::ListRequest req;
          req.set_job("replicas");
          resp.Clear();
          s = stub->List(&ctx, req, &resp);
          return s.error_code() != grpc::StatusCode::UNAVAILABLE;
        },
        absl::Seconds(10), absl::Milliseconds(100));
    ASSERT_TRUE(s.ok()) << s.error_message() << Logs();
    ASSERT_EQ(resp.groups_size(), 1) << targets[i] << ": " << resp.DebugString() << Logs();
    const pb::GroupInfo& g = resp.groups(0);
    EXPECT_EQ(g.group(), "g");
    EXPECT_EQ(g.state(), "FORMED");
    EXPECT_EQ(g.generation(), 1);
    ASSERT_EQ(g.members_size(), 4);
    EXPECT_EQ(g.members(3).host_id(), "host-3");
  }
  // Every rank leaves through the new leader: the generation ends, and so does its record.
  auto stub = pb::Registry::NewStub(grpc::CreateChannel(targets[next], grpc::InsecureChannelCredentials()));
  for (int rank = 0; rank < 4; ++rank) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    pb::LeaveRequest req;
    req.set_job("replicas");
    req.set_group("g");
    req.set_rank(rank);
    req.set_generation(1);
    pb::LeaveResponse resp;
    const grpc::Status s = stub->Leave(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << "rank " << rank << ": " << s.error_message();
  }
  EXPECT_TRUE(AwaitJournalKeys({}, absl::Seconds(10))) << absl::StrJoin(JournalKeys(), ",") << Logs();
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Issue 18: the replicas forward to each other over TLS when their API is TLS, with mutual
// TLS here: each presents its own certificate to the leader. The certificate names
// 127.0.0.1 and localhost; the replicas check the leader's as "localhost"
// (--replica_tls_server_name, as a Kubernetes Service name for a pod IP).
TEST_F(RegistryReplicasTest, OverTlsTheFollowersForwardToTheLeaderAndOneThatDoesNotTrustItForwardsNothing) {
  Pki pki;
  ASSERT_TRUE(pki.MakeCa("ca") && pki.MakeCert("replica", "ca") && pki.MakeCert("client", "ca") && pki.MakeCa("other"))
      << ReadFile(pki.Path("openssl.log"));
  const std::vector<std::string> tls = {
      absl::StrCat("--tls_cert=", pki.Path("replica.pem")), absl::StrCat("--tls_key=", pki.Path("replica.key")),
      absl::StrCat("--tls_ca=", pki.Path("ca.pem")), "--tls_client_auth", "--replica_tls_server_name=localhost"};
  for (int i = 0; i < 3; ++i) ASSERT_GT(StartReplica(i, absl::Seconds(2), tls), 0) << Logs();
  const int leader = AwaitLeader(absl::Seconds(20));
  ASSERT_GE(leader, 0) << Logs();
  grpc::SslCredentialsOptions o;
  o.pem_root_certs = ReadFile(pki.Path("ca.pem"));
  o.pem_cert_chain = ReadFile(pki.Path("client.pem"));
  o.pem_private_key = ReadFile(pki.Path("client.key"));
  const auto credentials = grpc::SslCredentials(o);
  std::vector<std::string> followers;
  for (int i = 0; i < 3; ++i) {
    if (i != leader) followers.push_back(absl::StrCat("127.0.0.1:", ports_[i]));
  }
  // Every rank joins through a follower: the group can only form at the leader.
  ASSERT_THAT(JoinAll(followers, 4, absl::Seconds(30), nullptr, credentials), IsOk()) << Logs();
  // A plaintext client is refused by the API itself.
  EXPECT_FALSE(Join(followers[0], 0, 1, absl::Now() + absl::Seconds(2)).ok());

  // A fourth replica that verifies the leader against another CA: its forwarded calls fail
  // in the handshake (UNAVAILABLE), however long they are retried.
  std::vector<std::string> distrust = tls;
  distrust.push_back(absl::StrCat("--replica_tls_ca=", pki.Path("other.pem")));
  ASSERT_GT(StartReplica(3, absl::Seconds(2), distrust), 0) << Logs();
  ASSERT_EQ(AwaitLeader(absl::Seconds(1)), leader);
  auto stub = pb::Registry::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", ports_[3]), credentials));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  pb::ListRequest list;
  list.set_job("replicas");
  pb::ListResponse listed;
  const grpc::Status s = stub->List(&ctx, list, &listed);
  EXPECT_NE(s.error_code(), grpc::StatusCode::OK) << listed.DebugString();
  EXPECT_THAT(s.error_code(), ::testing::AnyOf(grpc::StatusCode::UNAVAILABLE, grpc::StatusCode::DEADLINE_EXCEEDED))
      << s.error_message();
}

TEST(RegistryReplicasConfigTest, ReplicasNeedEtcdAndACaForTls) {
  server::CoordinatorOptions o;
  o.listen_address = "127.0.0.1:0";
  o.credentials.allow_unauthenticated = true;
  o.replication.advertise_address = "127.0.0.1:0";
  auto started = server::Coordinator::Start(o);
  EXPECT_THAT(started, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(std::string(started.status().message()), HasSubstr("need the store in etcd"));
  o.etcd.endpoints = {"127.0.0.1:1"};
  // TLS on the API: the replicas need a CA to verify each other with.
  Pki pki;
  ASSERT_TRUE(pki.MakeCa("ca") && pki.MakeCert("replica", "ca"));
  o.tls.cert_file = pki.Path("replica.pem");
  o.tls.key_file = pki.Path("replica.key");
  started = server::Coordinator::Start(o);
  EXPECT_THAT(started, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(std::string(started.status().message()), HasSubstr("--replica_tls_ca"));
  // A replica CA that does not exist.
  o.replication.tls.ca_file = "/nonexistent/ca.pem";
  started = server::Coordinator::Start(o);
  EXPECT_THAT(started, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(std::string(started.status().message()), HasSubstr("/nonexistent/ca.pem"));
  // TLS between replicas with a plaintext API.
  o.tls = {};
  o.replication.tls.ca_file = pki.Path("ca.pem");
  started = server::Coordinator::Start(o);
  EXPECT_THAT(started, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(std::string(started.status().message()), HasSubstr("needs TLS on the gRPC API"));
}

}  // namespace
}  // namespace collserve::testing
