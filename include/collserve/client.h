// collserve C++ client SDK.
//
// Names follow torch.distributed (https://pytorch.org/docs/stable/distributed.html):
// InitProcessGroup ~ init_process_group, ProcessGroup::AllReduce ~ all_reduce, Work ~
// torch.distributed.Work, ReduceOp, GetRank/GetWorldSize, and StoreClient ~ TCPStore.
//
//   auto options = collserve::client::InitOptions::FromEnv();      // env:// variables
//   auto pg = collserve::client::InitProcessGroup(*options);
//   std::vector<float> grad(n);
//   auto work = (*pg)->AllReduce(grad.data(), grad.size(), collserve::DataType::kFloat32,
//                                collserve::ReduceOp::kSum);
//   absl::Status s = work->Wait();
//
// A ProcessGroup talks to the collserve sidecar on its host (a unix socket, or host:port
// for a sidecar elsewhere); the sidecar joins the group at the coordinator and moves the
// bytes. Errors are absl::Status values with canonical codes (identical to gRPC's).
#ifndef COLLSERVE_CLIENT_H_
#define COLLSERVE_CLIENT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "collserve/types.h"

namespace collserve::client {

// Default address of the sidecar on this host.
inline constexpr absl::string_view kDefaultSidecarAddress = "unix:/run/collserve/sidecar.sock";

// Transport security of the gRPC channels a client opens to a coordinator and to a sidecar's
// TCP listener. A "unix:" address is always plaintext (a local socket; its file mode guards
// it). With ca_file empty the channel is plaintext too. Files are PEM and are re-read while
// the channel lives (every minute), so a rotated certificate needs no restart.
struct TlsOptions {
  // CA bundle that signed the servers' certificates; set = TLS. Env: COLLSERVE_TLS_CA.
  std::string ca_file;
  // This client's certificate chain and private key, for servers that require mutual TLS;
  // both or neither. Env: COLLSERVE_TLS_CERT, COLLSERVE_TLS_KEY.
  std::string cert_file;
  std::string key_file;
  // The name the server's certificate must carry, when it differs from the host part of the
  // address (e.g. a Kubernetes Service name behind an IP). Env: COLLSERVE_TLS_SERVER_NAME.
  std::string server_name;

