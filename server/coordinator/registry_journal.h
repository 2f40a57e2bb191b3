// The group registry's formed generations in etcd (issue 18: with etcd, a coordinator holds
// no registry state that a successor cannot recover).
//
// A RegistryJournal (group_registry.h) that writes each formed generation to etcd as one
// key, `<prefix><len(job)>:<job>/<group>`, holding a collserve.v1.JoinResponse in its
// compact form (generation, member hosts, each rank's host index), and deletes the key when
// the generation ends. The registry leader writes; a new leader (or a coordinator restarted
// over the same etcd) reads every record with Load and hands each to GroupRegistry::Restore,
// so the groups that ran under the old leader are known at once (describe, list, diagnose,
// leases of hosts that never come back) instead of when their sidecars' watches report
// them. Records are hints, never the only copy of anything: the sidecars' watches still
// adopt a generation the journal missed, and a restored generation whose hosts never watch
// is lost when its adoption lease ends (then deleted).
//
// Writes are asynchronous: Formed and Ended queue the change (per key, only the latest is
// kept, so the queue is bounded by the groups held) and one thread writes it, each call
// bounded by call_timeout. A write that fails is logged and dropped (the record is a hint),
// as is a record over max_value_bytes (a group of tens of thousands of ranks on as many
// hosts; etcd refuses requests over its --max-request-bytes); GetStats counts both.
#ifndef COLLSERVE_SERVER_COORDINATOR_REGISTRY_JOURNAL_H_
#define COLLSERVE_SERVER_COORDINATOR_REGISTRY_JOURNAL_H_

#include <grpcpp/channel.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/coordinator/group_registry.h"

namespace collserve::server {

struct RegistryJournalOptions {
  // Every record's key starts with it (e.g. "<etcd prefix>registry/groups/").
  std::string prefix;
  // Deadline of each etcd call.
  absl::Duration call_timeout = absl::Seconds(2);
  // Largest record written, bytes.
  int64_t max_value_bytes = 1 << 20;
};

// Thread safety: every method may be called from any thread.
class EtcdRegistryJournal : public RegistryJournal {
 public:
  // `etcd`: a channel to its members (NewEtcdChannel). Does not connect. INVALID_ARGUMENT
  // for a null channel, an empty prefix or a non-positive limit.
  static absl::StatusOr<std::unique_ptr<EtcdRegistryJournal>> Create(std::shared_ptr<grpc::Channel> etcd,
                                                                      RegistryJournalOptions options);
  // Writes what is queued, all of it within one call_timeout (what etcd has not taken by
  // then is dropped), then stops.
  ~EtcdRegistryJournal() override;

  void Formed(const std::string& job, std::shared_ptr<const GroupView> view) override;
  void Ended(const std::string& job, const std::string& group, int64_t generation) override;

  struct Record {
    std::string job;
    GroupView view;  // group, generation, world_size, state "FORMED", members (ordered by rank)
  };
  // Every record in etcd, read in one Range within call_timeout. UNAVAILABLE when etcd does
  // not answer. A record that does not parse (a key or value not written by this class) is
  // skipped with a warning.
  absl::StatusOr<std::vector<Record>> Load();
  // Blocks until every change queued before the call was written or dropped, or `timeout`
  // passed; true if it was. For tests and orderly shutdowns.
  bool Flush(absl::Duration timeout);

  // What the writer thread did with the changes it took (a change superseded while queued
  // is in none of them). Exported as collserve_registry_journal_writes_total{result}.
  struct Stats {
    uint64_t written = 0;    // a Put or a DeleteRange etcd acknowledged
    uint64_t failed = 0;     // etcd refused it or did not answer within call_timeout: dropped
    uint64_t too_large = 0;  // a record over max_value_bytes: never sent
  };
  Stats GetStats();

  // The key of (job, group)'s record, and its inverse (false for a key of another shape).
  std::string Key(const std::string& job, const std::string& group) const;
  bool ParseKey(const std::string& key, std::string* job, std::string* group) const;

 private:
  EtcdRegistryJournal(std::shared_ptr<grpc::Channel> etcd, RegistryJournalOptions options);
  struct Change {
    int64_t generation = 0;
    std::shared_ptr<const GroupView> view;  // null: delete the record
  };
  void Loop();
  enum class Outcome { kWritten, kFailed, kTooLarge };
  Outcome Write(const std::string& key, const Change& change);

  const RegistryJournalOptions options_;
  std::shared_ptr<grpc::Channel> etcd_;
  struct Stubs;
  std::unique_ptr<Stubs> stubs_;
  absl::Mutex mu_;
  std::map<std::string, Change> pending_ ABSL_GUARDED_BY(mu_);  // by key: the latest change
  // By key: the generation of the latest Formed, queued or already taken by the writer, until
  // an Ended of it (or later) arrives. An Ended of an older generation is ignored against it
  // even once the writer took the newer record (else it would delete that record).
  std::map<std::string, int64_t> formed_ ABSL_GUARDED_BY(mu_);
  uint64_t queued_ ABSL_GUARDED_BY(mu_) = 0;   // changes queued so far
  uint64_t written_ ABSL_GUARDED_BY(mu_) = 0;  // of them, written or dropped
  Stats stats_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  absl::Time stop_by_ ABSL_GUARDED_BY(mu_) = absl::InfiniteFuture();  // stopping: the writes' last deadline
  std::thread thread_;
};

}  // namespace collserve::server

#endif  // COLLSERVE_SERVER_COORDINATOR_REGISTRY_JOURNAL_H_
