#pragma once

// pboxd's flags -> AgentConfig: the flags that are parsed rather than copied (sizes, --listen,
// --image), checked the way the agent needs them.

#include <string>
#include <vector>

#include "common/status.h"
#include "pbox/agent.h"

namespace bragg::pbox {

// What pboxd's command line gives. The flags that fill an AgentConfig field as they are go
// straight into `config`; the others are kept as text here.
struct AgentFlags {
  AgentConfig config;
  // Sizes as ParseSize reads them ("1G", "512MiB").
  std::string default_memory = "1G";
  std::string default_disk = "1G";
  std::string max_memory = "0";  // 0: any
  std::string max_image_bytes = "4G";
  std::vector<std::string> listen;  // empty: config.listen stays as it is
  std::vector<std::string> images;  // NAME=DIR (ParseImageFlag)
};

// The agent's config from its flags. InvalidArgument (the message names the flag's value and
// what to write instead) for a size ParseSize rejects, a --client-refusals-per-second that is
// not finite, or an --image that is not NAME=DIR.
Result<AgentConfig> MakeAgentConfig(AgentFlags flags);

}  // namespace bragg::pbox
