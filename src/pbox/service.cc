#include "pbox/service.h"

#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <chrono>
#include <future>
#include <thread>

#include "common/fs.h"
#include "fmt/format.h"
#include "spdlog/spdlog.h"

namespace bragg::pbox {
namespace {

using Clock = std::chrono::steady_clock;
namespace v1 = bragg::pbox::v1;

constexpr uint64_t kDefaultRunOutputCap = 1 << 20;
// Both streams fit one response under the 16 MiB message limit; Exec streams anything larger.
constexpr uint64_t kMaxRunOutputCap = 4 << 20;

// Longest command timeout a client may ask for: beyond any real command, and far below the
// ~292 years at which adding it to the steady clock's nanoseconds would overflow.
constexpr uint64_t kMaxTimeoutMs = 30ull * 24 * 3600 * 1000;

grpc::Status CheckTimeout(uint64_t timeout_ms) {
  if (timeout_ms > kMaxTimeoutMs) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        fmt::format("timeout_ms {} is over the limit of {} (30 days); 0 means "
                                    "no timeout",
                                    timeout_ms, kMaxTimeoutMs));
  }
  return grpc::Status::OK;
}

double SecondsSince(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

bool ConstantTimeEquals(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) {
    return false;
  }
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  }
  return diff == 0;
}

v1::FileType KindToProto(FileKind kind) {
  switch (kind) {
    case FileKind::kRegular:
      return v1::FILE_TYPE_REGULAR;
    case FileKind::kDirectory:
      return v1::FILE_TYPE_DIRECTORY;
    case FileKind::kSymlink:
      return v1::FILE_TYPE_SYMLINK;
    case FileKind::kOther:
      return v1::FILE_TYPE_OTHER;
    default:
      return v1::FILE_TYPE_UNKNOWN;
  }
}

void StatToProto(const FileStat& st, v1::FileInfo* out) {
  out->set_path(st.name);
  out->set_type(KindToProto(st.kind));
  out->set_size(st.size);
  out->set_mode(st.mode);
  out->set_mtime_unix_ns(st.mtime_ns);
  out->set_symlink_target(st.symlink_target);
}

void ResultToProto(const CommandResult& r, v1::ExecResult* out) {
  out->set_exit_code(r.exit_code);
  out->set_signal(r.signal);
  out->set_timed_out(r.timed_out);
  out->set_oom_killed(r.oom_killed);
  out->set_stdout_bytes(r.stdout_bytes);
  out->set_stderr_bytes(r.stderr_bytes);
  out->set_wall_time_ms(r.wall_ms);
  out->set_cpu_time_ms(r.cpu_ms);
  out->set_peak_memory_bytes(r.peak_memory_bytes);
  out->set_error(r.error);
}

CommandSpec SpecFromStart(const v1::ExecStart& start) {
  CommandSpec spec;
  spec.argv.assign(start.argv().begin(), start.argv().end());
  spec.env.insert(start.env().begin(), start.env().end());
  spec.cwd = start.cwd();
  spec.timeout = std::chrono::milliseconds(start.timeout_ms());
  spec.stdin = start.stdin();
  return spec;
}

// Streams output to an Exec client as it comes.
class StreamSink : public OutputSink {
 public:
  explicit StreamSink(grpc::ServerReaderWriter<v1::ExecResponse, v1::ExecRequest>* stream)
      : stream_(stream) {}
  bool OnStdout(std::string_view data) override {
    msg_.Clear();
    msg_.set_stdout(data.data(), data.size());
    return stream_->Write(msg_);
  }
  bool OnStderr(std::string_view data) override {
    msg_.Clear();
    msg_.set_stderr(data.data(), data.size());
    return stream_->Write(msg_);
  }

 private:
  grpc::ServerReaderWriter<v1::ExecResponse, v1::ExecRequest>* stream_;
  v1::ExecResponse msg_;
};

// Keeps the head and the tail of a stream, at most `cap` bytes in all.
class HeadTail {
 public:
  explicit HeadTail(uint64_t cap) : head_cap_(cap - cap / 2), tail_cap_(cap / 2) {}
  void Append(std::string_view data) {
    total_ += data.size();
    size_t to_head = std::min<size_t>(data.size(), head_cap_ - head_.size());
    head_.append(data.substr(0, to_head));
    data.remove_prefix(to_head);
    if (data.empty() || tail_cap_ == 0) {
      return;
    }
    tail_.append(data);
    if (tail_.size() > 2 * tail_cap_) {
      tail_.erase(0, tail_.size() - tail_cap_);
    }
  }
  bool truncated() const { return total_ > head_.size() + tail_.size(); }
  std::string Take() {
    if (tail_.size() > tail_cap_) {
      tail_.erase(0, tail_.size() - tail_cap_);
    }
    uint64_t dropped = total_ - head_.size() - tail_.size();
    std::string out = std::move(head_);
    if (dropped > 0) {
      out += fmt::format("\n...[{} bytes dropped]...\n", dropped);
    }
    out += tail_;
    return out;
  }

