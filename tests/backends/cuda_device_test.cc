// The sidecar's GPU side (backends/cuda): the local reduction kernels through DeviceStream
// (every dtype and op, more inputs than one launch takes, unaligned tensors, odd counts),
// device copies and copies through the host, the NCCL communicator's device-memory calls, and the runtime's refusals of
// malformed handles. Needs a GPU: skipped (not failed) without one (tests/gpu/run.sh runs
// it on a GPU machine).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "backends/cuda/cuda_device.h"
#include "backends/device.h"
#include "backends/nccl/nccl_communicator.h"
#include "tests/testing/in_memory_rendezvous_store.h"

namespace collserve::testing {
namespace {

class CudaDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string why;
    runtime_ = backends::NewCudaDeviceRuntime(&why);
    if (runtime_ == nullptr) GTEST_SKIP() << "no GPU: " << why;
    auto s = runtime_->NewStream(0);
    ASSERT_TRUE(s.ok()) << s.status();
    stream_ = std::move(*s);
  }
  void TearDown() override {
    for (void* p : allocations_) cudaFree(p);
  }
  template <typename T>
  T* Upload(const std::vector<T>& host, size_t pad_elements = 0) {
    void* p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, (host.size() + pad_elements + 1) * sizeof(T)), cudaSuccess);
    allocations_.push_back(p);
    T* t = static_cast<T*>(p) + pad_elements;
    EXPECT_EQ(cudaMemcpy(t, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
    return t;
  }
  template <typename T>
  std::vector<T> Download(const T* p, size_t n) {
    EXPECT_EQ(cudaStreamSynchronize(static_cast<cudaStream_t>(stream_->stream())), cudaSuccess);
    std::vector<T> host(n);
    EXPECT_EQ(cudaMemcpy(host.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  }
  std::unique_ptr<backends::DeviceRuntime> runtime_;
  std::unique_ptr<backends::DeviceStream> stream_;
  std::vector<void*> allocations_;
};

TEST_F(CudaDeviceTest, ReducesFloatsWithEveryOpAndScale) {
  const size_t n = 1000003;  // odd: a tail after the 16-byte packs
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kProduct, ReduceOp::kMin, ReduceOp::kMax}) {
    std::vector<const void*> ins;
    std::vector<void*> outs;
    for (int k = 0; k < 4; ++k) {
      std::vector<float> h(n);
      for (size_t i = 0; i < n; ++i) h[i] = static_cast<float>((i + k) % 7) - 3.0f;
      float* d = Upload(h);
      ins.push_back(d);
      outs.push_back(d);  // in place, as all_reduce
    }
    const double scale = op == ReduceOp::kSum ? 0.25 : 1.0;
    ASSERT_TRUE(stream_->Reduce(ins, outs, n, DataType::kFloat32, op, scale).ok());
    for (int k = 0; k < 4; ++k) {
      std::vector<float> got = Download(static_cast<const float*>(outs[k]), n);
      for (size_t i = 0; i < n; i += 9973) {
        float want = static_cast<float>(i % 7) - 3.0f;
        for (int j = 1; j < 4; ++j) {
          const float v = static_cast<float>((i + j) % 7) - 3.0f;
          want = op == ReduceOp::kSum ? want + v : op == ReduceOp::kProduct ? want * v
                 : op == ReduceOp::kMin ? std::min(want, v) : std::max(want, v);
        }
        EXPECT_EQ(got[i], static_cast<float>(want * scale)) << "op " << ReduceOpName(op) << " output " << k << " at " << i;
      }
      EXPECT_EQ(got[n - 1], got[n - 1]);  // the tail was written (not NaN garbage)
    }
  }
}

