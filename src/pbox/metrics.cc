#include "pbox/metrics.h"

#include <fmt/format.h>
#include <httplib.h>
#include <netdb.h>
#include <sys/socket.h>
#include <sys/types.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "common/prometheus.h"
#include "common/unique_fd.h"

namespace bragg::pbox {
namespace {

enum Type { kCounter = 0, kGauge = 1, kHistogram = 2 };

const char* TypeName(int type) {
  switch (type) {
    case kCounter:
      return "counter";
    case kGauge:
      return "gauge";
    default:
      return "histogram";
  }
}

// Programmer errors abort in every build type (assert would vanish under NDEBUG).
[[noreturn]] void Fail(const std::string& what) {
  std::fprintf(stderr, "pbox metrics: %s\n", what.c_str());
  std::abort();
}

bool ValidMetricName(const std::string& name) {
  if (name.empty()) {
    return false;
  }
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':';
    const bool digit = c >= '0' && c <= '9';
    if (!alpha && !(i > 0 && digit)) {
      return false;
    }
  }
  return true;
}

bool ValidLabelName(const std::string& name) {
  if (name.empty() || name.rfind("__", 0) == 0) {
    return false;
  }
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
    const bool digit = c >= '0' && c <= '9';
    if (!alpha && !(i > 0 && digit)) {
      return false;
    }
  }
  return true;
}

// Validates and sorts by name so that a label set has one canonical form.
MetricLabels CanonicalLabels(const std::string& metric, MetricLabels labels, bool histogram) {
  std::sort(labels.begin(), labels.end());
  for (size_t i = 0; i < labels.size(); ++i) {
    const std::string& name = labels[i].first;
    if (!ValidLabelName(name)) {
      Fail(fmt::format("metric {}: invalid label name \"{}\"", metric, name));
    }
    if (histogram && name == "le") {
      Fail(fmt::format("metric {}: label \"le\" is reserved for histogram buckets", metric));
    }
    if (i > 0 && labels[i - 1].first == name) {
      Fail(fmt::format("metric {}: duplicate label \"{}\"", metric, name));
    }
  }
  return labels;
}

// Shortest round-trip form; Prometheus spells the specials +Inf, -Inf and NaN.
std::string FormatDouble(double v) {
  if (std::isnan(v)) {
    return "NaN";
  }
  if (std::isinf(v)) {
    return v > 0 ? "+Inf" : "-Inf";
  }
  return fmt::format("{}", v);
}

// `{a="x",b="y"}` or "" for no labels; `extra` (e.g. le) is appended last.
std::string FormatLabels(const MetricLabels& labels, const std::string& extra_name = "",
                         const std::string& extra_value = "") {
  if (labels.empty() && extra_name.empty()) {
    return "";
  }
  std::string out = "{";
  bool first = true;
  for (const auto& [name, value] : labels) {
    if (!first) {
      out += ',';
    }
    first = false;
    out += fmt::format("{}=\"{}\"", name, PrometheusLabelValue(value));
  }
  if (!extra_name.empty()) {
    if (!first) {
      out += ',';
    }
    out += fmt::format("{}=\"{}\"", extra_name, extra_value);
  }
  out += '}';
  return out;
}

std::vector<double> CheckedBounds(std::vector<double> bounds) {
  if (!bounds.empty() && std::isinf(bounds.back()) && bounds.back() > 0) {
    bounds.pop_back();
  }
  for (size_t i = 0; i < bounds.size(); ++i) {
    if (!std::isfinite(bounds[i])) {
      Fail(fmt::format("histogram bucket bound {} is not finite", bounds[i]));
    }
    if (i > 0 && !(bounds[i - 1] < bounds[i])) {
      Fail(fmt::format("histogram bucket bounds not strictly increasing at {}", bounds[i]));
    }
  }
  return bounds;
}

}  // namespace

// ---- Histogram ----