 private:
  const size_t head_cap_;
  const size_t tail_cap_;
  uint64_t total_ = 0;
  std::string head_;
  std::string tail_;
};

class BufferSink : public OutputSink {
 public:
  explicit BufferSink(uint64_t cap) : out_(cap), err_(cap) {}
  bool OnStdout(std::string_view data) override {
    out_.Append(data);
    return true;
  }
  bool OnStderr(std::string_view data) override {
    err_.Append(data);
    return true;
  }
  HeadTail out_;
  HeadTail err_;
};

// A create request's spec, or a clone request's overrides, as the manager takes them.
SandboxSettings SettingsOf(const v1::SandboxSpec& spec) {
  SandboxSettings s;
  s.image = spec.image();
  s.runtime = spec.runtime();
  s.cpus = spec.cpus();
  s.cpu_quota = spec.cpu_quota();
  s.memory_bytes = spec.memory_bytes();
  s.pids = spec.pids();
  s.disk_bytes = spec.disk_bytes();
  s.env.insert(spec.env().begin(), spec.env().end());
  s.workdir = spec.workdir();
  s.idle_ttl_seconds = spec.idle_ttl_seconds();
  s.labels.insert(spec.labels().begin(), spec.labels().end());
  return s;
}

}  // namespace

grpc::Status ToGrpc(const Status& status) {
  if (status.ok()) {
    return grpc::Status::OK;
  }
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

AgentMetrics AgentMetrics::Register(Registry* r) {
  AgentMetrics m;
  m.sandboxes_created = r->AddCounter("pbox_sandboxes_created_total", "Sandboxes created.");
  m.sandboxes_destroyed = r->AddCounter("pbox_sandboxes_destroyed_total", "Sandboxes destroyed.");
  m.rejections = r->AddCounter("pbox_rejections_total",
                               "Sandbox creations refused because the agent was at capacity.");
  m.execs = r->AddCounter("pbox_execs_total", "Commands run (Exec and Run).");
  m.exec_timeouts = r->AddCounter("pbox_exec_timeouts_total", "Commands killed at their timeout.");
  m.oom_kills = r->AddCounter("pbox_oom_kills_total", "Commands killed by their sandbox's OOM.");
  m.bytes_uploaded = r->AddCounter("pbox_upload_bytes_total", "Bytes written by WriteFile.");
  m.bytes_downloaded = r->AddCounter("pbox_download_bytes_total", "Bytes sent by ReadFile.");
  auto buckets = LatencyBucketsSeconds();
  m.create_seconds = r->AddHistogram("pbox_create_seconds", "Time to create a sandbox.", buckets);
  m.exec_seconds = r->AddHistogram("pbox_exec_seconds", "Wall time of commands.", buckets);
  m.upload_seconds = r->AddHistogram("pbox_upload_seconds", "Time of WriteFile calls.", buckets);
  m.download_seconds = r->AddHistogram("pbox_download_seconds", "Time of ReadFile calls.", buckets);
  return m;
}

PboxService::PboxService(SandboxManager* manager, const AgentMetrics* metrics, ServiceInfo info,
                         std::string token, ImageStore* images, ClientLimits limits)
    : manager_(manager),
      metrics_(metrics),
      info_(std::move(info)),
      token_(std::move(token)),
      images_(images),
      limiter_(limits) {}

std::string PboxService::ClientOf(grpc::ServerContext* ctx) {
  auto it = ctx->client_metadata().find("x-pbox-client");
  std::string_view id;
  if (it != ctx->client_metadata().end()) {
    id = std::string_view(it->second.data(), it->second.size());
  }
  return ClientKey(id, ctx->peer());
}

grpc::Status PboxService::Refuse(const std::string& client, const Status& status) {
  metrics_->rejections->Inc();
  // A client that keeps asking a full agent is answered no faster than its budget: each
  // refusal costs the agent CPU that other clients' calls need (docs/pbox.md "Admission").
  limiter_.PaceRefusal(client);
  return ToGrpc(status);
}

grpc::Status PboxService::Authorize(grpc::ServerContext* ctx) const {
  std::string peer = ctx->peer();
  if (peer.rfind("unix:", 0) == 0) {
    return grpc::Status::OK;
  }
  if (!token_.empty()) {
    auto it = ctx->client_metadata().find("authorization");
    if (it != ctx->client_metadata().end()) {
      std::string_view value(it->second.data(), it->second.size());
      constexpr std::string_view kBearer = "Bearer ";
      if (value.substr(0, kBearer.size()) == kBearer &&
          ConstantTimeEquals(value.substr(kBearer.size()), token_)) {
        return grpc::Status::OK;
      }
    }
  }
  return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "missing or invalid token");
}

