// Fuzz target: opening a store whose write-ahead log (or snapshot) holds arbitrary bytes
// (store/wal.h). A damaged log must be DATA_LOSS or a dropped torn tail, never a crash, a
// hang or an allocation beyond what the file holds; the store that opens must serve.
#include <sys/stat.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "store/memory_store.h"

namespace {

const std::string& Dir() {
  static const std::string dir = [] {
    std::string pattern = "/tmp/collserve-fuzz-wal.XXXXXX";
    if (mkdtemp(pattern.data()) == nullptr) abort();
    return pattern;
  }();
  return dir;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  // The first byte says where the bytes go: the log (even) or the snapshot (odd).
  const bool snapshot = (data[0] & 1) != 0;
  const std::string dir = Dir() + "/store";
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
  std::filesystem::create_directory(dir);
  {
    std::ofstream out(dir + (snapshot ? "/snapshot" : "/wal"), std::ios::binary);
    out.write(reinterpret_cast<const char*>(data + 1), static_cast<std::streamsize>(size - 1));
  }
  collserve::store::StoreOptions options;
  options.data_dir = dir;
  options.log_warning = [](const std::string&) {};
  auto store = collserve::store::MemoryStore::Open(options);
  if (store.ok()) {
    if (!(*store)->Set("after-replay", "ok").ok()) abort();
    if ((*store)->NumKeys("").value_or(0) < 1) abort();
  } else if (store.status().code() != absl::StatusCode::kDataLoss &&
             store.status().code() != absl::StatusCode::kInvalidArgument &&
             store.status().code() != absl::StatusCode::kResourceExhausted) {
    abort();
  }
  return 0;
}