  // Reads the four variables above (unset = empty). INVALID_ARGUMENT if only one of
  // COLLSERVE_TLS_CERT and COLLSERVE_TLS_KEY is set, or a certificate is set without a CA.
  static absl::StatusOr<TlsOptions> FromEnv();
};

// The job token this process presents to the coordinator and its sidecar (docs/security.md):
// COLLSERVE_TOKEN, else the content of the file named by COLLSERVE_TOKEN_FILE (surrounding
// whitespace dropped), else "" (no token: accepted only by a coordinator started with
// --allow_unauthenticated). INVALID_ARGUMENT when COLLSERVE_TOKEN_FILE cannot be read or
// holds no token or more than 4096 bytes. Thread-safe (reads the environment).
absl::StatusOr<std::string> JobTokenFromEnv();

struct InitOptions {
  // The sidecar serving this process: "unix:/path" or "host:port". Default:
  // kDefaultSidecarAddress. Env: COLLSERVE_SIDECAR.
  std::string sidecar_address;
  // The coordinator (for store()): "host:port". Env: COLLSERVE_COORDINATOR, else
  // MASTER_ADDR and MASTER_PORT. Empty = store() is unavailable.
  std::string coordinator_address;
  // Job namespace for keys and groups. Env: COLLSERVE_JOB. Default "default".
  std::string job = "default";
  // Name of the default group. Default "world".
  std::string group = "world";
  // The generation of `group` to form (>= 0): 0 = the one forming, or the next (a fresh
  // name's first is 1). N > 0 re-forms the name in place as generation N: the first rank
  // to ask for it ends the group's earlier generation at the coordinator for every member
  // (collserve.v1.JoinRequest.generation), as Reconfigure does. FAILED_PRECONDITION when
  // generation N is already over.
  int64_t generation = 0;
  // This process's rank in [0, world_size). Env: RANK.
  int rank = -1;
  // Number of ranks in the group (> 0). Env: WORLD_SIZE.
  int world_size = -1;
  // Rank among the processes of this host; informational. Env: LOCAL_RANK (default -1).
  int local_rank = -1;
  // Move tensors through shared memory when the sidecar shares /dev/shm with this process
  // (probed at attach). false = always inline in the messages (what a client on another
  // host gets anyway). Env: COLLSERVE_SHARED_MEMORY=0 turns it off.
  bool shared_memory = true;
  // With shared memory, on one host: take a broadcast's or all-reduce's result straight
  // from the root's (the owner's) segment (mapped read-only) instead of having the sidecar
  // copy it into this rank's (docs/architecture.md, "Peer reads"). Env: COLLSERVE_PEER_READS=0 turns it off.
  bool peer_reads = true;
  // With shared memory: a broadcast root whose ordinary (non-arena) tensor holds at least
  // kPipelinedBroadcastMinBytes sends its request first and then copies the tensor into its
  // staging segment in pieces (a quarter of it, 256 KiB to 1 MiB), publishing how far it
  // got (collserve.v1.Buffer.fill_offset); peer readers copy each piece out as soon as it is
  // there, so the root's copy and the receivers' overlap instead of running one after the other (docs/architecture.md, "Peer
  // reads"). Env: COLLSERVE_PIPELINED_BROADCAST=0 turns it off.
  bool pipelined_broadcast = true;
  static constexpr int64_t kPipelinedBroadcastMinBytes = int64_t{1} << 20;
  // With shared memory: send this session's requests and receive their completions over
  // the sidecar's descriptor channel switched to ops mode (a SOCK_SEQPACKET socket, one
  // datagram per message; docs/architecture.md, "Ops channel") instead of the gRPC stream,
  // which then carries only attach and the session's end. Falls back to the stream when
  // the sidecar does not offer it. Env: COLLSERVE_OPS_CHANNEL=0 turns it off.
  bool ops_channel = true;
  // The backend between the group's hosts (collserve.v1.Attach.backend): "" = the sidecar's
  // default for the tensors' device (gloo for CPU); "mpi" = MPI between sidecars started as
  // one MPI world (docs/guide.md, "The MPI backend"). Every rank of a group must ask for the
  // same one. Env: COLLSERVE_BACKEND.
  std::string backend;
  // Where CUDA tensors' collectives and point-to-point calls run (docs/gpu.md):
  // kSidecar: through this host's sidecar (CUDA IPC; every local rank of a group on one GPU,
  // which several ranks may share); kNccl: with NCCL in this process, on the caller's stream
  // (one GPU per rank, the standard layout; the NCCL unique id goes through the coordinator's
  // store, so coordinator_address is needed; the sidecar still checks and records each
  // collective from a record the rank sends before the NCCL call, collserve.v1.Collective.
  // in_rank). Every rank of a group must use the same: the sidecars find ranks that differ
  // disagreeing at their first CUDA collective (INVALID_ARGUMENT naming the device on the
  // sidecar path; the NCCL ranks' communicator is aborted with it, though a join already
  // waiting for the unique id waits out the init timeout). Env: COLLSERVE_CUDA_PATH=sidecar
  // or nccl (INVALID_ARGUMENT otherwise).
  enum class CudaPath { kSidecar, kNccl };
  CudaPath cuda_path = CudaPath::kSidecar;
  // With cuda_path kNccl: send the sidecar a record of each CUDA collective (the ledger,
  // desync checks, diagnosis and metrics of them; docs/gpu.md). Off saves the rank about one
  // message per collective (bench/RESULTS.md, "records") and gives those up. Every rank of a
  // group must use the same (the records are part of the group's sequence of collectives:
  // ranks that differ disagree at their next collective through the sidecar, or wait for each
  // other until the op timeout). Env: COLLSERVE_NCCL_RECORDS=0 turns it off.
  bool nccl_records = true;
  // Rendezvous + backend connect deadline. Env: COLLSERVE_INIT_TIMEOUT_S. torch's default
  // is 30 minutes; ours is 300 s.
  absl::Duration init_timeout = absl::Seconds(300);
  // Default deadline of each collective, enforced by the sidecar (and by Work::Wait as a
  // safety net). Env: COLLSERVE_OP_TIMEOUT_S. Default 300 s.
  absl::Duration op_timeout = absl::Seconds(300);
  // How long the sidecar may leave an HTTP/2 ping of the session's connection unanswered
  // before the session is taken as lost (gRPC keepalive: a ping every half of it, at least
  // 1 s apart; the sidecar accepts pings 1 s apart). A sidecar that is stopped or hung, with
  // the connection's buffers full, otherwise left a call writing a request blocked for good:
  // the session now ends with UNAVAILABLE within about 1.5 times this, and a write the
  // sidecar does not take within the op timeout ends it too (DEADLINE_EXCEEDED). Env:
  // COLLSERVE_KEEPALIVE_TIMEOUT_S. Default 20 s.
  absl::Duration keepalive_timeout = absl::Seconds(20);
  // Bytes of staging segments (the shared-memory copies of tensors outside the arena) that
  // this group's collectives may hold at once, in bytes; 0 = no limit. A collective that
  // needs staging beyond it waits, inside the call that issues it, until this group's
  // earlier collectives complete and return theirs (at most its own op_timeout; then it
  // goes over). One collective larger than the limit still runs, alone. Bounds the memory
  // of deep asynchronous queues (the sidecar maps every segment it is given): with the
  // default, two 64 MiB tensors per rank are in flight. Send/recv never wait (a receive
  // may depend on this rank's later sends) but count. Env: COLLSERVE_MAX_STAGING_BYTES.
  int64_t max_staging_bytes = kDefaultMaxStagingBytes;
  static constexpr int64_t kDefaultMaxStagingBytes = int64_t{128} << 20;
  // Pacing of staged collectives issued back to back, in tensor bytes (0 = none): once two
  // are in flight, a collective whose staged bytes would take those in flight past this
  // waits, inside the call that issues it, for an earlier one to complete, for at most
  // kStagingWindowWait (then it goes ahead: a rank that issues several collectives and then
  // waits on something else its peers do first is delayed, never stopped). Deep queues of
  // staged copies work out of main memory (each op's copies are cold by the time the
  // sidecar and the readers touch them) and contend for the cores with the ops before them:
  // on one host, 4 ranks of 1 MiB ordinary tensors back to back ran 1.5-2x faster with 2 in
  // flight than with 128 (bench/RESULTS.md, 2026-11-29). Tensors of a few KiB are not
  // paced in practice (the window counts their bytes, not their 1 MiB segments), and
  // large ones keep two in flight. Env: COLLSERVE_STAGING_WINDOW_BYTES.
  int64_t staging_window_bytes = kDefaultStagingWindowBytes;
  static constexpr int64_t kDefaultStagingWindowBytes = int64_t{2} << 20;
  static constexpr absl::Duration kStagingWindowWait = absl::Milliseconds(10);
  // TLS to the sidecar (a TCP address only) and the coordinator. Env: COLLSERVE_TLS_*
  // (TlsOptions::FromEnv).
  TlsOptions tls;
  // The job's token (or the admin token), sent with every call to the sidecar and the
  // coordinator; "" = none. A secret: never logged. Env: COLLSERVE_TOKEN or
  // COLLSERVE_TOKEN_FILE (JobTokenFromEnv).
  std::string token;

  // Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (as torch's env://) and
  // COLLSERVE_COORDINATOR, COLLSERVE_SIDECAR, COLLSERVE_JOB, COLLSERVE_INIT_TIMEOUT_S, COLLSERVE_OP_TIMEOUT_S,
  // and the tuning variables (ReadTuningFromEnv).
  // INVALID_ARGUMENT when RANK or WORLD_SIZE are missing or not integers, a timeout is not
  // a positive number, COLLSERVE_MAX_STAGING_BYTES or COLLSERVE_STAGING_WINDOW_BYTES is not
  // a non-negative integer, the TLS variables are inconsistent (TlsOptions::FromEnv), or the
  // token file is unreadable.
  static absl::StatusOr<InitOptions> FromEnv();
  // Reads the variables that tune a rank's process group rather than name it into this
  // object: COLLSERVE_SHARED_MEMORY, COLLSERVE_PEER_READS, COLLSERVE_OPS_CHANNEL,
  // COLLSERVE_PIPELINED_BROADCAST, COLLSERVE_NCCL_RECORDS ("0" or
  // "false" turn one off; anything else on), COLLSERVE_CUDA_PATH, COLLSERVE_BACKEND, COLLSERVE_MAX_STAGING_BYTES,
  // COLLSERVE_STAGING_WINDOW_BYTES, COLLSERVE_KEEPALIVE_TIMEOUT_S (a positive number of
  // seconds), COLLSERVE_TLS_* and COLLSERVE_TOKEN(_FILE); a variable
  // that is unset or empty leaves its field as it is. For bindings that take the rank,
  // group and timeouts from their caller (the Python SDK, the c10d backend); FromEnv calls
  // it. INVALID_ARGUMENT as FromEnv for these variables; on an error nothing is changed.
  absl::Status ReadTuningFromEnv();
};

// The handle of an asynchronous operation (torch.distributed.Work).
// Thread-safe: any thread may Wait, poll or add callbacks.
class Work {
 public:
  virtual ~Work() = default;
  // Blocks until the operation completes or `timeout` passes, then returns its result:
  // OK; the operation's error; or DEADLINE_EXCEEDED if `timeout` passed first (the
  // operation goes on; Wait may be called again). The operation's own deadline
  // (InitOptions::op_timeout) bounds the wait even with an infinite timeout.
  virtual absl::Status Wait(absl::Duration timeout = absl::InfiniteDuration()) = 0;
  // True once the operation has completed (successfully or not). Never blocks.
  virtual bool IsCompleted() = 0;
  // Runs `callback(status)` once the operation completes: immediately on the calling
  // thread if it already has, else on one of the SDK's completion threads (one finishes the
  // group's collectives in issue order, another its sends and receives), so it must not
  // block: a blocked callback holds up every later completion of its kind.
  // Waiters are woken before callbacks run (as c10::ivalue::Future does): a callback may
  // still be running when Wait() returns, so it must own what it touches.
  virtual void OnCompletion(std::function<void(const absl::Status&)> callback) = 0;
  // Recv: the rank (in the group) the message came from, once completed successfully
  // (torch's recv return value / Work.source_rank()); -1 otherwise and for other ops.
  virtual int SourceRank() = 0;
  // How the sidecars ran the operation, once completed successfully (e.g. "local",
  // "local+gloo_ring", "local+gloo_bcube", "local+gloo_allgatherv"); "" otherwise and
  // for point-to-point. For reports (collserve-perf prints it); not a stable API.
  virtual std::string Algorithm() { return ""; }
};

// Memory that the sidecar of this process's group maps directly (the session's
// shared-memory arena). Tensors inside it reach the sidecar with no copy at all: the
// sidecar reads inputs and writes results in place. Obtained from
// ProcessGroup::AllocateShared; frees the memory on destruction. Thread-safe.
class SharedBuffer {
 public:
  virtual ~SharedBuffer() = default;
  // The first byte (64-byte aligned) and the usable size in bytes. Zero-filled at first.
  virtual void* data() = 0;
  virtual size_t size() const = 0;
};

// A reduction: a ReduceOp, or PREMUL_SUM with this rank's factor (torch's
// _make_nccl_premul_sum(factor)). Converts implicitly from ReduceOp.
struct ReduceOpArg {
  ReduceOpArg(ReduceOp op) : op(op) {}  // NOLINT: implicit on purpose, like torch's ReduceOp
  ReduceOp op;
  double premul_factor = 1.0;  // used by kPremulSum only
};
// PREMUL_SUM: every rank's tensor times its own `factor`, summed. Floating-point dtypes.
inline ReduceOpArg MakePremulSum(double factor) {
  ReduceOpArg r(ReduceOp::kPremulSum);
  r.premul_factor = factor;
  return r;
}

// One operation of BatchIsendIrecv (torch.distributed.P2POp).
struct P2POp {
  enum class Kind { kSend, kRecv };
  Kind kind;
  void* data;       // kSend: read only
  int64_t count;
  DataType dtype;
  int peer;         // group rank; kRecv: -1 = any source
  int64_t tag = 0;
  bool cuda = false;       // `data` is device memory: SendCuda / RecvCuda on `stream`
  void* stream = nullptr;  // the caller's cudaStream_t (cuda only; nullptr: the legacy default)
};

class StoreClient;

// Where in the program the calling thread issues its collectives from ("train.cc:42", or
// any tag that names the call), for the check that catches a rank that skipped or added a
// collective: the sidecars compare the call sites of every rank's collective of the same
// sequence number, and ranks that called it from different places all get INVALID_ARGUMENT
// naming them and both call sites (the group stays usable). Ranks without a call site are
// not checked. At most 256 bytes are sent. Thread-local: a ScopedCallSite marks the
// collectives its thread issues while it lives (the innermost one wins), and restores the
// previous one when it ends. The Python SDK fills it in with the caller's file and line.
class ScopedCallSite {
 public:
  explicit ScopedCallSite(std::string call_site);
  ~ScopedCallSite();
  ScopedCallSite(const ScopedCallSite&) = delete;
  ScopedCallSite& operator=(const ScopedCallSite&) = delete;