grpc::Status PboxService::Enter(grpc::ServerContext* ctx, const std::string& sandbox_id,
                                std::shared_ptr<Sandbox>* out) {
  if (auto s = Authorize(ctx); !s.ok()) {
    return s;
  }
  auto sb = manager_->Get(sandbox_id);
  if (!sb.ok()) {
    return ToGrpc(sb.status());
  }
  (*sb)->Touch();
  *out = std::move(*sb);
  return grpc::Status::OK;
}

grpc::Status PboxService::StatInto(const Sandbox& sb, const std::string& path, v1::FileInfo* out) {
  auto st = sb.fs().Stat(path);
  if (!st.ok()) {
    return ToGrpc(st.status());
  }
  StatToProto(*st, out);
  out->set_path(path);
  return grpc::Status::OK;
}

void PboxService::Describe(const Sandbox& sb, v1::Sandbox* out) const {
  const SandboxSettings& s = sb.settings();
  out->set_id(sb.id());
  out->set_session_id(sb.session_id());
  v1::SandboxSpec* spec = out->mutable_spec();
  spec->set_image(s.image);
  spec->set_runtime(s.runtime);
  spec->set_cpus(s.cpus);
  spec->set_cpu_quota(s.cpu_quota);
  spec->set_memory_bytes(s.memory_bytes);
  spec->set_pids(s.pids);
  spec->set_disk_bytes(s.disk_bytes);
  spec->set_network(v1::NETWORK_NONE);
  spec->mutable_env()->insert(s.env.begin(), s.env.end());
  spec->set_workdir(s.workdir);
  spec->set_idle_ttl_seconds(s.idle_ttl_seconds);
  spec->mutable_labels()->insert(s.labels.begin(), s.labels.end());
  out->set_state(sb.destroying() ? v1::SANDBOX_STATE_DESTROYING : v1::SANDBOX_STATE_RUNNING);
  out->set_cpuset(sb.cpus().ToString());
  out->set_created_unix_ms(sb.created_unix_ms());
  out->set_last_used_unix_ms(sb.last_used_unix_ms());
  out->set_running_execs(sb.running_commands());
  auto stats = sb.Stats();
  if (stats.ok()) {
    out->set_memory_usage_bytes(stats->memory_current);
  }
}

grpc::Status PboxService::Session(
    grpc::ServerContext* ctx,
    grpc::ServerReaderWriter<v1::SessionEvent, v1::SessionRequest>* stream) {
  if (auto s = Authorize(ctx); !s.ok()) {
    return s;
  }
  // Taken: say so before reading, so that a client can tell this call from a refused one
  // without first writing into a call that may already have ended (pbox.proto).
  ctx->AddInitialMetadata("pbox-session", "ready");
  stream->SendInitialMetadata();
  v1::SessionRequest req;
  if (!stream->Read(&req)) {
    return grpc::Status(grpc::StatusCode::CANCELLED, "session stream closed before it opened");
  }
  if (!req.has_open()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "the first message of a Session must be SessionOpen");
  }
  CpuSet session_cpus;
  if (!req.open().cpuset().empty()) {
    auto parsed = CpuSet::Parse(req.open().cpuset());
    if (!parsed.ok()) {
      return ToGrpc(parsed.status());
    }
    session_cpus = *std::move(parsed);
  }
  auto opened = manager_->OpenSession(req.open().client_name(), req.open().job_id(), session_cpus);
  if (!opened.ok()) {
    return ToGrpc(opened.status());
  }
  const std::string id = *std::move(opened);
  v1::SessionEvent ev;
  ev.mutable_opened()->set_session_id(id);
  if (stream->Write(ev)) {
    while (stream->Read(&req)) {
      if (req.has_ping()) {
        ev.Clear();
        ev.mutable_pong()->set_nonce(req.ping().nonce());
        if (!stream->Write(ev)) {
          break;
        }
      }
    }
  }
  // However the stream ended (half-close, crash, kill -9, keepalive timeout), the lease ends.
  manager_->CloseSession(id);
  return grpc::Status::OK;
}

