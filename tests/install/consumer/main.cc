// bragg_consumer [ENDPOINT]: uses the installed libraries the way a user's program would.
//   - bragg::pack: plans 64 traces over 4 DP ranks and checks every trace is placed once;
//   - bragg::pbox_client, with ENDPOINT: creates a sandbox in a session on that pboxd, runs a
//     command in it, checks its output and exit status, and ends the session.
// Prints "ok" and exits 0, or says what failed and exits 1.

#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include "pack/plan.h"
#include "pbox/client/client.h"

namespace {

int Fail(const std::string& what) {
  std::fprintf(stderr, "bragg_consumer: %s\n", what.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<bragg::pack::Trace> traces;
  for (int i = 0; i < 64; ++i) {
    traces.push_back({.id = i, .length = 100 + 37 * i});
  }
  bragg::pack::PackConfig config;
  config.dp = 4;
  config.max_tokens = 8192;
  auto plan = bragg::pack::PlanPacking(traces, config);
  if (!plan.ok()) {
    return Fail("PlanPacking: " + std::string(plan.status().message()));
  }
  std::multiset<int64_t> placed;
  for (const auto& rank : plan->ranks) {
    for (const auto& mb : rank.micro_batches) {
      for (const auto& row : mb.rows) {
        placed.insert(row.trace_ids.begin(), row.trace_ids.end());
      }
    }
  }
  if (plan->ranks.size() != 4 || placed.size() != traces.size() ||
      std::set<int64_t>(placed.begin(), placed.end()).size() != traces.size()) {
    return Fail("the plan does not place every trace exactly once on 4 ranks");
  }

  if (argc > 1) {
    namespace pc = bragg::pbox::client;
    auto client = pc::Client::Connect({.endpoint = argv[1]});
    if (!client.ok()) {
      return Fail("Connect: " + std::string(client.status().message()));
    }
    auto session = (*client)->OpenSession("bragg_consumer");
    if (!session.ok()) {
      return Fail("OpenSession: " + std::string(session.status().message()));
    }
    auto sandbox = (*client)->Create(pc::v1::SandboxSpec(), (*session)->id());
    if (!sandbox.ok()) {
      return Fail("Create: " + std::string(sandbox.status().message()));
    }
    auto run = (*client)->Run(
        {.sandbox_id = sandbox->id(), .argv = {"/bin/sh", "-c", "echo from-the-sandbox; exit 3"}});
    if (!run.ok()) {
      return Fail("Run: " + std::string(run.status().message()));
    }
    if (run->stdout() != "from-the-sandbox\n" || run->result().exit_code() != 3) {
      return Fail("Run gave stdout '" + run->stdout() + "', exit " +
                  std::to_string(run->result().exit_code()));
    }
    if (auto s = (*session)->Close(); !s.ok()) {
      return Fail("Session::Close: " + std::string(s.message()));
    }
  }
  std::printf("ok\n");
  return 0;
}
