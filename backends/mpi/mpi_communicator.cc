#include "backends/mpi/mpi_communicator.h"

#include <mpi.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include <glog/logging.h>

#include "absl/base/call_once.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "backends/reduce.h"
#include "common/status_macros.h"

namespace collserve::backends {
namespace {

struct MpiProcess {
  absl::once_flag once;
  absl::Status status;
  std::atomic<bool> ready{false};
  uint64_t salt = 0;
  int world_rank = -1;
  int world_size = 0;
  int tag_ub = 32767;
  std::atomic<int64_t> communicators{0};  // MPI communicators created (never freed)
};

MpiProcess& Process() {
  static MpiProcess* p = new MpiProcess;
  return *p;
}

std::string MpiError(int rc) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) return absl::StrCat("MPI error ", rc);
  return std::string(text, static_cast<size_t>(len));
}

// FNV-1a, 64 bits: the same on every process (std::hash and absl::Hash need not be).
uint64_t Fnv(uint64_t h, absl::string_view s) {
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  return h;
}

// MPI user functions: inout[i] = in[i] op inout[i], with collserve's kernels.
using UserFn = void (*)(void*, void*, int*, MPI_Datatype*);
template <int D, int O>
void ReduceFn(void* in, void* inout, int* len, MPI_Datatype*) {
  Reduce(static_cast<DataType>(D), static_cast<ReduceOp>(O), inout, in, inout, static_cast<size_t>(*len));
}
template <int D>
constexpr std::array<UserFn, 10> Row() {
  return {nullptr,         &ReduceFn<D, 1>, &ReduceFn<D, 2>, &ReduceFn<D, 3>, &ReduceFn<D, 4>,
          &ReduceFn<D, 5>, &ReduceFn<D, 6>, &ReduceFn<D, 7>, &ReduceFn<D, 8>, &ReduceFn<D, 9>};
}
constexpr std::array<std::array<UserFn, 10>, 10> kFns = {
    {{}, Row<1>(), Row<2>(), Row<3>(), Row<4>(), Row<5>(), Row<6>(), Row<7>(), Row<8>(), Row<9>()}};

// One MPI datatype per dtype (ElementSize contiguous bytes) and one MPI_Op per (dtype, op),
// made on first use and kept for the process's life.
class Reductions {
 public:
  static Reductions& Get() {
    static Reductions* r = new Reductions;
    return *r;
  }
  absl::Status Find(DataType dtype, ReduceOp op, MPI_Datatype* type, MPI_Op* mpi_op) {
    const int d = static_cast<int>(dtype);
    const int o = static_cast<int>(op);
    if (d <= 0 || d >= 10 || o <= 0 || o >= 10 || kFns[d][o] == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("no MPI reduction for dtype ", d, " and op ", o));
    }
    absl::MutexLock lock(&mu_);
    auto t = types_.find(d);
    if (t == types_.end()) {
      MPI_Datatype made;
      int rc = MPI_Type_contiguous(static_cast<int>(ElementSize(dtype)), MPI_BYTE, &made);
      if (rc == MPI_SUCCESS) rc = MPI_Type_commit(&made);
      if (rc != MPI_SUCCESS) return absl::UnavailableError(absl::StrCat("MPI_Type_contiguous: ", MpiError(rc)));
      t = types_.emplace(d, made).first;
    }
    auto f = ops_.find({d, o});
    if (f == ops_.end()) {
      MPI_Op made;
      const int rc = MPI_Op_create(kFns[d][o], /*commute=*/1, &made);
      if (rc != MPI_SUCCESS) return absl::UnavailableError(absl::StrCat("MPI_Op_create: ", MpiError(rc)));
      f = ops_.emplace(std::make_pair(d, o), made).first;
    }
    *type = t->second;
    *mpi_op = f->second;
    return absl::OkStatus();
  }

 private:
  absl::Mutex mu_;
  std::map<int, MPI_Datatype> types_ ABSL_GUARDED_BY(mu_);
  std::map<std::pair<int, int>, MPI_Op> ops_ ABSL_GUARDED_BY(mu_);
};