grpc::Status PboxService::CreateSandbox(grpc::ServerContext* ctx,
                                        const v1::CreateSandboxRequest* req, v1::Sandbox* resp) {
  if (auto s = Authorize(ctx); !s.ok()) {
    return s;
  }
  auto t0 = Clock::now();
  const std::string client = ClientOf(ctx);
  auto slot = limiter_.Admit(client, ClientLimiter::Kind::kCreate);
  if (!slot.ok()) {
    return Refuse(client, slot.status());
  }
  // A caller that is gone (dead, or past its deadline) would never learn the new sandbox's id.
  auto sb = manager_->Create(req->session_id(), SettingsOf(req->spec()),
                             [ctx] { return ctx->IsCancelled(); });
  if (!sb.ok()) {
    if (sb.status().code() == absl::StatusCode::kResourceExhausted) {
      return Refuse(client, sb.status());
    }
    return ToGrpc(sb.status());
  }
  metrics_->sandboxes_created->Inc();
  metrics_->create_seconds->Observe(SecondsSince(t0));
  Describe(**sb, resp);
  return grpc::Status::OK;
}

grpc::Status PboxService::CloneSandbox(grpc::ServerContext* ctx, const v1::CloneSandboxRequest* req,
                                       v1::CloneSandboxResponse* resp) {
  if (auto s = Authorize(ctx); !s.ok()) {
    return s;
  }
  auto t0 = Clock::now();
  const std::string client = ClientOf(ctx);
  auto slot = limiter_.Admit(client, ClientLimiter::Kind::kCreate);
  if (!slot.ok()) {
    return Refuse(client, slot.status());
  }
  // Unset fields (zero, empty) keep the source's settings.
  auto clones = manager_->Clone(req->session_id(), req->sandbox_id(), req->count(),
                                SettingsOf(req->overrides()), [ctx] { return ctx->IsCancelled(); });
  if (!clones.ok()) {
    if (clones.status().code() == absl::StatusCode::kResourceExhausted) {
      return Refuse(client, clones.status());
    }
    return ToGrpc(clones.status());
  }
  double per_clone = SecondsSince(t0) / static_cast<double>(clones->size());
  for (const auto& sb : *clones) {
    metrics_->sandboxes_created->Inc();
    metrics_->create_seconds->Observe(per_clone);
    Describe(*sb, resp->add_sandboxes());
  }
  return grpc::Status::OK;
}

grpc::Status PboxService::DestroySandbox(grpc::ServerContext* ctx,
                                         const v1::DestroySandboxRequest* req,
                                         v1::DestroySandboxResponse*) {
  if (auto s = Authorize(ctx); !s.ok()) {
    return s;
  }
  Status s = manager_->Destroy(req->sandbox_id());
  if (s.ok()) {
    metrics_->sandboxes_destroyed->Inc();
  }
  return ToGrpc(s);
}

grpc::Status PboxService::GetSandbox(grpc::ServerContext* ctx, const v1::GetSandboxRequest* req,
                                     v1::Sandbox* resp) {
  if (auto s = Authorize(ctx); !s.ok()) {
    return s;
  }
  auto sb = manager_->Get(req->sandbox_id());
  if (!sb.ok()) {
    return ToGrpc(sb.status());
  }
  Describe(**sb, resp);
  return grpc::Status::OK;
}

grpc::Status PboxService::ListSandboxes(grpc::ServerContext* ctx,
                                        const v1::ListSandboxesRequest* req,
                                        v1::ListSandboxesResponse* resp) {
  if (auto s = Authorize(ctx); !s.ok()) {
    return s;
  }
  for (const auto& sb : manager_->List(req->session_id())) {
    Describe(*sb, resp->add_sandboxes());
  }
  return grpc::Status::OK;
}

