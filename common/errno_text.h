// ErrnoText: the text of an errno value, for error messages.
//
// strerror_r, not std::error_code(err, std::generic_category()).message(): that is a
// virtual call, and UBSan's vptr check of it reads the object's memory through a pipe
// (sanitizer_common's IsAccessibleMemoryRange), so with the process out of descriptors
// (EMFILE, exactly when these messages are written) a sanitized daemon reported an invalid
// vptr and died. strerror itself is not thread-safe. Header-only; thread-safe.
#ifndef COLLSERVE_COMMON_ERRNO_TEXT_H_
#define COLLSERVE_COMMON_ERRNO_TEXT_H_

#include <string.h>

#include <string>

namespace collserve {
namespace errno_text_internal {
// strerror_r comes in a GNU (returns char*) and an XSI (returns int) flavour.
[[maybe_unused]] inline std::string Result(char* buf, int result) {
  return result == 0 ? std::string(buf) : std::string("unknown error");
}
[[maybe_unused]] inline std::string Result(char*, char* result) { return std::string(result); }
}  // namespace errno_text_internal

// "No such file or directory" for ENOENT; "Unknown error N" (or "unknown error") for a
// value the C library does not know.
inline std::string ErrnoText(int err) {
  char buf[256];
  buf[0] = '\0';
  return errno_text_internal::Result(buf, strerror_r(err, buf, sizeof(buf)));
}

}  // namespace collserve

#endif  // COLLSERVE_COMMON_ERRNO_TEXT_H_