// Buffers and communicators of failed groups that MPI may still write or use: never freed.
void Bury(std::vector<char> buffer) {
  static absl::Mutex mu(absl::kConstInit);
  static auto* graveyard = new std::vector<std::vector<char>>;
  absl::MutexLock lock(&mu);
  graveyard->push_back(std::move(buffer));
}

absl::Status CheckInt(size_t n, const char* what) {
  if (n > static_cast<size_t>(INT_MAX)) {
    return absl::InvalidArgumentError(absl::StrCat(what, " of ", n, " is over the MPI backend's limit of ", INT_MAX,
                                                   " per call (MPI counts are int)"));
  }
  return absl::OkStatus();
}

class MpiCommunicator : public Communicator {
 public:
  MpiCommunicator(int rank, int size, MPI_Comm coll, MPI_Comm p2p, int max_call_elements)
      : rank_(rank), size_(size), coll_(coll), p2p_(p2p), max_call_elements_(max_call_elements) {}

  // The MPI communicators are never freed: Open MPI reuses a freed communicator's context
  // id for the next one it creates, and delivers to that one the messages still arriving
  // for the freed one (a departure header sent to a host whose group had just ended, a
  // send no rank received): a later generation would take them for its own. Each group
  // generation across hosts thus keeps two context ids of the process for its life.
  ~MpiCommunicator() override {
    if (pending_.load()) {
      // An operation MPI may still complete into these buffers.
      Bury(std::move(coll_buf_));
      Bury(std::move(send_buf_));
      Bury(std::move(recv_buf_));
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

  absl::Status AllReduce(void* data, size_t count, DataType dtype, ReduceOp op, absl::Duration timeout,
                         AllReduceAlgorithm) override {
    COLLSERVE_RETURN_IF_ERROR(Usable());
    if (op == ReduceOp::kAvg) return absl::InvalidArgumentError("AllReduce takes no AVG: reduce with SUM, then divide");
    COLLSERVE_RETURN_IF_ERROR(ValidateReduce(dtype, op));
    MPI_Datatype type = MPI_DATATYPE_NULL;
    MPI_Op mpi_op = MPI_OP_NULL;
    COLLSERVE_RETURN_IF_ERROR(Reductions::Get().Find(dtype, op == ReduceOp::kPremulSum ? ReduceOp::kSum : op, &type,
                                                     &mpi_op));
    const size_t esize = ElementSize(dtype);
    if (count > SIZE_MAX / esize) return absl::InvalidArgumentError("all_reduce byte size overflows");
    if (count == 0) return absl::OkStatus();
    const absl::Time deadline = absl::Now() + timeout;
    char* buf = Fit(coll_buf_, count * esize);
    std::memcpy(buf, data, count * esize);
    for (size_t done = 0; done < count;) {
      const size_t n = std::min(count - done, static_cast<size_t>(max_call_elements_));
      MPI_Request req;
      const int rc = MPI_Iallreduce(MPI_IN_PLACE, buf + done * esize, static_cast<int>(n), type, mpi_op, coll_, &req);
      COLLSERVE_RETURN_IF_ERROR(Started(rc, "all_reduce"));
      COLLSERVE_RETURN_IF_ERROR(Await(&req, deadline, timeout, "all_reduce", nullptr, nullptr));
      done += n;
    }
    std::memcpy(data, buf, count * esize);
    return absl::OkStatus();
  }

  absl::Status Broadcast(void* data, size_t bytes, int root, absl::Duration timeout) override {
    COLLSERVE_RETURN_IF_ERROR(Usable());
    if (root < 0 || root >= size_) return absl::InvalidArgumentError(absl::StrCat("broadcast root ", root, " out of range"));
    COLLSERVE_RETURN_IF_ERROR(CheckInt(bytes, "a broadcast of bytes"));
    if (bytes == 0) return absl::OkStatus();
    const absl::Time deadline = absl::Now() + timeout;
    char* buf = Fit(coll_buf_, bytes);
    if (rank_ == root) std::memcpy(buf, data, bytes);
    MPI_Request req;
    COLLSERVE_RETURN_IF_ERROR(Started(MPI_Ibcast(buf, static_cast<int>(bytes), MPI_BYTE, root, coll_, &req), "broadcast"));
    COLLSERVE_RETURN_IF_ERROR(Await(&req, deadline, timeout, "broadcast", nullptr, nullptr));
    if (rank_ != root) std::memcpy(data, buf, bytes);
    return absl::OkStatus();
  }

  absl::Status AllGather(const void* in, void* out, size_t bytes, absl::Duration timeout) override {
    return AllGatherV(in, out, std::vector<size_t>(static_cast<size_t>(size_), bytes), timeout);
  }

  absl::Status AllGatherV(const void* in, void* out, const std::vector<size_t>& bytes, absl::Duration timeout) override {
    COLLSERVE_RETURN_IF_ERROR(Usable());
    if (bytes.size() != static_cast<size_t>(size_)) {
      return absl::InvalidArgumentError(absl::StrCat("all_gather with ", bytes.size(), " sizes for ", size_, " hosts"));
    }
    std::vector<int> counts, displs;
    size_t total = 0;
    COLLSERVE_RETURN_IF_ERROR(Layout(bytes, &counts, &displs, &total, "an all_gather's bytes"));
    if (total == 0) return absl::OkStatus();
    const absl::Time deadline = absl::Now() + timeout;
    const size_t mine = bytes[static_cast<size_t>(rank_)];
    char* buf = Fit(coll_buf_, total);
    // In place: this host's piece is already at its offset of the result.
    if (mine > 0) std::memcpy(buf + displs[static_cast<size_t>(rank_)], in, mine);
    MPI_Request req;
    COLLSERVE_RETURN_IF_ERROR(Started(
        MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_BYTE, buf, counts.data(), displs.data(), MPI_BYTE, coll_, &req),
        "all_gather"));
    COLLSERVE_RETURN_IF_ERROR(Await(&req, deadline, timeout, "all_gather", nullptr, nullptr));
    std::memcpy(out, buf, total);
    return absl::OkStatus();
  }

  absl::Status AllToAllV(const void* in, const std::vector<size_t>& send_bytes, void* out,
                         const std::vector<size_t>& recv_bytes, absl::Duration timeout) override {
    COLLSERVE_RETURN_IF_ERROR(Usable());
    if (send_bytes.size() != static_cast<size_t>(size_) || recv_bytes.size() != static_cast<size_t>(size_)) {
      return absl::InvalidArgumentError(absl::StrCat("all_to_all with ", send_bytes.size(), " and ", recv_bytes.size(),
                                                     " sizes for ", size_, " hosts"));
    }
    std::vector<int> scounts, sdispls, rcounts, rdispls;
    size_t stotal = 0, rtotal = 0;
    COLLSERVE_RETURN_IF_ERROR(Layout(send_bytes, &scounts, &sdispls, &stotal, "an all_to_all's bytes sent"));
    COLLSERVE_RETURN_IF_ERROR(Layout(recv_bytes, &rcounts, &rdispls, &rtotal, "an all_to_all's bytes received"));
    const absl::Time deadline = absl::Now() + timeout;
    char* buf = Fit(coll_buf_, stotal + rtotal);
    if (stotal > 0) std::memcpy(buf, in, stotal);
    MPI_Request req;
    COLLSERVE_RETURN_IF_ERROR(Started(MPI_Ialltoallv(buf, scounts.data(), sdispls.data(), MPI_BYTE, buf + stotal,
                                                     rcounts.data(), rdispls.data(), MPI_BYTE, coll_, &req),
                                      "all_to_all"));
    COLLSERVE_RETURN_IF_ERROR(Await(&req, deadline, timeout, "all_to_all", nullptr, nullptr));
    if (rtotal > 0) std::memcpy(out, buf + stotal, rtotal);
    return absl::OkStatus();
  }

  absl::Status Send(const void* data, size_t bytes, int peer, uint32_t slot, absl::Duration timeout) override {
    absl::MutexLock lock(&send_mu_);
    COLLSERVE_RETURN_IF_ERROR(Usable());
    COLLSERVE_RETURN_IF_ERROR(CheckPeerAndSlot(peer, slot));
    COLLSERVE_RETURN_IF_ERROR(CheckInt(bytes, "a send of bytes"));
    const absl::Time deadline = absl::Now() + timeout;
    char* buf = Fit(send_buf_, bytes);
    if (bytes > 0) std::memcpy(buf, data, bytes);
    MPI_Request req;
    COLLSERVE_RETURN_IF_ERROR(
        Started(MPI_Isend(buf, static_cast<int>(bytes), MPI_BYTE, peer, static_cast<int>(slot), p2p_, &req), "send"));
    return Await(&req, deadline, timeout, absl::StrCat("send to host ", peer), nullptr, nullptr);
  }

  absl::Status Recv(void* data, size_t bytes, const std::vector<int>& peers, uint32_t slot, int* from,
                    absl::Duration timeout) override {
    absl::MutexLock lock(&recv_mu_);
    if (abort_recv_.load()) return absl::CancelledError("the receive was aborted");
    COLLSERVE_RETURN_IF_ERROR(Usable());
    if (peers.empty()) return absl::InvalidArgumentError("a receive from no host");
    for (int p : peers) COLLSERVE_RETURN_IF_ERROR(CheckPeerAndSlot(p, slot));
    std::set<int> others(peers.begin(), peers.end());
    int source = peers[0];
    if (peers.size() > 1) {
      // MPI receives from one source or from any: "any" must mean every other host.
      if (others.size() != static_cast<size_t>(size_ - 1) || others.count(rank_) != 0) {
        return absl::InvalidArgumentError("the MPI backend receives from one host or from every other host");
      }
      source = MPI_ANY_SOURCE;
    }
    COLLSERVE_RETURN_IF_ERROR(CheckInt(bytes, "a receive of bytes"));
    const absl::Time deadline = absl::Now() + timeout;
    char* buf = Fit(recv_buf_, bytes);
    MPI_Request req;
    COLLSERVE_RETURN_IF_ERROR(
        Started(MPI_Irecv(buf, static_cast<int>(bytes), MPI_BYTE, source, static_cast<int>(slot), p2p_, &req), "receive"));
    MPI_Status status;
    COLLSERVE_RETURN_IF_ERROR(Await(&req, deadline, timeout, "receive", &abort_recv_, &status));
    int got = 0;
    MPI_Get_count(&status, MPI_BYTE, &got);
    if (static_cast<size_t>(got) != bytes) {
      return Fail(absl::InternalError(absl::StrCat("host ", status.MPI_SOURCE, " sent ", got, " bytes on slot ", slot,
                                                   " where ", bytes, " were expected")));
    }
    if (bytes > 0) std::memcpy(data, buf, bytes);
    if (from != nullptr) *from = status.MPI_SOURCE;
    return absl::OkStatus();
  }

  void AbortRecv() override { abort_recv_.store(true); }

  void ShutdownPeer(int peer) override {
    int none = -1;
    gone_peer_.compare_exchange_strong(none, peer);
  }

 private:
  static char* Fit(std::vector<char>& buf, size_t bytes) {
    if (buf.size() < bytes) buf.resize(bytes);
    return buf.data();
  }

  absl::Status Usable() {
    absl::MutexLock lock(&fail_mu_);
    if (failure_.ok()) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat("the MPI communicator failed before: ", failure_.message()));
  }

