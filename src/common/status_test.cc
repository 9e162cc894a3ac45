#include "common/status.h"

#include <gtest/gtest.h>

namespace bragg {
namespace {

TEST(StatusTest, ErrnoErrorNamesCallArgumentAndReason) {
  Status s = ErrnoError("mount", "/x", EPERM);
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(s.message(), "mount(/x): Operation not permitted");
  EXPECT_EQ(ErrnoError("open", "", ENOENT).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ErrnoError("write", "", ENOSPC).code(), absl::StatusCode::kResourceExhausted);
}

Result<int> Half(int x) {
  if (x % 2 != 0) {
    return absl::InvalidArgumentError("odd");
  }
  return x / 2;
}

Result<int> Quarter(int x) {
  BRAGG_ASSIGN_OR_RETURN(int h, Half(x));
  BRAGG_ASSIGN_OR_RETURN(int q, Half(h));
  return q;
}

TEST(StatusTest, MacrosPropagate) {
  EXPECT_EQ(*Quarter(8), 2);
  EXPECT_EQ(Quarter(6).status().message(), "odd");
  EXPECT_TRUE(Annotate(absl::OkStatus(), "ctx").ok());
  EXPECT_EQ(Annotate(absl::NotFoundError("x"), "ctx").message(), "ctx: x");
}

}  // namespace
}  // namespace bragg
