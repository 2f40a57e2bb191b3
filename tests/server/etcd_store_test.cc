// The etcd store (server/coordinator/etcd_store.h) against a real etcd on loopback
// (Debian's etcd-server, started by the test): the store conformance suite, the
// exactly-once writes, waits across a restart of etcd, and a 3-member cluster losing the
// member the store talks to.
#include "server/coordinator/etcd_store.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <map>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "collserve/client.h"
#include "server/coordinator/coordinator.h"
#include "server/coordinator/registry_journal.h"
#include "etcd/etcdserverpb/rpc.grpc.pb.h"
#include "tests/testing/etcd_cluster.h"
#include "tests/testing/pki.h"
#include "tests/testing/store_conformance.h"
#include "tests/testing/wait_for.h"

namespace collserve::testing {
namespace {

using ::testing::HasSubstr;

// One single-member etcd for the conformance suite (every store gets a fresh prefix),
// started before the first test and stopped after the last.
class SharedEtcdEnvironment : public ::testing::Environment {
 public:
  void SetUp() override {
    auto c = EtcdCluster::Start(1);
    if (!c.ok()) {
      ADD_FAILURE() << c.status() << " (scripts/install_deps.sh installs etcd-server)";
      return;
    }
    cluster = std::move(*c);
  }
  void TearDown() override { cluster.reset(); }
  std::unique_ptr<EtcdCluster> cluster;
};
SharedEtcdEnvironment* const shared_etcd =
    static_cast<SharedEtcdEnvironment*>(::testing::AddGlobalTestEnvironment(new SharedEtcdEnvironment));

EtcdCluster* SharedEtcd() { return shared_etcd->cluster.get(); }

absl::StatusOr<std::unique_ptr<store::Store>> NewStore(const std::vector<std::string>& endpoints,
                                                       absl::Duration call_timeout = absl::Seconds(10)) {
  static std::atomic<int> next{0};
  server::EtcdStoreOptions options;
  options.endpoints = endpoints;
  options.prefix = absl::StrCat("test-", getpid(), "-", next.fetch_add(1), "/");
  options.call_timeout = call_timeout;
  return server::NewEtcdStore(options);
}

std::unique_ptr<store::Store> ConformanceStore() {
  EtcdCluster* etcd = SharedEtcd();
  if (etcd == nullptr) return nullptr;
  auto s = NewStore(etcd->endpoints());
  EXPECT_TRUE(s.ok()) << s.status() << etcd->Logs();
  return s.ok() ? std::move(*s) : nullptr;
}

INSTANTIATE_TEST_SUITE_P(Etcd, StoreConformanceTest, ::testing::Values(StoreFactory{"etcd", ConformanceStore}),
                         StoreFactoryName);

// A registry journal over `endpoints` (etcd's, or an address where nothing listens)
// writing under a prefix unique to this process and `name`.
absl::StatusOr<std::unique_ptr<server::EtcdRegistryJournal>> NewJournal(const std::vector<std::string>& endpoints,
                                                                        const std::string& name,
                                                                        server::RegistryJournalOptions o = {}) {
  server::EtcdStoreOptions e;
  e.endpoints = endpoints;
  auto channel = server::NewEtcdChannel(e);
  if (!channel.ok()) return channel.status();
  o.prefix = absl::StrCat("journal-", name, "-", getpid(), "/");
  return server::EtcdRegistryJournal::Create(*std::move(channel), std::move(o));
}

// A formed generation's view for the registry journal: rank r on host hosts_of_ranks[r].
std::shared_ptr<const server::GroupView> JournalView(const std::string& group, int64_t generation,
                                                     std::vector<std::string> hosts_of_ranks) {
  auto v = std::make_shared<server::GroupView>();
  v->group = group;
  v->generation = generation;
  std::map<std::string, int32_t> index;
  for (size_t r = 0; r < hosts_of_ranks.size(); ++r) {
    server::MemberInfo m;
    m.rank = static_cast<int>(r);
    m.host_id = hosts_of_ranks[r];
    m.host_address = absl::StrCat("10.0.0.", index.size());
    m.sidecar_address = absl::StrCat(m.host_address, ":7");
    auto [it, added] = index.try_emplace(m.host_id, static_cast<int32_t>(v->hosts.size()));
    if (added) v->hosts.push_back(m);
    v->rank_host.push_back(it->second);
    v->members.push_back(m);
  }
  return v;
}

// The registry journal (registry_journal.h) over a real etcd: a formed generation is one
// record whose membership reads back whole (names with '/' and ':' in them included), a
// later generation replaces it, an ended one deletes it, and a key that is not a record is
// skipped.
TEST(EtcdRegistryJournalTest, RecordsReadBackAndEndedOnesGo) {
  EtcdCluster* etcd = SharedEtcd();
  ASSERT_NE(etcd, nullptr);
  auto journal = NewJournal(etcd->endpoints(), "records");
  ASSERT_TRUE(journal.ok()) << journal.status();
  server::EtcdStoreOptions e;
  e.endpoints = etcd->endpoints();
  auto channel = server::NewEtcdChannel(e);
  ASSERT_TRUE(channel.ok()) << channel.status();
  const std::string prefix = absl::StrCat("journal-records-", getpid(), "/");
  auto view = JournalView;
  (*journal)->Formed("job/a:1", view("g/x", 1, {"h0", "h1", "h0"}));
  (*journal)->Formed("job", view("other", 3, {"h2"}));
  (*journal)->Formed("job", view("other", 4, {"h2", "h3"}));  // replaces generation 3
  (*journal)->Ended("job", "other", 3);                       // too old: ignored
  ASSERT_TRUE((*journal)->Flush(absl::Seconds(10)));
  // Once generation 4 was written, an Ended of 3 is still too old (it deleted generation 4's
  // record when the writer had taken 4 before 3's Ended came: a CI failure).
  (*journal)->Ended("job", "other", 3);
  ASSERT_TRUE((*journal)->Flush(absl::Seconds(10)));
  // The writer may have taken generation 3 before 4 replaced it: 2 or 3 writes.
  server::EtcdRegistryJournal::Stats stats = (*journal)->GetStats();
  EXPECT_GE(stats.written, 2u);
  EXPECT_LE(stats.written, 3u);
  EXPECT_EQ(stats.failed, 0u);
  EXPECT_EQ(stats.too_large, 0u);
  {  // not a record: skipped
    auto kv = etcdserverpb::KV::NewStub(*channel);
    grpc::ClientContext ctx;
    etcdserverpb::PutRequest put;
    put.set_key(absl::StrCat(prefix, "garbage"));
    put.set_value("x");
    etcdserverpb::PutResponse resp;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    ctx.set_wait_for_ready(true);
    const grpc::Status s = kv->Put(&ctx, put, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
  }
  auto records = (*journal)->Load();
  ASSERT_TRUE(records.ok()) << records.status();
  ASSERT_EQ(records->size(), 2u);
  std::map<std::string, server::GroupView> by_group;
  for (auto& r : *records) by_group[absl::StrCat(r.job, "|", r.view.group)] = r.view;
  ASSERT_EQ(by_group.count("job/a:1|g/x"), 1u);
  const server::GroupView& g = by_group["job/a:1|g/x"];
  EXPECT_EQ(g.generation, 1);
  EXPECT_EQ(g.state, "FORMED");
  ASSERT_EQ(g.members.size(), 3u);
  EXPECT_EQ(g.members[2].rank, 2);
  EXPECT_EQ(g.members[2].host_id, "h0");
  EXPECT_EQ(g.members[1].host_id, "h1");
  EXPECT_EQ(g.members[1].sidecar_address, "10.0.0.1:7");
  EXPECT_EQ(by_group["job|other"].generation, 4);
  EXPECT_EQ(by_group["job|other"].world_size, 2);
  (*journal)->Ended("job/a:1", "g/x", 1);
  (*journal)->Ended("job", "other", 4);
  ASSERT_TRUE((*journal)->Flush(absl::Seconds(10)));
  records = (*journal)->Load();
  ASSERT_TRUE(records.ok()) << records.status();
  EXPECT_TRUE(records->empty());
  EXPECT_EQ((*journal)->GetStats().written, stats.written + 2);
}

// What the journal could not write is counted (collserve_registry_journal_writes_total):
// a record over max_value_bytes is never sent, and a write etcd does not answer within
// call_timeout (here: nothing listens at the endpoint) is dropped.
TEST(EtcdRegistryJournalTest, RecordsNotWrittenAreCounted) {
  EtcdCluster* etcd = SharedEtcd();
  ASSERT_NE(etcd, nullptr);
  server::RegistryJournalOptions o;
  o.max_value_bytes = 16;
  auto small = NewJournal(etcd->endpoints(), "small", o);
  ASSERT_TRUE(small.ok()) << small.status();
  (*small)->Formed("job", JournalView("big", 1, {"host-with-a-long-name-0", "host-with-a-long-name-1"}));
  ASSERT_TRUE((*small)->Flush(absl::Seconds(10)));
  server::EtcdRegistryJournal::Stats stats = (*small)->GetStats();
  EXPECT_EQ(stats.too_large, 1u);
  EXPECT_EQ(stats.written, 0u);
  EXPECT_EQ(stats.failed, 0u);
  auto records = (*small)->Load();
  ASSERT_TRUE(records.ok()) << records.status();
  EXPECT_TRUE(records->empty());

  const int port = UnusedPort();
  ASSERT_NE(port, 0);
  o.max_value_bytes = 1 << 20;
  o.call_timeout = absl::Milliseconds(300);
  auto lost = NewJournal({absl::StrCat("127.0.0.1:", port)}, "dead", o);
  ASSERT_TRUE(lost.ok()) << lost.status();
  (*lost)->Formed("job", JournalView("g", 1, {"h0", "h1"}));
  (*lost)->Ended("other", "g", 2);
  ASSERT_TRUE((*lost)->Flush(absl::Seconds(10)));
  stats = (*lost)->GetStats();
  EXPECT_EQ(stats.failed, 2u);
  EXPECT_EQ(stats.written, 0u);
  EXPECT_EQ(stats.too_large, 0u);
}

TEST(EtcdStoreTest, RetriedWritesWithARequestIdAreAppliedOnce) {
  ASSERT_NE(SharedEtcd(), nullptr);
  auto s = NewStore(SharedEtcd()->endpoints());
  ASSERT_TRUE(s.ok()) << s.status();
  store::Store& store = **s;
  EXPECT_THAT(store.AddOnce("n", 5, "req-1"), IsOkAndHolds(5));
  EXPECT_THAT(store.AddOnce("n", 5, "req-1"), IsOkAndHolds(5));  // the retry: the first answer
  EXPECT_THAT(store.AddOnce("n", 5, "req-2"), IsOkAndHolds(10));
  EXPECT_THAT(store.Get("n", absl::ZeroDuration()), IsOkAndHolds("10"));
  EXPECT_THAT(store.CompareSetOnce("c", "", "first", "req-3"), IsOkAndHolds("first"));
  EXPECT_THAT(store.CompareSetOnce("c", "", "first", "req-3"), IsOkAndHolds("first"));
  EXPECT_THAT(store.AppendOnce("a", "x", "req-4"), IsOk());
  EXPECT_THAT(store.AppendOnce("a", "x", "req-4"), IsOk());
  EXPECT_THAT(store.Get("a", absl::ZeroDuration()), IsOkAndHolds("x"));
  EXPECT_THAT(store.DeleteKeyOnce("a", "req-5"), IsOkAndHolds(true));
  EXPECT_THAT(store.DeleteKeyOnce("a", "req-5"), IsOkAndHolds(true));
  // A write that did not apply is not remembered: its retry is evaluated afresh.
  EXPECT_THAT(store.DeleteKeyOnce("gone", "req-6"), IsOkAndHolds(false));
  ASSERT_THAT(store.Set("gone", "v"), IsOk());
  EXPECT_THAT(store.DeleteKeyOnce("gone", "req-6"), IsOkAndHolds(true));
  // Request ids live outside the store's keys.
  EXPECT_THAT(store.NumKeys(""), IsOkAndHolds(2));  // n, c
}

TEST(EtcdStoreTest, ConcurrentAddsFromSeveralStoresOnOneEtcdAreNotLost) {
  // Several coordinator replicas over one etcd: each has its own store.
  ASSERT_NE(SharedEtcd(), nullptr);
  server::EtcdStoreOptions options;
  options.endpoints = SharedEtcd()->endpoints();
  options.prefix = absl::StrCat("replicas-", getpid(), "/");
  std::vector<std::unique_ptr<store::Store>> replicas;
  for (int i = 0; i < 3; ++i) {
    auto s = server::NewEtcdStore(options);
    ASSERT_TRUE(s.ok()) << s.status();
    replicas.push_back(std::move(*s));
  }
  constexpr int kPerThread = 40;
  std::vector<std::thread> threads;
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) EXPECT_THAT(replicas[t % 3]->Add("counter", 1), IsOk());
    });
  }
  // A wait on one replica is woken by a write through another.
  absl::Notification woken;
  replicas[0]->WaitAsync({"done"}, absl::Now() + absl::Seconds(30), [&](absl::Status st) {
    EXPECT_TRUE(st.ok()) << st;
    woken.Notify();
  });
  for (auto& th : threads) th.join();
  ASSERT_THAT(replicas[2]->Set("done", "1"), IsOk());
  EXPECT_TRUE(woken.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_THAT(replicas[1]->Get("counter", absl::ZeroDuration()), IsOkAndHolds(absl::StrCat(6 * kPerThread)));
}