  absl::Status Fail(absl::Status s) {
    absl::MutexLock lock(&fail_mu_);
    if (failure_.ok()) failure_ = s;
    return s;
  }

  absl::Status Started(int rc, absl::string_view what) {
    if (rc == MPI_SUCCESS) return absl::OkStatus();
    return Fail(absl::UnavailableError(absl::StrCat(what, " could not start in MPI: ", MpiError(rc))));
  }

  absl::Status CheckPeerAndSlot(int peer, uint32_t slot) const {
    if (peer < 0 || peer >= size_ || peer == rank_) {
      return absl::InvalidArgumentError(absl::StrCat("host ", peer, " is not another host of ", size_));
    }
    if (slot > static_cast<uint32_t>(Process().tag_ub)) {
      return absl::InvalidArgumentError(absl::StrCat("slot ", slot, " is over MPI's largest tag ", Process().tag_ub));
    }
    return absl::OkStatus();
  }

  // Counts and displacements (int, as MPI takes them) of pieces of `bytes`; their total
  // must fit an int too (the displacements are int).
  static absl::Status Layout(const std::vector<size_t>& bytes, std::vector<int>* counts, std::vector<int>* displs,
                             size_t* total, const char* what) {
    for (size_t b : bytes) {
      if (b > static_cast<size_t>(INT_MAX) - *total) {
        return absl::InvalidArgumentError(absl::StrCat(what, " come to more than the MPI backend's limit of ", INT_MAX,
                                                       " per call (MPI counts and displacements are int)"));
      }
      counts->push_back(static_cast<int>(b));
      displs->push_back(static_cast<int>(*total));
      *total += b;
    }
    return absl::OkStatus();
  }