TEST_F(CudaDeviceTest, ManyInputsUnalignedAndIntegerAndHalf) {
  // 20 inputs (more than one launch's 16), offset by one element (not 16-byte aligned).
  const size_t n = 4099;
  std::vector<const void*> ins;
  for (int k = 0; k < 20; ++k) ins.push_back(Upload(std::vector<int32_t>(n, k + 1), 1));
  int32_t* out = Upload(std::vector<int32_t>(n, 0), 3);
  ASSERT_TRUE(stream_->Reduce(ins, {out}, n, DataType::kInt32, ReduceOp::kSum, 1.0).ok());
  std::vector<int32_t> got = Download(out, n);
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(got[i], 210) << i;
  // float16 sums accumulate in float.
  std::vector<uint16_t> one(n, 0x3C00);  // 1.0 in IEEE half
  std::vector<const void*> halves{Upload(one), Upload(one), Upload(one)};
  uint16_t* hout = Upload(std::vector<uint16_t>(n, 0));
  ASSERT_TRUE(stream_->Reduce(halves, {hout}, n, DataType::kFloat16, ReduceOp::kSum, 1.0).ok());
  std::vector<uint16_t> hgot = Download(hout, n);
  EXPECT_EQ(hgot[0], 0x4200);      // 3.0
  EXPECT_EQ(hgot[n - 1], 0x4200);
  // AVG on integers is refused, as is a bitwise op.
  EXPECT_EQ(stream_->Reduce(ins, {out}, n, DataType::kInt32, ReduceOp::kSum, 0.5).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(stream_->Reduce(ins, {out}, n, DataType::kInt32, ReduceOp::kBand, 1.0).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(CudaDeviceTest, CopyScratchAndEndOpBoundWhatIsInFlight) {
  const size_t n = 1 << 20;
  float* a = Upload(std::vector<float>(n, 7.0f));
  float* b = Upload(std::vector<float>(n, 0.0f));
  ASSERT_TRUE(stream_->Copy(b, a, n * sizeof(float)).ok());
  auto scratch = stream_->Scratch(n * sizeof(float));
  ASSERT_TRUE(scratch.ok()) << scratch.status();
  ASSERT_TRUE(stream_->Copy(*scratch, b, n * sizeof(float)).ok());
  for (int i = 0; i < 20; ++i) {
    ASSERT_TRUE(stream_->EndOp({std::make_shared<int>(i)}, 2, absl::Seconds(30), nullptr).ok());
  }
  EXPECT_EQ(Download(static_cast<const float*>(*scratch), n)[n - 1], 7.0f);
}

// Point-to-point between hosts moves CUDA tensors through the host: more than one staging
// piece (8 MiB) each way, with an odd tail, every element checked.
TEST_F(CudaDeviceTest, CopiesToAndFromTheHostThroughStagingPieces) {
  const size_t n = (size_t{5} << 20) + 3;  // 20 MiB + 12 bytes of float32: 3 pieces
  std::vector<float> host(n);
  for (size_t i = 0; i < n; ++i) host[i] = static_cast<float>(i % 100003);
  float* d = Upload(std::vector<float>(n, -1.0f));
  ASSERT_TRUE(stream_->CopyFromHost(d, host.data(), n * sizeof(float), absl::Seconds(30)).ok());
  std::vector<float> back(n, 0.0f);
  ASSERT_TRUE(stream_->CopyToHost(back.data(), d, n * sizeof(float), absl::Seconds(30)).ok());
  EXPECT_EQ(back, host);
  EXPECT_EQ(Download(d, n), host);
}

TEST_F(CudaDeviceTest, RefusesMalformedHandles) {
  EXPECT_EQ(runtime_->DeviceOf("short").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(runtime_->DeviceOf(std::string(16, '\x5a')).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(runtime_->MapMemory(0, "x").status().code(), absl::StatusCode::kInvalidArgument);
  // 64 bytes that no process exported.
  EXPECT_EQ(runtime_->MapMemory(0, std::string(64, '\x01')).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(runtime_->OpenEvent(0, std::string(63, '\0')).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(runtime_->MapMemory(99, std::string(64, '\0')).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(CudaDeviceTest, NcclDeviceCallsWithOneRank) {
  InMemoryRendezvousStore store;
  auto comm = backends::ConnectNccl(store, "cuda-device-test", 0, 1, backends::NcclOptions());
  ASSERT_TRUE(comm.ok()) << comm.status();
  const size_t n = 1 << 16;
  float* x = Upload(std::vector<float>(n, 3.0f));
  float* y = Upload(std::vector<float>(n, 0.0f));
  void* s = stream_->stream();
  ASSERT_TRUE((*comm)->AllReduceOnStream(x, n, DataType::kFloat32, ReduceOp::kSum, s).ok());
  ASSERT_TRUE((*comm)->BroadcastOnStream(x, n * 4, 0, s).ok());
  ASSERT_TRUE((*comm)->AllGatherOnStream(x, y, n * 4, s).ok());
  EXPECT_EQ(Download(y, n)[n - 1], 3.0f);
  ASSERT_TRUE((*comm)->ReduceScatterOnStream(x, y, n, DataType::kFloat32, ReduceOp::kMax, s).ok());
  ASSERT_TRUE((*comm)->BroadcastGroupOnStream({x, y}, {64, 64}, {0, 0}, s).ok());
  EXPECT_EQ(Download(y, n)[0], 3.0f);
  EXPECT_TRUE((*comm)->AsyncError().ok());
  EXPECT_EQ((*comm)->AllReduceOnStream(x, n, DataType::kInt32, ReduceOp::kBxor, s).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*comm)->BroadcastOnStream(x, 4, 3, s).code(), absl::StatusCode::kInvalidArgument);
  (*comm)->Abort();
  EXPECT_FALSE((*comm)->AsyncError().ok());
}

}  // namespace
}  // namespace collserve::testing