TEST(EtcdStoreTest, AWaitOutlivesARestartOfEtcd) {
  auto etcd = EtcdCluster::Start(1);
  ASSERT_TRUE(etcd.ok()) << etcd.status();
  auto s = NewStore((*etcd)->endpoints());
  ASSERT_TRUE(s.ok()) << s.status() << (*etcd)->Logs();
  store::Store& store = **s;
  ASSERT_THAT(store.Set("before", "1"), IsOk());
  absl::Notification woken;
  absl::Status result;
  store.WaitAsync({"after"}, absl::Now() + absl::Seconds(60), [&](absl::Status st) {
    result = st;
    woken.Notify();
  });
  (*etcd)->Kill(0);
  EXPECT_THAT(store.Get("before", absl::ZeroDuration()), StatusIs(absl::StatusCode::kUnavailable));
  ASSERT_TRUE((*etcd)->Restart(0).ok());
  // Acknowledged writes survived; the wait, registered before the restart, is woken by a
  // write after it.
  absl::StatusOr<std::string> before = absl::UnknownError("not read");
  WaitFor([&] { return (before = store.Get("before", absl::ZeroDuration())).ok(); }, absl::Seconds(30),
          absl::Milliseconds(100));
  EXPECT_THAT(before, IsOkAndHolds("1")) << (*etcd)->Logs();
  ASSERT_THAT(store.Set("after", "2"), IsOk());
  ASSERT_TRUE(woken.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_TRUE(result.ok()) << result;
}

TEST(EtcdStoreTest, AThreeMemberClusterLosingTheStoresMemberLosesNoAcknowledgedWrite) {
  auto etcd = EtcdCluster::Start(3);
  ASSERT_TRUE(etcd.ok()) << etcd.status();
  // A new cluster answers once it elected its first leader.
  absl::StatusOr<std::unique_ptr<store::Store>> s = absl::UnknownError("not tried");
  for (const absl::Time until = absl::Now() + absl::Seconds(30); absl::Now() < until && !s.ok();) {
    s = NewStore((*etcd)->endpoints(), absl::Seconds(2));
  }
  ASSERT_TRUE(s.ok()) << s.status() << (*etcd)->Logs();
  store::Store& store = **s;
  // Writes in a loop; the member the channel picked first (the first endpoint) is killed.
  std::atomic<int> acknowledged{0};
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    for (int i = 0; !stop.load(); ++i) {
      // A write whose answer was lost (UNAVAILABLE) may still have landed: it is written
      // again under the same key, as a client retries.
      if (store.Set(absl::StrCat("k", acknowledged.load()), "v").ok()) acknowledged.fetch_add(1);
      absl::SleepFor(absl::Milliseconds(5));  // paces the load (about 200 writes a second), orders nothing
    }
  });
  EXPECT_TRUE(WaitFor([&] { return acknowledged.load() >= 20; }, absl::Seconds(30))) << (*etcd)->Logs();
  (*etcd)->Kill(0);
  // A write sent to a member while the cluster elects a new leader waits for its deadline
  // (etcd drops the proposal); the next ones go through.
  const absl::Time killed = absl::Now();
  const int at_kill = acknowledged.load();
  WaitFor([&] { return acknowledged.load() >= at_kill + 20; }, absl::Seconds(30));
  const absl::Duration recovered = absl::Now() - killed;
  stop = true;
  writer.join();
  ASSERT_GE(acknowledged.load(), at_kill + 20) << "writes did not go on after the member died" << (*etcd)->Logs();
  std::printf("20 writes after the member died within %s\n", absl::FormatDuration(recovered).c_str());
  // Every acknowledged write is there (one more may have landed unacknowledged).
  absl::StatusOr<int64_t> keys = store.NumKeys("k");
  ASSERT_TRUE(keys.ok()) << keys.status();
  EXPECT_GE(*keys, acknowledged.load());
  EXPECT_LE(*keys, acknowledged.load() + 1);
  for (int i = 0; i < acknowledged.load(); ++i) {
    ASSERT_THAT(store.Get(absl::StrCat("k", i), absl::ZeroDuration()), IsOkAndHolds("v")) << "k" << i;
  }
}