  // Polls `req` until it completes (OK), `deadline` passes (DEADLINE_EXCEEDED), a host is
  // shut down (UNAVAILABLE) or, for a receive, `cancel` is set (CANCELLED). Any non-OK
  // leaves the request to MPI: its buffer is never reused or freed, and every error but
  // CANCELLED makes the communicator unusable.
  absl::Status Await(MPI_Request* req, absl::Time deadline, absl::Duration timeout, absl::string_view what,
                     const std::atomic<bool>* cancel, MPI_Status* status) {
    absl::Duration nap = absl::Microseconds(2);
    for (int polls = 0;; ++polls) {
      int done = 0;
      MPI_Status st;
      const int rc = MPI_Test(req, &done, &st);
      if (rc != MPI_SUCCESS) {
        pending_.store(true);
        return Fail(absl::UnavailableError(absl::StrCat(what, " failed in MPI: ", MpiError(rc))));
      }
      if (done) {
        if (status != nullptr) *status = st;
        return absl::OkStatus();
      }
      if (cancel != nullptr && cancel->load()) {
        if (!CancelReceive(req)) pending_.store(true);
        return absl::CancelledError(absl::StrCat(what, " was aborted"));
      }
      if (const int gone = gone_peer_.load(); gone >= 0) {
        if (cancel == nullptr || !CancelReceive(req)) pending_.store(true);
        return Fail(absl::UnavailableError(absl::StrCat(what, " cannot complete: host ", gone, " of the group is gone")));
      }
      if (absl::Now() >= deadline) {
        if (cancel == nullptr || !CancelReceive(req)) pending_.store(true);
        return Fail(absl::DeadlineExceededError(
            absl::StrCat(what, " did not complete within its timeout of ", absl::FormatDuration(timeout),
                         " (a host of the group did not take part)")));
      }
      // Progress happens inside MPI calls (Open MPI's nonblocking collectives advance a
      // round per MPI_Test): poll often, backing off to 200 us, so that a call waiting on a
      // slow host does not hold a core of this machine (polling back to back for the first
      // 2 ms, then napping to 50 us, measured no faster: bench/RESULTS.md).
      if (polls > 64) {
        absl::SleepFor(nap);
        nap = std::min(nap * 2, absl::Microseconds(200));
      }
    }
  }

