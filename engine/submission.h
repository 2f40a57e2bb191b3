// One local rank's request as the engine holds it from Submit until its completion: the
// request, where its tensors are mapped, and the session to answer.
#ifndef COLLSERVE_ENGINE_SUBMISSION_H_
#define COLLSERVE_ENGINE_SUBMISSION_H_

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "backends/device.h"
#include "common/shm.h"
#include "engine/inline_budget.h"
#include "engine/interfaces.h"
#include "engine/types.h"

namespace collserve::engine {

struct Submission {
  int rank = -1;  // the local rank that issued it
  std::shared_ptr<Session> session;
  Request args;
  char* in = nullptr;   // the input (in-place ops: input and result)
  size_t in_bytes = 0;
  char* out = nullptr;  // out-of-place ops: the output
  size_t out_bytes = 0;
  std::vector<std::shared_ptr<ShmSegment>> segments;  // keep the mappings alive while queued/running
  // Inline input and output bytes. Behind pointers because `in` and `out` point into them
  // and a Submission moves (queue, executor): moving a short std::string copies its bytes
  // to a new place (the small-string optimization), a unique_ptr does not.
  std::unique_ptr<std::string> inline_in;
  std::unique_ptr<std::string> inline_out;
  bool inline_mode = false;
  // The inline bytes counted in the engine's InlineBudget. Complete gives them back just
  // before it hands the completion to the session, so that a client's next request, sent
  // after it read the completion, finds them free (mutable: Complete takes a const
  // Submission; the strings themselves are freed with it, moments later).
  mutable InlineCharge inline_charge;
  absl::Status error;      // invalid request: reported to every rank
  absl::Time deadline;
  absl::Time submitted;    // when the sidecar received it (latency metrics)
  int source = -1;         // RECV: the rank the message came from
  const char* algorithm = "";  // how it ran (Completion.algorithm)
  // The rank's client reads results out of peers' segments (AttachRequest::peer_reads).
  bool peer_reads = false;
  // Set by the executor (peer_rank >= 0): this rank's result is not written into its
  // buffer; its client copies it out of local rank peer_rank's segment (Completion).
  int peer_rank = -1;
  std::string peer_segment;
  int64_t peer_offset = 0;
  int64_t peer_bytes = 0;
  int64_t peer_fill_offset = 0;  // > 0: the owner is still writing them (BufferRef::fill_offset)
  // The count of the input's bytes written so far (BufferRef::fill_offset > 0: a broadcast
  // root whose client writes them after sending the request), in its segment; else null.
  const uint64_t* fill = nullptr;
  // CUDA tensors (args.OnDevice()): `in`/`out` are device addresses in the sidecar (CUDA
  // IPC mappings, kept alive by `device_refs`), on GPU `device`; the client's events.
  int device = -1;
  std::vector<std::shared_ptr<void>> device_refs;
  std::shared_ptr<backends::DeviceEvent> ready_event, done_event;
};

// Answers `sub` on its session with `status` (and, for a successful inline request, the
// result bytes), first giving back its inline bytes (sub.inline_charge) but the result's,
// which the completion holds until its session wrote or dropped it, and tells
// `observer` (may be null). Thread-safe for distinct submissions; never blocks.
void Complete(const Submission& sub, const absl::Status& status, EngineObserver* observer);

// Complete's parts, for a caller that answers several at once: the answer of `sub` with
// `status` (giving back its inline bytes but the result's, as Complete), and telling `observer` (may be null)
// once it went to the session.
Completion TakeCompletion(const Submission& sub, const absl::Status& status);
void ObserveCompleted(const Submission& sub, const absl::Status& status, EngineObserver* observer);

}  // namespace collserve::engine

#endif  // COLLSERVE_ENGINE_SUBMISSION_H_
