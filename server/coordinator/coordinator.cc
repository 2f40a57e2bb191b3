#include "server/coordinator/coordinator.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <glog/logging.h>

#include <algorithm>
#include <climits>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/common/daemon.h"
#include "server/common/grpc_listener.h"
#include "server/common/grpc_metrics.h"
#include "server/common/info_service.h"
#include "server/coordinator/registry_journal.h"
#include "server/coordinator/services.h"
#include "server/coordinator/tcpstore_protocol.h"
#include "server/coordinator/tcpstore_server.h"

namespace collserve::server {
namespace {

// The TLS a replica forwards to the leader with (CoordinatorOptions::replication): TLS when
// the API is TLS, as the leader's API is; the CA from --tls_ca unless given; this replica's
// own certificate as the client identity unless given.
absl::Status ReplicaTls(const ServerTlsOptions& api, client::TlsOptions& tls) {
  if (api.cert_file.empty()) {
    if (!tls.ca_file.empty() || !tls.cert_file.empty()) {
      return absl::InvalidArgumentError(
          "TLS between coordinator replicas (--replica_tls_ca) needs TLS on the gRPC API (--tls_cert): the "
          "replicas forward registry calls to each other's API");
    }
    return absl::OkStatus();
  }
  if (tls.ca_file.empty()) tls.ca_file = api.ca_file;
  if (tls.ca_file.empty()) {
    return absl::InvalidArgumentError(
        "coordinator replicas (--advertise_address) with TLS on the gRPC API (--tls_cert) forward registry calls "
        "to each other over TLS: give the CA that signed the replicas' certificates (--replica_tls_ca, or --tls_ca)");
  }
  if (tls.cert_file.empty() && tls.key_file.empty()) {
    tls.cert_file = api.cert_file;
    tls.key_file = api.key_file;
  }
  return CheckReplicaTls(tls);
}

class CoordinatorImpl : public Coordinator {
 public:
  ~CoordinatorImpl() override { Shutdown(absl::Seconds(5)); }

