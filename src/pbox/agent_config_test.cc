#include "pbox/agent_config.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <limits>

#include "pbox/wire/default_paths.h"

namespace bragg::pbox {
namespace {

TEST(AgentConfigTest, DefaultsParse) {
  auto config = MakeAgentConfig(AgentFlags{});
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->defaults.memory_bytes, 1ull << 30);
  EXPECT_EQ(config->defaults.disk_bytes, 1ull << 30);
  EXPECT_EQ(config->defaults.max_memory_bytes, 0u);
  EXPECT_EQ(config->max_image_bytes, 4ull << 30);
  EXPECT_EQ(config->listen, AgentConfig{}.listen);
  EXPECT_TRUE(config->images.empty());
}

TEST(AgentConfigTest, CarriesFlags) {
  AgentFlags flags;
  flags.config.state_dir = "/tmp/state";
  flags.default_memory = "512M";
  flags.default_disk = "1.5GiB";
  flags.max_memory = "2G";
  flags.max_image_bytes = "1P";
  flags.listen = {"unix:///tmp/a.sock", "tcp://127.0.0.1:0"};
  flags.images = {"deb=/srv/deb"};
  auto config = MakeAgentConfig(flags);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->state_dir, "/tmp/state");
  EXPECT_EQ(config->defaults.memory_bytes, 512ull << 20);
  EXPECT_EQ(config->defaults.disk_bytes, 3ull << 29);
  EXPECT_EQ(config->defaults.max_memory_bytes, 2ull << 30);
  EXPECT_EQ(config->max_image_bytes, 1ull << 50);
  EXPECT_EQ(config->listen, flags.listen);
  EXPECT_EQ(config->images.at("deb"), "/srv/deb");
}

TEST(AgentConfigTest, RejectsBadFlags) {
  for (auto set : std::initializer_list<void (*)(AgentFlags&)>{
           [](AgentFlags& f) { f.default_memory = "1X"; },
           [](AgentFlags& f) { f.default_disk = "-1G"; }, [](AgentFlags& f) { f.max_memory = ""; },
           [](AgentFlags& f) { f.max_image_bytes = "99999999999T"; },
           [](AgentFlags& f) {
             f.config.client_limits.refusals_per_second = std::numeric_limits<double>::infinity();
           },
           [](AgentFlags& f) { f.images = {"no-directory"}; }}) {
    AgentFlags flags;
    set(flags);
    auto config = MakeAgentConfig(flags);
    ASSERT_FALSE(config.ok());
    EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument) << config.status();
  }
}

// Where an agent listens with no flags, by who runs it; clients follow the same rule.
TEST(AgentConfigTest, DefaultPathsFollowTheUser) {
  EXPECT_EQ(DefaultRunDir(0, "/run/user/0"), "/run/pbox");
  EXPECT_EQ(DefaultRunDir(1001, "/run/user/1001"), "/run/user/1001/pbox");
  EXPECT_EQ(DefaultRunDir(1001, ""), "/tmp/pbox-1001");
  EXPECT_EQ(DefaultRunDir(1001, "relative/dir"), "/tmp/pbox-1001");  // not a path to trust

  auto config = MakeAgentConfig(AgentFlags{});
  ASSERT_TRUE(config.ok()) << config.status();
  const std::string run_dir = DefaultRunDir();
  EXPECT_EQ(config->state_dir, run_dir + "/state");
  EXPECT_EQ(config->listen, std::vector<std::string>{"unix://" + run_dir + "/pbox.sock"});
  if (::geteuid() == 0) {
    EXPECT_EQ(run_dir, "/run/pbox");
  }
}

}  // namespace
}  // namespace bragg::pbox
