// MPI (Open MPI) implementation of backends::Communicator: the transport between the
// sidecars of a cluster whose sidecars were started as one MPI world (mpirun or srun, one
// process per host). A group's hosts get a communicator of their own from that world with
// MPI_Comm_create_group (MPI 3.0 §6.4.2: collective over the group's processes only, so
// groups form without the rest of the world), in host-index order, plus a duplicate of it
// for point-to-point so that slots never match a collective's messages.
//
// Every call runs as a nonblocking MPI operation polled until it completes or its timeout
// passes (MPI's blocking calls have no timeout), on buffers this communicator owns: an
// operation that timed out may still be written by MPI later, so its buffers are never
// freed then (MPI forbids freeing or cancelling a pending collective).
//
// The MPI communicators themselves are never freed: Open MPI gives a freed communicator's
// context id to the next communicator the process creates and delivers to it the messages
// still arriving for the freed one (a header sent to a host whose group had just ended), so
// a later generation would take another's messages for its own. Each generation of a group
// across hosts keeps two of the process's context ids (Open MPI has 65,536) and a few KiB
// for the sidecar's life; past them the connect fails with MPI's error (UNAVAILABLE). Reductions use MPI user-defined operations over
// backends::Reduce, so every backend reduces (bool, float16, bfloat16 included) the same way.
//
// Limits: MPI counts are int, so one call moves at most 2^31 - 1 elements (all_reduce) or
// bytes (every other call, per host piece); larger pieces are refused with INVALID_ARGUMENT
// naming the limit. A host that dies stops nothing here by itself (MPI reports no failure
// of a peer): calls end at their timeout, or at once after ShutdownPeer. Under mpirun the
// sidecars need --enable-recovery, or mpirun kills every sidecar when one exits.
//
// Thread safety: as backends::Communicator. MPI must be initialized with
// MPI_THREAD_MULTIPLE (InitializeMpi) before any connect.
#ifndef COLLSERVE_BACKENDS_MPI_MPI_COMMUNICATOR_H_
#define COLLSERVE_BACKENDS_MPI_MPI_COMMUNICATOR_H_

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "backends/communicator.h"
#include "backends/rendezvous_store.h"

namespace collserve::backends {

// True when this process was started by an MPI launcher (Open MPI's mpirun, or a PMI/PMIx
// one such as srun): its environment names a world rank. Thread-safe.
bool LaunchedByMpi();

// Initializes MPI with MPI_THREAD_MULTIPLE, once per process (later calls return the first
// call's status). FAILED_PRECONDITION if the library offers less than
// MPI_THREAD_MULTIPLE (the sidecar calls the backend from several threads), UNAVAILABLE if
// MPI_Init_thread fails. Agrees a random salt across the world (one MPI_Bcast, so every
// process of the world must call it) that keys the communicators' creation tags.
// Thread-safe.
absl::Status InitializeMpi();

// MPI_Finalize, once, if InitializeMpi succeeded (blocks while Open MPI waits for the rest
// of the world: callers bound it). Thread-safe.
void FinalizeMpi();

// True once InitializeMpi succeeded. Thread-safe.
bool MpiInitialized();

// This process's rank in MPI_COMM_WORLD and the world's size; -1 and 0 before
// InitializeMpi. Thread-safe.
int MpiWorldRank();
int MpiWorldSize();

struct MpiOptions {
  // Timeout of the connect (waiting for every host's world rank and for the creation of
  // the group's communicator).
  absl::Duration connect_timeout = absl::Seconds(300);
  // The group's job: with `prefix`, it keys the communicator's creation tag (a tag must
  // differ between communicators a process creates at once).
  std::string job;
  // Largest element count one MPI call takes; a larger all_reduce is cut into pieces of
  // this many elements (every host cuts alike). Tests lower it to exercise the cut.
  int max_call_elements = 1 << 30;
};

// Connects host `rank` of `size`: publishes this process's world rank under `prefix` in
// `store`, waits for every host's, and creates the group's communicator. Every host must
// call it with the same `prefix` (unique per group generation), `size` and options.job.
// Errors: FAILED_PRECONDITION (MPI not initialized: the sidecar was not started under an
// MPI launcher), INVALID_ARGUMENT (rank/size; two hosts with one world rank; a world rank
// out of range), DEADLINE_EXCEEDED (a host did not show up, or the communicator was not
// created, within connect_timeout: a creation that never ends keeps a thread blocked in
// MPI), UNAVAILABLE (MPI's error). Thread-safe with respect to other connects.
absl::StatusOr<std::unique_ptr<Communicator>> ConnectMpi(RendezvousStore& store, const std::string& prefix, int rank,
                                                          int size, const MpiOptions& options);

}  // namespace collserve::backends

#endif  // COLLSERVE_BACKENDS_MPI_MPI_COMMUNICATOR_H_