 private:
  std::string previous_;
};

// Sets the call site of this thread's next collectives until it is set again ("" = none):
// for bindings that know it per call. C++ programs use ScopedCallSite. Thread-local.
void SetCallSite(std::string call_site);

// A name that stands for the caller's Python stack in the call sites the Python bindings
// make (the Python SDK, collserve.torch) while it is set ("" = none; Python:
// `with collserve.call_site("name"):`): for a program that issues one collective from
// different code paths on different ranks on purpose. The bindings count occurrences per
// name as they do per stack. Thread-local; CallSiteOverride returns this thread's.
void SetCallSiteOverride(std::string name);
const std::string& CallSiteOverride();

// A process group (torch.distributed.ProcessGroup) backed by the sidecar.
// Thread-safe; collectives issued from several threads are ordered by issue time, and
// every rank must issue the group's collectives in the same order (as with torch).
class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;

  virtual int GetRank() const = 0;
  virtual int GetWorldSize() const = 0;
  virtual const std::string& group_name() const = 0;
  // Number of sidecars (hosts) serving the group, and ranks of the group on this host.
  virtual int num_hosts() const = 0;
  virtual int local_world_size() const = 0;
  // The generation of the group's name that this process group is (1 for a name's first
  // formation at the coordinator, then 2, ...; InitOptions::generation).
  virtual int64_t generation() const = 0;
  // The id the coordinator drew for this formation of the group
  // (collserve.v1.JoinResponse.rendezvous_id): random, nonzero, the same at every rank of
  // the formation, and another at each formation, also when a restarted coordinator counts
  // a name's generations from 1 again. 0 when a sidecar of the group predates rendezvous
  // ids (the coordinator then draws none). With generation() it names store keys that only
  // this formation's ranks read (common/rendezvous.h's RendezvousScope; `collserve launch`'s
  // run id on several nodes). Thread-safe; never blocks.
  virtual uint64_t rendezvous_id() const = 0;
  // The seq of the last collective this rank completed with OK such that every earlier
  // one also completed OK: collectives (not send/recv) are numbered 0, 1, 2, ... in the
  // order this rank issued them, as the sidecar numbers the group's collectives (the
  // ledger's and `collservectl diagnose`'s "#seq"); -1 before the first. A collective
  // completes when its Work does (its result copied out). After a failure it stays at the
  // last good one: Reconfigure takes the smallest over the survivors
  // (ElasticGroup::last_common_seq). Thread-safe; never blocks.
  virtual int64_t last_completed_seq() const = 0;
  // The deadline of every operation issued after this call (InitOptions::op_timeout until
  // then; torch's _set_pg_timeout / Backend::setTimeout). Operations in flight keep theirs;
  // a monitored barrier's own timeout still wins. Errors: INVALID_ARGUMENT for a zero,
  // negative or infinite timeout. Thread-safe; never blocks.
  virtual absl::Status SetOpTimeout(absl::Duration timeout) = 0;

  // all_reduce, in place: `data` holds `count` elements of `dtype` and receives the
  // element-wise reduction over all ranks. Every rank must pass the same count, dtype and
  // op. `data` must stay valid and untouched until the Work completes.
  // The Work fails with:
  //   INVALID_ARGUMENT  op undefined for dtype (BAND/BOR/BXOR on floats), count < 0, or
  //                     ranks that disagree on count/dtype/op (the message names them)
  //   DEADLINE_EXCEEDED a rank did not arrive within the op timeout (names the missing ranks)
  //   UNAVAILABLE       the sidecar, a peer host or a rank went away
  //   FAILED_PRECONDITION the group was aborted by an earlier failure
  // Algorithm: hierarchical (docs/architecture.md). The sidecar reduces its local ranks' tensors in
  // shared memory (64 KiB chunks on a thread pool, each chunk written straight to every
  // rank); across hosts it exchanges the hosts' partial results directly (small tensors) or
  // runs Gloo's ring (large; the local reduction and copies overlap the transfer piece by
  // piece) or bcube, per size (sidecar --allreduce_algorithm); Work::Algorithm() says which.
  virtual std::shared_ptr<Work> AllReduce(void* data, int64_t count, DataType dtype,
                                          ReduceOpArg op = ReduceOp::kSum) = 0;

  // broadcast (torch.distributed.broadcast): `data` of rank `root` is copied, in place,
  // into `data` of every rank. Every rank passes the same count, dtype and root.
  // Errors as AllReduce; INVALID_ARGUMENT for a root outside [0, world_size) or ranks that
  // disagree on it. Algorithm: the root's host sends with Gloo's broadcast; each host
  // copies the result to its local ranks.
  virtual std::shared_ptr<Work> Broadcast(void* data, int64_t count, DataType dtype, int root) = 0;

