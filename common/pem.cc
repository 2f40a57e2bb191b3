#include "common/pem.h"

#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace collserve {

absl::Status CheckPemFile(const std::string& what, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(what, " ", path, ": cannot be read"));
  std::string head(4096, '\0');
  in.read(head.data(), static_cast<std::streamsize>(head.size()));
  head.resize(static_cast<size_t>(in.gcount()));
  if (!absl::StrContains(head, "-----BEGIN ")) {
    return absl::InvalidArgumentError(absl::StrCat(what, " ", path, ": not a PEM file"));
  }
  return absl::OkStatus();
}

}  // namespace collserve
