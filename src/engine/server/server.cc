#include "engine/server/server.h"

#include <absl/strings/escaping.h>
#include <arpa/inet.h>
#include <fmt/format.h>
#include <httplib.h>
#include <netinet/in.h>
#include <re2/re2.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

#include "common/http_server.h"
#include "common/prometheus.h"

namespace bragg::engine {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

// The one table of request fields (docs are generated from it). A field a scope does not list is
// refused with 400 "unknown field". Defaults and meanings are SGLang's (io_struct.py,
// sampling_params.py) unless the note says otherwise.
constexpr FieldSpec kFields[] = {
    // POST /generate (SGLang's GenerateReqInput)
    {"generate", "input_ids", FieldUse::kServed, "",
     "prompt token ids; a list of lists is a batch, answered as an array"},
    {"generate", "text", FieldUse::kServed, "",
     "prompt text (a list is a batch), with a tokenizer; without one refused"},
    {"generate", "sampling_params", FieldUse::kServed, "",
     "an object, or one per prompt of a batch"},
    {"generate", "rid", FieldUse::kServed, "",
     "request id (a list for a batch; a string for a batch names rid_0, rid_1, ...)"},
    {"generate", "return_logprob", FieldUse::kServed, "", "meta_info.output_token_logprobs"},
    {"generate", "logprob_start_len", FieldUse::kServed, "",
     "first prompt position of meta_info.input_token_logprobs; -1: none"},
    {"generate", "return_routed_experts", FieldUse::kServed, "",
     "meta_info.routed_experts: base64 of int32 [positions, moe layers, top_k], MoE models"},
    {"generate", "routed_experts_start_len", FieldUse::kServed, "",
     "routed experts of positions [this, tokens - 1)"},
    {"generate", "extra_key", FieldUse::kServed, "", "prefix-cache salt"},
    {"generate", "stream", FieldUse::kServed, "", "SSE: cumulative chunks, then data: [DONE]"},
    {"generate", "return_text_in_logprobs", FieldUse::kIgnored, "",
     "no tokenizer: the text slot of each logprob entry is null"},
    {"generate", "log_metrics", FieldUse::kIgnored, "", "every request counts in /metrics"},
    {"generate", "no_logs", FieldUse::kIgnored, "", "the server logs no request contents"},
    {"generate", "custom_labels", FieldUse::kIgnored, "", "metrics carry no per-request labels"},
    {"generate", "received_time", FieldUse::kIgnored, "", "latency is measured by the server"},
    {"generate", "top_logprobs_num", FieldUse::kDefaultOnly, "null|0", "top logprobs: not served"},
    {"generate", "token_ids_logprob", FieldUse::kDefaultOnly, "null", "not served"},
    {"generate", "return_hidden_states", FieldUse::kDefaultOnly, "false", "not served"},
    {"generate", "return_entropy", FieldUse::kDefaultOnly, "false", "not served"},
    {"generate", "return_prompt_token_ids", FieldUse::kDefaultOnly, "false", "not served"},
    {"generate", "input_embeds", FieldUse::kDefaultOnly, "null", "not served"},
    {"generate", "image_data", FieldUse::kDefaultOnly, "null", "text-only models"},
    {"generate", "video_data", FieldUse::kDefaultOnly, "null", "text-only models"},
    {"generate", "audio_data", FieldUse::kDefaultOnly, "null", "text-only models"},
    {"generate", "modalities", FieldUse::kDefaultOnly, "null", "text-only models"},
    {"generate", "lora_path", FieldUse::kDefaultOnly, "null", "no LoRA"},
    {"generate", "lora_id", FieldUse::kDefaultOnly, "null", "no LoRA"},
    {"generate", "custom_logit_processor", FieldUse::kDefaultOnly, "null", "not served"},
    {"generate", "session_params", FieldUse::kDefaultOnly, "null", "no sessions"},
    {"generate", "session_id", FieldUse::kDefaultOnly, "null", "no sessions"},
    {"generate", "priority", FieldUse::kDefaultOnly, "null", "one priority (FCFS)"},
    {"generate", "bootstrap_host", FieldUse::kDefaultOnly, "null", "no PD disaggregation"},
    {"generate", "bootstrap_port", FieldUse::kDefaultOnly, "null", "no PD disaggregation"},
    {"generate", "bootstrap_room", FieldUse::kDefaultOnly, "null", "no PD disaggregation"},
    {"generate", "bootstrap_pair_key", FieldUse::kDefaultOnly, "null", "no PD disaggregation"},
    {"generate", "data_parallel_rank", FieldUse::kDefaultOnly, "null", "one data-parallel rank"},
    {"generate", "routed_dp_rank", FieldUse::kDefaultOnly, "null", "one data-parallel rank"},
    {"generate", "background", FieldUse::kDefaultOnly, "false", "not served"},
    // sampling_params (SGLang's SamplingParams)
    {"sampling_params", "max_new_tokens", FieldUse::kServed, "", "default 128"},
    {"sampling_params", "temperature", FieldUse::kServed, "", ">= 0; 0 is greedy"},
    {"sampling_params", "top_p", FieldUse::kServed, "", "(0, 1]"},
    {"sampling_params", "top_k", FieldUse::kServed, "", "-1 (off) or >= 1"},
    {"sampling_params", "min_p", FieldUse::kServed, "", "[0, 1]"},
    {"sampling_params", "stop_token_ids", FieldUse::kServed, "", "token ids that end a request"},
    {"sampling_params", "sampling_seed", FieldUse::kServed, "",
     "same seed, prompt and weights: same tokens"},
    {"sampling_params", "ignore_eos", FieldUse::kServed, "", "keep going past EOS"},
    {"sampling_params", "stop", FieldUse::kServed, "",
     "a string or a list of strings that end the request (needs a tokenizer)"},
    {"sampling_params", "stop_regex", FieldUse::kServed, "",
     "a regular expression or a list of them (RE2 syntax) whose match in the output ends the "
     "request (needs a tokenizer)"},
    {"sampling_params", "n", FieldUse::kDefaultOnly, "1", "one sample per prompt; batch instead"},
    {"sampling_params", "frequency_penalty", FieldUse::kDefaultOnly, "0", "not served"},
    {"sampling_params", "presence_penalty", FieldUse::kDefaultOnly, "0", "not served"},
    {"sampling_params", "repetition_penalty", FieldUse::kDefaultOnly, "1", "not served"},
    {"sampling_params", "min_new_tokens", FieldUse::kDefaultOnly, "0", "not served"},
    {"sampling_params", "regex", FieldUse::kDefaultOnly, "null", "no constrained decoding"},
    {"sampling_params", "json_schema", FieldUse::kDefaultOnly, "null", "no constrained decoding"},
    {"sampling_params", "ebnf", FieldUse::kDefaultOnly, "null", "no constrained decoding"},
    {"sampling_params", "structural_tag", FieldUse::kDefaultOnly, "null",
     "no constrained decoding"},
    {"sampling_params", "logit_bias", FieldUse::kDefaultOnly, "null", "not served"},
    {"sampling_params", "custom_params", FieldUse::kDefaultOnly, "null", "not served"},
    {"sampling_params", "stream_interval", FieldUse::kDefaultOnly, "null|1",
     "every token is streamed"},
    {"sampling_params", "skip_special_tokens", FieldUse::kServed, "",
     "default true: special tokens are left out of the answer's text"},
    {"sampling_params", "spaces_between_special_tokens", FieldUse::kIgnored, "", "no detokenizer"},
    {"sampling_params", "no_stop_trim", FieldUse::kServed, "",
     "default false: the text ends before the stop string"},
    // POST /v1/completions (OpenAI, prompt as token ids)
    {"completions", "prompt", FieldUse::kServed, "",
     "token ids, or a string with a tokenizer (a list of strings is refused)"},
    {"completions", "model", FieldUse::kIgnored, "", "one model is served"},
    {"completions", "max_tokens", FieldUse::kServed, "", "default 16 (OpenAI's)"},
    {"completions", "temperature", FieldUse::kServed, "", "as sampling_params"},
    {"completions", "top_p", FieldUse::kServed, "", "as sampling_params"},
    {"completions", "top_k", FieldUse::kServed, "", "SGLang extension"},
    {"completions", "min_p", FieldUse::kServed, "", "SGLang extension"},
    {"completions", "seed", FieldUse::kServed, "", "sampling_seed"},
    {"completions", "stop_token_ids", FieldUse::kServed, "", "SGLang extension"},
    {"completions", "ignore_eos", FieldUse::kServed, "", "SGLang extension"},
    {"completions", "rid", FieldUse::kServed, "", "SGLang extension"},
    {"completions", "extra_key", FieldUse::kServed, "", "SGLang extension"},
    {"completions", "user", FieldUse::kIgnored, "", "not recorded"},
    {"completions", "stream", FieldUse::kDefaultOnly, "false",
     "streaming: use /generate with stream"},
    {"completions", "n", FieldUse::kDefaultOnly, "1", "one choice"},
    {"completions", "best_of", FieldUse::kDefaultOnly, "null|1", "one choice"},
    {"completions", "echo", FieldUse::kDefaultOnly, "false", "not served"},
    {"completions", "logprobs", FieldUse::kDefaultOnly, "null|0",
     "use /generate with return_logprob"},
    {"completions", "stop", FieldUse::kServed, "", "stop strings (needs a tokenizer)"},
    {"completions", "suffix", FieldUse::kDefaultOnly, "null", "not served"},
    {"completions", "frequency_penalty", FieldUse::kDefaultOnly, "0", "not served"},
    {"completions", "presence_penalty", FieldUse::kDefaultOnly, "0", "not served"},
    {"completions", "logit_bias", FieldUse::kDefaultOnly, "null", "not served"},
    // POST /v1/chat/completions (OpenAI; needs a tokenizer with ChatML's tokens)
    {"chat_completions", "messages", FieldUse::kServed, "",
     "role system|user|assistant|tool, content a string or text parts; rendered as ChatML"},
    {"chat_completions", "model", FieldUse::kIgnored, "", "one model is served"},
    {"chat_completions", "max_tokens", FieldUse::kServed, "", "default: up to the context"},
    {"chat_completions", "max_completion_tokens", FieldUse::kServed, "", "as max_tokens"},
    {"chat_completions", "temperature", FieldUse::kServed, "", "as sampling_params"},
    {"chat_completions", "top_p", FieldUse::kServed, "", "as sampling_params"},
    {"chat_completions", "top_k", FieldUse::kServed, "", "SGLang extension"},
    {"chat_completions", "min_p", FieldUse::kServed, "", "SGLang extension"},
    {"chat_completions", "seed", FieldUse::kServed, "", "sampling_seed"},
    {"chat_completions", "stop_token_ids", FieldUse::kServed, "",
     "SGLang extension; <|im_end|> always stops"},
    {"chat_completions", "ignore_eos", FieldUse::kServed, "", "SGLang extension"},
    {"chat_completions", "skip_special_tokens", FieldUse::kServed, "", "default true"},
    {"chat_completions", "rid", FieldUse::kServed, "", "SGLang extension"},
    {"chat_completions", "extra_key", FieldUse::kServed, "", "SGLang extension"},
    {"chat_completions", "user", FieldUse::kIgnored, "", "not recorded"},
    {"chat_completions", "stream", FieldUse::kDefaultOnly, "false",
     "streaming: use /generate with stream"},
    {"chat_completions", "n", FieldUse::kDefaultOnly, "1", "one choice"},
    {"chat_completions", "logprobs", FieldUse::kDefaultOnly, "null|false",
     "use /generate with return_logprob"},
    {"chat_completions", "top_logprobs", FieldUse::kDefaultOnly, "null|0", "not served"},
    {"chat_completions", "stop", FieldUse::kServed, "", "stop strings"},
    {"chat_completions", "tools", FieldUse::kDefaultOnly, "null|[]",
     "no tool-call parsing: put tools in the system message"},
    {"chat_completions", "tool_choice", FieldUse::kDefaultOnly, "null|\"none\"|\"auto\"",
     "no tool-call parsing"},
    {"chat_completions", "response_format", FieldUse::kDefaultOnly, "null",
     "no constrained decoding"},
    {"chat_completions", "frequency_penalty", FieldUse::kDefaultOnly, "0", "not served"},
    {"chat_completions", "presence_penalty", FieldUse::kDefaultOnly, "0", "not served"},
    {"chat_completions", "logit_bias", FieldUse::kDefaultOnly, "null", "not served"},
    // POST /tokenize and /detokenize (SGLang's TokenizeRequest, DetokenizeRequest)
    {"tokenize", "prompt", FieldUse::kServed, "", "a string or a list of strings"},
    {"tokenize", "add_special_tokens", FieldUse::kServed, "",
     "default true: the tokenizer's template (a BOS for some models)"},
    {"tokenize", "model", FieldUse::kIgnored, "", "one model is served"},
    {"detokenize", "tokens", FieldUse::kServed, "", "a list of ids, or a list of lists"},
    {"detokenize", "skip_special_tokens", FieldUse::kServed, "", "default false"},
    {"detokenize", "model", FieldUse::kIgnored, "", "one model is served"},
    // POST /update_weights_from_disk (UpdateWeightFromDiskReqInput)
    {"update_weights_from_disk", "model_path", FieldUse::kServed, "", "a Hugging Face directory"},
    {"update_weights_from_disk", "weight_version", FieldUse::kServed, "",
     "the version tokens sampled from now on carry"},
    {"update_weights_from_disk", "flush_cache", FieldUse::kServed, "", "default true"},
    {"update_weights_from_disk", "abort_all_requests", FieldUse::kServed, "",
     "abort every request before loading"},
    {"update_weights_from_disk", "keep_pause", FieldUse::kServed, "",
     "stay paused (in place) after loading"},
    {"update_weights_from_disk", "load_format", FieldUse::kDefaultOnly, "null|\"auto\"",
     "safetensors only"},
    {"update_weights_from_disk", "is_async", FieldUse::kDefaultOnly, "false", "loads in place"},
    {"update_weights_from_disk", "manifest", FieldUse::kDefaultOnly, "null", "not served"},
    {"update_weights_from_disk", "torch_empty_cache", FieldUse::kIgnored, "", "no-op"},
    {"update_weights_from_disk", "recapture_cuda_graph", FieldUse::kIgnored, "", "no CUDA graphs"},
    {"update_weights_from_disk", "token_step", FieldUse::kIgnored, "", "not recorded"},
    // POST /abort_request (AbortReq)
    {"abort_request", "rid", FieldUse::kServed, "", "404 if no request has it"},
    {"abort_request", "abort_all", FieldUse::kServed, "", "abort every request"},
    // POST /pause_generation (PauseGenerationReqInput)
    {"pause_generation", "mode", FieldUse::kServed, "", "abort (default) | in_place | retract"},
    // POST /continue_generation (ContinueGenerationReqInput)
    {"continue_generation", "torch_empty_cache", FieldUse::kIgnored, "", "no-op"},
};

const FieldSpec* FindField(std::string_view scope, std::string_view name) {
  for (const FieldSpec& f : kFields) {
    if (f.scope == scope && f.name == name) {
      return &f;
    }
  }
  return nullptr;
}

// Every key of `obj` is known in `scope`, and every kDefaultOnly field holds a no-op value.
Status CheckFields(std::string_view scope, const json& obj, std::string_view where) {
  for (const auto& [key, value] : obj.items()) {
    const FieldSpec* f = FindField(scope, key);
    if (f == nullptr) {
      return absl::InvalidArgumentError(
          fmt::format("unknown field '{}' in {}: bragg-engine does not take it", key, where));
    }
    if (f->use != FieldUse::kDefaultOnly) {
      continue;
    }
    bool ok = false;
    std::string_view rest = f->accepted;
    while (!ok && !rest.empty()) {
      size_t bar = rest.find('|');
      ok = json::parse(rest.substr(0, bar)) == value;
      rest = bar == std::string_view::npos ? std::string_view() : rest.substr(bar + 1);
    }
    if (!ok) {
      std::string accepted = std::string(f->accepted);
      std::replace(accepted.begin(), accepted.end(), '|', ' ');
      return absl::InvalidArgumentError(
          fmt::format("{}.{} is not supported by bragg-engine ({}); it may only be {}", where, key,
                      f->note, accepted));
    }
  }
  return absl::OkStatus();
}

// Strings from clients may hold invalid UTF-8 (nlohmann's parser lets it through); replace it
// rather than throw when writing.
std::string Dump(const json& value) {
  return value.dump(-1, ' ', false, json::error_handler_t::replace);
}

int HttpCode(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange:
    case absl::StatusCode::kAlreadyExists:
      return 400;
    case absl::StatusCode::kUnauthenticated:
      return 401;
    case absl::StatusCode::kPermissionDenied:
      return 403;
    case absl::StatusCode::kNotFound:
      return 404;
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kUnavailable:
      return 503;
    default:
      return 500;
  }
}

