// DeviceScope: the calling thread's current CUDA device is `device` for the scope (the one
// it had comes back at the end). For the SDK's CUDA code (built with COLLSERVE_WITH_CUDA).
#ifndef COLLSERVE_CLIENT_DEVICE_SCOPE_H_
#define COLLSERVE_CLIENT_DEVICE_SCOPE_H_

#include <cuda_runtime.h>

namespace collserve::client {

class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    if (previous_ != device) cudaSetDevice(device);
  }
  ~DeviceScope() {
    int now = -1;
    if (previous_ >= 0 && cudaGetDevice(&now) == cudaSuccess && now != previous_) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace collserve::client

#endif  // COLLSERVE_CLIENT_DEVICE_SCOPE_H_
