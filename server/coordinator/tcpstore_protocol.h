// torch.distributed's TCPStore wire protocol as pure functions over bytes: the request
// decoder and the reply encoders of the coordinator's TCPStore endpoint
// (tcpstore_server.h), with no sockets, so that it can be fuzzed and tested alone.
//
// Source: torch/csrc/distributed/c10d/TCPStore.cpp and TCPStoreBackend.cpp (torch 1.13.1
// and 2.6.0). Byte layout: no frame headers; a request is a 1-byte opcode and fields laid
// out per opcode; integers are host order (little-endian).
//   string/bytes: uint64 length, then the bytes      key list: uint64 n, then n strings
//   int64: 8 bytes, two's complement                  enums: 1 byte
// Opcodes and replies (1.13 value / >= 2.2 value):
//   -/0   VALIDATE   uint32 magic 0x3C85F7CE (bytes 00 CE F7 85 3C on the wire); no reply.
//                    It opens every >= 2.2 connection; its presence selects that dialect.
//   0/1   SET        key, value; no reply
//   1/2   COMPARE_SET key, expected, desired; reply: value (current after the call, or
//                    `expected` when the key is missing and `expected` is not empty)
//   2/3   GET        key; reply: value (empty if missing, as torch 2.x's libuv server)
//   3/4   ADD        key, int64 delta; reply: int64 new value (stored as ASCII decimal)
//   4/5   CHECK      key list; reply: uint8 READY=0 / NOT_READY=1
//   5/6   WAIT       key list; reply: uint8 STOP_WAITING=0 once every key exists (deferred;
//                    the connection keeps being served meanwhile)
//   6/7   GETNUMKEYS no fields; reply: int64 (keys of the job, "init/" included)
//   7/-   WATCH_KEY  key (1.13's callback connection); reply: uint8 KEY_CALLBACK_REGISTERED=3.
//                    No change events follow: torch 1.13's Python API cannot register
//                    watches and c10d never does; the connection is kept open, silent,
//                    because closing it makes a 1.13 client abort or spin.
//   8/8   DELETE_KEY key; reply: int64 keys deleted (0 or 1)
//   -/9   APPEND     key, bytes; no reply
//   -/10  MULTI_GET  key list; reply: one value per key (empty if missing)
//   -/11  MULTI_SET  int64 n, then n x (key, value); no reply
//   -/12  CANCEL_WAIT no fields; cancels this connection's pending WAITs; reply: uint8
//                    WAIT_CANCELED=1 (after any STOP_WAITING already sent)
//   -/13  PING       uint32 nonce; reply: the same 4 bytes
// Not served (an unknown opcode): torch >= 2.7's QUEUE_PUSH/POP/LEN (14-16, libuv server
// only) and later LIST_KEYS/BARRIER. A torch 2.1-era client (no VALIDATE, APPEND=8) cannot
// be told from 1.13 on the wire and is not supported.
#ifndef COLLSERVE_SERVER_COORDINATOR_TCPSTORE_PROTOCOL_H_
#define COLLSERVE_SERVER_COORDINATOR_TCPSTORE_PROTOCOL_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace collserve::server::tcpstore {

inline constexpr uint32_t kValidationMagic = 0x3C85F7CE;

enum class Op {
  kValidate, kSet, kCompareSet, kGet, kAdd, kCheck, kWait, kNumKeys, kWatchKey, kDeleteKey,
  kAppend, kMultiGet, kMultiSet, kCancelWait, kPing
};

inline constexpr int kNumOps = static_cast<int>(Op::kPing) + 1;

// torch's name of `op` ("SET", "COMPARE_SET", "MULTI_GET", ...; TCPStore's QueryType).
inline const char* OpName(Op op) {
  static const char* const kNames[kNumOps] = {"VALIDATE", "SET",        "COMPARE_SET", "GET",       "ADD",
                                              "CHECK",    "WAIT",       "GETNUMKEYS",  "WATCH_KEY", "DELETE_KEY",
                                              "APPEND",   "MULTI_GET",  "MULTI_SET",   "CANCEL_WAIT", "PING"};
  return kNames[static_cast<int>(op)];
}

enum class Dialect {
  kUndecided,  // nothing read yet
  kV1,         // torch 1.13 (and 2.0)
  kV2,         // torch >= 2.2 (opened with VALIDATE)
};

struct Limits {
  int64_t max_key_bytes = 4096;
  int64_t max_value_bytes = 64 << 20;
  int64_t max_keys_per_request = 128 * 1024;  // torch 2.x's libuv server: 128 Ki
};

// One decoded request. Which fields are set depends on op: keys (SET, COMPARE_SET, GET,
// ADD, CHECK, WAIT, WATCH_KEY, DELETE_KEY, APPEND, MULTI_GET, MULTI_SET), values (SET and
// APPEND: 1; COMPARE_SET: expected, desired; MULTI_SET: one per key), delta (ADD), nonce
// (PING, VALIDATE's magic).
struct Request {
  Op op = Op::kPing;
  std::vector<std::string> keys;
  std::vector<std::string> values;
  int64_t delta = 0;
  uint32_t nonce = 0;
};

enum class Parse { kRequest, kIncomplete, kError };

struct ParseResult {
  Parse status = Parse::kIncomplete;
  size_t consumed = 0;       // kRequest: bytes of `in` the request took
  size_t needed = 0;         // kIncomplete: try again once `in` holds at least this many bytes
  std::string error;         // kError: why (a length over the limits, an unknown opcode, ...)
};

// Decodes the request at the start of `in` for a connection in `*dialect` (which it settles
// on the first request: VALIDATE selects kV2, anything else kV1). Never reads past `in`,
// never allocates more than the limits allow before the bytes are there, and rejects a
// length over the limits before reading it. Thread-compatible (pure).
ParseResult ParseRequest(absl::string_view in, const Limits& limits, Dialect* dialect, Request* out);

// Reply encodings.
std::string EncodeBytes(absl::string_view v);
std::string EncodeInt(int64_t v);

}  // namespace collserve::server::tcpstore

#endif  // COLLSERVE_SERVER_COORDINATOR_TCPSTORE_PROTOCOL_H_
