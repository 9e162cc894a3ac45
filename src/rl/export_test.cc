#include "rl/export.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "common/fs.h"

namespace bragg::rl {
namespace {

using json = nlohmann::json;

train::Trajectory Make(const std::string& id, size_t len, uint32_t seed) {
  std::mt19937 rng(seed);
  train::Trajectory t;
  t.id = id;
  t.group = "g" + std::to_string(seed % 3);
  for (size_t i = 0; i < len; ++i) {
    t.tokens.push_back(1 + static_cast<int32_t>(rng() % 70));
    bool sampled = i >= len / 3 && rng() % 4 != 0;
    t.loss_mask.push_back(sampled ? 1 : 0);
    t.logprobs.push_back(sampled ? -0.01f * static_cast<float>(1 + rng() % 300) : 0.0f);
  }
  return t;
}

std::vector<json> ReadRows(const std::string& path) {
  std::vector<json> rows;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    rows.push_back(json::parse(line));
  }
  return rows;
}

// Every trajectory exactly once, at its offset, with its own tokens, mask, log-probs and
// advantage; padding all zeros; the row's lengths consistent.
void CheckRows(const std::vector<json>& rows, const std::vector<train::Trajectory>& batch,
               const std::vector<double>& adv, int64_t align, int64_t max_tokens) {
  std::map<std::string, size_t> index;
  for (size_t i = 0; i < batch.size(); ++i) index[batch[i].id] = i;
  std::map<std::string, int> seen;
  for (const json& r : rows) {
    auto tokens = r["tokens"].get<std::vector<int32_t>>();
    auto cu = r["cu_seqlens"].get<std::vector<int32_t>>();
    auto cup =
        r.contains("cu_seqlens_padded") ? r["cu_seqlens_padded"].get<std::vector<int32_t>>() : cu;
    auto loss = r["loss_mask"].get<std::vector<int>>();
    auto a = r["advantages"].get<std::vector<double>>();
    auto lp = r["logprobs"].get<std::vector<double>>();
    auto ids = r["trajectory_ids"].get<std::vector<std::string>>();
    ASSERT_EQ(cu.size(), ids.size() + 1);
    ASSERT_EQ(cup.size(), cu.size());
    ASSERT_EQ(static_cast<size_t>(cup.back()), tokens.size());
    ASSERT_LE(static_cast<int64_t>(tokens.size()), max_tokens);
    ASSERT_EQ(loss.size(), tokens.size());
    ASSERT_EQ(a.size(), tokens.size());
    ASSERT_EQ(lp.size(), tokens.size());
    EXPECT_EQ(r["step"], 7);
    EXPECT_EQ(r["version"], 7);
    std::vector<bool> real(tokens.size(), false);
    for (size_t k = 0; k < ids.size(); ++k) {
      ASSERT_TRUE(index.count(ids[k])) << ids[k];
      const train::Trajectory& t = batch[index[ids[k]]];
      ++seen[ids[k]];
      int64_t span = cup[k + 1] - cup[k];
      EXPECT_EQ(span % align, 0) << "span " << span << " not a multiple of " << align;
      ASSERT_EQ(static_cast<size_t>(cu[k + 1] - cu[k]), t.tokens.size());
      for (size_t j = 0; j < t.tokens.size(); ++j) {
        size_t at = static_cast<size_t>(cup[k]) + j;
        real[at] = true;
        EXPECT_EQ(tokens[at], t.tokens[j]);
        EXPECT_EQ(loss[at], t.loss_mask[j]);
        EXPECT_EQ(a[at], t.loss_mask[j] ? adv[index[ids[k]]] : 0.0);
        EXPECT_FLOAT_EQ(static_cast<float>(lp[at]), t.loss_mask[j] ? t.logprobs[j] : 0.0f);
      }
    }
    for (size_t at = 0; at < tokens.size(); ++at) {
      if (!real[at]) {
        EXPECT_EQ(tokens[at], 0);
        EXPECT_EQ(loss[at], 0);
        EXPECT_EQ(a[at], 0);
      }
    }
  }
  EXPECT_EQ(seen.size(), batch.size());
  for (const auto& [id, n] : seen) EXPECT_EQ(n, 1) << id;
}

class ExportTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto d = TempDir::Create();
    ASSERT_TRUE(d.ok()) << d.status();
    dir_ = std::move(*d);
    for (int i = 0; i < 24; ++i) {
      batch_.push_back(Make("r-" + std::to_string(i), 20 + static_cast<size_t>(i * 37 % 200), i));
      adv_.push_back(0.125 * (i % 5) - 0.25);
    }
  }
  std::string Path(const std::string& name) { return dir_.path() + "/" + name; }
  TempDir dir_;
  std::vector<train::Trajectory> batch_;
  std::vector<double> adv_;
};

