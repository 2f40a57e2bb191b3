// The backends this build links (backends/registry.h AddBuiltinBackends).
#include "backends/gloo/gloo_communicator.h"
#include "backends/device.h"
#include "backends/registry.h"
#include "common/status_macros.h"
#ifdef COLLSERVE_WITH_NCCL
#include "backends/nccl/nccl_communicator.h"
#endif
#ifdef COLLSERVE_WITH_MPI
#include <memory>
#include <thread>

#include "absl/synchronization/notification.h"
#include "backends/mpi/mpi_communicator.h"
#endif
#ifdef COLLSERVE_WITH_CUDA
#include "backends/cuda/cuda_device.h"
#endif

namespace collserve::backends {

absl::Status AddBuiltinBackends(BackendRegistry& registry) {
  COLLSERVE_RETURN_IF_ERROR(registry.Register(
      "gloo", {DeviceType::kCpu}, [](RendezvousStore& store, const ConnectParams& p) {
        GlooOptions gloo;
        gloo.hostname = p.hostname;
        gloo.connect_timeout = p.connect_timeout;
        gloo.ring_segment_bytes = p.ring_segment_bytes;
        return ConnectGloo(store, p.prefix, p.rank, p.size, gloo);
      }));
  COLLSERVE_RETURN_IF_ERROR(registry.SetDefault(DeviceType::kCpu, "gloo"));
#ifdef COLLSERVE_WITH_MPI
  COLLSERVE_RETURN_IF_ERROR(registry.Register(
      "mpi", {DeviceType::kCpu}, [](RendezvousStore& store, const ConnectParams& p) {
        MpiOptions mpi;
        mpi.connect_timeout = p.connect_timeout;
        mpi.job = p.job;
        return ConnectMpi(store, p.prefix, p.rank, p.size, mpi);
      }));
#endif
#ifdef COLLSERVE_WITH_NCCL
  // NCCL stages host buffers through the GPU, so it serves CPU groups that ask for it too.
  COLLSERVE_RETURN_IF_ERROR(registry.Register(
      "nccl", {DeviceType::kCuda, DeviceType::kCpu}, [](RendezvousStore& store, const ConnectParams& p) {
        NcclOptions nccl;
        nccl.device = p.device;
        nccl.connect_timeout = p.connect_timeout;
        return ConnectNccl(store, p.prefix, p.rank, p.size, nccl);
      }));
  COLLSERVE_RETURN_IF_ERROR(registry.SetDefault(DeviceType::kCuda, "nccl"));
#endif
  return absl::OkStatus();
}

absl::Status StartMpiWorld() {
#ifdef COLLSERVE_WITH_MPI
  if (!LaunchedByMpi()) {
    return absl::FailedPreconditionError(
        "--mpi: this process was not started by mpirun or srun (no MPI world rank in its environment)");
  }
  return InitializeMpi();
#else
  return absl::FailedPreconditionError("--mpi: this build has no MPI backend (COLLSERVE_WITH_MPI; install libopenmpi-dev)");
#endif
}

void StopMpiWorld(absl::Duration timeout) {
#ifdef COLLSERVE_WITH_MPI
  if (!MpiInitialized()) return;
  auto done = std::make_shared<absl::Notification>();
  std::thread([done] {
    FinalizeMpi();
    done->Notify();
  }).detach();
  done->WaitForNotificationWithTimeout(timeout);
#else
  (void)timeout;
#endif
}

std::unique_ptr<DeviceRuntime> NewDeviceRuntime(std::string* why) {
#ifdef COLLSERVE_WITH_CUDA
  return NewCudaDeviceRuntime(why);
#else
  if (why != nullptr) *why = "this build has no CUDA support (COLLSERVE_WITH_CUDA)";
  return nullptr;
#endif
}

}  // namespace collserve::backends
