#include "fusion/api.h"

#include <fmt/format.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "absl/strings/escaping.h"
#include "absl/strings/str_join.h"

namespace bragg::fusion {
namespace {

using json = nlohmann::json;

// Where a language's source goes: a name no SandboxFusion caller uses (it picks random names),
// in the working directory, so that a Python program imports the files sent beside it.
const std::vector<Language>& Languages() {
  static const auto* const kLanguages = new std::vector<Language>{
      {"python", "__fusion_main__.py", {}, {"/usr/bin/python3", "__fusion_main__.py"}},
      {"bash", "__fusion_main__.sh", {}, {"/usr/bin/bash", "__fusion_main__.sh"}},
      // SandboxFusion: g++ -std=c++17 FILE -o test [-lcrypto -lssl -lpthread], then ./test.
      {"cpp",
       "__fusion_main__.cpp",
       {"/usr/bin/g++", "-std=c++17", "__fusion_main__.cpp", "-o", "test", "-lpthread"},
       {"./test"}},
  };
  return *kLanguages;
}

// SandboxFusion's Language literal (sandbox/runners/types.py, and the PyPI client's models.py,
// which adds python2 and a few more).
constexpr std::string_view kSandboxFusionLanguages[] = {
    "python", "python2", "cpp",        "nodejs", "go",    "go_test", "java",  "php",
    "csharp", "bash",    "typescript", "sql",    "rust",  "cuda",    "lua",   "R",
    "perl",   "D_ut",    "ruby",       "scala",  "julia", "pytest",  "junit", "kotlin_script",
    "jest",   "verilog", "python_gpu", "lean",   "swift", "racket",  "gtest", "react"};

RequestError Error(std::string field, std::string message, std::string type) {
  return RequestError{std::move(field), std::move(message), std::move(type)};
}

// A number field: absent keeps `*out`; JSON numbers only (FastAPI would also take "10").
bool ReadNumber(const json& body, const char* field, double* out, RequestError* error) {
  auto it = body.find(field);
  if (it == body.end()) {
    return true;
  }
  if (!it->is_number()) {
    *error = Error(field, "Input should be a valid number", "float_type");
    return false;
  }
  *out = it->get<double>();
  return true;
}

bool ReadTimeout(const json& body, const char* field, const RequestLimits& limits, double* out,
                 RequestError* error) {
  if (!ReadNumber(body, field, out, error)) {
    return false;
  }
  // SandboxFusion takes any float; a timeout of zero or less would mean "no limit" to pbox.
  if (!std::isfinite(*out) || *out <= 0) {
    *error = Error(field, "Input should be greater than 0", "greater_than");
    return false;
  }
  if (*out > limits.max_timeout_s) {
    *error = Error(field,
                   fmt::format("Input should be at most {} (this server's --max-timeout-s)",
                               limits.max_timeout_s),
                   "less_than_equal");
    return false;
  }
  return true;
}

void Fail(RequestError* error, RequestError value) {
  if (error != nullptr) {
    *error = std::move(value);
  }
}

}  // namespace

const Language* FindLanguage(std::string_view name) {
  for (const Language& l : Languages()) {
    if (l.name == name) {
      return &l;
    }
  }
  return nullptr;
}

bool IsSandboxFusionLanguage(std::string_view name) {
  for (std::string_view l : kSandboxFusionLanguages) {
    if (l == name) {
      return true;
    }
  }
  return false;
}

std::string SupportedLanguagesText() {
  std::vector<std::string> names;
  for (const Language& l : Languages()) {
    names.push_back(fmt::format("'{}'", l.name));
  }
  std::string last = names.back();
  names.pop_back();
  return absl::StrJoin(names, ", ") + " or " + last;
}

Result<std::string> NormalizeRelativePath(std::string_view path) {
  if (path.empty()) {
    return absl::InvalidArgumentError("empty file path");
  }
  if (path.find('\0') != std::string_view::npos) {
    return absl::InvalidArgumentError("file path contains a NUL byte");
  }
  if (path.front() == '/') {
    return absl::InvalidArgumentError(fmt::format(
        "file path '{}' is absolute: paths are relative to the working directory", path));
  }
  std::vector<std::string> parts;
  size_t start = 0;
  while (start <= path.size()) {
    size_t end = std::min(path.find('/', start), path.size());
    std::string_view part = path.substr(start, end - start);
    start = end + 1;
    if (part.empty() || part == ".") {
      continue;
    }
    if (part == "..") {
      return absl::InvalidArgumentError(fmt::format(
          "file path '{}' has a '..' component: paths stay below the working directory", path));
    }
    parts.emplace_back(part);
  }
  if (parts.empty()) {
    return absl::InvalidArgumentError(fmt::format("file path '{}' names no file", path));
  }
  return absl::StrJoin(parts, "/");
}

Result<RunCodeRequest> ParseRunCodeRequest(std::string_view body, const RequestLimits& limits,
                                           RequestError* error) {
  RequestError e;
  auto refuse = [&](RequestError value) -> Status {
    std::string text = value.field.empty() ? value.message : value.field + ": " + value.message;
    Fail(error, std::move(value));
    return absl::InvalidArgumentError(text);
  };
  json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    return refuse(Error("", "JSON decode error", "json_invalid"));
  }
  if (!j.is_object()) {
    return refuse(Error("", "Input should be a valid dictionary", "dict_type"));
  }
  RunCodeRequest req;
  auto code = j.find("code");
  if (code == j.end()) {
    return refuse(Error("code", "Field required", "missing"));
  }
  if (!code->is_string()) {
    return refuse(Error("code", "Input should be a valid string", "string_type"));
  }
  req.code = code->get<std::string>();