  absl::Status Init(const CoordinatorOptions& options) {
    const bool etcd = !options.etcd.endpoints.empty();
    if (etcd && !options.store.data_dir.empty()) {
      return absl::InvalidArgumentError("a store in etcd (--etcd_endpoints) and in --data_dir: choose one");
    }
    const bool replicas = !options.replication.advertise_address.empty();
    if (replicas && !etcd) {
      return absl::InvalidArgumentError(
          "coordinator replicas (--advertise_address) need the store in etcd (--etcd_endpoints)");
    }
    // The replicas' TLS is checked before anything talks to etcd.
    RegistryReplicationOptions replica_options = options.replication;
    if (replicas) {
      if (absl::Status s = ReplicaTls(options.tls, replica_options.tls); !s.ok()) return s;
    }
    const int64_t max_value_bytes =
        etcd ? std::min(options.store.max_value_bytes, options.etcd.max_value_bytes) : options.store.max_value_bytes;
    // gRPC takes its message limit as an int: a larger value once wrapped to a negative one,
    // which gRPC ignores for its 4 MiB default (every Set over 4 MiB refused).
    constexpr int64_t kMaxValueBytesLimit = int64_t{INT_MAX} - (1 << 20);
    if (options.store.max_value_bytes < 1 || options.store.max_value_bytes > kMaxValueBytesLimit) {
      return absl::InvalidArgumentError(absl::StrCat("max_value_bytes ", options.store.max_value_bytes,
                                                     " is not 1 - ", kMaxValueBytesLimit,
                                                     " (one gRPC message holds at most 2 GiB)"));
    }
    if (options.rpc_memory_bytes <= options.store.max_value_bytes + (1 << 20)) {
      return absl::InvalidArgumentError(absl::StrCat("rpc_memory_bytes (", options.rpc_memory_bytes,
                                                     ") must exceed max_value_bytes (", options.store.max_value_bytes,
                                                     ") + 1 MiB: one Set of the largest value must fit"));
    }
    trimmer_ = std::make_unique<MemoryTrimmer>(absl::Seconds(2));
    absl::StatusOr<std::unique_ptr<store::Store>> store;
    if (etcd) {
      EtcdStoreOptions e = options.etcd;
      e.max_key_bytes = options.store.max_key_bytes;
      e.max_value_bytes = max_value_bytes;
      store = NewEtcdStore(e);
    } else {
      store = store::NewMemoryStore(options.store);
    }
    if (!store.ok()) return store.status();
    store_ = std::move(*store);
    // Writes that wait (for an fdatasync, or for etcd) run on threads of their own.
    const int write_threads = options.store.data_dir.empty() && !etcd ? 0 : options.store_write_threads;
    auto job_credentials = JobCredentials::Create(options.credentials, store_.get());
    if (!job_credentials.ok()) return job_credentials.status();
    credentials_ = std::move(*job_credentials);
    registry_ = std::make_unique<GroupRegistry>(options.registry);
    if (etcd) {
      // The registry's formed generations in etcd: restored here by a coordinator alone, or
      // by each replica when it wins the registry's election.
      auto channel = NewEtcdChannel(options.etcd);
      if (!channel.ok()) return channel.status();
      RegistryJournalOptions j;
      j.prefix = absl::StrCat(options.etcd.prefix, "registry/groups/");
      // A new leader reads the records before it renews its lease: well within the lease.
      j.call_timeout = replicas ? std::min(options.etcd.call_timeout, options.replication.lease_ttl / 3)
                                : options.etcd.call_timeout;
      j.max_value_bytes = options.etcd.max_value_bytes;
      auto journal = EtcdRegistryJournal::Create(*std::move(channel), std::move(j));
      if (!journal.ok()) return journal.status();
      journal_ = std::move(*journal);
      registry_->SetJournal(journal_.get());
      if (!replicas) RestoreRegistry();
    }
    auto listener = GrpcListener::Bind(options.listen_address);
    if (!listener.ok()) return listener.status();
    listener_ = std::move(*listener);
    port_ = listener_->port();
    if (replicas) {
      RegistryReplicationOptions r = std::move(replica_options);
      if (absl::EndsWith(r.advertise_address, ":0")) {
        r.advertise_address = absl::StrCat(r.advertise_address.substr(0, r.advertise_address.size() - 1), port_);
      }
      if (r.key.empty()) r.key = absl::StrCat(options.etcd.prefix, "registry/leader");
      r.on_elected = [this] { RestoreRegistry(); };
      auto channel = NewEtcdChannel(options.etcd);
      if (!channel.ok()) return channel.status();
      auto replication = RegistryReplication::Start(*std::move(channel), std::move(r));
      if (!replication.ok()) return replication.status();
      replication_ = std::move(*replication);
    }
    metrics_registry_ = std::make_shared<prometheus::Registry>();
    rpc_metrics_ = std::make_unique<RpcMetrics>(*metrics_registry_);
    RegisterBuildInfo(*metrics_registry_, "coordinator");
    grpc_metrics_ = std::make_unique<GrpcServerMetrics>(*metrics_registry_);
    store_service_ = std::make_unique<StoreService>(*store_, *credentials_, *rpc_metrics_, write_threads);
    registry_service_ =
        std::make_unique<RegistryService>(*registry_, *store_, *credentials_, *rpc_metrics_, replication_.get());
    job_policies_ = options.job_policies;
    auth_service_ = std::make_unique<AuthService>(*credentials_, *rpc_metrics_, job_policies_);

    grpc::EnableDefaultHealthCheckService(true);
    grpc::reflection::InitProtoReflectionServerBuilderPlugin();  // grpc_cli / grpcurl can list and call
    grpc::ServerBuilder builder;
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
    interceptors.push_back(InterceptorFactory(grpc_metrics_.get()));
    builder.experimental().SetInterceptorCreators(std::move(interceptors));
    LimitRpcMemory(builder, "collserve-coordinator", options.rpc_memory_bytes);
    auto credentials = ServerCredentialsFor(options.tls);
    if (!credentials.ok()) return credentials.status();
    listener_->RegisterWith(builder, *credentials);
    builder.SetMaxReceiveMessageSize(static_cast<int>(options.store.max_value_bytes + (1 << 20)));
    builder.SetMaxSendMessageSize(256 << 20);
    builder.RegisterService(store_service_.get());
    builder.RegisterService(registry_service_.get());
    builder.RegisterService(auth_service_.get());
    info_service_ = std::make_unique<InfoService>("coordinator", "");
    builder.RegisterService(info_service_.get());
    server_ = builder.BuildAndStart();
    if (server_ == nullptr) return absl::InternalError("the gRPC server did not start");
    listener_->Start();
    server_->GetHealthCheckService()->SetServingStatus("collserve.v1.Store", true);
    server_->GetHealthCheckService()->SetServingStatus("collserve.v1.Registry", true);
    server_->GetHealthCheckService()->SetServingStatus("collserve.v1.Auth", true);
    server_->GetHealthCheckService()->SetServingStatus("liveness", true);  // the probe a kubelet restarts on
    auto exposer = ServeMetrics(options.metrics_address, metrics_registry_);
    if (!exposer.ok()) return exposer.status();
    exposer_ = std::move(*exposer);
    if (exposer_ != nullptr) {
      gauges_ = std::make_shared<ScrapeGauges>([this] { return Gauges(); });
      exposer_->RegisterCollectable(gauges_);
    }
    if (!options.tcpstore_address.empty()) {
      TcpStoreOptions t = options.tcpstore;
      t.listen_address = options.tcpstore_address;
      t.job = options.tcpstore_job;
      t.max_key_bytes = options.store.max_key_bytes;
      t.max_value_bytes = max_value_bytes;
      t.write_threads = write_threads;
      auto tcpstore = TcpStoreServer::Start(*store_, t);
      if (!tcpstore.ok()) return tcpstore.status();
      tcpstore_ = std::move(*tcpstore);
    }
    return absl::OkStatus();
  }