  // Cancels a pending receive; true once MPI says it is done with it (within 1 s).
  static bool CancelReceive(MPI_Request* req) {
    if (MPI_Cancel(req) != MPI_SUCCESS) return false;
    const absl::Time until = absl::Now() + absl::Seconds(1);
    while (absl::Now() < until) {
      int done = 0;
      if (MPI_Test(req, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) return false;
      if (done) return true;
      absl::SleepFor(absl::Microseconds(50));
    }
    return false;
  }

  const int rank_;
  const int size_;
  MPI_Comm coll_;
  MPI_Comm p2p_;
  const int max_call_elements_;
  std::vector<char> coll_buf_;  // the executor's (one collective at a time)
  absl::Mutex send_mu_;
  std::vector<char> send_buf_ ABSL_GUARDED_BY(send_mu_);
  absl::Mutex recv_mu_;
  std::vector<char> recv_buf_ ABSL_GUARDED_BY(recv_mu_);
  std::atomic<bool> abort_recv_{false};
  std::atomic<int> gone_peer_{-1};
  std::atomic<bool> pending_{false};
  absl::Mutex fail_mu_;
  absl::Status failure_ ABSL_GUARDED_BY(fail_mu_);
};

// The creation of a group's communicators, on a thread of its own (MPI's calls block with
// no timeout): the connect waits for it up to its deadline and leaves it behind after.
struct Creation {
  absl::Mutex mu;
  bool done ABSL_GUARDED_BY(mu) = false;
  int rc ABSL_GUARDED_BY(mu) = MPI_SUCCESS;
  MPI_Comm coll ABSL_GUARDED_BY(mu) = MPI_COMM_NULL;
  MPI_Comm p2p ABSL_GUARDED_BY(mu) = MPI_COMM_NULL;
};

}  // namespace