Histogram::Histogram(std::vector<double> upper_bounds)
    : bounds_(CheckedBounds(std::move(upper_bounds))),
      buckets_(new std::atomic<uint64_t>[bounds_.size() + 1]) {
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    buckets_[i].store(0, std::memory_order_relaxed);
  }
}

void Histogram::Observe(double v) {
  size_t i = bounds_.size();
  if (!std::isnan(v)) {
    i = static_cast<size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin());
  }
  buckets_[i].fetch_add(1, std::memory_order_relaxed);
  sum_.fetch_add(v, std::memory_order_relaxed);
}

std::vector<uint64_t> Histogram::CumulativeCounts() const {
  std::vector<uint64_t> out(bounds_.size() + 1);
  uint64_t total = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    total += buckets_[i].load(std::memory_order_relaxed);
    out[i] = total;
  }
  return out;
}

std::vector<double> LatencyBucketsSeconds() {
  return {0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
          0.1,     0.25,   0.5,     1,      2.5,   5,      10,    30,   60};
}

// ---- Registry ----

struct Registry::Series {
  MetricLabels labels;
  std::unique_ptr<Counter> counter;
  std::unique_ptr<Gauge> gauge;
  std::unique_ptr<Histogram> histogram;
  std::function<double()> callback;
};

struct Registry::Family {
  std::string name;
  std::string help;
  int type;
  std::vector<std::unique_ptr<Series>> series;

  Series* Find(const MetricLabels& labels) {
    for (auto& s : series) {
      if (s->labels == labels) {
        return s.get();
      }
    }
    return nullptr;
  }
};

Registry::Registry() = default;
Registry::~Registry() = default;

Registry::Family* Registry::FamilyFor(const std::string& name, const std::string& help, int type) {
  if (!ValidMetricName(name)) {
    Fail(fmt::format("invalid metric name \"{}\"", name));
  }
  for (auto& f : families_) {
    if (f->name != name) {
      continue;
    }
    if (f->type != type) {
      Fail(fmt::format("metric {} registered as {} and as {}", name, TypeName(f->type),
                       TypeName(type)));
    }
    if (f->help != help) {
      Fail(fmt::format("metric {} registered with two help texts", name));
    }
    return f.get();
  }
  auto family = std::make_unique<Family>();
  family->name = name;
  family->help = help;
  family->type = type;
  families_.push_back(std::move(family));
  return families_.back().get();
}

Counter* Registry::AddCounter(const std::string& name, const std::string& help,
                              const MetricLabels& labels) {
  MetricLabels canon = CanonicalLabels(name, labels, false);
  std::lock_guard<std::mutex> lock(mu_);
  Family* family = FamilyFor(name, help, kCounter);
  if (Series* s = family->Find(canon)) {
    return s->counter.get();
  }
  auto series = std::make_unique<Series>();
  series->labels = std::move(canon);
  series->counter = std::make_unique<Counter>();
  family->series.push_back(std::move(series));
  return family->series.back()->counter.get();
}

Gauge* Registry::AddGauge(const std::string& name, const std::string& help,
                          const MetricLabels& labels) {
  MetricLabels canon = CanonicalLabels(name, labels, false);
  std::lock_guard<std::mutex> lock(mu_);
  Family* family = FamilyFor(name, help, kGauge);
  if (Series* s = family->Find(canon)) {
    if (!s->gauge) {
      Fail(fmt::format("metric {}: label set already used by a callback gauge", name));
    }
    return s->gauge.get();
  }
  auto series = std::make_unique<Series>();
  series->labels = std::move(canon);
  series->gauge = std::make_unique<Gauge>();
  family->series.push_back(std::move(series));
  return family->series.back()->gauge.get();
}