grpc::Status PboxService::Exec(
    grpc::ServerContext* ctx, grpc::ServerReaderWriter<v1::ExecResponse, v1::ExecRequest>* stream) {
  if (auto s = Authorize(ctx); !s.ok()) {
    return s;
  }
  v1::ExecRequest first;
  if (!stream->Read(&first) || !first.has_start()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "the first message of an Exec must be ExecStart");
  }
  if (auto s = CheckTimeout(first.start().timeout_ms()); !s.ok()) {
    return s;
  }
  const std::string client = ClientOf(ctx);
  auto slot = limiter_.Admit(client, ClientLimiter::Kind::kExec);
  if (!slot.ok()) {
    return Refuse(client, slot.status());
  }
  std::shared_ptr<Sandbox> sb;
  if (auto s = Enter(ctx, first.start().sandbox_id(), &sb); !s.ok()) {
    return s;
  }
  auto cmd = sb->Start(SpecFromStart(first.start()));
  if (!cmd.ok()) {
    return ToGrpc(cmd.status());
  }
  metrics_->execs->Inc();
  RunningCommand* running = cmd->get();
  // Client messages (stdin, close, signals) are read on their own thread while this one pumps
  // output: gRPC allows one reader and one writer at a time on a stream.
  std::promise<void> reader_done;
  std::future<void> reader_finished = reader_done.get_future();
  std::thread reader([stream, running, &reader_done] {
    v1::ExecRequest req;
    while (stream->Read(&req)) {
      if (req.has_stdin()) {
        (void)running->WriteStdin(req.stdin());
      } else if (req.has_stdin_close()) {
        running->CloseStdin();
      } else if (req.kind_case() == v1::ExecRequest::kSignal) {
        (void)running->Signal(req.signal());
      }
    }
    // The client half-closed or went away: the command sees EOF on stdin.
    running->CloseStdin();
    reader_done.set_value();
  });
  StreamSink sink(stream);
  // A cancelled call (the client cancelled, died, or its deadline passed) kills the command:
  // nothing would read its output, and it would hold the client's exec slot.
  CommandResult result = running->Pump(sink, [ctx] { return ctx->IsCancelled(); });
  running->CloseStdin();
  metrics_->exec_seconds->Observe(result.wall_ms / 1000.0);
  if (result.timed_out) {
    metrics_->exec_timeouts->Inc();
  }
  if (result.oom_killed) {
    metrics_->oom_kills->Inc();
  }
  v1::ExecResponse last;
  ResultToProto(result, last.mutable_result());
  stream->Write(last);
  // A well-behaved client half-closes; one that does not gets a few seconds, then the call is
  // cancelled so this thread is not held forever.
  if (reader_finished.wait_for(std::chrono::seconds(5)) != std::future_status::ready) {
    ctx->TryCancel();
  }
  reader.join();
  cmd->reset();
  return grpc::Status::OK;
}

grpc::Status PboxService::Run(grpc::ServerContext* ctx, const v1::RunRequest* req,
                              v1::RunResponse* resp) {
  if (auto s = Authorize(ctx); !s.ok()) {
    return s;
  }
  uint64_t cap = req->max_output_bytes() == 0 ? kDefaultRunOutputCap : req->max_output_bytes();
  if (cap > kMaxRunOutputCap) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        fmt::format("max_output_bytes {} is over the limit of {}; use Exec to "
                                    "stream larger output",
                                    cap, kMaxRunOutputCap));
  }
  if (auto s = CheckTimeout(req->timeout_ms()); !s.ok()) {
    return s;
  }
  const std::string client = ClientOf(ctx);
  auto slot = limiter_.Admit(client, ClientLimiter::Kind::kExec);
  if (!slot.ok()) {
    return Refuse(client, slot.status());
  }
  std::shared_ptr<Sandbox> sb;
  if (auto s = Enter(ctx, req->sandbox_id(), &sb); !s.ok()) {
    return s;
  }
  CommandSpec spec;
  spec.argv.assign(req->argv().begin(), req->argv().end());
  spec.env.insert(req->env().begin(), req->env().end());
  spec.cwd = req->cwd();
  spec.timeout = std::chrono::milliseconds(req->timeout_ms());
  spec.stdin = !req->stdin().empty();
  auto cmd = sb->Start(spec);
  if (!cmd.ok()) {
    return ToGrpc(cmd.status());
  }
  metrics_->execs->Inc();
  RunningCommand* running = cmd->get();
  std::thread writer;
  if (spec.stdin) {
    // A separate writer: a command that prints before reading all its input must not
    // deadlock against us.
    writer = std::thread([running, req] {
      (void)running->WriteStdin(req->stdin());
      running->CloseStdin();
    });
  }
  BufferSink sink(cap);
  CommandResult result = running->Pump(sink, [ctx] { return ctx->IsCancelled(); });
  running->CloseStdin();
  if (writer.joinable()) {
    writer.join();
  }
  metrics_->exec_seconds->Observe(result.wall_ms / 1000.0);
  if (result.timed_out) {
    metrics_->exec_timeouts->Inc();
  }
  if (result.oom_killed) {
    metrics_->oom_kills->Inc();
  }
  v1::ExecResult* r = resp->mutable_result();
  ResultToProto(result, r);
  r->set_stdout_truncated(sink.out_.truncated());
  r->set_stderr_truncated(sink.err_.truncated());
  resp->set_stdout(sink.out_.Take());
  resp->set_stderr(sink.err_.Take());
  return grpc::Status::OK;
}

