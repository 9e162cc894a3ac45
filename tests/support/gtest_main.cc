// main() of every bragg_test() binary: GoogleTest's own, plus skips made visible.
//
// ctest counts a binary that exits 0 as passed, so a binary whose every test called
// GTEST_SKIP would pass having run nothing. Here such a binary exits 77, which bragg_test()
// registers as ctest's SKIP_RETURN_CODE, and every skipped test is appended, with its reason,
// to the file $BRAGG_SKIP_FILE names (set for every ctest entry by the root CMakeLists.txt), so
// that `make test` can list each skip and, under CI=true, fail on one the install should have
// made runnable (scripts/test-summary, tests/allowed-skips.txt).

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

// "Suite.Test: reason" for every test that ran and was skipped.
std::vector<std::string> SkippedTests() {
  std::vector<std::string> out;
  const testing::UnitTest& unit = *testing::UnitTest::GetInstance();
  for (int i = 0; i < unit.total_test_suite_count(); ++i) {
    const testing::TestSuite& suite = *unit.GetTestSuite(i);
    for (int j = 0; j < suite.total_test_count(); ++j) {
      const testing::TestInfo& info = *suite.GetTestInfo(j);
      if (!info.should_run() || !info.result()->Skipped()) {
        continue;
      }
      std::string reason;
      const testing::TestResult& result = *info.result();
      for (int k = 0; k < result.total_part_count(); ++k) {
        const testing::TestPartResult& part = result.GetTestPartResult(k);
        if (part.skipped() && part.message() != nullptr) {
          reason = part.message();
        }
      }
      for (char& c : reason) {
        if (c == '\n') {
          c = ' ';
        }
      }
      out.push_back(std::string(suite.name()) + "." + info.name() + ": " +
                    (reason.empty() ? "(no reason given)" : reason));
    }
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  testing::InitGoogleTest(&argc, argv);
  int rc = RUN_ALL_TESTS();
  std::vector<std::string> skipped = SkippedTests();
  const char* skip_file = std::getenv("BRAGG_SKIP_FILE");
  if (!skipped.empty() && skip_file != nullptr && *skip_file != '\0') {
    if (FILE* f = std::fopen(skip_file, "a")) {
      for (const std::string& line : skipped) {
        std::fprintf(f, "%s\n", line.c_str());
      }
      std::fclose(f);
    }
  }
  int to_run = testing::UnitTest::GetInstance()->test_to_run_count();
  if (rc == 0 && to_run > 0 && static_cast<int>(skipped.size()) == to_run) {
    std::printf("every test of this binary was skipped: reported to ctest as a skip\n");
    return 77;
  }
  return rc;
}