Histogram* Registry::AddHistogram(const std::string& name, const std::string& help,
                                  std::vector<double> buckets, const MetricLabels& labels) {
  MetricLabels canon = CanonicalLabels(name, labels, true);
  auto histogram = std::make_unique<Histogram>(std::move(buckets));
  std::lock_guard<std::mutex> lock(mu_);
  Family* family = FamilyFor(name, help, kHistogram);
  if (!family->series.empty() &&
      family->series.front()->histogram->upper_bounds() != histogram->upper_bounds()) {
    Fail(fmt::format("histogram {}: series registered with different buckets", name));
  }
  if (Series* s = family->Find(canon)) {
    return s->histogram.get();
  }
  auto series = std::make_unique<Series>();
  series->labels = std::move(canon);
  series->histogram = std::move(histogram);
  family->series.push_back(std::move(series));
  return family->series.back()->histogram.get();
}

void Registry::AddCallbackGauge(const std::string& name, const std::string& help,
                                std::function<double()> fn, const MetricLabels& labels) {
  if (!fn) {
    Fail(fmt::format("metric {}: empty callback", name));
  }
  MetricLabels canon = CanonicalLabels(name, labels, false);
  std::lock_guard<std::mutex> lock(mu_);
  Family* family = FamilyFor(name, help, kGauge);
  if (family->Find(canon) != nullptr) {
    Fail(fmt::format("metric {}: callback gauge for a label set that already exists", name));
  }
  auto series = std::make_unique<Series>();
  series->labels = std::move(canon);
  series->callback = std::move(fn);
  family->series.push_back(std::move(series));
}

std::string Registry::Render() const {
  std::string out;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& f : families_) {
    out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", f->name, PrometheusHelpText(f->help),
                       f->name, TypeName(f->type));
    for (const auto& s : f->series) {
      if (s->counter) {
        out += fmt::format("{}{} {}\n", f->name, FormatLabels(s->labels), s->counter->value());
      } else if (s->gauge) {
        out += fmt::format("{}{} {}\n", f->name, FormatLabels(s->labels),
                           FormatDouble(s->gauge->value()));
      } else if (s->callback) {
        out +=
            fmt::format("{}{} {}\n", f->name, FormatLabels(s->labels), FormatDouble(s->callback()));
      } else {
        const Histogram& h = *s->histogram;
        // One snapshot, so that _count equals the +Inf bucket even while threads observe.
        const std::vector<uint64_t> counts = h.CumulativeCounts();
        const auto& bounds = h.upper_bounds();
        for (size_t i = 0; i < counts.size(); ++i) {
          const std::string le = i < bounds.size() ? FormatDouble(bounds[i]) : "+Inf";
          out += fmt::format("{}_bucket{} {}\n", f->name, FormatLabels(s->labels, "le", le),
                             counts[i]);
        }
        out +=
            fmt::format("{}_sum{} {}\n", f->name, FormatLabels(s->labels), FormatDouble(h.sum()));
        out += fmt::format("{}_count{} {}\n", f->name, FormatLabels(s->labels), counts.back());
      }
    }
  }
  return out;
}

// ---- MetricsServer ----

namespace {

struct HostPort {
  std::string host;
  int port = 0;
};

Result<HostPort> ParseListen(const std::string& listen) {
  const size_t colon = listen.rfind(':');
  if (colon == std::string::npos) {
    return absl::InvalidArgumentError(
        fmt::format("invalid listen address \"{}\": want HOST:PORT, e.g. 127.0.0.1:9100", listen));
  }
  HostPort hp;
  hp.host = listen.substr(0, colon);
  const std::string port = listen.substr(colon + 1);
  if (hp.host.size() >= 2 && hp.host.front() == '[' && hp.host.back() == ']') {
    hp.host = hp.host.substr(1, hp.host.size() - 2);
  } else if (hp.host.find(':') != std::string::npos) {
    return absl::InvalidArgumentError(fmt::format(
        "invalid listen address \"{}\": put an IPv6 host in brackets, e.g. [::1]:9100", listen));
  }
  if (hp.host.empty()) {
    return absl::InvalidArgumentError(fmt::format(
        "invalid listen address \"{}\": empty host (use 0.0.0.0 for all interfaces)", listen));
  }
  if (port.empty() || port.size() > 5 ||
      !std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; }) ||
      std::stoi(port) > 65535) {
    return absl::InvalidArgumentError(fmt::format(
        "invalid listen address \"{}\": port must be a number from 0 to 65535", listen));
  }
  hp.port = std::stoi(port);
  return hp;
}