TEST_F(ExportTest, PlainRowsHoldEveryTrajectoryOnce) {
  ExportConfig layout;
  ASSERT_TRUE(WritePackedBatch(batch_, adv_, layout, 512, 7, 7, Path("b.jsonl")).ok());
  auto rows = ReadRows(Path("b.jsonl"));
  EXPECT_GT(rows.size(), 1u);
  for (const json& r : rows) {
    EXPECT_FALSE(r.contains("cu_seqlens_padded"));  // nothing to pad: the adapter's default
    EXPECT_EQ(r["dp_rank"], 0);
  }
  CheckRows(rows, batch_, adv_, 1, 512);
  EXPECT_FALSE(std::filesystem::exists(Path("b.jsonl.tmp")));
}

TEST_F(ExportTest, ContextParallelPadsEverySequence) {
  ExportConfig layout;
  layout.cp = 2;
  layout.tp = 2;
  layout.sequence_parallel = true;
  ASSERT_TRUE(WritePackedBatch(batch_, adv_, layout, 1024, 7, 7, Path("cp.jsonl")).ok());
  auto rows = ReadRows(Path("cp.jsonl"));
  bool padded = false;
  for (const json& r : rows) padded = padded || r.contains("cu_seqlens_padded");
  EXPECT_TRUE(padded);
  CheckRows(rows, batch_, adv_, 8, 1024);  // 2 * cp * tp
}

TEST_F(ExportTest, DataParallelRanksGetEqualMicroBatchCounts) {
  ExportConfig layout;
  layout.dp = 3;
  ASSERT_TRUE(WritePackedBatch(batch_, adv_, layout, 600, 7, 7, Path("dp.jsonl")).ok());
  auto rows = ReadRows(Path("dp.jsonl"));
  std::map<int, int> per_rank;
  for (const json& r : rows) ++per_rank[r["dp_rank"].get<int>()];
  ASSERT_EQ(per_rank.size(), 3u);
  EXPECT_EQ(per_rank[0], per_rank[1]);
  EXPECT_EQ(per_rank[1], per_rank[2]);
  CheckRows(rows, batch_, adv_, 1, 600);
}

TEST_F(ExportTest, HostileIdStaysValidJson) {
  batch_[3].id = "a\"b\\c\nd\xff";
  ExportConfig layout;
  ASSERT_TRUE(WritePackedBatch(batch_, adv_, layout, 512, 7, 7, Path("h.jsonl")).ok());
  auto rows = ReadRows(Path("h.jsonl"));  // json::parse throws on a bad line
  bool found = false;
  for (const json& r : rows) {
    for (const auto& id : r["trajectory_ids"]) {
      found = found || id.get<std::string>().find("a\"b\\c\nd") == 0;
    }
  }
  EXPECT_TRUE(found);
}

TEST_F(ExportTest, RefusesWhatCannotBeExported) {
  ExportConfig layout;
  // A trajectory longer than a row.
  EXPECT_EQ(WritePackedBatch(batch_, adv_, layout, 100, 7, 7, Path("x.jsonl")).code(),
            absl::StatusCode::kInvalidArgument);
  // Advantages that do not match.
  std::vector<double> short_adv(adv_.begin(), adv_.end() - 1);
  EXPECT_EQ(WritePackedBatch(batch_, short_adv, layout, 512, 7, 7, Path("x.jsonl")).code(),
            absl::StatusCode::kInvalidArgument);
  // Lengths that disagree.
  auto bad = batch_;
  bad[0].logprobs.pop_back();
  EXPECT_EQ(WritePackedBatch(bad, adv_, layout, 512, 7, 7, Path("x.jsonl")).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(WritePackedBatch({}, {}, layout, 512, 7, 7, Path("x.jsonl")).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(std::filesystem::exists(Path("x.jsonl")));
  // A directory that does not exist: an error, not a crash.
  EXPECT_FALSE(WritePackedBatch(batch_, adv_, layout, 512, 7, 7, Path("no/such/b.jsonl")).ok());
}

}  // namespace
}  // namespace bragg::rl