void SetError(httplib::Response& res, int code, std::string_view message) {
  json body = {{"error", {{"message", std::string(message)}, {"code", code}}}};
  res.status = code;
  res.set_content(Dump(body), "application/json");
}

void SetError(httplib::Response& res, const Status& status) {
  SetError(res, HttpCode(status.code()), std::string(status.message()));
}

void Reply(httplib::Response& res, const json& body, int code = 200) {
  res.status = code;
  res.set_content(Dump(body), "application/json");
}

// nlohmann's parser is iterative but its destructor and dump recurse on older releases: refuse
// deep nesting before parsing anything.
constexpr int kMaxDepth = 64;

Status CheckDepth(std::string_view text) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > kMaxDepth) {
        return absl::InvalidArgumentError(
            fmt::format("request body nests deeper than {} levels", kMaxDepth));
      }
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return absl::OkStatus();
}

// The body as a JSON object; an empty body is {} when `empty_ok`.
Result<json> ParseObject(const std::string& body, bool empty_ok) {
  if (body.empty() && empty_ok) {
    return json::object();
  }
  BRAGG_RETURN_IF_ERROR(CheckDepth(body));
  json out;
  try {
    out = json::parse(body);
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(fmt::format("request body is not valid JSON: {}", e.what()));
  }
  if (!out.is_object()) {
    return absl::InvalidArgumentError(
        fmt::format("request body must be a JSON object, not {}", out.type_name()));
  }
  return out;
}

bool Present(const json& obj, std::string_view name) {
  auto it = obj.find(name);
  return it != obj.end() && !it->is_null();
}

// Typed reads of optional fields: absent or null leaves *out as it is.
Status ReadInt(const json& obj, std::string_view where, std::string_view name, int64_t lo,
               int64_t hi, int64_t* out) {
  if (!Present(obj, name)) {
    return absl::OkStatus();
  }
  const json& v = obj[std::string(name)];
  bool in_range = false;
  if (v.is_number_unsigned()) {
    uint64_t u = v.get<uint64_t>();
    in_range = hi >= 0 && u <= static_cast<uint64_t>(hi) && static_cast<int64_t>(u) >= lo;
  } else if (v.is_number_integer()) {
    in_range = v.get<int64_t>() >= lo && v.get<int64_t>() <= hi;
  }
  if (!in_range) {
    return absl::InvalidArgumentError(fmt::format("{}{} must be an integer in [{}, {}], got {}",
                                                  where, name, lo, hi, Dump(v).substr(0, 64)));
  }
  *out = v.get<int64_t>();
  return absl::OkStatus();
}