  auto language = j.find("language");
  if (language == j.end()) {
    return refuse(Error("language", "Field required", "missing"));
  }
  if (language->is_string()) {
    req.language = FindLanguage(language->get_ref<const std::string&>());
  }
  if (req.language == nullptr) {
    // SandboxFusion refuses a name outside its Language literal with 422; one it knows but
    // pbox-fusion has no toolchain for is refused the same way, naming what runs here.
    std::string name = language->is_string() ? language->get<std::string>() : language->dump();
    std::string known = IsSandboxFusionLanguage(name) ? " (a SandboxFusion language that "
                                                        "pbox-fusion does not run)"
                                                      : "";
    return refuse(Error("language",
                        fmt::format("Input should be {}{}", SupportedLanguagesText(), known),
                        "literal_error"));
  }

  if (!ReadTimeout(j, "compile_timeout", limits, &req.compile_timeout_s, &e) ||
      !ReadTimeout(j, "run_timeout", limits, &req.run_timeout_s, &e)) {
    return refuse(e);
  }

  if (auto it = j.find("memory_limit_MB"); it != j.end()) {
    if (!it->is_number_integer()) {
      return refuse(Error("memory_limit_MB", "Input should be a valid integer", "int_type"));
    }
    req.memory_limit_mb = it->get<int64_t>();
    if (req.memory_limit_mb > limits.max_memory_mb) {
      return refuse(Error("memory_limit_MB",
                          fmt::format("Input should be at most {} (this server's --max-memory-mb)",
                                      limits.max_memory_mb),
                          "less_than_equal"));
    }
  }

  if (auto it = j.find("stdin"); it != j.end() && !it->is_null()) {
    if (!it->is_string()) {
      return refuse(Error("stdin", "Input should be a valid string", "string_type"));
    }
    req.stdin_data = it->get<std::string>();
  }

  if (auto it = j.find("files"); it != j.end() && !it->is_null()) {
    if (!it->is_object()) {
      return refuse(Error("files", "Input should be a valid dictionary", "dict_type"));
    }
    if (it->size() > limits.max_files) {
      return refuse(Error("files", fmt::format("at most {} files", limits.max_files), "too_long"));
    }
    for (const auto& [name, content] : it->items()) {
      if (content.is_null()) {
        continue;
      }
      // SandboxFusion's restore_files skips these names.
      if (name.find("IGNORE_THIS_FILE") != std::string::npos) {
        continue;
      }
      if (!content.is_string()) {
        return refuse(Error("files", fmt::format("'{}': Input should be a valid string", name),
                            "string_type"));
      }
      Result<std::string> path = NormalizeRelativePath(name);
      if (!path.ok()) {
        return refuse(Error("files", std::string(path.status().message()), "value_error"));
      }
      std::string bytes;
      if (!absl::Base64Unescape(content.get_ref<const std::string&>(), &bytes)) {
        return refuse(
            Error("files", fmt::format("'{}': content is not valid base64", name), "value_error"));
      }
      req.files.emplace_back(std::move(*path), std::move(bytes));
    }
  }