  // barrier (torch.distributed.barrier): completes once every rank of the group has called
  // it. DEADLINE_EXCEEDED names the local ranks that did not arrive in time.
  virtual std::shared_ptr<Work> Barrier() = 0;

  // reduce (torch.distributed.reduce): like AllReduce, but only rank `dst` receives the
  // result; the other ranks' `data` is left unchanged. Errors as AllReduce and Broadcast.
  virtual std::shared_ptr<Work> Reduce(void* data, int64_t count, DataType dtype, ReduceOpArg op, int dst) = 0;

  // ---- Out-of-place collectives. Inputs are read when the call is made (they may be reused
  // at once; not so inputs in AllocateShared memory, read in place while the op runs);
  // outputs must stay valid until the Work completes and are written only on success
  // (outputs in AllocateShared memory are written in place and may be partly written on failure). Sizes are elements of `dtype`. Ranks are ranks in this group. Besides the
  // errors listed for AllReduce, sizes that do not fit together across ranks give every
  // rank INVALID_ARGUMENT naming the ranks and sizes. Across hosts the sidecars exchange
  // each host's inputs with Gloo's allgatherv (gather-like ops) or broadcast (scatter). ----

  // all_gather, list form: outputs[r] (counts[r] elements) receives rank r's `input`
  // (`count` elements; counts[GetRank()] == count; uneven sizes allowed). outputs and
  // counts have GetWorldSize() entries, identical on every rank.
  virtual std::shared_ptr<Work> AllGather(const std::vector<void*>& outputs, const std::vector<int64_t>& counts,
                                          const void* input, int64_t count, DataType dtype) = 0;
  // all_gather_into_tensor: `output` (world_size * count elements) receives every rank's
  // `input` (count elements, equal on every rank) in rank order.
  virtual std::shared_ptr<Work> AllGatherIntoTensor(void* output, const void* input, int64_t count,
                                                    DataType dtype) = 0;
  // gather: rank `dst`'s outputs[r] (counts[r]) receives rank r's input (count). Other ranks
  // pass empty outputs and counts.
  virtual std::shared_ptr<Work> Gather(const void* input, int64_t count, const std::vector<void*>& outputs,
                                       const std::vector<int64_t>& counts, DataType dtype, int dst) = 0;
  // scatter: rank r's `output` (count elements) receives rank `src`'s inputs[r]
  // (counts[r] == rank r's count). Other ranks pass empty inputs and counts.
  virtual std::shared_ptr<Work> Scatter(void* output, int64_t count, const std::vector<const void*>& inputs,
                                        const std::vector<int64_t>& counts, DataType dtype, int src) = 0;
  // reduce_scatter, list form: `output` (count == counts[GetRank()] elements) receives the
  // reduction over ranks of their inputs[GetRank()]. inputs/counts: GetWorldSize() entries,
  // counts identical on every rank.
  virtual std::shared_ptr<Work> ReduceScatter(void* output, int64_t count, const std::vector<const void*>& inputs,
                                              const std::vector<int64_t>& counts, DataType dtype,
                                              ReduceOpArg op = ReduceOp::kSum) = 0;
  // reduce_scatter_tensor: `input` holds world_size * count elements; `output` (count)
  // receives the reduction of block GetRank().
  virtual std::shared_ptr<Work> ReduceScatterTensor(void* output, const void* input, int64_t count, DataType dtype,
                                                    ReduceOpArg op = ReduceOp::kSum) = 0;
  // all_to_all, list form: inputs[j] (input_counts[j]) goes to rank j, which receives it in
  // its outputs[GetRank()]. Rank i's input_counts[j] must equal rank j's output_counts[i].
  virtual std::shared_ptr<Work> AllToAll(const std::vector<void*>& outputs, const std::vector<int64_t>& output_counts,
                                         const std::vector<const void*>& inputs,
                                         const std::vector<int64_t>& input_counts, DataType dtype) = 0;
  // all_to_all_single: `input` cut by input_splits, `output` by output_splits (empty splits
  // = count / world_size each, count must divide evenly). `count` is the input's elements
  // and `output_count` the output's.
  virtual std::shared_ptr<Work> AllToAllSingle(void* output, int64_t output_count, const void* input, int64_t count,
                                               const std::vector<int64_t>& output_splits,
                                               const std::vector<int64_t>& input_splits, DataType dtype) = 0;

  // monitored_barrier: like Barrier, but if some ranks do not arrive within `timeout`,
  // every rank that did gets DEADLINE_EXCEEDED naming the first missing rank (all of them
  // with wait_all_ranks), e.g. "rank 2 failed to pass monitored_barrier within 5s", and the
  // group is unusable afterwards (as torch's). If every rank of a host is missing, the
  // error names the ranks on the hosts that did not report.
  virtual std::shared_ptr<Work> MonitoredBarrier(absl::Duration timeout, bool wait_all_ranks = false) = 0;