grpc::Status PboxService::WriteFile(grpc::ServerContext* ctx,
                                    grpc::ServerReader<v1::WriteFileRequest>* reader,
                                    v1::FileInfo* resp) {
  if (auto s = Authorize(ctx); !s.ok()) {
    return s;
  }
  auto t0 = Clock::now();
  v1::WriteFileRequest msg;
  if (!reader->Read(&msg) || !msg.has_header()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "the first message of a WriteFile must be its header");
  }
  const v1::WriteFileHeader header = msg.header();
  std::shared_ptr<Sandbox> sb;
  if (auto s = Enter(ctx, header.sandbox_id(), &sb); !s.ok()) {
    return s;
  }
  Sandbox::TransferHold hold(sb);  // no idle TTL while the bytes come
  uint32_t mode = header.mode() == 0 ? 0644 : header.mode();
  if ((mode & ~07777u) != 0) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        fmt::format("mode {:o} has bits beyond 07777", mode));
  }
  auto fd = sb->fs().OpenWrite(header.path(), mode & 0777, header.make_parents(), header.append());
  if (!fd.ok()) {
    return ToGrpc(fd.status());
  }
  if (Status s = RefusePseudoFs(fd->get(), header.path()); !s.ok()) {
    return ToGrpc(s);
  }
  uint64_t written = 0;
  while (reader->Read(&msg)) {
    if (!msg.has_chunk() && msg.has_header()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "WriteFile: a second header in one call");
    }
    Status s = WriteAll(fd->get(), msg.chunk());
    if (!s.ok()) {
      return ToGrpc(Annotate(s, header.path()));
    }
    written += msg.chunk().size();
  }
  if (ctx->IsCancelled()) {
    return grpc::Status(grpc::StatusCode::CANCELLED, "upload cancelled by the client");
  }
  if (sb->destroying()) {  // destroyed meanwhile: the bytes went with it
    return grpc::Status(grpc::StatusCode::NOT_FOUND,
                        fmt::format("sandbox {} was destroyed during the upload", sb->id()));
  }
  struct stat st;
  if (::fstat(fd->get(), &st) != 0) {
    return ToGrpc(ErrnoError("fstat", header.path()));
  }
  resp->set_path(header.path());
  resp->set_type(v1::FILE_TYPE_REGULAR);
  resp->set_size(static_cast<uint64_t>(st.st_size));
  resp->set_mode(st.st_mode & 07777);
  resp->set_mtime_unix_ns(static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 +
                          st.st_mtim.tv_nsec);
  metrics_->bytes_uploaded->Inc(written);
  metrics_->upload_seconds->Observe(SecondsSince(t0));
  return grpc::Status::OK;
}

grpc::Status PboxService::ReadFile(grpc::ServerContext* ctx, const v1::ReadFileRequest* req,
                                   grpc::ServerWriter<v1::ReadFileResponse>* writer) {
  auto t0 = Clock::now();
  std::shared_ptr<Sandbox> sb;
  if (auto s = Enter(ctx, req->sandbox_id(), &sb); !s.ok()) {
    return s;
  }
  Sandbox::TransferHold hold(sb);  // no idle TTL while the bytes go
  auto fd = sb->fs().OpenRead(req->path());
  if (!fd.ok()) {
    return ToGrpc(fd.status());
  }
  if (Status s = RefusePseudoFs(fd->get(), req->path()); !s.ok()) {
    return ToGrpc(s);
  }
  uint64_t offset = req->offset();
  uint64_t left = req->length() == 0 ? UINT64_MAX : req->length();
  v1::ReadFileResponse msg;
  std::string* buf = msg.mutable_chunk();
  uint64_t sent = 0;
  while (left > 0) {
    size_t want = static_cast<size_t>(std::min<uint64_t>(left, kChunkBytes));
    buf->resize(want);
    ssize_t n = ::pread(fd->get(), buf->data(), want, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) {
        continue;
      }
      return ToGrpc(ErrnoError("pread", req->path()));
    }
    if (n == 0) {
      break;
    }
    buf->resize(static_cast<size_t>(n));
    if (!writer->Write(msg)) {
      return grpc::Status(grpc::StatusCode::CANCELLED, "download cancelled by the client");
    }
    offset += static_cast<uint64_t>(n);
    left -= static_cast<uint64_t>(n);
    sent += static_cast<uint64_t>(n);
  }
  metrics_->bytes_downloaded->Inc(sent);
  metrics_->download_seconds->Observe(SecondsSince(t0));
  return grpc::Status::OK;
}