bool LaunchedByMpi() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"}) {
    if (std::getenv(v) != nullptr) return true;
  }
  return false;
}

absl::Status InitializeMpi() {
  MpiProcess& p = Process();
  absl::call_once(p.once, [&p] {
    // Open MPI's nonblocking all_reduce (libnbc) picks by default an algorithm that took
    // 1.65x the time of the blocking MPI_Allreduce for 64 MiB between 2 processes;
    // Rabenseifner's (reduce-scatter, then all-gather) matched it there and was as fast as
    // the default with 4 (bench/RESULTS.md, "The MPI column"). An operator's own setting
    // (mpirun --mca, or this variable) wins.
    setenv("OMPI_MCA_coll_libnbc_iallreduce_algorithm", "3", /*overwrite=*/0);
    int provided = 0;
    int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    if (rc != MPI_SUCCESS) {
      p.status = absl::UnavailableError(absl::StrCat("MPI_Init_thread failed: ", MpiError(rc)));
      return;
    }
    if (provided < MPI_THREAD_MULTIPLE) {
      p.status = absl::FailedPreconditionError(absl::StrCat(
          "the MPI library offers thread level ", provided, ", not MPI_THREAD_MULTIPLE (", MPI_THREAD_MULTIPLE,
          "): the sidecar calls MPI from several threads"));
      return;
    }
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    MPI_Comm_rank(MPI_COMM_WORLD, &p.world_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &p.world_size);
    void* ub = nullptr;
    int flag = 0;
    if (MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &flag) == MPI_SUCCESS && flag) p.tag_ub = *static_cast<int*>(ub);
    uint64_t salt = 0;
    if (p.world_rank == 0) salt = (static_cast<uint64_t>(std::random_device{}()) << 32) ^ std::random_device{}();
    rc = MPI_Bcast(&salt, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
    if (rc != MPI_SUCCESS) {
      p.status = absl::UnavailableError(absl::StrCat("agreeing the MPI world's salt failed: ", MpiError(rc)));
      return;
    }
    p.salt = salt;
    p.ready.store(true);
  });
  return p.status;
}

void FinalizeMpi() {
  static absl::once_flag once;
  absl::call_once(once, [] {
    if (Process().ready.load()) MPI_Finalize();
  });
}

bool MpiInitialized() { return Process().ready.load(); }
int MpiWorldRank() { return MpiInitialized() ? Process().world_rank : -1; }
int MpiWorldSize() { return MpiInitialized() ? Process().world_size : 0; }

