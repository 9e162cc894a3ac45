#include "common/status.h"

#include <cstring>

#include "fmt/format.h"

namespace bragg {

absl::StatusCode ErrnoToCode(int err) {
  switch (err) {
    case 0:
      return absl::StatusCode::kOk;
    case ENOENT:
    case ESRCH:
    case ENXIO:
      return absl::StatusCode::kNotFound;
    case EEXIST:
      return absl::StatusCode::kAlreadyExists;
    case EPERM:
    case EACCES:
    case EROFS:
      return absl::StatusCode::kPermissionDenied;
    case ENOSPC:
    case EMFILE:
    case ENFILE:
    case ENOMEM:
    case EDQUOT:
    case EAGAIN:
    case EFBIG:
      return absl::StatusCode::kResourceExhausted;
    case EINVAL:
    case ENAMETOOLONG:
    case ELOOP:
    case EXDEV:
    case ENOTDIR:
    case EISDIR:
    case ENOTEMPTY:
    case E2BIG:
      return absl::StatusCode::kInvalidArgument;
    case ETIMEDOUT:
      return absl::StatusCode::kDeadlineExceeded;
    case EBUSY:
      return absl::StatusCode::kFailedPrecondition;
    case ENOSYS:
    case EOPNOTSUPP:
      return absl::StatusCode::kUnimplemented;
    case EINTR:
      return absl::StatusCode::kAborted;
    default:
      return absl::StatusCode::kInternal;
  }
}

Status ErrnoError(std::string_view call, std::string_view arg, int err) {
  std::string msg = arg.empty() ? fmt::format("{}: {}", call, strerror(err))
                                : fmt::format("{}({}): {}", call, arg, strerror(err));
  return Status(ErrnoToCode(err), msg);
}

Status Annotate(const Status& s, std::string_view context) {
  if (s.ok()) {
    return s;
  }
  return Status(s.code(), fmt::format("{}: {}", context, std::string(s.message())));
}

}  // namespace bragg
