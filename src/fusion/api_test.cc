#include "fusion/api.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

namespace bragg::fusion {
namespace {

using json = nlohmann::json;

Result<RunCodeRequest> Parse(const std::string& body, RequestError* error = nullptr,
                             RequestLimits limits = {}) {
  return ParseRunCodeRequest(body, limits, error);
}

TEST(ParseRunCodeRequest, TakesSandboxFusionFields) {
  Result<RunCodeRequest> r = Parse(R"j({"code": "print(1)", "language": "python",
      "compile_timeout": 3, "run_timeout": 2.5, "memory_limit_MB": 256, "stdin": "x",
      "files": {"./a//b.txt": "aGk=", "skip": null, "x_IGNORE_THIS_FILE": "aGk="},
      "fetch_files": ["out.txt"]})j");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->code, "print(1)");
  EXPECT_EQ(r->language->name, "python");
  EXPECT_EQ(r->compile_timeout_s, 3);
  EXPECT_EQ(r->run_timeout_s, 2.5);
  EXPECT_EQ(r->memory_limit_mb, 256);
  EXPECT_EQ(r->stdin_data, "x");
  ASSERT_EQ(r->files.size(), 1u);
  EXPECT_EQ(r->files[0].first, "a/b.txt");
  EXPECT_EQ(r->files[0].second, "hi");
  ASSERT_EQ(r->fetch_files.size(), 1u);
  EXPECT_EQ(r->fetch_files[0].first, "out.txt");
}

TEST(ParseRunCodeRequest, DefaultsAsSandboxFusion) {
  Result<RunCodeRequest> r = Parse(R"({"code": "", "language": "bash", "stdin": null})");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->compile_timeout_s, 10);
  EXPECT_EQ(r->run_timeout_s, 10);
  EXPECT_EQ(r->memory_limit_mb, -1);
  EXPECT_TRUE(r->stdin_data.empty());
}

TEST(ParseRunCodeRequest, RefusesWhatFastApiRefuses) {
  struct Case {
    std::string body, field, type;
  };
  for (const Case& c : std::vector<Case>{
           {"not json", "", "json_invalid"},
           {"[1]", "", "dict_type"},
           {R"({"language": "python"})", "code", "missing"},
           {R"({"code": 1, "language": "python"})", "code", "string_type"},
           {R"({"code": ""})", "language", "missing"},
           {R"({"code": "", "language": "cobol"})", "language", "literal_error"},
           {R"({"code": "", "language": "go"})", "language", "literal_error"},
           {R"({"code": "", "language": "python", "run_timeout": -1})", "run_timeout",
            "greater_than"},
           {R"({"code": "", "language": "python", "compile_timeout": 0})", "compile_timeout",
            "greater_than"},
           {R"({"code": "", "language": "python", "run_timeout": 1e9})", "run_timeout",
            "less_than_equal"},
           {R"({"code": "", "language": "python", "run_timeout": "1"})", "run_timeout",
            "float_type"},
           {R"({"code": "", "language": "python", "memory_limit_MB": 1.5})", "memory_limit_MB",
            "int_type"},
           {R"({"code": "", "language": "python", "files": {"../../etc/x": "aGk="}})", "files",
            "value_error"},
           {R"({"code": "", "language": "python", "files": {"/etc/x": "aGk="}})", "files",
            "value_error"},
           {R"({"code": "", "language": "python", "files": {"a": "!!!"}})", "files", "value_error"},
           {R"({"code": "", "language": "python", "fetch_files": ["a/../../b"]})", "fetch_files",
            "value_error"},
           {R"({"code": "", "language": "python", "fetch_files": "a"})", "fetch_files",
            "list_type"},
       }) {
    RequestError e;
    Result<RunCodeRequest> r = Parse(c.body, &e);
    EXPECT_TRUE(absl::IsInvalidArgument(r.status())) << c.body;
    EXPECT_EQ(e.field, c.field) << c.body;
    EXPECT_EQ(e.type, c.type) << c.body;
    json detail = json::parse(RequestErrorJson(e))["detail"];
    ASSERT_EQ(detail.size(), 1u);
    EXPECT_EQ(detail[0]["loc"][0], "body");
  }
}

TEST(NormalizeRelativePath, KeepsPathsBelowTheWorkdir) {
  EXPECT_EQ(*NormalizeRelativePath("a/./b//c"), "a/b/c");
  EXPECT_FALSE(NormalizeRelativePath("").ok());
  EXPECT_FALSE(NormalizeRelativePath(".").ok());
  EXPECT_FALSE(NormalizeRelativePath("/abs").ok());
  EXPECT_FALSE(NormalizeRelativePath("a/..").ok());
  EXPECT_FALSE(NormalizeRelativePath(std::string("a\0b", 3)).ok());
}

TEST(RunStatus, FollowsParseRunStatus) {
  RunCodeResponse r;
  r.run_result = CommandResult{.status = CommandStatus::kFinished, .return_code = 0};
  SetRunStatus(&r);
  EXPECT_EQ(r.status, RunStatus::kSuccess);
  r.run_result->return_code = -9;
  SetRunStatus(&r);
  EXPECT_EQ(r.status, RunStatus::kFailed);
  r.run_result = CommandResult{.status = CommandStatus::kTimeLimitExceeded};
  SetRunStatus(&r);
  EXPECT_EQ(r.status, RunStatus::kFailed);
  r.compile_result = CommandResult{.status = CommandStatus::kError, .err = "boom"};
  SetRunStatus(&r);
  EXPECT_EQ(r.status, RunStatus::kSandboxError);
  EXPECT_EQ(r.message, "boom");
}

TEST(ToJson, UsesSandboxFusionNamesAndSurvivesBadUtf8) {
  RunCodeResponse r;
  r.run_result = CommandResult{.status = CommandStatus::kTimeLimitExceeded,
                               .execution_time = 1.5,
                               .out = "a\xff",
                               .err = ""};
  r.files.emplace_back("o.bin", std::string("\0\1", 2));
  SetRunStatus(&r);
  json j = json::parse(ToJson(r));
  EXPECT_EQ(j["status"], "Failed");
  EXPECT_EQ(j["message"], "");
  EXPECT_TRUE(j["compile_result"].is_null());
  EXPECT_EQ(j["run_result"]["status"], "TimeLimitExceeded");
  EXPECT_TRUE(j["run_result"]["return_code"].is_null());
  EXPECT_EQ(j["run_result"]["execution_time"], 1.5);
  EXPECT_EQ(j["run_result"]["stdout"], "a\xEF\xBF\xBD");
  EXPECT_EQ(j["files"]["o.bin"], "AAE=");
}

}  // namespace
}  // namespace bragg::fusion
