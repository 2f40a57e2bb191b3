#include "server/coordinator/tcpstore_protocol.h"

#include <cstring>
#include <optional>

#include "absl/strings/str_cat.h"

namespace collserve::server::tcpstore {
namespace {

// torch 1.13 (and 2.0) QueryType.
std::optional<Op> DecodeV1(uint8_t code) {
  static constexpr Op kOps[] = {Op::kSet,  Op::kCompareSet, Op::kGet,      Op::kAdd,      Op::kCheck,
                                Op::kWait, Op::kNumKeys,    Op::kWatchKey, Op::kDeleteKey};
  if (code >= sizeof(kOps) / sizeof(kOps[0])) return std::nullopt;
  return kOps[code];
}

// torch >= 2.2 QueryType (2.6 verified; 2.8 appends queue ops we do not serve).
std::optional<Op> DecodeV2(uint8_t code) {
  static constexpr Op kOps[] = {Op::kValidate, Op::kSet,      Op::kCompareSet, Op::kGet,       Op::kAdd,
                                Op::kCheck,    Op::kWait,     Op::kNumKeys,    Op::kDeleteKey, Op::kAppend,
                                Op::kMultiGet, Op::kMultiSet, Op::kCancelWait, Op::kPing};
  if (code >= sizeof(kOps) / sizeof(kOps[0])) return std::nullopt;
  return kOps[code];
}

// Reads fields from the front of a buffer. The first shortfall or limit violation sticks:
// `incomplete` (with the bytes needed) or `error`, and every later read returns nothing.
class Reader {
 public:
  Reader(absl::string_view in, const Limits& limits) : in_(in), limits_(limits) {}

  bool ok() const { return !incomplete_ && error_.empty(); }
  bool incomplete() const { return incomplete_; }
  size_t needed() const { return needed_; }
  const std::string& error() const { return error_; }
  size_t pos() const { return pos_; }

  template <typename T>
  T Scalar() {
    T v{};
    if (!Have(sizeof(T))) return v;
    std::memcpy(&v, in_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }

  std::string Bytes(int64_t limit, const char* what) {
    const uint64_t len = Scalar<uint64_t>();
    if (!ok()) return "";
    if (len > static_cast<uint64_t>(limit)) {
      Fail(absl::StrCat(what, " of ", len, " bytes exceeds the limit of ", limit));
      return "";
    }
    if (!Have(static_cast<size_t>(len))) return "";
    std::string out(in_.data() + pos_, static_cast<size_t>(len));
    pos_ += static_cast<size_t>(len);
    return out;
  }
  std::string Key() { return Bytes(limits_.max_key_bytes, "key"); }
  std::string Value() { return Bytes(limits_.max_value_bytes, "value"); }

  int64_t Count(const char* what) {
    const uint64_t n = Scalar<uint64_t>();
    if (ok() && n > static_cast<uint64_t>(limits_.max_keys_per_request)) {
      Fail(absl::StrCat(what, " of ", n, " exceeds the limit of ", limits_.max_keys_per_request));
      return 0;
    }
    return ok() ? static_cast<int64_t>(n) : 0;
  }

  std::vector<std::string> Keys() {
    const int64_t n = Count("key count");
    std::vector<std::string> keys;
    for (int64_t i = 0; i < n && ok(); ++i) keys.push_back(Key());
    return keys;
  }

  void Fail(std::string why) {
    if (ok()) error_ = std::move(why);
  }

 private:
  // Whether `n` more bytes are there; records the shortfall otherwise.
  bool Have(size_t n) {
    if (!ok()) return false;
    if (in_.size() - pos_ >= n) return true;
    incomplete_ = true;
    needed_ = pos_ + n;
    return false;
  }

  absl::string_view in_;
  const Limits& limits_;
  size_t pos_ = 0;
  bool incomplete_ = false;
  size_t needed_ = 0;
  std::string error_;
};

}  // namespace

ParseResult ParseRequest(absl::string_view in, const Limits& limits, Dialect* dialect, Request* out) {
  ParseResult result;
  if (in.empty()) {
    result.needed = 1;
    return result;
  }
  if (*dialect == Dialect::kUndecided) {
    // torch >= 2.2 opens with VALIDATE: 00 CE F7 85 3C.
    if (static_cast<uint8_t>(in[0]) == 0) {
      if (in.size() < 5) {
        result.needed = 5;
        return result;
      }
      uint32_t magic;
      std::memcpy(&magic, in.data() + 1, sizeof(magic));
      *dialect = magic == kValidationMagic ? Dialect::kV2 : Dialect::kV1;
    } else {
      *dialect = Dialect::kV1;
    }
  }
  const bool v2 = *dialect == Dialect::kV2;
  const uint8_t code = static_cast<uint8_t>(in[0]);
  const std::optional<Op> op = v2 ? DecodeV2(code) : DecodeV1(code);
  if (!op.has_value()) {
    result.status = Parse::kError;
    result.error = absl::StrCat("unknown opcode ", code, v2 ? " (torch >= 2.2 dialect)" : " (torch 1.13 dialect)");
    return result;
  }
  Reader r(in.substr(1), limits);
  *out = Request();
  out->op = *op;
  switch (*op) {
    case Op::kValidate:
    case Op::kPing:
      out->nonce = r.Scalar<uint32_t>();
      if (r.ok() && *op == Op::kValidate && out->nonce != kValidationMagic) {
        r.Fail(absl::StrCat("VALIDATE with a wrong magic ", out->nonce));
      }
      break;
    case Op::kSet:
    case Op::kAppend:
      out->keys.push_back(r.Key());
      out->values.push_back(r.Value());
      break;
    case Op::kCompareSet:
      out->keys.push_back(r.Key());
      out->values.push_back(r.Value());
      out->values.push_back(r.Value());
      break;
    case Op::kGet:
    case Op::kDeleteKey:
    case Op::kWatchKey:
      out->keys.push_back(r.Key());
      break;
    case Op::kAdd:
      out->keys.push_back(r.Key());
      out->delta = r.Scalar<int64_t>();
      break;
    case Op::kCheck:
    case Op::kWait:
    case Op::kMultiGet:
      out->keys = r.Keys();
      break;
    case Op::kMultiSet: {
      const int64_t n = r.Count("MULTI_SET count");
      for (int64_t i = 0; i < n && r.ok(); ++i) {
        out->keys.push_back(r.Key());
        out->values.push_back(r.Value());
      }
      break;
    }
    case Op::kNumKeys:
    case Op::kCancelWait:
      break;
  }
  if (r.incomplete()) {
    result.needed = 1 + r.needed();
    return result;
  }
  if (!r.ok()) {
    result.status = Parse::kError;
    result.error = r.error();
    return result;
  }
  result.status = Parse::kRequest;
  result.consumed = 1 + r.pos();
  return result;
}

std::string EncodeBytes(absl::string_view v) {
  const uint64_t len = v.size();
  std::string out(reinterpret_cast<const char*>(&len), sizeof(len));
  out.append(v.data(), v.size());
  return out;
}

std::string EncodeInt(int64_t v) { return std::string(reinterpret_cast<const char*>(&v), sizeof(v)); }

}  // namespace collserve::server::tcpstore
