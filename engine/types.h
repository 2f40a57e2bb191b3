// The collective engine's vocabulary: one rank's request, its completion, the membership
// of a group. Plain C++ (no gRPC, protobuf or prometheus types): the sidecar's RPC layer
// translates its messages into these (server/sidecar/translate.h), and in-process tests
// build them directly.
//
// Enumerations carry the values of their collserve.v1 counterparts, so translation is a
// cast; server/sidecar/translate.cc ties them with static_asserts. Fields that come from a
// client are untrusted: the engine validates every one (engine/collective_args.h) before it
// touches memory.
#ifndef COLLSERVE_ENGINE_TYPES_H_
#define COLLSERVE_ENGINE_TYPES_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/flight_record.h"
#include "engine/inline_budget.h"

namespace collserve::engine {

// The operations of a group (collserve.v1.CollectiveOp; see collectives.proto for each
// op's shapes).
enum class CollectiveOp : int {
  kUnspecified = 0,
  kAllReduce = 1,
  kBroadcast = 2,
  kBarrier = 3,
  kReduce = 4,
  kAllGather = 5,
  kGather = 6,
  kScatter = 7,
  kReduceScatter = 8,
  kAllToAll = 9,
  kMonitoredBarrier = 10,
  kSend = 11,
  kRecv = 12,
};

// torch-style op name: "all_reduce", "reduce_scatter", ...; "op#<n>" for an unknown value.
std::string OpName(int op);
inline std::string OpName(CollectiveOp op) { return OpName(static_cast<int>(op)); }

// Where one tensor lives: in a shared-memory segment the client created (named; mapped by
// the engine on first use and kept mapped until released) or inline (its bytes travel in
// the request and the result in the completion).
struct BufferRef {
  std::string segment;        // POSIX shm name; "" = inline
  int64_t segment_bytes = 0;  // the segment's size in bytes (> 0 when named)
  int64_t offset = 0;         // byte offset of the tensor in the segment
  std::string inline_data;    // the tensor's bytes when segment is ""
  bool arena = false;         // the client's arena (no copy) rather than a staging copy; metrics only
  // A CUDA tensor: the client's cudaIpcMemHandle_t bytes (64) of the allocation and the
  // GPU's UUID (16 bytes); `offset` is from the allocation's base. "" = host memory.
  std::string cuda_ipc_handle;
  std::string cuda_device_uuid;
  // > 0: the client writes the tensor after sending the request; the count of its bytes
  // written so far is the 8-byte word at this offset of the segment (Buffer.fill_offset).
  int64_t fill_offset = 0;
};

// One rank's call (collserve.v1.Collective): counts are elements of dtype. Untrusted.
struct Request {
  int64_t seq = 0;  // 0, 1, 2, ... per session, no gaps
  CollectiveOp op = CollectiveOp::kUnspecified;
  int dtype = 0;      // a DataType value (common/types.h), unchecked
  int64_t count = 0;  // elements of the input
  int reduce_op = 0;  // a ReduceOp value, unchecked
  int root = 0;
  BufferRef buffer;   // the input (in-place ops: input and result)
  int64_t timeout_ms = 0;  // 0 = the group's op timeout
  std::vector<std::string> released_segments;  // segments the client dropped: unmap them
  BufferRef output;   // out-of-place ops: where the result goes
  int64_t output_count = 0;
  std::vector<int64_t> input_splits;
  std::vector<int64_t> output_splits;
  double premul_factor = 0;  // PREMUL_SUM: this rank's factor
  int peer = 0;              // SEND/RECV: the other rank; RECV: -1 = any source
  int64_t tag = 0;           // SEND/RECV
  bool wait_all_ranks = false;  // MONITORED_BARRIER
  // CUDA tensors: the client's interprocess events (cudaIpcEventHandle_t bytes, 64 each):
  // waited for before the op / recorded after it (collectives.proto).
  std::string cuda_ready_event;
  std::string cuda_done_event;
  // Where the rank issued the call (collserve.v1.Collective.call_site); "" = unknown.
  std::string call_site;
  // A record of a collective the rank runs itself with NCCL (collserve.v1.Collective.in_rank):
  // no buffers; agreed, recorded and answered, no data step.
  bool in_rank = false;
  // Whether the request names CUDA tensors.
  bool OnDevice() const { return !buffer.cuda_ipc_handle.empty(); }
};

// The answer to one Request (collserve.v1.Completion).
struct Completion {
  int64_t seq = 0;
  absl::Status status;       // the error names ranks and arguments where relevant
  std::string inline_data;   // the result, when the request was inline and succeeded
  int source = -1;           // RECV: the rank the message came from
  std::string algorithm;     // how it ran: "local", "local+gloo_ring", ...; "" = not run
  // Set (rank >= 0) when the result was not written into this rank's buffer: it is
  // `peer_bytes` bytes at `peer_offset` of local rank `peer_rank`'s segment `peer_segment`
  // (collserve.v1.PeerSource); the client copies it out and answers ReadDone.
  int peer_rank = -1;
  std::string peer_segment;
  int64_t peer_offset = 0;
  int64_t peer_bytes = 0;
  int64_t peer_fill_offset = 0;  // > 0: the owner is still writing them (PeerSource.fill_offset)
  // `inline_data`'s bytes, still counted in the sidecar's inline budgets (--max_inline_bytes,
  // the job's max_inline_bytes) until the answer is written to the client or dropped (the
  // last copy of this pointer goes): a client that reads none of its answers holds its
  // budget, not the host's memory beyond it. Null when there are none.
  std::shared_ptr<const InlineCharge> inline_charge;
};

// Sent once per session when its group is ready (collserve.v1.Attached).
struct AttachedInfo {
  int64_t generation = 0;
  uint64_t rendezvous_id = 0;  // Membership::rendezvous_id (collserve.v1.Attached.rendezvous_id)
  bool shared_memory = false;  // the client may register segments and name them
  int num_hosts = 0;
  int local_world_size = 0;
  std::string host_id;
  bool peer_reads = false;  // AttachRequest.peer_reads, granted (shared memory too)
  // The group's priority class's DSCP (EngineOptions::traffic_marks), for connections the
  // rank makes itself (collserve.v1.Attached.traffic_dscp); -1 = none.
  int traffic_dscp = -1;
};

// What a rank asks for when it attaches (collserve.v1.Attach, after the RPC layer's checks).
struct AttachRequest {
  std::string job;    // "" = "default"
  std::string group;  // non-empty
  int rank = -1;
  int world_size = 0;
  absl::Duration init_timeout = absl::Seconds(300);  // rendezvous + backend connect
  absl::Duration op_timeout = absl::Seconds(300);    // default per-collective timeout
  // Whether the rank may use shared memory: the RPC layer says so only for a client on
  // this host that can pass segment descriptors (Group::AddSegment); otherwise every
  // tensor must be inline and a request naming a segment is PERMISSION_DENIED.
  bool shared_memory = false;
  // The backend among the group's hosts ("gloo", "nccl"); "" = the registry's default for
  // CPU tensors (backends/registry.h).
  std::string backend;
  // The client reads results out of a peer's segment when told to (Completion.peer_rank)
  // and answers Group::OnReadDone. Only with shared_memory.
  bool peer_reads = false;
  // The generation of the group to join (>= 0; collserve.v1.JoinRequest.generation): 0 =
  // the one forming, or the next; N > 0 = generation N, re-forming the name in place. An
  // earlier generation of the group still on this host (ranks that have not left it yet)
  // is retired: it goes on for them, apart, until they leave.
  int64_t generation = 0;
  // The rank's job credential (its bearer token), opaque to the engine: handed to the
  // CoordinatorLink calls made for this rank and its group (join, leave, the backend's
  // rendezvous store), so the coordinator checks them as the rank's own. The RPC layer
  // verifies it before attaching. "" = none. A secret: never logged.
  std::string credential;
  // The job's scheduling on this host, set by the RPC layer from the operator's policy for
  // the job (collserve.v1.JobPolicy), never by the job: its class (0 latency-critical, 1
  // default, 2 bulk; backends::PoolTenant) and its weight within the class (>= 1). A group
  // takes them from the attach that created it; the job's last group to form on this host
  // sets them for all of the job's groups here.
  int priority = 1;
  int share_weight = 1;
  // The most data-path threads running the job's work at once (JobPolicy.max_data_threads;
  // 0 = no limit), set the same way.
  int max_data_threads = 0;
  // Bytes of the job's inline requests (input and result) held on this host at once, every
  // group and session of the job together (JobPolicy.max_inline_bytes; 0 = only the host's
  // EngineOptions::max_inline_bytes). Each attach sets it anew for the job.
  int64_t max_inline_bytes = 0;
};

// The ledger (docs/operations.md, "Diagnosing a hang"): what one local rank of a group has
// done, as its host saw it. Collectives only (point-to-point ops are not sequenced).
struct RankProgress {
  int rank = 0;
  int64_t issued_seq = -1;     // its last collective submitted; -1: none yet
  // That collective's arguments (Request's fields of the same names).
  CollectiveOp op = CollectiveOp::kUnspecified;
  int dtype = 0;
  int64_t count = 0;
  int root = 0;
  int reduce_op = 0;
  absl::Duration issued_age;   // how long ago it was submitted, at the snapshot
  int64_t completed_seq = -1;  // its last collective answered (successfully or not); -1: none
  absl::Duration completed_age;
  std::string completed_status;  // "" = OK, else the error's code name (e.g. "DEADLINE_EXCEEDED")
};

// One group's ledger on one host (Group::Progress): sent to the coordinator, which merges
// every host's into a diagnosis (Registry.DiagnoseGroup).
struct GroupProgress {
  std::string job;
  std::string group;
  int64_t generation = 0;  // 0 while the group is forming
  int world_size = 0;
  std::string host_id;
  std::string state;       // "joining", "connecting", "ready" or "failed"
  std::string failure;     // the group's error on this host when failed
  std::vector<RankProgress> ranks;  // its local ranks, by rank
  // The flight recorder's latest records (at most kPublishedFlightRecords, oldest first),
  // with the local ranks' arrivals only.
  std::vector<FlightRecord> records;
  static constexpr size_t kPublishedFlightRecords = 32;
};

// One rank of a formed group (collserve.v1.Member).
struct Member {
  int rank = 0;
  std::string host_id;       // the sidecar serving it
  std::string host_address;  // where that sidecar's backend listens
};

// A rank that left a formed generation, or was lost with its host, as the coordinator
// saw it (collserve.v1.Departure).
struct Departure {
  int rank = -1;
  std::string host_id;
  std::string reason;
  bool host_lost = false;  // its host stopped renewing its lease: every rank there is gone
};

// A watch's answer (collserve.v1.WatchGroupResponse).
struct GroupEvents {
  int64_t generation = 0;
  std::string state;                  // FORMED or BROKEN
  std::vector<Departure> departures;  // every departure of the generation so far, in order
};

// The answer of a rendezvous (collserve.v1.JoinResponse): every rank of the generation.
// How one priority class's traffic between hosts is marked once its group connected
// (backends::Communicator::MarkTraffic): the DSCP (0-63) and the socket priority
// (SO_PRIORITY); -1 leaves each as the backend made it.
struct TrafficMark {
  int dscp = -1;
  int socket_priority = -1;
  bool any() const { return dscp >= 0 || socket_priority >= 0; }
};

struct Membership {
  int64_t generation = 0;
  uint64_t rendezvous_id = 0;  // collserve.v1.JoinResponse.rendezvous_id (0: none)
  std::vector<Member> members;
};

}  // namespace collserve::engine

#endif  // COLLSERVE_ENGINE_TYPES_H_