  // ---- Point-to-point (send/recv/isend/irecv). Not part of the collective order: only
  // the two ranks take part. A recv matches a send when its source is the sender (or -1,
  // any source) and the tags are equal; messages from one sender with one tag arrive in
  // order. Count and dtype must match (else INVALID_ARGUMENT on both ends). Within a host
  // the sidecar copies between the two ranks' shared memory and both complete together;
  // across hosts the send completes once the receiving sidecar has the bytes. An unmatched
  // send or recv fails with DEADLINE_EXCEEDED after the op timeout; the group stays usable.
  virtual std::shared_ptr<Work> Send(const void* data, int64_t count, DataType dtype, int dst, int64_t tag = 0) = 0;
  // `data` receives the message; Work::SourceRank() tells the sender. src = -1: any source.
  virtual std::shared_ptr<Work> Recv(void* data, int64_t count, DataType dtype, int src, int64_t tag = 0) = 0;
  // batch_isend_irecv: issues every op (in order; CUDA ones with SendCuda / RecvCuda) and
  // returns their Works. With COLLSERVE_CUDA_PATH=nccl, CUDA ops go to NCCL as one group
  // (ncclGroupStart ... ncclGroupEnd), so that a ring of sends and receives cannot deadlock
  // (torch's batch_isend_irecv on NCCL); every op of such a batch must then be a CUDA one
  // (INVALID_ARGUMENT otherwise).
  virtual std::vector<std::shared_ptr<Work>> BatchIsendIrecv(const std::vector<P2POp>& ops);

  // ---- CUDA tensors (docs/gpu.md) ----
  // The same collectives on CUDA device memory, for a process on the sidecar's host (a
  // unix-socket session with shared memory) in a build with CUDA (CudaSupported()). `data`,
  // `input` and `output` are device addresses of memory from cudaMalloc (torch's caching
  // allocator; not cudaMallocAsync pools or expandable segments); `stream` is the caller's
  // cudaStream_t (nullptr: the legacy default stream) on that device. Semantics follow
  // torch's ProcessGroupNCCL: the collective runs after the work already queued on `stream`
  // (an interprocess event recorded there), on the sidecar's GPU stream (a CUDA kernel for
  // the ranks of one host, NCCL across hosts); the Work completes once the sidecar has
  // queued it, and a successful Work::Wait makes `stream` wait for the result (the CPU
  // does not wait for the GPU). The tensors must stay allocated until the stream has
  // passed the result. Work::IsCompleted and OnCompletion callbacks see the sidecar's answer
  // (the op is queued on the GPU, maybe not finished): read the result on the GPU after
  // Wait, or synchronize the stream before reading it on the CPU. Shapes as the CPU calls (AllGatherIntoTensor: input `count`,
  // output world_size * count; ReduceScatterTensor: output `count`, input world_size *
  // count). ReduceOp: SUM, AVG, PRODUCT, MIN, MAX. Errors (in the Work): those of the CPU
  // calls, plus, from the SDK before anything is sent: FAILED_PRECONDITION (this build has
  // no CUDA), INVALID_ARGUMENT (not device memory, not exportable), PERMISSION_DENIED (a
  // remote session); from the sidecar, on every rank of the collective as a rank's invalid
  // request (INVALID_ARGUMENT "ranks [..] sent invalid requests; this rank's request: ...",
  // the group stays usable): a sidecar without CUDA or without that GPU, a tensor outside
  // its allocation, a ReduceOp or uneven sizes the GPU path lacks; INVALID_ARGUMENT that
  // fails the group: the local ranks of a group on different GPUs. The defaults return
  // UNIMPLEMENTED.
  // With InitOptions::cuda_path kNccl (one GPU per rank, docs/gpu.md) every call below runs
  // with NCCL in this process instead (client/rank_comm.h): queued on `stream` like NCCL's
  // own calls, its Work complete when the call returns (Wait has nothing left to order);
  // tags are ignored and a receive from any source is INVALID_ARGUMENT; errors name the call
  // and NCCL's error, or why the communicator ended (a rank left, the group failed, a call
  // unfinished past the op timeout, the sidecars found the ranks' calls disagreeing in the
  // records each collective sends them: ABORTED / UNAVAILABLE / DEADLINE_EXCEEDED).
  // DEADLINE_EXCEEDED too when 1024 records stay unanswered for the op timeout.
  virtual std::shared_ptr<Work> AllReduceCuda(void* data, int64_t count, DataType dtype, ReduceOpArg op,
                                              void* stream);
  virtual std::shared_ptr<Work> BroadcastCuda(void* data, int64_t count, DataType dtype, int root, void* stream);
  virtual std::shared_ptr<Work> AllGatherIntoTensorCuda(void* output, const void* input, int64_t count,
                                                        DataType dtype, void* stream);
  virtual std::shared_ptr<Work> ReduceScatterTensorCuda(void* output, const void* input, int64_t count,
                                                        DataType dtype, ReduceOpArg op, void* stream);
  // all_to_all_single on CUDA tensors, as AllToAllSingle: `input` (count elements) holds
  // input_splits[r] elements for rank r in rank order, `output` (output_count) receives
  // output_splits[r] from rank r; empty splits: count / world_size each (INVALID_ARGUMENT
  // when it does not divide). Every pair of ranks must agree on its sizes (else
  // INVALID_ARGUMENT on every rank naming them, the group stays usable).
  virtual std::shared_ptr<Work> AllToAllSingleCuda(void* output, int64_t output_count, const void* input,
                                                   int64_t count, const std::vector<int64_t>& output_splits,
                                                   const std::vector<int64_t>& input_splits, DataType dtype,
                                                   void* stream);
  // gather on CUDA tensors: every rank's `input` (count elements; counts may differ) into
  // rank `dst`'s `output`, rank r's piece at the sum of the earlier ranks' counts
  // (`counts`: every rank's, on `dst` only; output world_size pieces long). Other ranks pass
  // output null and counts empty.
  virtual std::shared_ptr<Work> GatherCuda(void* output, const void* input, int64_t count,
                                           const std::vector<int64_t>& counts, DataType dtype, int dst,
                                           void* stream);
  // scatter on CUDA tensors: rank `src`'s `input` holds counts[r] elements for each rank r in
  // rank order; rank r's `output` (count elements == counts[r]) receives its piece. Other
  // ranks pass input null and counts empty.
  virtual std::shared_ptr<Work> ScatterCuda(void* output, int64_t count, const void* input,
                                            const std::vector<int64_t>& counts, DataType dtype, int src,
                                            void* stream);
  // send / recv on CUDA tensors, matched as Send / Recv (peer, tag, any source, count and
  // dtype; a CPU tensor on the other side is fine). Within a host the sidecar copies from the
  // sender's tensor into the receiver's on its GPU stream after both ranks' `stream` work
  // queued before the calls, and both Works complete once that copy is queued; Wait then
  // makes `stream` wait for it (the sender must not overwrite `data` before its stream has
  // passed that point, as with NCCL). Between hosts the bytes go through host memory on both
  // sidecars (device -> host, the sidecars' connection, host -> device: the connection's
  // speed, not NCCL's), and the send completes once its bytes left the GPU and were handed
  // to the connection. Errors: those of Send / Recv and of the collectives above; the two
  // tensors of a pair on one host must be on one GPU (INVALID_ARGUMENT on both, the group
  // stays usable); a GPU copy that fails or does not finish within the op timeout fails the
  // group.
  virtual std::shared_ptr<Work> SendCuda(const void* data, int64_t count, DataType dtype, int dst, int64_t tag,
                                         void* stream);
  virtual std::shared_ptr<Work> RecvCuda(void* data, int64_t count, DataType dtype, int src, int64_t tag,
                                         void* stream);