  if (auto it = j.find("fetch_files"); it != j.end() && !it->is_null()) {
    if (!it->is_array()) {
      return refuse(Error("fetch_files", "Input should be a valid list", "list_type"));
    }
    if (it->size() > limits.max_files) {
      return refuse(
          Error("fetch_files", fmt::format("at most {} files", limits.max_files), "too_long"));
    }
    for (const json& name : *it) {
      if (!name.is_string()) {
        return refuse(Error("fetch_files", "Input should be a valid string", "string_type"));
      }
      Result<std::string> path = NormalizeRelativePath(name.get_ref<const std::string&>());
      if (!path.ok()) {
        return refuse(Error("fetch_files", std::string(path.status().message()), "value_error"));
      }
      req.fetch_files.emplace_back(name.get<std::string>(), std::move(*path));
    }
  }
  return req;
}

std::string RequestErrorJson(const RequestError& error) {
  json loc = json::array({"body"});
  if (!error.field.empty()) {
    loc.push_back(error.field);
  }
  json detail = {{"type", error.type}, {"loc", loc}, {"msg", error.message}};
  return json{{"detail", json::array({detail})}}.dump(-1, ' ', false,
                                                      json::error_handler_t::replace);
}

std::string_view ToString(CommandStatus status) {
  switch (status) {
    case CommandStatus::kFinished:
      return "Finished";
    case CommandStatus::kError:
      return "Error";
    case CommandStatus::kTimeLimitExceeded:
      return "TimeLimitExceeded";
  }
  return "Error";
}

std::string_view ToString(RunStatus status) {
  switch (status) {
    case RunStatus::kSuccess:
      return "Success";
    case RunStatus::kFailed:
      return "Failed";
    case RunStatus::kSandboxError:
      return "SandboxError";
  }
  return "SandboxError";
}

void SetRunStatus(RunCodeResponse* r) {
  std::vector<const CommandResult*> results;
  for (const auto* c : {&r->compile_result, &r->run_result}) {
    if (c->has_value()) {
      results.push_back(&**c);
    }
  }
  for (const CommandResult* c : results) {
    if (c->status == CommandStatus::kError) {
      r->status = RunStatus::kSandboxError;
      r->message = c->err;
      return;
    }
  }
  r->status = RunStatus::kSuccess;
  for (const CommandResult* c : results) {
    if (c->status == CommandStatus::kTimeLimitExceeded ||
        (c->return_code.has_value() && *c->return_code != 0)) {
      r->status = RunStatus::kFailed;
    }
  }
}

RunCodeResponse SandboxErrorResponse(std::string message) {
  RunCodeResponse r;
  r.status = RunStatus::kSandboxError;
  r.message = std::move(message);
  return r;
}

namespace {

json CommandJson(const std::optional<CommandResult>& c) {
  if (!c.has_value()) {
    return nullptr;
  }
  json j = {{"status", ToString(c->status)}, {"stdout", c->out}, {"stderr", c->err}};
  j["execution_time"] = c->execution_time.has_value() ? json(*c->execution_time) : json(nullptr);
  j["return_code"] = c->return_code.has_value() ? json(*c->return_code) : json(nullptr);
  return j;
}

}  // namespace

std::string ToJson(const RunCodeResponse& r) {
  json files = json::object();
  for (const auto& [name, bytes] : r.files) {
    files[name] = absl::Base64Escape(bytes);
  }
  json j = {{"status", ToString(r.status)},
            {"message", r.message},
            {"compile_result", CommandJson(r.compile_result)},
            {"run_result", CommandJson(r.run_result)},
            {"executor_pod_name", nullptr},
            {"files", files}};
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

}  // namespace bragg::fusion
