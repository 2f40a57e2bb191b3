// Certificates for tests, made with openssl in a temp dir of the test's own (removed at the
// end unless COLLSERVE_KEEP_TEST_DIRS is set).
#ifndef COLLSERVE_TESTS_TESTING_PKI_H_
#define COLLSERVE_TESTS_TESTING_PKI_H_

#include <stdlib.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"

namespace collserve::testing {

// Runs a shell command; true on exit status 0. Output goes to `log`.
inline bool Shell(const std::string& command, const std::string& log) {
  const std::string full = absl::StrCat("(", command, ") >>", log, " 2>&1");
  return std::system(full.c_str()) == 0;
}

// A temp dir with CAs and certificates made by openssl, removed at the end.
class Pki {
 public:
  Pki() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "collserve-tls.XXXXXX").string();
    dir_ = mkdtemp(tmpl.data()) != nullptr ? tmpl : "";
  }
  ~Pki() {
    if (!dir_.empty() && std::getenv("COLLSERVE_KEEP_TEST_DIRS") == nullptr) std::filesystem::remove_all(dir_);
  }
  const std::string& dir() const { return dir_; }
  std::string Path(const std::string& name) const { return absl::StrCat(dir_, "/", name); }

  // <name>.pem / <name>.key: a self-signed CA.
  bool MakeCa(const std::string& name) {
    return Shell(absl::StrCat("openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=", name,
                              " -keyout ", Path(name + ".key"), " -out ", Path(name + ".pem")),
                 Path("openssl.log"));
  }
  // <name>.pem / <name>.key signed by `ca`, for 127.0.0.1 and localhost (server and client use).
  bool MakeCert(const std::string& name, const std::string& ca) {
    const std::string ext = Path(name + ".ext");
    std::ofstream(ext) << "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                       << "extendedKeyUsage=serverAuth,clientAuth\n";
    return Shell(absl::StrCat("openssl req -newkey rsa:2048 -nodes -subj /CN=", name, " -keyout ",
                              Path(name + ".key"), " -out ", Path(name + ".csr"), " && openssl x509 -req -in ",
                              Path(name + ".csr"), " -CA ", Path(ca + ".pem"), " -CAkey ", Path(ca + ".key"),
                              " -CAcreateserial -days 2 -extfile ", ext, " -out ", Path(name + ".pem")),
                 Path("openssl.log"));
  }

 private:
  std::string dir_;
};

}  // namespace collserve::testing

#endif  // COLLSERVE_TESTS_TESTING_PKI_H_
