#include "pbox/agent_config.h"

#include <cmath>
#include <utility>

#include "common/units.h"
#include "pbox/image/image_store.h"
#include "pbox/wire/default_paths.h"

namespace bragg::pbox {

Result<AgentConfig> MakeAgentConfig(AgentFlags flags) {
  AgentConfig config = std::move(flags.config);
  for (auto [text, dest] : {std::pair{&flags.default_memory, &config.defaults.memory_bytes},
                            {&flags.default_disk, &config.defaults.disk_bytes},
                            {&flags.max_memory, &config.defaults.max_memory_bytes},
                            {&flags.max_image_bytes, &config.max_image_bytes}}) {
    BRAGG_ASSIGN_OR_RETURN(*dest, ParseSize(*text));
  }
  if (!std::isfinite(config.client_limits.refusals_per_second)) {
    return absl::InvalidArgumentError("--client-refusals-per-second must be a finite number");
  }
  // The defaults are under /run/pbox for root, under the user's own run directory otherwise
  // (a rootless agent): the rule clients follow to find it (wire/default_paths.h).
  const AgentConfig defaults;
  const std::string run_dir = DefaultRunDir();
  if (!flags.listen.empty()) {
    config.listen = std::move(flags.listen);
  } else if (config.listen == defaults.listen) {
    config.listen = {"unix://" + run_dir + "/pbox.sock"};
  }
  if (config.state_dir == defaults.state_dir) {
    config.state_dir = run_dir + "/state";
  }
  for (const std::string& flag : flags.images) {
    BRAGG_ASSIGN_OR_RETURN(auto parsed, ParseImageFlag(flag));
    config.images[parsed.first] = parsed.second;
  }
  return config;
}

}  // namespace bragg::pbox