Status ReadFloat(const json& obj, std::string_view where, std::string_view name, double lo,
                 double hi, bool lo_open, float* out) {
  if (!Present(obj, name)) {
    return absl::OkStatus();
  }
  const json& v = obj[std::string(name)];
  double d = v.is_number() ? v.get<double>() : std::nan("");
  if (!std::isfinite(d) || d < lo || d > hi || (lo_open && d == lo)) {
    return absl::InvalidArgumentError(fmt::format("{}{} must be a number in {}{}, {}], got {}",
                                                  where, name, lo_open ? "(" : "[", lo, hi,
                                                  Dump(v).substr(0, 64)));
  }
  *out = static_cast<float>(d);
  return absl::OkStatus();
}

Status ReadBool(const json& obj, std::string_view where, std::string_view name, bool* out) {
  if (!Present(obj, name)) {
    return absl::OkStatus();
  }
  const json& v = obj[std::string(name)];
  if (!v.is_boolean()) {
    return absl::InvalidArgumentError(
        fmt::format("{}{} must be true or false, got {}", where, name, Dump(v).substr(0, 64)));
  }
  *out = v.get<bool>();
  return absl::OkStatus();
}

Status ReadString(const json& obj, std::string_view where, std::string_view name,
                  std::string* out) {
  if (!Present(obj, name)) {
    return absl::OkStatus();
  }
  const json& v = obj[std::string(name)];
  if (!v.is_string()) {
    return absl::InvalidArgumentError(
        fmt::format("{}{} must be a string, got {}", where, name, Dump(v).substr(0, 64)));
  }
  *out = v.get<std::string>();
  return absl::OkStatus();
}

Status ReadIds(const json& v, std::string_view what, std::vector<int32_t>* out) {
  if (!v.is_array()) {
    return absl::InvalidArgumentError(
        fmt::format("{} must be a list of token ids, got {}", what, v.type_name()));
  }
  out->clear();
  out->reserve(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    const json& t = v[i];
    if (!t.is_number_integer() || (t.is_number_unsigned() && t.get<uint64_t>() > INT32_MAX) ||
        (!t.is_number_unsigned() && (t.get<int64_t>() < 0 || t.get<int64_t>() > INT32_MAX))) {
      return absl::InvalidArgumentError(
          fmt::format("{}[{}] must be a token id (an integer in [0, 2^31)), got {}", what, i,
                      Dump(t).substr(0, 64)));
    }
    out->push_back(static_cast<int32_t>(t.get<int64_t>()));
  }
  return absl::OkStatus();
}

Status ReadSampling(const json& sp, SamplingParams* s) {
  if (sp.is_null()) {
    return absl::OkStatus();
  }
  if (!sp.is_object()) {
    return absl::InvalidArgumentError(
        fmt::format("sampling_params must be an object, got {}", sp.type_name()));
  }
  BRAGG_RETURN_IF_ERROR(CheckFields("sampling_params", sp, "sampling_params"));
  constexpr std::string_view w = "sampling_params.";
  BRAGG_RETURN_IF_ERROR(ReadInt(sp, w, "max_new_tokens", 0, INT32_MAX, &s->max_new_tokens));
  BRAGG_RETURN_IF_ERROR(ReadFloat(sp, w, "temperature", 0, 1e6, false, &s->temperature));
  BRAGG_RETURN_IF_ERROR(ReadFloat(sp, w, "top_p", 0, 1, true, &s->top_p));
  BRAGG_RETURN_IF_ERROR(ReadInt(sp, w, "top_k", -1, INT32_MAX, &s->top_k));
  if (s->top_k == 0) {
    return absl::InvalidArgumentError("sampling_params.top_k must be -1 (off) or at least 1");
  }
  BRAGG_RETURN_IF_ERROR(ReadFloat(sp, w, "min_p", 0, 1, false, &s->min_p));
  if (Present(sp, "stop_token_ids")) {
    BRAGG_RETURN_IF_ERROR(
        ReadIds(sp["stop_token_ids"], "sampling_params.stop_token_ids", &s->stop_token_ids));
  }
  if (Present(sp, "sampling_seed")) {
    const json& v = sp["sampling_seed"];
    if (!v.is_number_integer() || (!v.is_number_unsigned() && v.get<int64_t>() < 0)) {
      return absl::InvalidArgumentError(
          fmt::format("sampling_params.sampling_seed must be a non-negative 64-bit integer, got {}",
                      Dump(v).substr(0, 64)));
    }
    s->sampling_seed = v.get<uint64_t>();
  }
  BRAGG_RETURN_IF_ERROR(ReadBool(sp, w, "ignore_eos", &s->ignore_eos));
  return absl::OkStatus();
}

// One prompt of a /generate call as parsed.
struct Item {
  GenerateRequest request;
  std::vector<int32_t> input_ids;   // kept for input_token_logprobs (the request's are moved)
  bool skip_special_tokens = true;  // for the answer's text
  std::vector<std::string> stop;    // stop strings
  bool no_stop_trim = false;        // keep the matched stop string in the text
};

// Where the text ends for the answer: before the first stop string in it (none: npos).
size_t StopCut(std::string_view text, const std::vector<std::string>& stop) {
  size_t cut = std::string_view::npos;
  for (const std::string& s : stop) {
    cut = std::min(cut, text.find(s));
  }
  return cut;
}

// The answer's text for `out`; empty without a tokenizer. A stream's chunk (not finished) holds
// back the bytes of a character the next token has yet to complete, and an end of the text that
// may be the start of a stop string; a finished answer that a stop string ended stops before it
// (unless no_stop_trim).
std::string OutputText(const Tokenizer* tokenizer, const GenerateOutput& out, const Item& item) {
  if (tokenizer == nullptr) {
    return "";
  }
  if (out.finished()) {
    std::string text = tokenizer->Decode(out.output_ids, item.skip_special_tokens);
    if (out.matched_stop_string && !item.no_stop_trim) {
      text.resize(std::min(text.size(), StopCut(text, item.stop)));
    }
    return text;
  }
  std::string raw = tokenizer->DecodeBytes(out.output_ids, item.skip_special_tokens);
  raw.resize(raw.size() - IncompleteUtf8Tail(raw));
  size_t held = 0;
  for (const std::string& s : item.stop) {
    for (size_t k = std::min(s.size() - 1, raw.size()); k > held; --k) {
      if (raw.compare(raw.size() - k, k, s, 0, k) == 0) {
        held = k;
        break;
      }
    }
  }
  raw.resize(raw.size() - held);
  raw.resize(raw.size() - IncompleteUtf8Tail(raw));
  return Utf8Lossy(raw);
}

constexpr size_t kMaxStopStrings = 32;
constexpr size_t kMaxStopBytes = 1024;

// `value` as SGLang reads `stop` and `stop_regex`: a string or a list of them; null, "" and []
// are none. Each string is UTF-8 and at most kMaxStopBytes.
Status ReadStringList(const json& value, std::string_view where, std::vector<std::string>* out) {
  auto add = [&](const json& v) -> Status {
    if (!v.is_string()) {
      return absl::InvalidArgumentError(
          fmt::format("{} must be a string or a list of strings, got {}", where, v.type_name()));
    }
    const std::string& s = v.get_ref<const std::string&>();
    if (s.size() > kMaxStopBytes || Utf8Lossy(s) != s) {
      return absl::InvalidArgumentError(fmt::format(
          "{} holds a string that is not UTF-8 or longer than {} bytes", where, kMaxStopBytes));
    }
    if (!s.empty()) {
      out->push_back(s);
    }
    return absl::OkStatus();
  };
  if (value.is_array()) {
    if (value.size() > kMaxStopStrings) {
      return absl::InvalidArgumentError(
          fmt::format("{} has {} strings, more than {}", where, value.size(), kMaxStopStrings));
    }
    for (const json& v : value) {
      BRAGG_RETURN_IF_ERROR(add(v));
    }
  } else if (!value.is_null()) {
    BRAGG_RETURN_IF_ERROR(add(value));
  }
  return absl::OkStatus();
}

Status NeedTokenizer(const Tokenizer* tokenizer, std::string_view where, std::string_view what) {
  if (tokenizer != nullptr) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(fmt::format(
      "{}: {} need a tokenizer (this engine has none: use stop_token_ids)", where, what));
}

// `value` as stop strings (SGLang's `stop`) into `item`. Refused without a tokenizer.
Status ReadStop(const json& value, std::string_view where, const Tokenizer* tokenizer, Item* item) {
  std::vector<std::string> stop;
  BRAGG_RETURN_IF_ERROR(ReadStringList(value, where, &stop));
  if (!stop.empty()) {
    BRAGG_RETURN_IF_ERROR(NeedTokenizer(tokenizer, where, "stop strings"));
  }
  item->stop = std::move(stop);
  return absl::OkStatus();
}

using StopRegexes = std::vector<std::shared_ptr<const RE2>>;