  // ---- Groups ----
  // new_group: a group of the given ranks (ranks of this group, distinct). Every rank of
  // this group must call NewGroup with the same ranks in the same order (as with torch);
  // members block until all members have joined (init_timeout). Returns nullptr on ranks
  // that are not members (torch's GroupMember.NON_GROUP_MEMBER). Errors: INVALID_ARGUMENT
  // (rank out of range, duplicates, empty), and those of InitProcessGroup.
  // Collectives of the new group run independently of this one's.
  virtual absl::StatusOr<std::unique_ptr<ProcessGroup>> NewGroup(std::vector<int> ranks) = 0;
  // get_process_group_ranks: the ranks of the parent (the group NewGroup was called on;
  // for a group from InitProcessGroup: itself) that make up this group, in group-rank order.
  virtual const std::vector<int>& GetProcessGroupRanks() const = 0;
  // get_global_rank / get_group_rank: between this group's ranks and the parent's.
  // INVALID_ARGUMENT for a rank outside the group.
  absl::StatusOr<int> GetGlobalRank(int group_rank) const;
  absl::StatusOr<int> GetGroupRank(int global_rank) const;
  // destroy_process_group is destroying the ProcessGroup object: its session ends, and
  // the other members' pending and later collectives fail with UNAVAILABLE.

  // Typed convenience overload for float, double, int32_t and int64_t vectors.
  template <typename T>
  std::shared_ptr<Work> AllReduce(std::vector<T>& data, ReduceOpArg op = ReduceOp::kSum);
  template <typename T>
  std::shared_ptr<Work> Broadcast(std::vector<T>& data, int root);

  // The coordinator's store for this job (nullptr if no coordinator address was given).
  virtual StoreClient* store() = 0;

  // Allocates `bytes` (> 0) bytes in this group's shared-memory arena: one segment per
  // allocation, mapped by the sidecar the first time a collective names it, and unmapped
  // there once the buffer is destroyed. A tensor that lies entirely inside such a buffer
  // (an in-place tensor, the single input, or the single output of an out-of-place call
  // such as AllGatherIntoTensor, ReduceScatterTensor or AllToAllSingle) passes with no
  // copy on either side; anything else is copied through a staging segment as before.
  // Differences from ordinary memory, as with NCCL's device buffers: an arena input is
  // read while the collective runs, so it must stay untouched until the Work completes,
  // and an arena output may be partly written when the Work fails. A buffer serves only
  // the group that allocated it (another group copies it like ordinary memory); it may
  // outlive the group. Without shared memory (a remote session, COLLSERVE_SHARED_MEMORY=0)
  // the buffer is ordinary memory and every call copies. Errors: INVALID_ARGUMENT (0
  // bytes), RESOURCE_EXHAUSTED / UNAVAILABLE (shm_open, ftruncate or mmap failed, e.g.
  // /dev/shm full). Thread-safe.
  virtual absl::StatusOr<std::shared_ptr<SharedBuffer>> AllocateShared(size_t bytes) = 0;
};

// Connects to the sidecar, attaches as (group, rank) and blocks until every rank of the
// group has joined and the backend is connected, or init_timeout passes.
// Errors: INVALID_ARGUMENT (rank outside [0, world_size), world_size <= 0, empty group,
// a world_size disagreeing with the group's, or COLLSERVE_MUTEX_DEADLOCK_DETECTION other
// than ignore, report or abort), ALREADY_EXISTS (the rank is taken), DEADLINE_EXCEEDED
// (rendezvous timed out; names the missing ranks), UNAVAILABLE (no sidecar/coordinator at
// the address). The first call also switches off Abseil's Mutex deadlock detection for
// the process (unless COLLSERVE_MUTEX_DEADLOCK_DETECTION says report or abort): the
// tracking that Debian's Abseil does on every lock and Abseil's release builds do not
// (docs/operations.md, "Abseil's deadlock detection").
absl::StatusOr<std::unique_ptr<ProcessGroup>> InitProcessGroup(const InitOptions& options);

