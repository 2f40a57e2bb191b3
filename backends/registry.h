// Backends by name: how a group's communicator among its hosts is made. A backend registers
// a name ("gloo", "nccl"), the device types whose tensors it moves, and a connect function;
// a group picks one per group (its attach's backend name) and device type.
//
// Built-ins (AddBuiltinBackends): "gloo" (CPU tensors, TCP) always; "nccl" (CUDA tensors;
// host buffers are staged through the GPU) when the build found CUDA and NCCL
// (COLLSERVE_WITH_NCCL); "mpi" (CPU tensors, between sidecars started as one MPI world)
// when the build found MPI (COLLSERVE_WITH_MPI): its connect fails with FAILED_PRECONDITION
// in a sidecar that has no MPI world. The defaults per device type are gloo for CPU and nccl for CUDA,
// as torch's "cpu:gloo,cuda:nccl".
//
// Thread safety: Register before sharing the registry; the const methods are thread-safe.
#ifndef COLLSERVE_BACKENDS_REGISTRY_H_
#define COLLSERVE_BACKENDS_REGISTRY_H_

#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "backends/communicator.h"
#include "backends/rendezvous_store.h"

namespace collserve {

// Where a tensor lives.
enum class DeviceType { kCpu, kCuda };

}  // namespace collserve

namespace collserve::backends {

// What every backend's connect takes; a backend ignores what it does not use.
struct ConnectParams {
  std::string prefix;  // store key prefix, unique per group generation
  int rank = 0;        // this host's index in [0, size)
  int size = 1;        // hosts in the group
  std::string hostname = "127.0.0.1";  // Gloo: address to bind and advertise
  absl::Duration connect_timeout = absl::Seconds(300);
  size_t ring_segment_bytes = 0;       // Gloo: ring all_reduce piece (0 = Gloo's default)
  int device = 0;                      // NCCL: CUDA device ordinal
  std::string job;                     // MPI: the group's job (keys the communicator's creation tag)
};

// Connects host params.rank of params.size through `store` (blocking up to
// params.connect_timeout). Errors as the backend's (DEADLINE_EXCEEDED, UNAVAILABLE, ...).
using ConnectFn = std::function<absl::StatusOr<std::unique_ptr<Communicator>>(RendezvousStore& store,
                                                                              const ConnectParams& params)>;

class BackendRegistry {
 public:
  // Adds backend `name` for `devices`. ALREADY_EXISTS if the name is taken;
  // INVALID_ARGUMENT for an empty name or no devices.
  absl::Status Register(const std::string& name, std::vector<DeviceType> devices, ConnectFn connect);
  // Makes `name` the default for `device` (it must be registered for it): INVALID_ARGUMENT.
  absl::Status SetDefault(DeviceType device, const std::string& name);

  // The backend a group asks for: `name` itself, or the default for `device` when `name` is
  // "". NOT_FOUND (unknown name; the message lists the registered ones), INVALID_ARGUMENT
  // (the backend does not serve `device`), FAILED_PRECONDITION (no default for `device`).
  absl::StatusOr<std::string> Resolve(const std::string& name, DeviceType device) const;

  // Connects with backend `name` (as Resolve returned it). NOT_FOUND for an unknown name;
  // else the backend's errors.
  absl::StatusOr<std::unique_ptr<Communicator>> Connect(const std::string& name, RendezvousStore& store,
                                                         const ConnectParams& params) const;

  // Registered names, sorted.
  std::vector<std::string> Names() const;

 private:
  struct Entry {
    std::vector<DeviceType> devices;
    ConnectFn connect;
  };
  std::map<std::string, Entry> backends_;
  std::map<DeviceType, std::string> defaults_;
};

// Registers the backends this build has ("gloo"; "nccl" with COLLSERVE_WITH_NCCL) with their
// defaults. Defined in the collserve_backend_registry library, which links them.
absl::Status AddBuiltinBackends(BackendRegistry& registry);

// Joins this process to its MPI world, for the "mpi" backend: the sidecars of a cluster
// started together by mpirun or srun (one per host). Call once at start, before serving.
// FAILED_PRECONDITION when the build has no MPI (COLLSERVE_WITH_MPI) or the process was not
// started by an MPI launcher; else backends::InitializeMpi's errors. Thread-safe.
absl::Status StartMpiWorld();
// Leaves the MPI world (MPI_Finalize) if StartMpiWorld succeeded, waiting at most `timeout`
// (Open MPI's finalize waits for the other processes of the world: a sidecar that stops
// alone goes without it). Thread-safe; call once, at exit.
void StopMpiWorld(absl::Duration timeout);

// "cpu" / "cuda".
const char* DeviceTypeName(DeviceType device);

}  // namespace collserve::backends

#endif  // COLLSERVE_BACKENDS_REGISTRY_H_
