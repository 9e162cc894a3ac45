#include "pbox/wire/default_paths.h"

#include <sys/stat.h>
#include <unistd.h>

#include "common/process.h"
#include "fmt/format.h"

namespace bragg::pbox {

std::string DefaultRunDir(uid_t euid, const std::string& xdg) {
  if (euid == 0) {
    return kSystemRunDir;
  }
  if (!xdg.empty() && xdg[0] == '/') {
    return xdg + "/pbox";
  }
  return fmt::format("/tmp/pbox-{}", euid);
}

std::string DefaultRunDir() { return DefaultRunDir(::geteuid(), GetEnv("XDG_RUNTIME_DIR")); }

std::string DefaultEndpoint() {
  const std::string system = fmt::format("{}/pbox.sock", kSystemRunDir);
  struct stat st;
  if (::geteuid() == 0 || ::stat(system.c_str(), &st) == 0) {
    return "unix://" + system;
  }
  return fmt::format("unix://{}/pbox.sock", DefaultRunDir());
}

}  // namespace bragg::pbox