// `value` as stop regexes (SGLang's `stop_regex`), compiled into `out`. RE2's syntax, which is
// Python's `re` without backreferences and lookaround, and matches in time linear in the text
// whatever the pattern (a request's pattern runs on the engine's thread). Refused without a
// tokenizer, or a pattern RE2 cannot compile within its memory budget.
Status ReadStopRegex(const json& value, std::string_view where, const Tokenizer* tokenizer,
                     StopRegexes* out) {
  std::vector<std::string> patterns;
  BRAGG_RETURN_IF_ERROR(ReadStringList(value, where, &patterns));
  if (patterns.empty()) {
    return absl::OkStatus();
  }
  BRAGG_RETURN_IF_ERROR(NeedTokenizer(tokenizer, where, "stop regexes"));
  RE2::Options options;
  options.set_log_errors(false);
  options.set_max_mem(int64_t{8} << 20);
  for (const std::string& p : patterns) {
    auto re = std::make_shared<const RE2>(p, options);
    if (!re->ok()) {
      return absl::InvalidArgumentError(fmt::format(
          "{}: {} is not a regular expression RE2 takes: {}", where, json(p).dump(), re->error()));
    }
    out->push_back(std::move(re));
  }
  return absl::OkStatus();
}

// The engine's check for `item`'s stop strings and `regexes`, once both are read (none: no
// check).
// A stop string counts where the last token completes it: the check decodes the last token and
// enough of the tokens before it to hold the longest (byte-level tokens decode one by one). A
// regex counts where a match first appears anywhere in the output: the check keeps the output's
// bytes decoded so far and searches them whole after each token, as SGLang searches its tail.
// The first stop string wins over a regex; among regexes, the first listed.
void SetStopCheck(const Tokenizer* tokenizer, StopRegexes regexes, Item* item) {
  if (item->stop.empty() && regexes.empty()) {
    return;
  }
  size_t longest = 0;
  for (const std::string& s : item->stop) {
    longest = std::max(longest, s.size());
  }
  struct Decoded {
    std::string bytes;
    size_t ids = 0;
  };
  bool skip = item->skip_special_tokens;
  item->request.stop_check = [tokenizer, stop = item->stop, regexes = std::move(regexes), longest,
                              skip, decoded = std::make_shared<Decoded>()](
                                 std::span<const int32_t> ids) -> std::optional<std::string> {
    if (ids.empty()) {
      return std::nullopt;
    }
    std::string tail = tokenizer->DecodeBytes(ids.last(1), skip);
    size_t fresh = tail.size();
    if (fresh == 0) {
      return std::nullopt;
    }
    if (!stop.empty()) {
      for (size_t k = 2; k <= ids.size() && tail.size() < fresh + longest - 1; ++k) {
        tail.insert(0, tokenizer->DecodeBytes(ids.subspan(ids.size() - k, 1), skip));
      }
      std::optional<std::string> best;
      size_t best_at = std::string::npos;
      for (const std::string& s : stop) {
        size_t from = tail.size() - fresh + 1 > s.size() ? tail.size() - fresh + 1 - s.size() : 0;
        size_t at = tail.find(s, from);
        if (at != std::string::npos && at < best_at) {
          best_at = at;
          best = s;
        }
      }
      if (best) {
        return best;
      }
    }
    if (regexes.empty()) {
      return std::nullopt;
    }
    if (decoded->ids > ids.size()) {  // not the output this check has followed: start over
      *decoded = Decoded{};
    }
    decoded->bytes += tokenizer->DecodeBytes(ids.subspan(decoded->ids), skip);
    decoded->ids = ids.size();
    for (const auto& re : regexes) {
      if (RE2::PartialMatch(decoded->bytes, *re)) {
        return re->pattern();
      }
    }
    return std::nullopt;
  };
}

// Tokenizes one prompt text for `where` (a field name in errors). A text too long to fit in
// `max_tokens` whatever its tokens is refused before it is encoded (a regex's work on a long text
// is the costly part).
Status EncodePrompt(const Tokenizer& tokenizer, const json& text, std::string_view where,
                    int64_t max_tokens, std::vector<int32_t>* out, bool add_special_tokens = true) {
  if (!text.is_string()) {
    return absl::InvalidArgumentError(
        fmt::format("{} must be a string, got {}", where, text.type_name()));
  }
  const std::string& s = text.get_ref<const std::string&>();
  if (max_tokens > 0 && s.size() / tokenizer.max_token_bytes() > static_cast<size_t>(max_tokens)) {
    return absl::InvalidArgumentError(
        fmt::format("{} has {} bytes, more than {} tokens (the context length) can be", where,
                    s.size(), max_tokens));
  }
  Result<std::vector<int32_t>> ids = tokenizer.Encode(s, add_special_tokens);
  if (!ids.ok()) {
    return absl::InvalidArgumentError(
        fmt::format("{}: {}", where, std::string(ids.status().message())));
  }
  *out = *std::move(ids);
  return absl::OkStatus();
}

struct GenerateCall {
  std::vector<Item> items;
  bool batch = false;
  bool stream = false;
};

// SGLang lets these be one value per prompt of a batch.
const json& PerItem(const json& body, std::string_view name, bool batch, size_t i, size_t n,
                    Status* error) {
  static const json kNull;
  auto it = body.find(name);
  if (it == body.end()) {
    return kNull;
  }
  if (batch && it->is_array() && name != "input_ids") {
    if (it->size() != n) {
      *error = absl::InvalidArgumentError(
          fmt::format("{} has {} entries for a batch of {} prompts", name, it->size(), n));
      return kNull;
    }
    return (*it)[i];
  }
  return *it;
}

Result<GenerateCall> ParseGenerate(const json& body, size_t max_batch, const Tokenizer* tokenizer,
                                   int64_t context_length) {
  json encoded;
  bool text = Present(body, "text");
  if (text && tokenizer == nullptr) {
    return absl::InvalidArgumentError(
        "text is refused: this engine takes input_ids (no tokenizer: its model directory has no "
        "tokenizer.json, or it runs with --skip-tokenizer-init)");
  }
  BRAGG_RETURN_IF_ERROR(CheckFields("generate", body, "the request"));
  if (text) {
    if (Present(body, "input_ids")) {
      return absl::InvalidArgumentError("send text or input_ids, not both");
    }
    const json& t = body["text"];
    if (t.is_array()) {
      if (t.empty()) {
        return absl::InvalidArgumentError("text is an empty batch");
      }
      if (t.size() > max_batch) {
        return absl::InvalidArgumentError(fmt::format(
            "a batch of {} prompts is more than this server takes ({})", t.size(), max_batch));
      }
      encoded = json::array();
      for (size_t i = 0; i < t.size(); ++i) {
        std::vector<int32_t> ids;
        BRAGG_RETURN_IF_ERROR(
            EncodePrompt(*tokenizer, t[i], fmt::format("text[{}]", i), context_length, &ids));
        encoded.push_back(std::move(ids));
      }
    } else {
      std::vector<int32_t> ids;
      BRAGG_RETURN_IF_ERROR(EncodePrompt(*tokenizer, t, "text", context_length, &ids));
      encoded = std::move(ids);
    }
  } else if (!Present(body, "input_ids")) {
    return absl::InvalidArgumentError("input_ids is required (a list of token ids)");
  }
  const json& ids = text ? encoded : body["input_ids"];
  if (!ids.is_array()) {
    return absl::InvalidArgumentError(
        fmt::format("input_ids must be a list of token ids, got {}", ids.type_name()));
  }
  GenerateCall call;
  call.batch = !ids.empty() && ids[0].is_array();
  size_t n = call.batch ? ids.size() : 1;
  if (n > max_batch) {
    return absl::InvalidArgumentError(
        fmt::format("a batch of {} prompts is more than this server takes ({})", n, max_batch));
  }
  BRAGG_RETURN_IF_ERROR(ReadBool(body, "", "stream", &call.stream));
  if (call.stream && call.batch) {
    return absl::InvalidArgumentError(
        "stream is served for one prompt at a time; send the batch's prompts as separate "
        "requests");
  }
  std::string rid_prefix;
  if (call.batch && Present(body, "rid") && !body["rid"].is_array()) {
    BRAGG_RETURN_IF_ERROR(ReadString(body, "", "rid", &rid_prefix));
  }
  call.items.resize(n);
  for (size_t i = 0; i < n; ++i) {
    Item& item = call.items[i];
    GenerateRequest& r = item.request;
    std::string where =
        fmt::format("{}{}", text ? "text" : "input_ids", call.batch ? fmt::format("[{}]", i) : "");
    BRAGG_RETURN_IF_ERROR(ReadIds(call.batch ? ids[i] : ids, where, &r.input_ids));
    if (r.input_ids.empty()) {
      return absl::InvalidArgumentError(fmt::format("{} is empty", where));
    }
    Status error;
    auto one = [&](std::string_view name) -> json {
      const json& v = PerItem(body, name, call.batch, i, n, &error);
      return json{{std::string(name), v}};
    };
    json sp = one("sampling_params");
    BRAGG_RETURN_IF_ERROR(error);
    BRAGG_RETURN_IF_ERROR(ReadSampling(sp["sampling_params"], &r.sampling));
    std::string prefix = call.batch ? fmt::format("[{}] ", i) : "";
    if (sp["sampling_params"].is_object()) {
      const json& params = sp["sampling_params"];
      BRAGG_RETURN_IF_ERROR(ReadBool(params, prefix + "sampling_params.", "skip_special_tokens",
                                     &item.skip_special_tokens));
      BRAGG_RETURN_IF_ERROR(
          ReadBool(params, prefix + "sampling_params.", "no_stop_trim", &item.no_stop_trim));
      if (params.contains("stop")) {
        BRAGG_RETURN_IF_ERROR(
            ReadStop(params["stop"], prefix + "sampling_params.stop", tokenizer, &item));
      }
      StopRegexes regexes;
      if (params.contains("stop_regex")) {
        BRAGG_RETURN_IF_ERROR(ReadStopRegex(
            params["stop_regex"], prefix + "sampling_params.stop_regex", tokenizer, &regexes));
      }
      SetStopCheck(tokenizer, std::move(regexes), &item);
    }
    if (!rid_prefix.empty()) {
      r.rid = fmt::format("{}_{}", rid_prefix, i);
    } else {
      json v = one("rid");
      BRAGG_RETURN_IF_ERROR(error);
      BRAGG_RETURN_IF_ERROR(ReadString(v, prefix, "rid", &r.rid));
    }
    for (auto [name, field] : {std::pair{"return_logprob", &r.return_logprob},
                               std::pair{"return_routed_experts", &r.return_routed_experts}}) {
      json v = one(name);
      BRAGG_RETURN_IF_ERROR(error);
      BRAGG_RETURN_IF_ERROR(ReadBool(v, prefix, name, field));
    }
    json v = one("logprob_start_len");
    BRAGG_RETURN_IF_ERROR(error);
    BRAGG_RETURN_IF_ERROR(
        ReadInt(v, prefix, "logprob_start_len", -1, INT32_MAX, &r.logprob_start_len));
    if (r.logprob_start_len >= static_cast<int64_t>(r.input_ids.size())) {
      return absl::InvalidArgumentError(
          fmt::format("{}logprob_start_len {} is not inside the prompt of {} tokens", prefix,
                      r.logprob_start_len, r.input_ids.size()));
    }
    if (!r.return_logprob) {
      r.logprob_start_len = -1;  // as SGLang: no logprobs asked, none computed
    }
    v = one("routed_experts_start_len");
    BRAGG_RETURN_IF_ERROR(error);
    BRAGG_RETURN_IF_ERROR(
        ReadInt(v, prefix, "routed_experts_start_len", 0, INT32_MAX, &r.routed_experts_start_len));
    if (r.routed_experts_start_len > static_cast<int64_t>(r.input_ids.size())) {
      return absl::InvalidArgumentError(
          fmt::format("{}routed_experts_start_len {} is past the prompt of {} tokens", prefix,
                      r.routed_experts_start_len, r.input_ids.size()));
    }
    v = one("extra_key");
    BRAGG_RETURN_IF_ERROR(error);
    BRAGG_RETURN_IF_ERROR(ReadString(v, prefix, "extra_key", &r.extra_key));
    item.input_ids = r.input_ids;
  }
  return call;
}