// Two coordinators over one etcd serve one store: a write through one is read, and wakes a
// wait, through the other.
TEST(EtcdStoreTest, TwoCoordinatorsOverOneEtcdServeOneStore) {
  ASSERT_NE(SharedEtcd(), nullptr);
  std::vector<std::unique_ptr<server::Coordinator>> replicas;
  for (int i = 0; i < 2; ++i) {
    server::CoordinatorOptions o;
    o.listen_address = "127.0.0.1:0";
    o.credentials.allow_unauthenticated = true;
    o.etcd.endpoints = SharedEtcd()->endpoints();
    o.etcd.prefix = absl::StrCat("coordinators-", getpid(), "/");
    o.metrics_address = "127.0.0.1:0";
    auto started = server::Coordinator::Start(o);
    ASSERT_TRUE(started.ok()) << started.status();
    replicas.push_back(std::move(*started));
  }
  // With etcd the registry's journal is exported (collserve_registry_journal_writes_total).
  const std::string metrics = HttpGet(replicas[0]->metrics_port(), "/metrics");
  for (const char* result : {"written", "failed", "too_large"}) {
    EXPECT_THAT(metrics, HasSubstr(absl::StrCat("collserve_registry_journal_writes_total{result=\"", result, "\"} 0")));
  }
  std::vector<std::unique_ptr<client::StoreClient>> clients;
  for (auto& r : replicas) {
    client::StoreClientOptions o;
    o.job = "shared";
    auto c = client::StoreClient::Connect(absl::StrCat("127.0.0.1:", r->port()), o);
    ASSERT_TRUE(c.ok()) << c.status();
    clients.push_back(std::move(*c));
  }
  std::thread waiter([&] { EXPECT_THAT(clients[1]->Get("late", absl::Seconds(20)), IsOkAndHolds("here")); });
  ASSERT_THAT(clients[0]->Set("k", "v"), IsOk());
  EXPECT_THAT(clients[1]->Get("k", absl::ZeroDuration()), IsOkAndHolds("v"));
  EXPECT_THAT(clients[0]->Add("n", 2), IsOkAndHolds(2));
  EXPECT_THAT(clients[1]->Add("n", 3), IsOkAndHolds(5));
  ASSERT_THAT(clients[0]->Set("late", "here"), IsOk());
  waiter.join();
  // A client given both replicas' addresses (gRPC's ipv4: target; a Service name resolving
  // to every replica does the same) goes on through the other when its replica stops.
  {
    client::StoreClientOptions o;
    o.job = "shared";
    auto both = client::StoreClient::Connect(
        absl::StrCat("ipv4:127.0.0.1:", replicas[0]->port(), ",127.0.0.1:", replicas[1]->port()), o);
    ASSERT_TRUE(both.ok()) << both.status();
    EXPECT_THAT((*both)->Add("n", 1), IsOkAndHolds(6));  // through replica 0 (pick_first)
    replicas[0].reset();
    clients[0].reset();
    EXPECT_THAT((*both)->Add("n", 1), IsOkAndHolds(7));
    EXPECT_THAT((*both)->Get("late", absl::Seconds(10)), IsOkAndHolds("here"));
  }
  // The etcd store's value limit applies (etcd's requests are bounded).
  EXPECT_THAT(clients[1]->Set("big", std::string(2 << 20, 'x')), StatusIs(absl::StatusCode::kInvalidArgument));
  // Both at once is refused.
  server::CoordinatorOptions both;
  both.listen_address = "127.0.0.1:0";
  both.credentials.allow_unauthenticated = true;
  both.etcd.endpoints = SharedEtcd()->endpoints();
  both.store.data_dir = "/nonexistent";
  EXPECT_THAT(server::Coordinator::Start(both), StatusIs(absl::StatusCode::kInvalidArgument));
}

