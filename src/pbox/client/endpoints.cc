#include "pbox/client/endpoints.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <set>

#include "common/fs.h"
#include "common/unique_fd.h"
#include "fmt/format.h"

namespace bragg::pbox::client {
namespace {

using Json = nlohmann::json;

constexpr size_t kMaxEndpointsFileBytes = 16 << 20;
constexpr size_t kMaxTokenFileBytes = 64 << 10;

bool IsSpace(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

std::string_view Strip(std::string_view s) {
  while (!s.empty() && IsSpace(s.front())) {
    s.remove_prefix(1);
  }
  while (!s.empty() && IsSpace(s.back())) {
    s.remove_suffix(1);
  }
  return s;
}

bool AllDigits(std::string_view s) {
  if (s.empty()) {
    return false;
  }
  for (char c : s) {
    if (c < '0' || c > '9') {
      return false;
    }
  }
  return true;
}

// The value of a string of digits, capped at 1000000 (beyond any CPU number).
int SaturatingDecimal(std::string_view digits) {
  int v = 0;
  for (char c : digits) {
    v = std::min(v * 10 + (c - '0'), 1000000);
  }
  return v;
}

// Python's truth value of a JSON value, as the Python client tests `n.get(key) or ...`.
bool Truthy(const Json* v) {
  if (v == nullptr || v->is_null()) {
    return false;
  }
  if (v->is_boolean()) {
    return v->get<bool>();
  }
  if (v->is_number_integer()) {
    return v->get<int64_t>() != 0;
  }
  if (v->is_number()) {
    return v->get<double>() != 0.0;
  }
  if (v->is_string()) {
    return !v->get_ref<const std::string&>().empty();
  }
  return !v->empty();  // array, object, binary
}

const Json* Member(const Json& obj, const char* key) {
  auto it = obj.find(key);
  return it == obj.end() ? nullptr : &*it;
}

// Reads at most `limit` bytes of `path`; InvalidArgument (with `what`) on any failure.
Result<std::string> ReadBounded(const std::string& path, size_t limit, std::string_view what) {
  auto fd = OpenFile(path, O_RDONLY | O_CLOEXEC);
  if (!fd.ok()) {
    return absl::InvalidArgumentError(
        fmt::format("{} {}: {}", what, path, std::string(fd.status().message())));
  }
  std::string out;
  char buf[16384];
  for (;;) {
    ssize_t n = ::read(fd->get(), buf, sizeof(buf));
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n < 0) {
      Status s = ErrnoError("read", path);
      return absl::InvalidArgumentError(
          fmt::format("{} {}: {}", what, path, std::string(s.message())));
    }
    if (n == 0) {
      return out;
    }
    if (out.size() + static_cast<size_t>(n) > limit) {
      return absl::InvalidArgumentError(
          fmt::format("{} {}: larger than {} bytes", what, path, limit));
    }
    out.append(buf, static_cast<size_t>(n));
  }
}

// Node name from a truthy JSON value: a string, or an integer's decimal text (as Python's
// str()); InvalidArgument for other types.
Result<std::string> NameOf(const Json& v, std::string_view where, size_t i, const char* key) {
  if (v.is_string()) {
    return v.get<std::string>();
  }
  if (v.is_number_integer()) {
    return v.dump();
  }
  return absl::InvalidArgumentError(
      fmt::format("{}: nodes[{}].{} must be a string, not {}", where, i, key, v.type_name()));
}

}  // namespace

Result<std::string> CanonicalEndpoint(std::string_view ep) {
  if (ep.rfind("unix://", 0) == 0) {
    if (ep.size() == 7 || ep[7] != '/') {
      return absl::InvalidArgumentError(
          fmt::format("endpoint \"{}\": use unix:///absolute/path.sock", ep));
    }
    return std::string(ep);
  }
  if (ep.rfind("tcp://", 0) == 0) {
    std::string_view hostport = ep.substr(6);
    while (!hostport.empty() && hostport.back() == '/') {
      hostport.remove_suffix(1);
    }
    size_t colon = hostport.rfind(':');
    if (colon == std::string_view::npos || !AllDigits(hostport.substr(colon + 1))) {
      return absl::InvalidArgumentError(fmt::format("endpoint \"{}\": use tcp://HOST:PORT", ep));
    }
    return std::string(ep);
  }
  if (!ep.empty() && ep[0] == '/') {
    return "unix://" + std::string(ep);
  }
  return absl::InvalidArgumentError(
      fmt::format("endpoint \"{}\": expected unix:///path/to/pbox.sock or tcp://HOST:PORT", ep));
}

Result<size_t> CountCpuList(std::string_view text) {
  std::string_view s = Strip(text);
  if (s.empty()) {
    return absl::InvalidArgumentError("empty CPU list");
  }
  std::vector<std::pair<int, int>> ranges;
  while (true) {
    size_t comma = s.find(',');
    std::string_view part = Strip(s.substr(0, comma));
    size_t dash = part.find('-');
    std::string_view lo = part.substr(0, dash);
    std::string_view hi = dash == std::string_view::npos ? lo : part.substr(dash + 1);
    if (!AllDigits(lo) || !AllDigits(hi)) {
      return absl::InvalidArgumentError(fmt::format("bad CPU list \"{}\": \"{}\"", text, part));
    }
    int a = SaturatingDecimal(lo);
    int b = SaturatingDecimal(hi);
    if (b < a || b > 65535) {
      return absl::InvalidArgumentError(
          fmt::format("bad CPU list \"{}\": range \"{}\"", text, part));
    }
    ranges.emplace_back(a, b);
    if (comma == std::string_view::npos) {
      break;
    }
    s.remove_prefix(comma + 1);
  }
  // Overlapping ranges count once: merge them in order.
  std::sort(ranges.begin(), ranges.end());
  size_t count = 0;
  int next = 0;  // first CPU not yet counted
  for (auto [a, b] : ranges) {
    a = std::max(a, next);
    if (a <= b) {
      count += static_cast<size_t>(b - a + 1);
      next = b + 1;
    }
  }
  return count;
}

Result<std::vector<Endpoint>> ParseEndpointsJson(std::string_view text, std::string_view where) {
  Json doc = Json::parse(text, /*cb=*/nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) {
    return absl::InvalidArgumentError(fmt::format("{}: not JSON", where));
  }
  if (doc.is_array()) {
    doc = Json{{"nodes", std::move(doc)}};
  }
  const Json* nodes = doc.is_object() ? Member(doc, "nodes") : nullptr;
  if (nodes == nullptr || !nodes->is_array() || nodes->empty()) {
    return absl::InvalidArgumentError(
        fmt::format("{}: expected an object with a non-empty 'nodes' list", where));
  }
  std::string top_token;
  if (const Json* t = Member(doc, "token_file"); t != nullptr) {
    if (!t->is_string()) {
      return absl::InvalidArgumentError(fmt::format("{}: token_file must be a string", where));
    }
    top_token = t->get<std::string>();
  }
  std::vector<Endpoint> out;
  std::set<std::string> names;
  for (size_t i = 0; i < nodes->size(); ++i) {
    const Json& n = (*nodes)[i];
    if (!n.is_object()) {
      return absl::InvalidArgumentError(fmt::format("{}: nodes[{}] is not an object", where, i));
    }
    Endpoint e;
    const Json* ep = Member(n, "endpoint");
    if (!Truthy(ep)) {
      const Json* host = Member(n, "host");
      const Json* port = Member(n, "port");
      bool host_ok = host != nullptr && host->is_string() && !host->get<std::string>().empty();
      // An unsigned value above INT64_MAX reads as negative here: rejected too.
      bool port_ok = port != nullptr && port->is_number_integer() && port->get<int64_t>() > 0 &&
                     port->get<int64_t>() < 65536;
      if (!host_ok || !port_ok) {
        return absl::InvalidArgumentError(
            fmt::format("{}: nodes[{}] needs 'endpoint' or 'host' and 'port'", where, i));
      }
      const std::string& h = host->get_ref<const std::string&>();
      e.endpoint = h.find(':') != std::string::npos
                       ? fmt::format("tcp://[{}]:{}", h, port->get<int64_t>())
                       : fmt::format("tcp://{}:{}", h, port->get<int64_t>());
    } else if (!ep->is_string()) {
      return absl::InvalidArgumentError(
          fmt::format("{}: nodes[{}].endpoint must be a string", where, i));
    } else {
      e.endpoint = ep->get<std::string>();
    }
    auto canonical = CanonicalEndpoint(e.endpoint);
    if (!canonical.ok()) {
      return absl::InvalidArgumentError(
          fmt::format("{}: nodes[{}]: {}", where, i, std::string(canonical.status().message())));
    }
    std::string raw_endpoint = e.endpoint;
    e.endpoint = *canonical;
    if (const Json* v = Member(n, "node"); Truthy(v)) {
      BRAGG_ASSIGN_OR_RETURN(e.node, NameOf(*v, where, i, "node"));
    } else if (const Json* h = Member(n, "host"); Truthy(h)) {
      BRAGG_ASSIGN_OR_RETURN(e.node, NameOf(*h, where, i, "host"));
    } else {
      e.node = raw_endpoint;
    }
    for (auto [key, dst] : {std::pair<const char*, std::string*>{"cpuset", &e.cpuset},
                            {"trainer_cpus", &e.trainer_cpus},
                            {"token_file", &e.token_file}}) {
      if (const Json* v = Member(n, key); v != nullptr) {
        if (!v->is_string()) {
          return absl::InvalidArgumentError(
              fmt::format("{}: nodes[{}].{} must be a string", where, i, key));
        }
        *dst = v->get<std::string>();
      }
    }
    if (!e.cpuset.empty()) {
      auto count = CountCpuList(e.cpuset);
      if (!count.ok()) {
        return absl::InvalidArgumentError(fmt::format("{}: nodes[{}].cpuset: {}", where, i,
                                                      std::string(count.status().message())));
      }
    }
    if (e.token_file.empty()) {
      e.token_file = top_token;
    }
    if (!names.insert(e.node).second) {
      return absl::InvalidArgumentError(
          fmt::format("{}: duplicate node name \"{}\"", where, e.node));
    }
    out.push_back(std::move(e));
  }
  return out;
}

Result<std::vector<Endpoint>> LoadEndpointsFile(const std::string& path) {
  std::string where = "endpoints file " + path;
  auto text = ReadBounded(path, kMaxEndpointsFileBytes, "endpoints file");
  if (!text.ok()) {
    return text.status();
  }
  return ParseEndpointsJson(*text, where);
}

Result<std::vector<Endpoint>> ParseEndpointList(std::string_view list) {
  std::vector<Endpoint> out;
  std::set<std::string> names;
  while (true) {
    size_t comma = list.find(',');
    std::string_view item = Strip(list.substr(0, comma));
    if (!item.empty()) {
      BRAGG_ASSIGN_OR_RETURN(std::string canonical, CanonicalEndpoint(item));
      if (!names.insert(canonical).second) {
        return absl::InvalidArgumentError(
            fmt::format("duplicate endpoint \"{}\" in \"{}\"", canonical, list));
      }
      out.push_back(Endpoint{.node = canonical, .endpoint = canonical});
    }
    if (comma == std::string_view::npos) {
      break;
    }
    list.remove_prefix(comma + 1);
  }
  if (out.empty()) {
    return absl::InvalidArgumentError("empty endpoint list");
  }
  return out;
}

Result<std::vector<Endpoint>> LoadEndpoints(std::string_view spec) {
  std::string env;
  if (spec.empty()) {
    const char* v = std::getenv(kEndpointsEnv);
    env = v == nullptr ? "" : v;
    if (env.empty()) {
      return absl::InvalidArgumentError(fmt::format(
          "no endpoints: pass endpoints or an endpoints file, or set ${}", kEndpointsEnv));
    }
    spec = env;
  }
  if (spec.find("://") == std::string_view::npos) {
    return LoadEndpointsFile(std::string(spec));
  }
  return ParseEndpointList(spec);
}

Result<std::string> ReadTokenFile(const std::string& path) {
  BRAGG_ASSIGN_OR_RETURN(std::string text, ReadBounded(path, kMaxTokenFileBytes, "token file"));
  std::string token(Strip(text));
  for (unsigned char c : token) {
    if (c < 0x20 || c > 0x7e) {
      return absl::InvalidArgumentError(fmt::format(
          "token file {}: the token holds a byte (0x{:02x}) that an HTTP header cannot carry", path,
          c));
    }
  }
  return token;
}

}  // namespace bragg::pbox::client
