// Status propagation macros shared by every layer (absl only).
#ifndef COLLSERVE_COMMON_STATUS_MACROS_H_
#define COLLSERVE_COMMON_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define COLLSERVE_INTERNAL_CONCAT_(a, b) a##b
#define COLLSERVE_INTERNAL_CONCAT(a, b) COLLSERVE_INTERNAL_CONCAT_(a, b)

// Returns `expr` from the enclosing function if it is not OK.
#define COLLSERVE_RETURN_IF_ERROR(expr)                 \
  do {                                                  \
    ::absl::Status collserve_status_ = (expr);          \
    if (!collserve_status_.ok()) return collserve_status_; \
  } while (0)

// `lhs = value of expr` if OK, otherwise returns its status from the enclosing function.
#define COLLSERVE_ASSIGN_OR_RETURN(lhs, expr) \
  COLLSERVE_INTERNAL_ASSIGN_OR_RETURN(COLLSERVE_INTERNAL_CONCAT(collserve_statusor_, __LINE__), lhs, expr)

#define COLLSERVE_INTERNAL_ASSIGN_OR_RETURN(statusor, lhs, expr) \
  auto statusor = (expr);                                        \
  if (!statusor.ok()) return std::move(statusor).status();       \
  lhs = std::move(statusor).value()

#endif  // COLLSERVE_COMMON_STATUS_MACROS_H_