// httplib's default sets SO_REUSEPORT, which would let two agents share one port silently;
// SO_REUSEADDR alone still allows a quick restart over TIME_WAIT connections.
void ListenSocketOptions(int fd) {
  int yes = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
}

// httplib reports a failed bind as a bare `false`, so the cause is found by binding the same
// address again with the same options.
Status BindFailure(const std::string& listen, const HostPort& hp, int saved_errno) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* result = nullptr;
  const std::string service = std::to_string(hp.port);
  const int gai = ::getaddrinfo(hp.host.c_str(), service.c_str(), &hints, &result);
  if (gai != 0) {
    return absl::InvalidArgumentError(
        fmt::format("cannot listen on {}: {}", listen, ::gai_strerror(gai)));
  }
  int err = saved_errno != 0 ? saved_errno : EADDRNOTAVAIL;
  for (addrinfo* ai = result; ai != nullptr; ai = ai->ai_next) {
    UniqueFd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
    if (!fd) {
      err = errno;
      continue;
    }
    ListenSocketOptions(fd.get());
    if (::bind(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0 || ::listen(fd.get(), 1) != 0) {
      err = errno;
      break;
    }
  }
  ::freeaddrinfo(result);
  absl::StatusCode code = ErrnoToCode(err);
  if (err == EADDRINUSE || err == EADDRNOTAVAIL) {
    code = absl::StatusCode::kUnavailable;
  }
  return Status(code, fmt::format("cannot listen on {}: {}", listen, std::strerror(err)));
}

}  // namespace

MetricsServer::MetricsServer() = default;

Result<std::unique_ptr<MetricsServer>> MetricsServer::Start(const Registry* registry,
                                                            const std::string& listen) {
  BRAGG_ASSIGN_OR_RETURN(HostPort hp, ParseListen(listen));
  std::unique_ptr<MetricsServer> self(new MetricsServer());
  self->server_ = std::make_unique<httplib::Server>();
  httplib::Server& svr = *self->server_;
  svr.set_socket_options([](int fd) { ListenSocketOptions(fd); });
  // Scrapes are rare; httplib's default pool (>= 8 threads) is more than a node agent should
  // spend, but more than one keeps an idle keep-alive scraper from blocking /healthz.
  svr.new_task_queue = [] { return new httplib::ThreadPool(4); };
  svr.Get("/metrics", [registry](const httplib::Request&, httplib::Response& res) {
    res.set_content(registry->Render(), "text/plain; version=0.0.4");
  });
  svr.Get("/healthz", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("ok", "text/plain");
  });
  svr.set_error_handler([](const httplib::Request&, httplib::Response& res) {
    if (res.status == 404) {
      res.set_content("not found; try /metrics or /healthz\n", "text/plain");
    }
  });

  errno = 0;
  if (hp.port == 0) {
    const int port = svr.bind_to_any_port(hp.host);
    if (port < 0) {
      return BindFailure(listen, hp, errno);
    }
    self->port_ = port;
  } else {
    if (!svr.bind_to_port(hp.host, hp.port)) {
      return BindFailure(listen, hp, errno);
    }
    self->port_ = hp.port;
  }

  MetricsServer* raw = self.get();
  self->thread_ = std::thread([raw] {
    raw->server_->listen_after_bind();
    raw->finished_.store(true);
  });
  // stop() is a no-op until the accept loop has started, so the destructor could otherwise hang.
  while (!svr.is_running() && !self->finished_.load()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (self->finished_.load()) {
    return absl::InternalError(fmt::format("metrics server on {} stopped at start", listen));
  }
  return self;
}

MetricsServer::~MetricsServer() {
  if (server_) {
    server_->stop();
  }
  if (thread_.joinable()) {
    thread_.join();
  }
}

}  // namespace bragg::pbox