json LogprobEntry(float logprob, int32_t token) {
  json lp = std::isfinite(logprob) ? json(logprob) : json(nullptr);
  return json::array({lp, token, nullptr});
}

json FinishName(FinishReason reason) {
  std::string_view name = FinishReasonName(reason);
  return name.empty() ? json(nullptr) : json(std::string(name));
}

json FinishJson(const GenerateOutput& out) {
  switch (out.finish) {
    case FinishReason::kNone:
      return nullptr;
    case FinishReason::kStop: {
      json f = {{"type", "stop"}};
      if (out.matched_stop_string) {
        f["matched"] = *out.matched_stop_string;
      } else if (out.matched_stop) {
        f["matched"] = *out.matched_stop;
      }
      return f;
    }
    case FinishReason::kLength:
      return {{"type", "length"}, {"length", out.output_ids.size()}};
    case FinishReason::kAbort:
      return {{"type", "abort"}, {"message", out.finish_message}};
  }
  return nullptr;
}

std::string Base64Int32(const std::vector<int32_t>& values) {
  static_assert(std::endian::native == std::endian::little, "routed_experts is little-endian");
  std::string bytes(values.size() * sizeof(int32_t), '\0');
  if (!values.empty()) {
    std::memcpy(bytes.data(), values.data(), bytes.size());
  }
  return absl::Base64Escape(bytes);
}

// SGLang's /generate answer for one prompt.
json OutputJson(const GenerateOutput& out, const Item& item, bool moe, Clock::time_point start,
                const Tokenizer* tokenizer) {
  const GenerateRequest& r = item.request;
  json spans = json::array();
  for (const VersionSpan& s : out.weight_versions) {
    spans.push_back({{"version", s.version}, {"start", s.start}, {"end", s.end}});
  }
  json meta = {
      {"id", out.rid},
      {"finish_reason", FinishJson(out)},
      {"prompt_tokens", out.prompt_tokens},
      {"completion_tokens", out.output_ids.size()},
      {"cached_tokens", out.cached_tokens},
      {"weight_version", out.weight_version},
      {"weight_versions", spans},
      {"e2e_latency", std::chrono::duration<double>(Clock::now() - start).count()},
  };
  if (r.return_logprob) {
    json outs = json::array();
    for (size_t i = 0; i < out.output_ids.size() && i < out.output_logprobs.size(); ++i) {
      outs.push_back(LogprobEntry(out.output_logprobs[i], out.output_ids[i]));
    }
    meta["output_token_logprobs"] = std::move(outs);
    json ins = json::array();
    if (r.logprob_start_len >= 0) {
      size_t start = static_cast<size_t>(r.logprob_start_len);
      for (size_t i = 0; i < out.input_logprobs.size() && start + i < item.input_ids.size(); ++i) {
        // SGLang gives the first prompt token no logprob (nothing predicts it).
        float lp = start + i == 0 ? std::nanf("") : out.input_logprobs[i];
        ins.push_back(LogprobEntry(lp, item.input_ids[start + i]));
      }
    }
    meta["input_token_logprobs"] = std::move(ins);
  }
  if (r.return_routed_experts && moe && out.finished()) {
    meta["routed_experts"] = Base64Int32(out.routed_experts);
  }
  std::string text = OutputText(tokenizer, out, item);
  return {
      {"text", std::move(text)}, {"output_ids", out.output_ids}, {"meta_info", std::move(meta)}};
}

// The streams of one HTTP request; cancels those unfinished when the exchange ends early.
struct Exchange {
  std::vector<Item> items;
  std::vector<std::shared_ptr<RequestStream>> streams;
  std::vector<bool> finished;
  Clock::time_point start;
  void CancelUnfinished() {
    for (size_t i = 0; i < streams.size(); ++i) {
      if (!finished[i]) {
        streams[i]->Cancel();
        finished[i] = true;
      }
    }
  }
};

}  // namespace

std::span<const FieldSpec> RequestFields() { return kFields; }

struct Server::Impl {
  Impl(Engine& e, ServerOptions o) : engine(e), options(std::move(o)) {}

  void Register();
  void HandleGenerate(const httplib::Request& req, httplib::Response& res);
  // /v1/completions, or /v1/chat/completions when `chat`.
  void HandleCompletions(const httplib::Request& req, httplib::Response& res, bool chat);
  // /tokenize, or /detokenize.
  void HandleTokenize(const httplib::Request& req, httplib::Response& res, bool detokenize);
  // Submits every item; on a failure cancels those already submitted.
  Result<std::shared_ptr<Exchange>> Submit(std::vector<Item> items);
  // Waits for the exchange's requests to finish, probing the client every heartbeat with
  // `probe` (false: it went away, and the unfinished requests are cancelled). Returns false
  // then, or when the server stops.
  bool WaitAll(Exchange& ex, std::vector<GenerateOutput>* outs, const std::function<bool()>& probe);
  std::string MetricsText();
  json ServerInfo();

  Engine& engine;
  ServerOptions options;
  httplib::Server http;
  std::thread thread;
  int port = 0;
  bool started = false;
  std::atomic<bool> stopping{false};
};

Result<std::shared_ptr<Exchange>> Server::Impl::Submit(std::vector<Item> items) {
  auto ex = std::make_shared<Exchange>();
  ex->start = Clock::now();
  ex->items = std::move(items);
  for (Item& item : ex->items) {
    Result<std::shared_ptr<RequestStream>> s = engine.Submit(item.request);
    if (!s.ok()) {
      ex->CancelUnfinished();
      return s.status();
    }
    ex->streams.push_back(*std::move(s));
    ex->finished.push_back(false);
  }
  return ex;
}

bool Server::Impl::WaitAll(Exchange& ex, std::vector<GenerateOutput>* outs,
                           const std::function<bool()>& probe) {
  Clock::time_point last_probe = Clock::now();
  for (size_t i = 0; i < ex.streams.size(); ++i) {
    size_t seen = 0;
    for (;;) {
      if (stopping.load()) {
        ex.CancelUnfinished();
        return false;
      }
      GenerateOutput out = ex.streams[i]->Wait(seen, options.heartbeat);
      if (out.finished()) {
        ex.finished[i] = true;
        outs->push_back(std::move(out));
        break;
      }
      seen = out.output_ids.size();
      if (Clock::now() - last_probe >= options.heartbeat) {
        last_probe = Clock::now();
        if (!probe()) {
          ex.CancelUnfinished();
          return false;
        }
      }
    }
  }
  return true;
}