grpc::Status PboxService::ListDir(grpc::ServerContext* ctx, const v1::ListDirRequest* req,
                                  v1::ListDirResponse* resp) {
  std::shared_ptr<Sandbox> sb;
  if (auto s = Enter(ctx, req->sandbox_id(), &sb); !s.ok()) {
    return s;
  }
  auto entries = sb->fs().ListDir(req->path());
  if (!entries.ok()) {
    return ToGrpc(entries.status());
  }
  for (const FileStat& e : *entries) {
    StatToProto(e, resp->add_entries());
  }
  return grpc::Status::OK;
}

grpc::Status PboxService::Stat(grpc::ServerContext* ctx, const v1::StatRequest* req,
                               v1::FileInfo* resp) {
  std::shared_ptr<Sandbox> sb;
  if (auto s = Enter(ctx, req->sandbox_id(), &sb); !s.ok()) {
    return s;
  }
  return StatInto(*sb, req->path(), resp);
}

grpc::Status PboxService::MakeDir(grpc::ServerContext* ctx, const v1::MakeDirRequest* req,
                                  v1::FileInfo* resp) {
  std::shared_ptr<Sandbox> sb;
  if (auto s = Enter(ctx, req->sandbox_id(), &sb); !s.ok()) {
    return s;
  }
  uint32_t mode = req->mode() == 0 ? 0755 : req->mode();
  if ((mode & ~07777u) != 0) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        fmt::format("mode {:o} has bits beyond 07777", mode));
  }
  if (Status s = sb->fs().MakeDir(req->path(), mode & 0777, req->parents()); !s.ok()) {
    return ToGrpc(s);
  }
  return StatInto(*sb, req->path(), resp);
}

grpc::Status PboxService::Remove(grpc::ServerContext* ctx, const v1::RemoveRequest* req,
                                 v1::RemoveResponse*) {
  std::shared_ptr<Sandbox> sb;
  if (auto s = Enter(ctx, req->sandbox_id(), &sb); !s.ok()) {
    return s;
  }
  return ToGrpc(sb->Remove(req->path(), req->recursive()));
}

grpc::Status PboxService::Move(grpc::ServerContext* ctx, const v1::MoveRequest* req,
                               v1::FileInfo* resp) {
  std::shared_ptr<Sandbox> sb;
  if (auto s = Enter(ctx, req->sandbox_id(), &sb); !s.ok()) {
    return s;
  }
  if (Status s = sb->fs().Move(req->src(), req->dst(), req->no_replace()); !s.ok()) {
    return ToGrpc(s);
  }
  return StatInto(*sb, req->dst(), resp);
}

void PboxService::EnableDataChannel(TransferTickets* tickets, std::string unix_endpoint,
                                    uint16_t tcp_port) {
  tickets_ = tickets;
  data_unix_endpoint_ = std::move(unix_endpoint);
  data_tcp_port_ = tcp_port;
}

