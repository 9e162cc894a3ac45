#pragma once

// Status and Result for every boundary that can fail because of the outside world.
// Bragg uses Abseil's canonical codes; Result<T> is absl::StatusOr<T>.

#include <cerrno>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace bragg {

using Status = absl::Status;
template <typename T>
using Result = absl::StatusOr<T>;

// Maps an errno value to the closest canonical code (ENOENT -> NotFound, EACCES/EPERM ->
// PermissionDenied, ENOSPC/EMFILE/ENOMEM -> ResourceExhausted, ...).
absl::StatusCode ErrnoToCode(int err);

// "call(arg): strerror(err)" with the code from ErrnoToCode. `err` defaults to errno, read
// before anything else can clobber it.
Status ErrnoError(std::string_view call, std::string_view arg, int err = errno);

// Prefixes a non-OK status with context ("creating sandbox sb-1: ..."); OK passes through.
Status Annotate(const Status& s, std::string_view context);

}  // namespace bragg

#define BRAGG_CONCAT_INNER_(a, b) a##b
#define BRAGG_CONCAT_(a, b) BRAGG_CONCAT_INNER_(a, b)

// Returns from the enclosing function if `expr` (a Status) is not OK.
#define BRAGG_RETURN_IF_ERROR(expr)                \
  do {                                             \
    ::absl::Status bragg_status_ = (expr);         \
    if (!bragg_status_.ok()) return bragg_status_; \
  } while (0)

// `lhs = value of expr` (a Result<T>), or returns its status.
#define BRAGG_ASSIGN_OR_RETURN(lhs, expr) \
  BRAGG_ASSIGN_OR_RETURN_IMPL_(BRAGG_CONCAT_(bragg_result_, __LINE__), lhs, expr)
#define BRAGG_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                                 \
  if (!tmp.ok()) return std::move(tmp).status();     \
  lhs = std::move(tmp).value()