void Server::Impl::HandleGenerate(const httplib::Request& req, httplib::Response& res) {
  Result<json> body = ParseObject(req.body, false);
  if (!body.ok()) {
    SetError(res, body.status());
    return;
  }
  Result<GenerateCall> call = ParseGenerate(*body, options.max_batch, options.tokenizer,
                                            engine.model_info().context_length);
  if (!call.ok()) {
    SetError(res, call.status());
    return;
  }
  bool moe = engine.model_info().num_experts > 0;
  bool batch = call->batch;
  bool stream = call->stream;
  Result<std::shared_ptr<Exchange>> submitted = Submit(std::move(call->items));
  if (!submitted.ok()) {
    SetError(res, submitted.status());
    return;
  }
  std::shared_ptr<Exchange> ex = *std::move(submitted);
  // Whatever ends the exchange (a client gone before the first byte included) cancels what is
  // still running; the releaser runs when httplib drops the response.
  auto release = [ex](bool) { ex->CancelUnfinished(); };
  if (!stream) {
    res.set_chunked_content_provider(
        "application/json",
        [this, ex, batch, moe](size_t, httplib::DataSink& sink) {
          std::vector<GenerateOutput> outs;
          // Leading whitespace is valid JSON: a byte that finds the client gone fails.
          if (!WaitAll(*ex, &outs, [&sink] { return sink.write(" ", 1); })) {
            return false;
          }
          json answer = json::array();
          for (size_t i = 0; i < outs.size(); ++i) {
            answer.push_back(OutputJson(outs[i], ex->items[i], moe, ex->start, options.tokenizer));
          }
          std::string text = batch ? Dump(answer) : Dump(answer[0]);
          if (!sink.write(text.data(), text.size())) {
            return false;
          }
          sink.done();
          return true;
        },
        release);
    return;
  }
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, ex, moe](size_t, httplib::DataSink& sink) {
        RequestStream& s = *ex->streams[0];
        size_t seen = 0;
        Clock::time_point last_write = Clock::now();
        auto send = [&](const std::string& text) {
          last_write = Clock::now();
          if (sink.write(text.data(), text.size())) {
            return true;
          }
          ex->CancelUnfinished();
          return false;
        };
        for (;;) {
          if (stopping.load()) {
            ex->CancelUnfinished();
            return false;
          }
          GenerateOutput out = s.Wait(seen, options.heartbeat);
          if (out.finished()) {
            ex->finished[0] = true;
            if (!send("data: " +
                      Dump(OutputJson(out, ex->items[0], moe, ex->start, options.tokenizer)) +
                      "\n\ndata: [DONE]\n\n")) {
              return false;
            }
            sink.done();
            return true;
          }
          if (out.output_ids.size() > seen) {
            seen = out.output_ids.size();
            if (!send("data: " +
                      Dump(OutputJson(out, ex->items[0], moe, ex->start, options.tokenizer)) +
                      "\n\n")) {
              return false;
            }
          } else if (Clock::now() - last_write >= options.heartbeat) {
            // An SSE comment: clients skip it; a client gone makes the write fail.
            if (!send(": keep-alive\n\n")) {
              return false;
            }
          }
        }
      },
      release);
}

// OpenAI's sampling fields of a completions or chat request, as sampling_params.
Status ReadOpenAiSampling(const json& body, int64_t default_max_tokens, SamplingParams* out) {
  json sp = json::object();
  for (const char* name :
       {"temperature", "top_p", "top_k", "min_p", "stop_token_ids", "ignore_eos"}) {
    if (body.contains(name)) {
      sp[name] = body[name];
    }
  }
  sp["max_new_tokens"] = default_max_tokens;
  for (const char* name : {"max_completion_tokens", "max_tokens"}) {
    if (body.contains(name) && !body[name].is_null()) {
      sp["max_new_tokens"] = body[name];
    }
  }
  if (body.contains("seed")) {
    sp["sampling_seed"] = body["seed"];
  }
  return ReadSampling(sp, out);
}

// ChatML, the format of Qwen's chat templates for plain messages: each message is
// "<|im_start|>ROLE\nCONTENT<|im_end|>\n", then "<|im_start|>assistant\n" for the answer.
Result<std::string> RenderChatMl(const json& messages) {
  if (!messages.is_array() || messages.empty()) {
    return absl::InvalidArgumentError("messages must be a non-empty list");
  }
  std::string out;
  for (size_t i = 0; i < messages.size(); ++i) {
    const json& m = messages[i];
    std::string where = fmt::format("messages[{}]", i);
    if (!m.is_object()) {
      return absl::InvalidArgumentError(fmt::format("{} must be an object", where));
    }
    for (const auto& [key, value] : m.items()) {
      if (key != "role" && key != "content" && key != "name" && key != "tool_call_id") {
        return absl::InvalidArgumentError(
            fmt::format("{} has field {}, which is not served (role, content, name, "
                        "tool_call_id)",
                        where, key));
      }
    }
    std::string role;
    BRAGG_RETURN_IF_ERROR(ReadString(m, where + ".", "role", &role));
    if (role != "system" && role != "user" && role != "assistant" && role != "tool" &&
        role != "developer") {
      return absl::InvalidArgumentError(
          fmt::format("{}.role is {}: one of system, developer, user, assistant, tool", where,
                      Dump(m.value("role", json())).substr(0, 64)));
    }
    std::string content;
    const json& c = m.value("content", json());
    if (c.is_string()) {
      content = c.get<std::string>();
    } else if (c.is_array()) {
      for (size_t j = 0; j < c.size(); ++j) {
        const json& part = c[j];
        if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") ||
            !part["text"].is_string()) {
          return absl::InvalidArgumentError(fmt::format(
              "{}.content[{}] must be {{\"type\": \"text\", \"text\": ...}} (text-only model)",
              where, j));
        }
        content += part["text"].get<std::string>();
      }
    } else if (!c.is_null()) {
      return absl::InvalidArgumentError(
          fmt::format("{}.content must be a string or a list of text parts", where));
    }
    out += fmt::format("<|im_start|>{}\n{}<|im_end|>\n", role, content);
  }
  out += "<|im_start|>assistant\n";
  return out;
}

void Server::Impl::HandleCompletions(const httplib::Request& req, httplib::Response& res,
                                     bool chat) {
  Result<json> parsed = ParseObject(req.body, false);
  if (!parsed.ok()) {
    SetError(res, parsed.status());
    return;
  }
  const json& body = *parsed;
  const Tokenizer* tokenizer = options.tokenizer;
  if (tokenizer == nullptr && (chat || (Present(body, "prompt") && body["prompt"].is_string()))) {
    SetError(res, 400,
             chat ? "this engine has no tokenizer (its model directory has no tokenizer.json, or "
                    "it runs with --skip-tokenizer-init): use /generate with input_ids"
                  : "this engine has no tokenizer: send prompt as a list of token ids, or use "
                    "/generate with input_ids");
    return;
  }
  Status st = CheckFields(chat ? "chat_completions" : "completions", body, "the request");
  if (!st.ok()) {
    SetError(res, st);
    return;
  }
  Item item;
  GenerateRequest& r = item.request;
  ModelInfo info = engine.model_info();
  st = [&]() -> Status {
    if (chat) {
      std::optional<int32_t> end = tokenizer->TokenId("<|im_end|>");
      if (!tokenizer->TokenId("<|im_start|>") || !end) {
        return absl::FailedPreconditionError(
            "chat needs ChatML's <|im_start|> and <|im_end|> tokens, which this tokenizer does "
            "not have: use /v1/completions or /generate with the model's own prompt format");
      }
      if (!Present(body, "messages")) {
        return absl::InvalidArgumentError("messages is required");
      }
      BRAGG_ASSIGN_OR_RETURN(std::string prompt, RenderChatMl(body["messages"]));
      BRAGG_RETURN_IF_ERROR(EncodePrompt(*tokenizer, json(std::move(prompt)), "messages",
                                         info.context_length, &r.input_ids,
                                         /*add_special_tokens=*/false));
      // OpenAI's default is as long as the context allows (and the KV cache: a request that
      // could never fit is refused).
      int64_t limit = info.context_length;
      int64_t capacity = engine.stats().kv_tokens_capacity;
      if (capacity > 0) {
        limit = std::min(limit, capacity);
      }
      int64_t room = std::max<int64_t>(1, limit - static_cast<int64_t>(r.input_ids.size()));
      BRAGG_RETURN_IF_ERROR(ReadOpenAiSampling(body, room, &r.sampling));
      if (std::find(r.sampling.stop_token_ids.begin(), r.sampling.stop_token_ids.end(), *end) ==
          r.sampling.stop_token_ids.end()) {
        r.sampling.stop_token_ids.push_back(*end);
      }
      BRAGG_RETURN_IF_ERROR(ReadBool(body, "", "skip_special_tokens", &item.skip_special_tokens));
    } else {
      if (!Present(body, "prompt")) {
        return absl::InvalidArgumentError("prompt is required (a list of token ids or a string)");
      }
      if (body["prompt"].is_string()) {
        BRAGG_RETURN_IF_ERROR(
            EncodePrompt(*tokenizer, body["prompt"], "prompt", info.context_length, &r.input_ids));
      } else {
        BRAGG_RETURN_IF_ERROR(ReadIds(body["prompt"], "prompt", &r.input_ids));
      }
      BRAGG_RETURN_IF_ERROR(ReadOpenAiSampling(body, 16, &r.sampling));  // OpenAI's default
    }
    if (body.contains("stop")) {
      BRAGG_RETURN_IF_ERROR(ReadStop(body["stop"], "stop", tokenizer, &item));
      SetStopCheck(tokenizer, {}, &item);
    }
    if (r.input_ids.empty()) {
      return absl::InvalidArgumentError(chat ? "the messages give no tokens" : "prompt is empty");
    }
    BRAGG_RETURN_IF_ERROR(ReadString(body, "", "rid", &r.rid));
    BRAGG_RETURN_IF_ERROR(ReadString(body, "", "extra_key", &r.extra_key));
    return absl::OkStatus();
  }();
  if (!st.ok()) {
    SetError(res, st);
    return;
  }
  item.input_ids = r.input_ids;
  std::vector<Item> items;
  items.push_back(std::move(item));
  Result<std::shared_ptr<Exchange>> submitted = Submit(std::move(items));
  if (!submitted.ok()) {
    SetError(res, submitted.status());
    return;
  }
  std::shared_ptr<Exchange> ex = *std::move(submitted);
  std::string model = info.served_model_name;
  res.set_chunked_content_provider(
      "application/json",
      [this, ex, model, chat](size_t, httplib::DataSink& sink) {
        std::vector<GenerateOutput> outs;
        if (!WaitAll(*ex, &outs, [&sink] { return sink.write(" ", 1); })) {
          return false;
        }
        const GenerateOutput& out = outs[0];
        std::string text = OutputText(options.tokenizer, out, ex->items[0]);
        json choice = {{"index", 0},
                       {"output_ids", out.output_ids},
                       {"logprobs", nullptr},
                       {"finish_reason", FinishName(out.finish)},
                       {"matched_stop", out.matched_stop_string ? json(*out.matched_stop_string)
                                        : out.matched_stop      ? json(*out.matched_stop)
                                                                : json()}};
        if (chat) {
          choice["message"] = {{"role", "assistant"}, {"content", std::move(text)}};
        } else {
          choice["text"] = std::move(text);
        }
        int64_t completion = static_cast<int64_t>(out.output_ids.size());
        json answer = {{"id", out.rid},
                       {"object", chat ? "chat.completion" : "text_completion"},
                       {"created", std::chrono::duration_cast<std::chrono::seconds>(
                                       std::chrono::system_clock::now().time_since_epoch())
                                       .count()},
                       {"model", model},
                       {"choices", json::array({choice})},
                       {"usage",
                        {{"prompt_tokens", out.prompt_tokens},
                         {"completion_tokens", completion},
                         {"total_tokens", out.prompt_tokens + completion},
                         {"prompt_tokens_details", {{"cached_tokens", out.cached_tokens}}}}},
                       {"weight_version", out.weight_version}};
        std::string dumped = Dump(answer);
        if (!sink.write(dumped.data(), dumped.size())) {
          return false;
        }
        sink.done();
        return true;
      },
      [ex](bool) { ex->CancelUnfinished(); });
}

