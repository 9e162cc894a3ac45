#pragma once

// SandboxFusion's /run_code wire format (github.com/bytedance/SandboxFusion,
// sandbox/server/sandbox_api.py; the PyPI client sandbox-fusion 0.3.7, sandbox_fusion/models.py):
// the request parsed and checked, the response rendered with SandboxFusion's field names and
// status strings. No I/O; thread-compatible.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"

namespace bragg::fusion {

// How one language is compiled and run inside a sandbox, in its working directory. Arguments
// are argv entries, never a shell line: `source` is the file the code is written to.
struct Language {
  std::string_view name;
  std::string_view source;
  std::vector<std::string> compile;  // empty: nothing to compile
  std::vector<std::string> run;
};

// The language pbox-fusion runs under `name` (python, bash, cpp), or null.
const Language* FindLanguage(std::string_view name);
// Whether SandboxFusion knows `name` at all (its Language literal), run here or not.
bool IsSandboxFusionLanguage(std::string_view name);
// "'python', 'bash' or 'cpp'", for error messages.
std::string SupportedLanguagesText();

// Bounds on what a request may ask for; pbox-fusion's flags.
struct RequestLimits {
  double max_timeout_s = 600;     // compile_timeout and run_timeout, each
  int64_t max_memory_mb = 16384;  // memory_limit_MB
  size_t max_files = 1000;        // entries of `files` and of `fetch_files`, each
};

struct RunCodeRequest {
  std::string code;
  const Language* language = nullptr;  // never null once parsed
  double compile_timeout_s = 10;
  double run_timeout_s = 10;
  int64_t memory_limit_mb = -1;  // <= 0: the server's default
  std::string stdin_data;
  // Relative, normalized paths (NormalizeRelativePath) with their decoded bytes.
  std::vector<std::pair<std::string, std::string>> files;
  // As the client spelled them (the response's keys), each with its normalized path.
  std::vector<std::pair<std::string, std::string>> fetch_files;
};

// A refused request: what FastAPI answers with 422 {"detail": [{"loc": ["body", field], ...}]}.
struct RequestError {
  std::string field;  // empty: the body as a whole
  std::string message;
  std::string type;  // pydantic's error type: "missing", "literal_error", "json_invalid", ...
};

// Parses a /run_code body. InvalidArgument when it is refused, with `*error` (if not null) saying
// which field and why. Paths in `files` and `fetch_files` must be relative and stay below the
// working directory; `files` entries whose content is null are skipped, as SandboxFusion does.
Result<RunCodeRequest> ParseRunCodeRequest(std::string_view body, const RequestLimits& limits,
                                           RequestError* error);

// The 422 body for `error`.
std::string RequestErrorJson(const RequestError& error);

// "a/./b//c" -> "a/b/c". InvalidArgument for an empty or absolute path, a NUL byte, or a ".."
// component (SandboxFusion joins the path to its temp dir, so such a path writes outside it).
Result<std::string> NormalizeRelativePath(std::string_view path);

// SandboxFusion's CommandRunStatus and RunStatus.
enum class CommandStatus { kFinished, kError, kTimeLimitExceeded };
enum class RunStatus { kSuccess, kFailed, kSandboxError };

struct CommandResult {
  CommandStatus status = CommandStatus::kFinished;
  std::optional<double> execution_time;  // seconds
  std::optional<int> return_code;        // -N for a command killed by signal N, as Python's
  std::string out;                       // stdout (may hold any bytes; rendered as UTF-8)
  std::string err;                       // stderr
};

struct RunCodeResponse {
  RunStatus status = RunStatus::kSuccess;
  std::string message;
  std::optional<CommandResult> compile_result;
  std::optional<CommandResult> run_result;
  std::vector<std::pair<std::string, std::string>> files;  // name -> raw bytes (base64 on the wire)
};

// SandboxFusion's parse_run_status: SandboxError (message: that command's stderr) if a command
// ended in Error, Failed for a time-out or a non-zero return code, else Success.
void SetRunStatus(RunCodeResponse* response);
// A response for a failure of the sandbox side (pbox unreachable, a file that cannot be written).
RunCodeResponse SandboxErrorResponse(std::string message);

// The JSON body; bytes that are not UTF-8 become U+FFFD.
std::string ToJson(const RunCodeResponse& response);

std::string_view ToString(CommandStatus status);
std::string_view ToString(RunStatus status);

}  // namespace bragg::fusion
