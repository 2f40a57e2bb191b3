// collserve-embedded-store-bench: the durable embedded store (store::MemoryStore with a
// data_dir: its write-ahead log with group commit, store/wal.h) against LevelDB (Debian's
// libleveldb-dev) doing the same durable writes, in one run on the same disk: issue 18 asks
// whether a well-kept embedded engine would be as fast as our own log, and to decide from a
// measurement.
//
// Each of `clients` threads owns one counter key and, for `seconds`, adds 1 to it: on the
// store with MemoryStore::Add (acknowledged after the fdatasync that covers it); on LevelDB
// with a Get and a Put of the new value under WriteOptions::sync = true (LevelDB's own group
// commit: concurrent writers queue and the first writes one batch for all, db_impl.cc
// BuildBatchGroup). A LevelDB Put alone is not an atomic add; the store would still need its
// own lock around the read-modify-write, which this benchmark leaves out, so LevelDB's
// numbers are an upper bound. Also measured: one client's median latency per write, and a
// 64-byte append + fdatasync to a file in the same directory (the disk's own cost).
//
// Prints one line per (engine, clients): writes per second and the median latency in us.
// Usage: collserve-embedded-store-bench [--dir=/tmp] [--seconds=2] [--clients=1,4,16]
//        [--latency_ops=300]
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "leveldb/db.h"
#include "leveldb/options.h"
#include "leveldb/write_batch.h"
#include "store/memory_store.h"

ABSL_FLAG(std::string, dir, "/tmp", "Directory on the disk to measure (a temporary folder is made in it).");
ABSL_FLAG(double, seconds, 2.0, "Seconds per measurement of writes per second.");
ABSL_FLAG(std::string, clients, "1,4,16", "Numbers of concurrent clients (threads), comma separated.");
ABSL_FLAG(int, latency_ops, 300, "Writes timed one by one for the median latency.");

namespace {

using Clock = std::chrono::steady_clock;

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "collserve-embedded-store-bench: %s\n", what.c_str());
  std::exit(1);
}

// One engine: a durable "add 1 to this client's counter".
class Engine {
 public:
  virtual ~Engine() = default;
  virtual void Add(int client) = 0;
};

class StoreEngine final : public Engine {
 public:
  explicit StoreEngine(const std::string& dir) {
    collserve::store::StoreOptions options;
    options.data_dir = dir;
    auto store = collserve::store::MemoryStore::Open(options);
    if (!store.ok()) Die(store.status().ToString());
    store_ = std::move(*store);
  }
  void Add(int client) override {
    auto r = store_->Add(absl::StrCat("counter/", client), 1);
    if (!r.ok()) Die(r.status().ToString());
  }

 private:
  std::unique_ptr<collserve::store::MemoryStore> store_;
};

class LevelDbEngine final : public Engine {
 public:
  explicit LevelDbEngine(const std::string& dir) {
    leveldb::Options options;
    options.create_if_missing = true;
    leveldb::DB* db = nullptr;
    leveldb::Status s = leveldb::DB::Open(options, dir, &db);
    if (!s.ok()) Die("leveldb: " + s.ToString());
    db_.reset(db);
  }
  void Add(int client) override {
    const std::string key = absl::StrCat("counter/", client);
    std::string value;
    int64_t n = 0;
    leveldb::Status s = db_->Get(leveldb::ReadOptions(), key, &value);
    if (s.ok()) {
      if (!absl::SimpleAtoi(value, &n)) Die("leveldb: bad counter " + value);
    } else if (!s.IsNotFound()) {
      Die("leveldb: " + s.ToString());
    }
    leveldb::WriteOptions sync;
    sync.sync = true;
    s = db_->Put(sync, key, absl::StrCat(n + 1));
    if (!s.ok()) Die("leveldb: " + s.ToString());
  }

 private:
  std::unique_ptr<leveldb::DB> db_;
};

// A 64-byte append and fdatasync to a file: what the disk itself costs one durable write.
class FsyncEngine final : public Engine {
 public:
  explicit FsyncEngine(const std::string& dir) : fd_(::open((dir + "/append").c_str(), O_CREAT | O_WRONLY | O_APPEND, 0600)) {
    if (fd_ < 0) Die("open " + dir + "/append");
  }
  ~FsyncEngine() override { ::close(fd_); }
  void Add(int) override {
    static const char kRecord[64] = {};
    if (::write(fd_, kRecord, sizeof kRecord) != static_cast<ssize_t>(sizeof kRecord) || ::fdatasync(fd_) != 0) {
      Die("append + fdatasync failed");
    }
  }

 private:
  const int fd_;
};

double WritesPerSecond(Engine& engine, int clients, double seconds) {
  std::atomic<bool> stop{false};
  std::vector<int64_t> done(clients, 0);
  std::vector<std::thread> threads;
  const Clock::time_point start = Clock::now();
  for (int c = 0; c < clients; ++c) {
    threads.emplace_back([&, c] {
      int64_t n = 0;
      while (!stop.load(std::memory_order_relaxed)) {
        engine.Add(c);
        ++n;
      }
      done[c] = n;
    });
  }
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  stop = true;
  for (auto& t : threads) t.join();
  const double elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  int64_t total = 0;
  for (int64_t n : done) total += n;
  return static_cast<double>(total) / elapsed;
}

double MedianLatencyUs(Engine& engine, int ops) {
  std::vector<double> us;
  us.reserve(ops);
  for (int i = 0; i < ops; ++i) {
    const Clock::time_point t0 = Clock::now();
    engine.Add(0);
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  std::nth_element(us.begin(), us.begin() + us.size() / 2, us.end());
  return us[us.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  std::vector<int> clients;
  for (absl::string_view part : absl::StrSplit(absl::GetFlag(FLAGS_clients), ',', absl::SkipEmpty())) {
    int n = 0;
    if (!absl::SimpleAtoi(part, &n) || n < 1 || n > 1024) Die(absl::StrCat("--clients: bad count ", part));
    clients.push_back(n);
  }
  const double seconds = absl::GetFlag(FLAGS_seconds);
  const int latency_ops = absl::GetFlag(FLAGS_latency_ops);
  if (!(seconds > 0) || seconds > 600) Die("--seconds must be in (0, 600]");
  if (latency_ops < 1 || latency_ops > 1000000) Die("--latency_ops must be in [1, 1000000]");

  std::string tmpl = absl::GetFlag(FLAGS_dir) + "/collserve-embedded-bench-XXXXXX";
  if (::mkdtemp(tmpl.data()) == nullptr) Die("mkdtemp in " + absl::GetFlag(FLAGS_dir));
  const std::filesystem::path root(tmpl);

  std::printf("%-8s %8s %12s %14s\n", "engine", "clients", "writes/s", "median_us(1)");
  const char* kNames[] = {"fsync", "store", "leveldb"};
  for (const char* name : kNames) {
    const std::filesystem::path dir = root / name;
    std::filesystem::create_directories(dir);
    std::unique_ptr<Engine> engine;
    if (std::string(name) == "store") {
      engine = std::make_unique<StoreEngine>(dir.string());
    } else if (std::string(name) == "leveldb") {
      engine = std::make_unique<LevelDbEngine>(dir.string());
    } else {
      engine = std::make_unique<FsyncEngine>(dir.string());
    }
    const double latency = MedianLatencyUs(*engine, latency_ops);
    for (int n : clients) {
      std::printf("%-8s %8d %12.0f %14.1f\n", name, n, WritesPerSecond(*engine, n, seconds), latency);
      std::fflush(stdout);
    }
  }
  std::error_code ec;
  std::filesystem::remove_all(root, ec);
  return 0;
}
