// Uses the installed SDK: only <collserve/...> headers (no common/, server/ or store/).
#include <collserve/client.h>

#include <cstdio>

int main() {
  // No RANK/WORLD_SIZE in the environment: a clear error, not a crash.
  auto options = collserve::client::InitOptions::FromEnv();
  std::printf("InitOptions::FromEnv: %s\n", options.ok() ? "ok" : std::string(options.status().message()).c_str());
  std::printf("float32 is %zu bytes\n", collserve::ElementSize(collserve::DataType::kFloat32));
  return collserve::ElementSize(collserve::DataType::kFloat32) == 4 ? 0 : 1;
}