void Server::Impl::HandleTokenize(const httplib::Request& req, httplib::Response& res,
                                  bool detokenize) {
  if (options.tokenizer == nullptr) {
    SetError(res, 400,
             "this engine has no tokenizer (its model directory has no tokenizer.json, or it "
             "runs with --skip-tokenizer-init)");
    return;
  }
  const Tokenizer& tokenizer = *options.tokenizer;
  Result<json> parsed = ParseObject(req.body, false);
  Status st = parsed.ok()
                  ? CheckFields(detokenize ? "detokenize" : "tokenize", *parsed, "the request")
                  : parsed.status();
  json answer;
  if (st.ok() && detokenize) {
    st = [&]() -> Status {
      bool skip = false;
      BRAGG_RETURN_IF_ERROR(ReadBool(*parsed, "", "skip_special_tokens", &skip));
      const json& tokens = parsed->value("tokens", json());
      std::vector<int32_t> ids;
      if (tokens.is_array() && !tokens.empty() && tokens[0].is_array()) {
        answer["text"] = json::array();
        for (size_t i = 0; i < tokens.size(); ++i) {
          BRAGG_RETURN_IF_ERROR(ReadIds(tokens[i], fmt::format("tokens[{}]", i), &ids));
          answer["text"].push_back(tokenizer.Decode(ids, skip));
        }
        return absl::OkStatus();
      }
      BRAGG_RETURN_IF_ERROR(ReadIds(tokens, "tokens", &ids));
      answer["text"] = tokenizer.Decode(ids, skip);
      return absl::OkStatus();
    }();
  } else if (st.ok()) {
    st = [&]() -> Status {
      bool special = true;
      BRAGG_RETURN_IF_ERROR(ReadBool(*parsed, "", "add_special_tokens", &special));
      const json& prompt = parsed->value("prompt", json());
      // Counting a text longer than the context is what /tokenize is for; up to 16 contexts.
      int64_t limit = 16 * engine.model_info().context_length;
      auto one = [&](const json& text, std::string_view where) -> Result<json> {
        std::vector<int32_t> ids;
        BRAGG_RETURN_IF_ERROR(EncodePrompt(tokenizer, text, where, limit, &ids, special));
        return json(std::move(ids));
      };
      if (prompt.is_array()) {
        answer["tokens"] = json::array();
        answer["count"] = json::array();
        for (size_t i = 0; i < prompt.size(); ++i) {
          BRAGG_ASSIGN_OR_RETURN(json ids, one(prompt[i], fmt::format("prompt[{}]", i)));
          answer["count"].push_back(ids.size());
          answer["tokens"].push_back(std::move(ids));
        }
      } else {
        BRAGG_ASSIGN_OR_RETURN(json ids, one(prompt, "prompt"));
        answer["count"] = ids.size();
        answer["tokens"] = std::move(ids);
      }
      answer["max_model_len"] = engine.model_info().context_length;
      return absl::OkStatus();
    }();
  }
  if (!st.ok()) {
    SetError(res, st);
    return;
  }
  Reply(res, answer);
}

std::string Server::Impl::MetricsText() {
  EngineStats s = engine.stats();
  ModelInfo info = engine.model_info();
  std::string labels =
      fmt::format("{{model_name=\"{}\"}}", PrometheusLabelValue(info.served_model_name));
  std::string out;
  auto metric = [&](std::string_view name, std::string_view type, std::string_view help,
                    double value) {
    out += fmt::format("# HELP {} {}\n# TYPE {} {}\n{}{} {}\n", name, PrometheusHelpText(help),
                       name, type, name, labels, value);
  };
  double used = s.kv_tokens_capacity > 0 ? static_cast<double>(s.kv_tokens_used) /
                                               static_cast<double>(s.kv_tokens_capacity)
                                         : 0.0;
  double hit = s.prompt_tokens_total > 0 ? static_cast<double>(s.cached_tokens_total) /
                                               static_cast<double>(s.prompt_tokens_total)
                                         : 0.0;
  metric("sglang:num_running_reqs", "gauge", "The number of running requests.",
         static_cast<double>(s.running));
  metric("sglang:num_queue_reqs", "gauge", "The number of requests in the waiting queue.",
         static_cast<double>(s.queued));
  metric("sglang:num_used_tokens", "gauge", "KV cache tokens in use.",
         static_cast<double>(s.kv_tokens_used));
  metric("sglang:max_total_num_tokens", "gauge", "KV cache capacity in tokens.",
         static_cast<double>(s.kv_tokens_capacity));
  metric("sglang:token_usage", "gauge", "The token usage (used / capacity of the KV cache).", used);
  metric("sglang:cache_hit_rate", "gauge", "Prompt tokens served from the prefix cache / all.",
         hit);
  metric("sglang:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
         static_cast<double>(s.prompt_tokens_total));
  metric("sglang:generation_tokens_total", "counter", "Number of generation tokens processed.",
         static_cast<double>(s.generation_tokens_total));
  metric("sglang:cached_tokens_total", "counter", "Number of cached prompt tokens.",
         static_cast<double>(s.cached_tokens_total));
  metric("sglang:num_requests_total", "counter", "Number of requests processed.",
         static_cast<double>(s.requests_total));
  metric("sglang:num_aborted_requests_total", "counter", "Number of requests aborted.",
         static_cast<double>(s.aborted_total));
  metric("bragg_engine_retracted_requests_total", "counter",
         "Requests sent back to the queue (pause retract, KV pressure).",
         static_cast<double>(s.retracted_total));
  metric("bragg_engine_weight_updates_total", "counter", "Weight updates applied.",
         static_cast<double>(s.weight_updates_total));
  metric("bragg_engine_step_seconds_total", "counter", "Seconds spent in engine steps.",
         s.step_seconds_total);
  metric("bragg_engine_radix_cache_tokens", "gauge", "Tokens held by the radix prefix cache.",
         static_cast<double>(s.cached_prefix_tokens));
  metric("bragg_engine_paused", "gauge", "1 while generation is paused.", s.paused ? 1 : 0);
  out += fmt::format(
      "# HELP bragg_engine_weight_version_info The weight version being served.\n"
      "# TYPE bragg_engine_weight_version_info gauge\n"
      "bragg_engine_weight_version_info{{model_name=\"{}\",weight_version=\"{}\"}} 1\n",
      PrometheusLabelValue(info.served_model_name), PrometheusLabelValue(s.weight_version));
  return out;
}

json Server::Impl::ServerInfo() {
  ModelInfo info = engine.model_info();
  EngineStats s = engine.stats();
  json out = {{"model_path", info.model_path},
              {"tokenizer_path", options.tokenizer ? json(options.tokenizer_path) : json()},
              {"skip_tokenizer_init", options.tokenizer == nullptr},
              {"served_model_name", info.served_model_name},
              {"weight_version", s.weight_version},
              {"host", options.host},
              {"port", port},
              {"device", info.device},
              {"dtype", info.dtype},
              {"context_length", info.context_length},
              {"max_total_num_tokens", s.kv_tokens_capacity},
              {"version", "bragg-engine"}};
  if (options.engine_options) {
    const EngineOptions& e = *options.engine_options;
    out["max_running_requests"] = e.max_running;
    out["chunked_prefill_size"] = e.chunked_prefill;
    out["page_size"] = e.block_size;
    out["enable_deterministic_inference"] = e.deterministic;
    out["deterministic"] = e.deterministic;
    out["threads"] = e.threads;
  }
  out["internal_states"] = json::array({{{"running", s.running},
                                         {"queued", s.queued},
                                         {"kv_tokens_used", s.kv_tokens_used},
                                         {"kv_tokens_capacity", s.kv_tokens_capacity},
                                         {"cached_prefix_tokens", s.cached_prefix_tokens},
                                         {"prompt_tokens_total", s.prompt_tokens_total},
                                         {"cached_tokens_total", s.cached_tokens_total},
                                         {"generation_tokens_total", s.generation_tokens_total},
                                         {"requests_total", s.requests_total},
                                         {"aborted_total", s.aborted_total},
                                         {"retracted_total", s.retracted_total},
                                         {"weight_updates_total", s.weight_updates_total},
                                         {"paused", s.paused}}});
  return out;
}