  // Takes in the formed generations the journal holds (registry_journal.h). Failures are
  // logged: the sidecars' watches report running groups anyway.
  void RestoreRegistry() {
    auto records = journal_->Load();
    if (!records.ok()) {
      LOG(WARNING) << "registry: " << records.status().message()
                   << "; running groups are adopted from their sidecars' watches instead";
      return;
    }
    int restored = 0;
    for (const EtcdRegistryJournal::Record& r : *records) {
      if (absl::Status s = registry_->Restore(r.job, r.view); s.ok()) {
        ++restored;
      } else {
        LOG(WARNING) << "registry: the recorded generation " << r.view.generation << " of group \"" << r.view.group
                     << "\" in job \"" << r.job << "\" is not restored: " << s.message();
      }
    }
    LOG(INFO) << "registry: restored " << restored << " of " << records->size()
              << " formed generations recorded in etcd";
  }

  // The store's and the registry's state, read at each scrape.
  std::vector<GaugeValue> Gauges() {
    const store::Store::Stats s = store_->GetStats();
    std::vector<GaugeValue> g = {
        {"collserve_store_keys", "Keys the store holds (every job).", static_cast<double>(s.keys)},
        {"collserve_store_bytes", "Bytes of keys and values the store holds (every job).", static_cast<double>(s.bytes)},
        {"collserve_store_max_keys", "The store's key limit (--max_keys).", static_cast<double>(s.max_keys)},
        {"collserve_store_max_bytes", "The store's byte limit (--max_store_bytes).", static_cast<double>(s.max_bytes)},
        {"collserve_store_pending_waits", "Store waits (get, wait) parked until their keys exist.",
         static_cast<double>(s.pending_waits)},
    };
    if (s.wal_bytes >= 0) {
      g.push_back({"collserve_store_wal_bytes", "Size of the store's write-ahead log (--data_dir), bytes.",
                   static_cast<double>(s.wal_bytes)});
      g.push_back({"collserve_store_wal_compactions", "Snapshots the store wrote since the coordinator started "
                   "(each starts a new, empty log).", static_cast<double>(s.wal_compactions)});
      g.push_back({"collserve_store_snapshot_timestamp_seconds",
                   "When the store's snapshot in use was written (Unix time, seconds; 0 = none yet): time() minus "
                   "it is the snapshot's age.",
                   s.snapshot_unix_s});
      g.push_back({"collserve_store_wal_syncs_total",
                   "fdatasyncs of the store's log; each makes a batch of writes durable (group commit).",
                   static_cast<double>(s.wal_syncs), true});
      g.push_back({"collserve_store_wal_writes_total",
                   "Store writes made durable (over collserve_store_wal_syncs_total: the mean batch size).",
                   static_cast<double>(s.wal_writes), true});
      g.push_back({"collserve_store_wal_sync_seconds_total", "Time those fdatasyncs took, seconds (over "
                   "collserve_store_wal_syncs_total: the mean fsync latency).", s.wal_sync_seconds, true});
    }
    if (replication_ != nullptr) {
      g.push_back({"collserve_registry_leader",
                   "1 while this coordinator replica leads the group registry (coordinator replicas over etcd), else 0.",
                   replication_->leading() ? 1.0 : 0.0});
    }
    if (registry_ != nullptr) {
      const GroupRegistry::Counts c = registry_->GroupCounts();
      g.push_back({"collserve_registry_groups", "Groups the registry holds (forming, formed or broken; every job).",
                   static_cast<double>(c.groups)});
      g.push_back({"collserve_registry_formed_groups", "Groups the registry holds whose generation is formed.",
                   static_cast<double>(c.formed)});
      g.push_back({"collserve_registry_generations_formed_total",
                   "Generations formed (rendezvous completed) since the coordinator started, every job.",
                   static_cast<double>(c.generations_formed), true});
    }
    if (journal_ != nullptr) {
      const EtcdRegistryJournal::Stats j = journal_->GetStats();
      const char* help =
          "Changes of the group registry's journal in etcd (a formed generation's record, or its deletion) by "
          "what became of them: written, failed (etcd refused or did not answer: dropped, the record is a hint) "
          "or too_large (over the etcd request limit: never sent).";
      for (const auto& [result, n] : {std::pair<const char*, uint64_t>{"written", j.written},
                                      {"failed", j.failed}, {"too_large", j.too_large}}) {
        g.push_back({"collserve_registry_journal_writes_total", help, static_cast<double>(n), true,
                     {{"result", result}}});
      }
    }
    if (tcpstore_ != nullptr) {
      const std::vector<int64_t> requests = tcpstore_->requests();
      for (int op = 0; op < static_cast<int>(requests.size()); ++op) {
        g.push_back({"collserve_tcpstore_requests_total",
                     "Requests served on the TCPStore-compatible endpoint, by torch's command name.",
                     static_cast<double>(requests[op]), true,
                     {{"command", tcpstore::OpName(static_cast<tcpstore::Op>(op))}}});
      }
      g.push_back({"collserve_tcpstore_protocol_errors_total",
                   "TCPStore connections closed for bad input (a malformed or oversized request).",
                   static_cast<double>(tcpstore_->protocol_errors()), true});
      g.push_back({"collserve_tcpstore_evicted_connections_total",
                   "TCPStore connections closed at the connection cap, having sent nothing, to make room for a "
                   "newcomer.",
                   static_cast<double>(tcpstore_->evicted()), true});
    }
    for (GaugeValue& p : ProcessMetrics()) g.push_back(std::move(p));
    return g;
  }