// etcd with TLS and client-certificate authentication: the store with the CA and a client
// certificate works; without the certificate, or trusting another CA, it cannot connect.
TEST(EtcdStoreTest, TlsToEtcdWithClientCertificates) {
  Pki pki;
  ASSERT_FALSE(pki.dir().empty());
  ASSERT_TRUE(pki.MakeCa("ca") && pki.MakeCa("other-ca") && pki.MakeCert("etcd", "ca") &&
              pki.MakeCert("client", "ca"))
      << "openssl failed; see " << pki.Path("openssl.log");
  auto etcd = EtcdCluster::Start(1, EtcdTls{pki.Path("etcd.pem"), pki.Path("etcd.key"), pki.Path("ca.pem")});
  ASSERT_TRUE(etcd.ok()) << etcd.status();
  server::EtcdStoreOptions options;
  options.endpoints = (*etcd)->endpoints();
  options.call_timeout = absl::Seconds(5);
  options.ca_file = pki.Path("ca.pem");
  options.cert_file = pki.Path("client.pem");
  options.key_file = pki.Path("client.key");
  auto s = server::NewEtcdStore(options);
  ASSERT_TRUE(s.ok()) << s.status() << (*etcd)->Logs();
  ASSERT_THAT((*s)->Set("k", "v"), IsOk());
  EXPECT_THAT((*s)->Get("k", absl::Seconds(1)), IsOkAndHolds("v"));

  server::EtcdStoreOptions no_cert = options;
  no_cert.cert_file.clear();
  no_cert.key_file.clear();
  no_cert.call_timeout = absl::Seconds(1);
  EXPECT_THAT(server::NewEtcdStore(no_cert), StatusIs(absl::StatusCode::kUnavailable));
  server::EtcdStoreOptions other_ca = options;
  other_ca.ca_file = pki.Path("other-ca.pem");
  other_ca.call_timeout = absl::Seconds(1);
  EXPECT_THAT(server::NewEtcdStore(other_ca), StatusIs(absl::StatusCode::kUnavailable));
  server::EtcdStoreOptions no_key = options;
  no_key.key_file.clear();
  EXPECT_THAT(server::NewEtcdStore(no_key), StatusIs(absl::StatusCode::kInvalidArgument));
  server::EtcdStoreOptions missing = options;
  missing.ca_file = pki.Path("nowhere.pem");
  auto refused = server::NewEtcdStore(missing);
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("nowhere.pem"));
}

TEST(EtcdStoreTest, BadOptionsAndAnUnreachableEtcdAreClearErrors) {
  server::EtcdStoreOptions options;
  EXPECT_THAT(server::NewEtcdStore(options), StatusIs(absl::StatusCode::kInvalidArgument));
  options.endpoints = {absl::StrCat("127.0.0.1:", UnusedPort())};
  options.call_timeout = absl::Milliseconds(300);
  auto s = server::NewEtcdStore(options);
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kUnavailable));
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("etcd at 127.0.0.1:"));
}

}  // namespace
}  // namespace collserve::testing