absl::StatusOr<std::unique_ptr<Communicator>> ConnectMpi(RendezvousStore& store, const std::string& prefix, int rank,
                                                          int size, const MpiOptions& options) {
  if (!MpiInitialized()) {
    return absl::FailedPreconditionError(
        "the mpi backend needs sidecars started as one MPI world (mpirun or srun, collserve-sidecar --mpi): this "
        "sidecar has none");
  }
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat("host ", rank, " of ", size, " is out of range"));
  }
  const absl::Time deadline = absl::Now() + options.connect_timeout;
  auto key = [&](int i) { return absl::StrCat(prefix, "/mpi/world_rank/", i); };
  COLLSERVE_RETURN_IF_ERROR(store.Set(key(rank), absl::StrCat(MpiWorldRank())));
  std::vector<std::string> keys;
  for (int i = 0; i < size; ++i) keys.push_back(key(i));
  COLLSERVE_RETURN_IF_ERROR(store.Wait(keys, std::max(deadline - absl::Now(), absl::ZeroDuration())));
  std::vector<int> world(static_cast<size_t>(size));
  std::map<int, int> host_of;
  for (int i = 0; i < size; ++i) {
    COLLSERVE_ASSIGN_OR_RETURN(std::string value, store.Get(keys[i], std::max(deadline - absl::Now(), absl::ZeroDuration())));
    int w = -1;
    if (!absl::SimpleAtoi(value, &w) || w < 0 || w >= MpiWorldSize()) {
      return absl::InvalidArgumentError(absl::StrCat("host ", i, " gave MPI world rank \"", value,
                                                     "\", not one of this world's ", MpiWorldSize()));
    }
    if (auto [it, fresh] = host_of.emplace(w, i); !fresh) {
      return absl::InvalidArgumentError(absl::StrCat("hosts ", it->second, " and ", i, " are both MPI world rank ", w,
                                                     " (one sidecar per host, each its own world rank)"));
    }
    world[static_cast<size_t>(i)] = w;
  }
  if (world[static_cast<size_t>(rank)] != MpiWorldRank()) {
    return absl::InvalidArgumentError(absl::StrCat("host ", rank, "'s world rank in the store is ",
                                                   world[static_cast<size_t>(rank)], ", not this sidecar's ",
                                                   MpiWorldRank()));
  }
  // A tag every member derives alike and that differs between the communicators a process
  // creates at once; the world's secret salt keeps a job from choosing another's.
  const int tag = static_cast<int>(Fnv(Fnv(Process().salt, options.job), prefix) %
                                   (static_cast<uint64_t>(Process().tag_ub) + 1));
  MPI_Group world_group, group;
  MPI_Comm_group(MPI_COMM_WORLD, &world_group);
  int rc = MPI_Group_incl(world_group, size, world.data(), &group);
  MPI_Group_free(&world_group);
  if (rc != MPI_SUCCESS) return absl::UnavailableError(absl::StrCat("MPI_Group_incl: ", MpiError(rc)));
  auto creation = std::make_shared<Creation>();
  std::thread([creation, group, tag]() mutable {
    MPI_Comm coll = MPI_COMM_NULL, p2p = MPI_COMM_NULL;
    int result = MPI_Comm_create_group(MPI_COMM_WORLD, group, tag, &coll);
    if (result == MPI_SUCCESS) {
      MPI_Comm_set_errhandler(coll, MPI_ERRORS_RETURN);
      result = MPI_Comm_dup(coll, &p2p);
    }
    if (result == MPI_SUCCESS) MPI_Comm_set_errhandler(p2p, MPI_ERRORS_RETURN);
    if (coll != MPI_COMM_NULL) ++Process().communicators;
    if (p2p != MPI_COMM_NULL) ++Process().communicators;
    MPI_Group_free(&group);
    absl::MutexLock lock(&creation->mu);
    creation->done = true;
    creation->rc = result;
    creation->coll = coll;
    creation->p2p = p2p;
  }).detach();
  absl::MutexLock lock(&creation->mu);
  if (!creation->mu.AwaitWithDeadline(absl::Condition(&creation->done), deadline)) {
    return absl::DeadlineExceededError(absl::StrCat(
        "the group's MPI communicator (world ranks [", absl::StrJoin(world, ", "), "]) was not created within ",
        absl::FormatDuration(options.connect_timeout), ": a host did not take part"));
  }
  if (creation->rc != MPI_SUCCESS) {
    // Communicators are never freed (~MpiCommunicator): after some 32,000 generations of
    // groups across hosts the MPI library runs out of context ids (65,536 in Open MPI).
    return absl::UnavailableError(absl::StrCat(
        "creating the group's MPI communicator: ", MpiError(creation->rc), " (this sidecar holds ",
        Process().communicators.load(), " MPI communicators, which it never frees; past Open MPI's 65,536 context "
        "ids the sidecar must be restarted: docs/guide.md)"));
  }
  if (const int64_t held = Process().communicators.load(); held % 10000 < 2 && held >= 10000) {
    LOG(WARNING) << "this sidecar holds " << held << " MPI communicators, which it never frees (two per generation "
                 << "of a group across hosts); Open MPI has 65,536 context ids: restart the sidecar before then";
  }
  return std::unique_ptr<Communicator>(new MpiCommunicator(
      rank, size, creation->coll, creation->p2p, std::clamp(options.max_call_elements, 1, INT_MAX)));
}

}  // namespace collserve::backends