  int port() const override { return port_; }
  int metrics_port() const override {
    return exposer_ == nullptr ? 0 : exposer_->port();
  }

  int tcpstore_port() const override { return tcpstore_ == nullptr ? 0 : tcpstore_->port(); }

  void Shutdown(absl::Duration grace) override {
    if (tcpstore_ != nullptr) tcpstore_->Shutdown();
    listener_.reset();  // no new connections
    if (server_ == nullptr) return;
    server_->GetHealthCheckService()->Shutdown();
    server_->Shutdown(absl::ToChronoTime(absl::Now() + grace));
    server_->Wait();
    server_.reset();
    exposer_.reset();  // before what the gauges read
    replication_.reset();  // a leader revokes its lease: another replica takes over at once
    registry_.reset();  // fails joins still parked (none after Shutdown)
    if (journal_ != nullptr) (void)journal_->Flush(absl::Seconds(2));  // what formed or ended last
  }

 private:
  std::unique_ptr<store::Store> store_;
  std::unique_ptr<JobCredentials> credentials_;  // after store_: destroyed before it
  std::unique_ptr<EtcdRegistryJournal> journal_;  // with etcd; outlives registry_, which calls it
  std::unique_ptr<GroupRegistry> registry_;
  std::unique_ptr<RegistryReplication> replication_;  // null: no replicas
  std::shared_ptr<prometheus::Registry> metrics_registry_;
  std::shared_ptr<ScrapeGauges> gauges_;  // Gauges(), registered with exposer_
  std::unique_ptr<GrpcServerMetrics> grpc_metrics_;  // outlives server_
  std::unique_ptr<InfoService> info_service_;
  std::unique_ptr<RpcMetrics> rpc_metrics_;
  std::unique_ptr<StoreService> store_service_;
  std::unique_ptr<RegistryService> registry_service_;
  collserve::v1::JobPolicies job_policies_;  // AuthService reads it
  std::unique_ptr<AuthService> auth_service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<GrpcListener> listener_;  // hands its connections to server_
  std::unique_ptr<MetricsServer> exposer_;
  std::unique_ptr<MemoryTrimmer> trimmer_;
  std::unique_ptr<TcpStoreServer> tcpstore_;  // declared after store_: destroyed first
  int port_ = 0;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Coordinator>> Coordinator::Start(const CoordinatorOptions& options) {
  auto c = std::make_unique<CoordinatorImpl>();
  if (absl::Status s = c->Init(options); !s.ok()) return s;
  return std::unique_ptr<Coordinator>(std::move(c));
}

}  // namespace collserve::server
