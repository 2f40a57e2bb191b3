// The CUDA implementation of backends::DeviceRuntime (backends/device.h). Built only when
// the CUDA toolkit is found; never links libcuda (the driver is reached through the
// runtime's cudaGetDriverEntryPointByVersion), so its binaries start on machines without a
// GPU driver.
#ifndef COLLSERVE_BACKENDS_CUDA_CUDA_DEVICE_H_
#define COLLSERVE_BACKENDS_CUDA_CUDA_DEVICE_H_

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "backends/device.h"

namespace collserve::backends {

// A runtime over every visible GPU, or null with the reason in *why (no driver, no GPU).
std::unique_ptr<DeviceRuntime> NewCudaDeviceRuntime(std::string* why);

// The bytes of the device allocation that contains `base`, counted from `base`
// (cuMemGetAddressRange). INVALID_ARGUMENT if `base` is not device memory; INTERNAL when
// the driver lacks the call. Thread-safe.
absl::Status AllocationBytes(const void* base, size_t* bytes);

}  // namespace collserve::backends

#endif  // COLLSERVE_BACKENDS_CUDA_CUDA_DEVICE_H_