// Whether this build of the SDK takes CUDA tensors (ProcessGroup::AllReduceCuda, ...).
// Thread-safe; never fails.
bool CudaSupported();

struct StoreClientOptions {
  std::string job = "default";                   // key namespace
  absl::Duration timeout = absl::Seconds(300);   // torch's store timeout: Get/Wait default
  absl::Duration connect_timeout = absl::Seconds(30);
  TlsOptions tls;  // TLS to the coordinator (default: plaintext)
  std::string token;  // the job's (or admin) token, sent with every call; "" = none (JobTokenFromEnv)
};

// The coordinator's key-value store with torch.distributed Store semantics (set, get,
// add, compare_set, check, wait, delete_key, num_keys, multi_get, multi_set, append).
// Values are bytes. Thread-safe. Errors: INVALID_ARGUMENT (empty key, over the size
// limits, Add on a non-integer), DEADLINE_EXCEEDED (a wait timed out; names the keys),
// UNAVAILABLE (the coordinator did not answer before the call's deadline).
//
// Coordinator restarts: a call the coordinator does not answer (UNAVAILABLE: it is down
// or restarting) is retried with exponential backoff (50 ms doubling to 1 s, +-50 %
// jitter), waiting for the channel to reconnect, until the call's deadline: the store
// timeout for calls that do not wait for keys, the wait's own timeout plus 5 s for get,
// wait and multi_get (which are re-sent with the time left). add, compare_set, append and
// delete_key carry a request id (64 random bits per client plus a counter) so that a
// retried write is applied once (the coordinator remembers the last
// --store_max_request_ids ids and logs them with the writes); set and multi_set are
// idempotent.
class StoreClient {
 public:
  // Connects to "host:port" (waits up to connect_timeout for the channel).
  static absl::StatusOr<std::unique_ptr<StoreClient>> Connect(const std::string& address,
                                                              const StoreClientOptions& options);
  virtual ~StoreClient() = default;

  virtual absl::Status Set(absl::string_view key, absl::string_view value) = 0;
  // Waits up to `timeout` (default: the store timeout) for the key.
  virtual absl::StatusOr<std::string> Get(absl::string_view key) = 0;
  virtual absl::StatusOr<std::string> Get(absl::string_view key, absl::Duration timeout) = 0;
  virtual absl::StatusOr<int64_t> Add(absl::string_view key, int64_t delta) = 0;
  virtual absl::StatusOr<std::string> CompareSet(absl::string_view key, absl::string_view expected,
                                                 absl::string_view desired) = 0;
  virtual absl::StatusOr<bool> Check(const std::vector<std::string>& keys) = 0;
  virtual absl::Status Wait(const std::vector<std::string>& keys) = 0;
  virtual absl::Status Wait(const std::vector<std::string>& keys, absl::Duration timeout) = 0;
  virtual absl::StatusOr<bool> DeleteKey(absl::string_view key) = 0;
  // Keys in the job's namespace (torch's num_keys), or only those starting with `prefix`.
  absl::StatusOr<int64_t> NumKeys() { return NumKeys(""); }
  virtual absl::StatusOr<int64_t> NumKeys(absl::string_view prefix) = 0;
  virtual absl::StatusOr<std::vector<std::string>> MultiGet(const std::vector<std::string>& keys,
                                                            absl::Duration timeout) = 0;
  virtual absl::Status MultiSet(const std::vector<std::string>& keys,
                                const std::vector<std::string>& values) = 0;
  virtual absl::Status Append(absl::string_view key, absl::string_view value) = 0;
  // Deletes the job's keys that start with `prefix` and returns how many it deleted: pages of
  // up to 1000 keys (Store.ListKeys), each key deleted once (Store.DeleteKey, with a request
  // id). Not atomic: a key set meanwhile may stay; on an error, the keys deleted before it
  // stay deleted and the message says how many there were (when any). INVALID_ARGUMENT for an empty prefix (every
  // key of a job is collservectl delete-job's). Each call has the store timeout.
  virtual absl::StatusOr<int64_t> DeleteKeysWithPrefix(absl::string_view prefix) = 0;
};

// ---- implementation details of the template above ----
namespace internal {
template <typename T> struct DataTypeOf;
template <> struct DataTypeOf<float> { static constexpr DataType value = DataType::kFloat32; };
template <> struct DataTypeOf<double> { static constexpr DataType value = DataType::kFloat64; };
template <> struct DataTypeOf<int32_t> { static constexpr DataType value = DataType::kInt32; };
template <> struct DataTypeOf<int64_t> { static constexpr DataType value = DataType::kInt64; };
template <> struct DataTypeOf<int8_t> { static constexpr DataType value = DataType::kInt8; };
template <> struct DataTypeOf<uint8_t> { static constexpr DataType value = DataType::kUInt8; };
template <> struct DataTypeOf<bool> { static constexpr DataType value = DataType::kBool; };
}  // namespace internal

template <typename T>
std::shared_ptr<Work> ProcessGroup::AllReduce(std::vector<T>& data, ReduceOpArg op) {
  return AllReduce(data.data(), static_cast<int64_t>(data.size()),
                   internal::DataTypeOf<T>::value, op);
}

template <typename T>
std::shared_ptr<Work> ProcessGroup::Broadcast(std::vector<T>& data, int root) {
  return Broadcast(data.data(), static_cast<int64_t>(data.size()), internal::DataTypeOf<T>::value, root);
}

}  // namespace collserve::client

#endif  // COLLSERVE_CLIENT_H_