void Server::Impl::Register() {
  http.Post("/generate", [this](const httplib::Request& req, httplib::Response& res) {
    HandleGenerate(req, res);
  });
  auto ok = [](const httplib::Request&, httplib::Response& res) { res.status = 200; };
  http.Get("/health", ok);
  http.Get("/health_generate", ok);
  http.Get("/get_model_info", [this](const httplib::Request&, httplib::Response& res) {
    ModelInfo info = engine.model_info();
    Reply(res, {{"model_path", info.model_path},
                {"tokenizer_path", options.tokenizer ? json(options.tokenizer_path) : json()},
                {"is_generation", true},
                {"preferred_sampling_params", nullptr},
                {"weight_version", engine.stats().weight_version},
                {"has_image_understanding", false},
                {"has_audio_understanding", false},
                {"architectures", json::array({info.architecture})},
                {"served_model_name", info.served_model_name},
                {"vocab_size", info.vocab_size},
                {"context_length", info.context_length},
                {"num_layers", info.num_layers},
                {"num_experts", info.num_experts},
                {"experts_per_token", info.experts_per_token},
                {"moe_layers", info.moe_layers},
                {"eos_token_ids", info.eos_token_ids},
                {"dtype", info.dtype},
                {"device", info.device}});
  });
  http.Get("/get_server_info",
           [this](const httplib::Request&, httplib::Response& res) { Reply(res, ServerInfo()); });
  http.Get("/get_weight_version", [this](const httplib::Request&, httplib::Response& res) {
    Reply(res, {{"weight_version", engine.stats().weight_version}});
  });
  http.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(MetricsText(), "text/plain; version=0.0.4");
  });
  auto flush = [this](const httplib::Request&, httplib::Response& res) {
    Status st = engine.FlushCache();
    if (!st.ok()) {
      SetError(res, st);
      return;
    }
    res.set_content("Cache flushed.\n", "text/plain");
  };
  http.Post("/flush_cache", flush);
  http.Get("/flush_cache", flush);
  http.Post("/abort_request", [this](const httplib::Request& req, httplib::Response& res) {
    Result<json> body = ParseObject(req.body, false);
    Status st = body.status();
    bool all = false;
    std::string rid;
    if (st.ok()) {
      st = CheckFields("abort_request", *body, "the request");
    }
    if (st.ok()) {
      st = ReadBool(*body, "", "abort_all", &all);
    }
    if (st.ok()) {
      st = ReadString(*body, "", "rid", &rid);
    }
    if (st.ok() && !all && rid.empty()) {
      st = absl::InvalidArgumentError("abort_request needs a rid or abort_all: true");
    }
    if (st.ok()) {
      if (all) {
        engine.AbortAll();
      } else {
        st = engine.Abort(rid);
      }
    }
    if (!st.ok()) {
      SetError(res, st);
      return;
    }
    Reply(res, {{"success", true}});
  });
  http.Post("/pause_generation", [this](const httplib::Request& req, httplib::Response& res) {
    Result<json> body = ParseObject(req.body, true);
    Status st = body.status();
    std::string mode = "abort";
    if (st.ok()) {
      st = CheckFields("pause_generation", *body, "the request");
    }
    if (st.ok()) {
      st = ReadString(*body, "", "mode", &mode);
    }
    if (st.ok()) {
      if (mode == "abort") {
        st = engine.Pause(PauseMode::kAbort);
      } else if (mode == "in_place") {
        st = engine.Pause(PauseMode::kInPlace);
      } else if (mode == "retract") {
        st = engine.Pause(PauseMode::kRetract);
      } else {
        st = absl::InvalidArgumentError(
            fmt::format("mode must be abort, in_place or retract, got '{}'", mode));
      }
    }
    if (!st.ok()) {
      SetError(res, st);
      return;
    }
    Reply(res, {{"message", "Generation paused successfully."}, {"status", "ok"}});
  });
  http.Post("/continue_generation", [this](const httplib::Request& req, httplib::Response& res) {
    Result<json> body = ParseObject(req.body, true);
    Status st = body.status();
    if (st.ok()) {
      st = CheckFields("continue_generation", *body, "the request");
    }
    if (st.ok()) {
      st = engine.Continue();
    }
    if (!st.ok()) {
      SetError(res, st);
      return;
    }
    Reply(res, {{"message", "Generation continued successfully."}, {"status", "ok"}});
  });
  http.Post("/update_weights_from_disk", [this](const httplib::Request& req,
                                                httplib::Response& res) {
    Result<json> body = ParseObject(req.body, false);
    Status st = body.status();
    std::string path;
    std::string version;
    bool flush = true;
    bool abort_all = false;
    bool keep_pause = false;
    if (st.ok()) {
      st = CheckFields("update_weights_from_disk", *body, "the request");
    }
    if (st.ok()) {
      st = ReadString(*body, "", "model_path", &path);
    }
    if (st.ok() && path.empty()) {
      st = absl::InvalidArgumentError("model_path is required");
    }
    if (st.ok()) {
      version = engine.stats().weight_version;
      st = ReadString(*body, "", "weight_version", &version);
    }
    if (st.ok()) {
      st = ReadBool(*body, "", "flush_cache", &flush);
    }
    if (st.ok()) {
      st = ReadBool(*body, "", "abort_all_requests", &abort_all);
    }
    if (st.ok()) {
      st = ReadBool(*body, "", "keep_pause", &keep_pause);
    }
    if (st.ok() && abort_all) {
      engine.AbortAll();
    }
    if (st.ok()) {
      st = engine.UpdateWeightsFromDisk(path, version, flush);
    }
    if (st.ok() && keep_pause) {
      st = engine.Pause(PauseMode::kInPlace);
    }
    if (!st.ok()) {
      Reply(
          res,
          {{"success", false}, {"message", std::string(st.message())}, {"num_paused_requests", 0}},
          400);
      return;
    }
    Reply(res, {{"success", true},
                {"message", "Succeeded to update model weights."},
                {"num_paused_requests", 0},
                {"weight_version", version}});
  });
  http.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
    ModelInfo info = engine.model_info();
    Reply(res, {{"object", "list"},
                {"data", json::array({{{"id", info.served_model_name},
                                       {"object", "model"},
                                       {"created", 0},
                                       {"owned_by", "bragg"},
                                       {"root", info.model_path},
                                       {"max_model_len", info.context_length}}})}});
  });
  http.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
    HandleCompletions(req, res, /*chat=*/false);
  });
  http.Post("/v1/chat/completions", [this](const httplib::Request& req, httplib::Response& res) {
    HandleCompletions(req, res, /*chat=*/true);
  });
  for (bool detokenize : {false, true}) {
    for (const char* prefix : {"", "/v1"}) {
      http.Post(fmt::format("{}/{}", prefix, detokenize ? "detokenize" : "tokenize"),
                [this, detokenize](const httplib::Request& req, httplib::Response& res) {
                  HandleTokenize(req, res, detokenize);
                });
    }
  }
}

Server::Server(Engine& engine, ServerOptions options)
    : impl_(std::make_unique<Impl>(engine, std::move(options))) {
  Impl& s = *impl_;
  s.http.new_task_queue = [n = s.options.max_threads] { return new ElasticTaskQueue(n); };
  s.http.set_tcp_nodelay(true);
  s.http.set_keep_alive_max_count(1 << 30);
  s.http.set_keep_alive_timeout(60);
  s.http.set_payload_max_length(s.options.max_body_bytes);
  if (s.options.api_key) {
    std::string want = "Bearer " + *s.options.api_key;
    s.http.set_pre_routing_handler([want](const httplib::Request& req, httplib::Response& res) {
      if (req.path == "/health" || req.path == "/health_generate" || req.path == "/metrics" ||
          req.get_header_value("Authorization") == want) {
        return httplib::Server::HandlerResponse::Unhandled;
      }
      SetError(res, 401, "Unauthorized: send Authorization: Bearer <api key>");
      return httplib::Server::HandlerResponse::Handled;
    });
  }
  s.http.set_exception_handler(
      [](const httplib::Request& req, httplib::Response& res, std::exception_ptr ep) {
        std::string what = "unknown error";
        try {
          std::rethrow_exception(ep);
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        spdlog::error("bragg-engine: {} {} failed: {}", req.method, req.path, what);
        SetError(res, 500, fmt::format("internal error: {}", what));
      });
  s.Register();
}

Server::~Server() { Stop(); }

Status Server::Start() {
  Impl& s = *impl_;
  if (s.started) {
    return absl::FailedPreconditionError("the server is already started");
  }
  BRAGG_ASSIGN_OR_RETURN(s.port, BindServer(s.http, s.options.host, s.options.port));
  BRAGG_ASSIGN_OR_RETURN(s.thread, ServeInBackground(s.http));
  s.started = true;
  return absl::OkStatus();
}

void Server::Stop() {
  Impl& s = *impl_;
  s.stopping = true;
  s.http.stop();
  if (s.thread.joinable()) {
    s.thread.join();
  }
}

int Server::port() const { return impl_->port; }

std::string Server::url() const {
  return fmt::format("http://{}:{}", impl_->options.host, impl_->port);
}

}  // namespace bragg::engine