grpc::Status PboxService::OpenTransfer(grpc::ServerContext* ctx, const v1::OpenTransferRequest* req,
                                       v1::OpenTransferResponse* resp) {
  if (auto s = Authorize(ctx); !s.ok()) {
    return s;
  }
  const bool unix_peer = ctx->peer().rfind("unix:", 0) == 0;
  std::string endpoint;
  if (tickets_ != nullptr) {
    if (unix_peer) {
      endpoint = data_unix_endpoint_;
    } else if (data_tcp_port_ != 0) {
      endpoint = fmt::format("tcp://:{}", data_tcp_port_);
    }
  }
  if (endpoint.empty()) {
    return grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                        "this agent offers no data channel here: use WriteFile/ReadFile");
  }
  const std::string client = ClientOf(ctx);
  auto slot = limiter_.Admit(client, ClientLimiter::Kind::kTransfer);
  if (!slot.ok()) {
    return Refuse(client, slot.status());
  }
  std::shared_ptr<Sandbox> sb;
  if (auto s = Enter(ctx, req->sandbox_id(), &sb); !s.ok()) {
    return s;
  }
  TransferGrant grant;
  grant.sandbox = sb;
  grant.path = req->path();
  grant.slot = *std::move(slot);
  switch (req->direction()) {
    case v1::TRANSFER_DIRECTION_UPLOAD: {
      uint32_t mode = req->mode() == 0 ? 0644 : req->mode();
      if ((mode & ~07777u) != 0) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            fmt::format("mode {:o} has bits beyond 07777", mode));
      }
      auto pending = sb->fs().CreatePending(req->path(), req->make_parents());
      if (!pending.ok()) {
        return ToGrpc(pending.status());
      }
      if (Status s = RefusePseudoFs(pending->fd(), req->path()); !s.ok()) {
        return ToGrpc(s);
      }
      // Refused now rather than after the bytes crossed: a file larger than the space left
      // (the sandbox's disk limit) would fail with ENOSPC anyway.
      struct statfs sfs;
      if (::fstatfs(pending->fd(), &sfs) == 0 && sfs.f_blocks != 0) {
        uint64_t free_bytes = static_cast<uint64_t>(sfs.f_bavail) * sfs.f_bsize;
        if (req->size() > free_bytes) {
          return grpc::Status(
              grpc::StatusCode::RESOURCE_EXHAUSTED,
              fmt::format("{}: {} bytes do not fit in the {} bytes left on the sandbox's disk "
                          "(its disk limit)",
                          req->path(), req->size(), free_bytes));
        }
      }
      grant.op = DataOp::kUpload;
      grant.size = req->size();
      grant.mode = mode & 0777;
      grant.pending.emplace(*std::move(pending));
      break;
    }
    case v1::TRANSFER_DIRECTION_DOWNLOAD: {
      auto fd = sb->fs().OpenRead(req->path());
      if (!fd.ok()) {
        return ToGrpc(fd.status());
      }
      if (Status s = RefusePseudoFs(fd->get(), req->path()); !s.ok()) {
        return ToGrpc(s);
      }
      struct stat st;
      if (::fstat(fd->get(), &st) != 0) {
        return ToGrpc(ErrnoError("fstat", req->path()));
      }
      grant.op = DataOp::kDownload;
      grant.offset = req->offset();
      grant.size = req->length() == 0 ? UINT64_MAX : req->length();
      uint64_t size = static_cast<uint64_t>(st.st_size);
      resp->set_size(size > grant.offset ? std::min(size - grant.offset, grant.size) : 0);
      grant.file = *std::move(fd);
      break;
    }
    default:
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "OpenTransfer: direction must be UPLOAD or DOWNLOAD");
  }
  auto ticket = tickets_->Issue(std::move(grant));
  if (!ticket.ok()) {
    if (ticket.status().code() == absl::StatusCode::kResourceExhausted) {
      return Refuse(client, ticket.status());
    }
    return ToGrpc(ticket.status());
  }
  resp->set_ticket(reinterpret_cast<const char*>(ticket->data()), ticket->size());
  resp->set_data_endpoint(endpoint);
  resp->set_expires_in_ms(static_cast<uint32_t>(tickets_->ttl().count()));
  return grpc::Status::OK;
}

grpc::Status PboxService::Info(grpc::ServerContext* ctx, const v1::InfoRequest*,
                               v1::InfoResponse* resp) {
  if (auto s = Authorize(ctx); !s.ok()) {
    return s;
  }
  resp->set_version(info_.version);
  resp->set_default_runtime(info_.default_runtime);
  for (const auto& r : info_.runtimes) {
    resp->add_runtimes(r);
  }
  resp->set_cpuset(info_.cpuset);
  resp->set_max_sandboxes(manager_->max_sandboxes());
  resp->set_live_sandboxes(static_cast<uint32_t>(manager_->live()));
  for (const auto& i : images_ != nullptr ? images_->Names() : info_.images) {
    resp->add_images(i);
  }
  resp->set_hostname(info_.hostname);
  resp->set_cgroup_version(info_.cgroup_version);
  resp->set_mode(info_.mode);
  for (const std::string& limit : info_.limits) {
    resp->add_limits(limit);
  }
  resp->set_uid(info_.uid);
  resp->set_root_fs(info_.root_fs);
  resp->set_default_memory_bytes(manager_->defaults().memory_bytes);
  resp->set_default_disk_bytes(manager_->defaults().disk_bytes);
  resp->set_default_pids(manager_->defaults().pids);
  return grpc::Status::OK;
}

grpc::Status PboxService::Health(grpc::ServerContext* ctx, const v1::HealthRequest*,
                                 v1::HealthResponse* resp) {
  if (auto s = Authorize(ctx); !s.ok()) {
    return s;
  }
  resp->set_serving(true);
  resp->set_live_sandboxes(static_cast<uint32_t>(manager_->live()));
  return grpc::Status::OK;
}

}  // namespace bragg::pbox
