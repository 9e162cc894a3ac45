#include "pbox/client/client.h"

#include <grpcpp/grpcpp.h>
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <random>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "common/fs.h"
#include "common/process.h"
#include "fmt/format.h"
#include "pbox/client/data_client.h"
#include "pbox/wire/default_paths.h"

namespace bragg::pbox::client {

Status FromGrpc(const grpc::Status& status) {
  if (status.ok()) {
    return absl::OkStatus();
  }
  std::string message = status.error_message();
  if (status.error_code() == grpc::StatusCode::UNAVAILABLE &&
      message.find("connect") != std::string::npos) {
    message += kConnectHint;
  }
  return Status(static_cast<absl::StatusCode>(status.error_code()), message);
}

Result<std::unique_ptr<Client>> Client::Connect(const ClientOptions& options) {
  std::unique_ptr<Client> c(new Client());
  c->endpoint_ = options.endpoint;
  if (c->endpoint_.empty()) {
    c->endpoint_ = bragg::GetEnv("PBOX_ENDPOINT");
  }
  if (c->endpoint_.empty()) {
    c->endpoint_ = DefaultEndpoint();
  }
  c->token_ = options.token;
  std::random_device random;
  c->client_id_ = fmt::format("cc-{}-{:08x}{:08x}", ::getpid(), random(), random());
  if (c->token_.empty()) {
    c->token_ = bragg::GetEnv("PBOX_TOKEN");
  }
  if (c->token_.empty() && !bragg::GetEnv("PBOX_TOKEN_FILE").empty()) {
    BRAGG_ASSIGN_OR_RETURN(c->token_, ReadFileToString(bragg::GetEnv("PBOX_TOKEN_FILE")));
    while (!c->token_.empty() && (c->token_.back() == '\n' || c->token_.back() == ' ')) {
      c->token_.pop_back();
    }
  }
  c->call_timeout_ms_ = options.call_timeout_ms;
  std::string target;
  if (c->endpoint_.rfind("unix://", 0) == 0) {
    target = "unix:" + c->endpoint_.substr(7);
  } else if (c->endpoint_.rfind("tcp://", 0) == 0) {
    target = c->endpoint_.substr(6);
  } else {
    return absl::InvalidArgumentError(fmt::format(
        "endpoint \"{}\": expected unix:///path.sock or tcp://host:port", c->endpoint_));
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(16 << 20);
  args.SetMaxSendMessageSize(16 << 20);
  // Keepalive lets the agent and this client notice a dead peer on TCP within seconds.
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  // A restarted agent is reached within seconds: gRPC's own reconnect backoff (1 s growing to
  // 120 s) would otherwise keep failing calls fast long after the agent is back.
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 200);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 4000);
  // Large initial flow-control window: file transfers move MiBs per call.
  args.SetInt(GRPC_ARG_HTTP2_STREAM_LOOKAHEAD_BYTES, 8 << 20);
  // gRPC reads sockets 8 KiB at a time by default: a MiB then costs 128 system calls.
  args.SetInt(GRPC_ARG_TCP_READ_CHUNK_SIZE, 512 << 10);
  args.SetInt(GRPC_ARG_TCP_MIN_READ_CHUNK_SIZE, 256 << 10);
  args.SetInt(GRPC_ARG_TCP_MAX_READ_CHUNK_SIZE, 4 << 20);
  if (options.data_channel && bragg::GetEnv("PBOX_DATA_CHANNEL") != "0") {
    std::string host;
    if (c->endpoint_.rfind("tcp://", 0) == 0) {
      host = target.substr(0, target.rfind(':'));
    }
    c->data_ = std::make_unique<DataPool>(host);
  }
  c->channel_ = grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
  c->stub_ = v1::Pbox::NewStub(c->channel_);
  return c;
}

Client::~Client() = default;

void Client::Prepare(grpc::ClientContext* ctx, bool with_deadline, uint32_t timeout_ms) const {
  ctx->AddMetadata("x-pbox-client", client_id_);
  if (!token_.empty()) {
    ctx->AddMetadata("authorization", "Bearer " + token_);
  }
  uint32_t ms = timeout_ms != 0 ? timeout_ms : call_timeout_ms_;
  if (with_deadline && ms > 0) {
    ctx->set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(ms));
  }
}

Result<v1::InfoResponse> Client::Info() {
  grpc::ClientContext ctx;
  Prepare(&ctx, true);
  v1::InfoResponse resp;
  BRAGG_RETURN_IF_ERROR(FromGrpc(stub_->Info(&ctx, v1::InfoRequest(), &resp)));
  return resp;
}

Result<v1::HealthResponse> Client::Health(uint32_t timeout_ms) {
  grpc::ClientContext ctx;
  Prepare(&ctx, true, timeout_ms);
  v1::HealthResponse resp;
  BRAGG_RETURN_IF_ERROR(FromGrpc(stub_->Health(&ctx, v1::HealthRequest(), &resp)));
  return resp;
}

Result<std::unique_ptr<Session>> Client::OpenSession(const std::string& client_name,
                                                     const std::string& job_id,
                                                     uint32_t open_timeout_ms,
                                                     const std::string& cpuset) {
  std::unique_ptr<Session> s(new Session());
  s->ctx_ = std::make_unique<grpc::ClientContext>();
  Prepare(s->ctx_.get(), false);
  // The stream lives as long as the session, so it carries no deadline; a watchdog cancels it
  // if the agent does not answer the open in time (a peer that accepts TCP but never speaks).
  absl::Mutex mu;
  bool opened = false, timed_out = false;
  std::thread watchdog;
  if (open_timeout_ms > 0) {
    watchdog = std::thread([&] {
      absl::MutexLock lock(&mu);
      if (!mu.AwaitWithTimeout(absl::Condition(&opened), absl::Milliseconds(open_timeout_ms))) {
        timed_out = true;
        s->ctx_->TryCancel();
      }
    });
  }
  s->stream_ = stub_->Session(s->ctx_.get());
  v1::SessionRequest open;
  open.mutable_open()->set_client_name(client_name);
  open.mutable_open()->set_job_id(job_id);
  open.mutable_open()->set_cpuset(cpuset);
  v1::SessionEvent ev;
  bool ok = s->stream_->Write(open) && s->stream_->Read(&ev) && ev.has_opened();
  if (watchdog.joinable()) {
    {
      absl::MutexLock lock(&mu);
      opened = true;
    }
    watchdog.join();
  }
  if (!ok || timed_out) {
    s->stream_->WritesDone();
    s->closed_ = true;
    Status st = FromGrpc(s->stream_->Finish());
    if (timed_out) {
      return absl::DeadlineExceededError(fmt::format(
          "the agent at {} did not open the session within {} ms", endpoint_, open_timeout_ms));
    }
    return st.ok() ? absl::UnavailableError("the agent closed the session at once") : st;
  }
  s->id_ = ev.opened().session_id();
  s->reader_ = std::thread([stream = s->stream_.get()] {
    v1::SessionEvent e;
    while (stream->Read(&e)) {
    }
  });
  return s;
}

Session::~Session() { (void)Close(); }

Status Session::Close() {
  if (closed_ || !stream_) {
    return absl::OkStatus();
  }
  closed_ = true;
  stream_->WritesDone();
  if (reader_.joinable()) {
    reader_.join();  // the agent ends the stream once it has destroyed the sandboxes
  }
  return FromGrpc(stream_->Finish());
}

Result<v1::Sandbox> Client::Create(const v1::SandboxSpec& spec, const std::string& session_id) {
  grpc::ClientContext ctx;
  Prepare(&ctx, false);
  v1::CreateSandboxRequest req;
  *req.mutable_spec() = spec;
  req.set_session_id(session_id);
  v1::Sandbox resp;
  BRAGG_RETURN_IF_ERROR(FromGrpc(stub_->CreateSandbox(&ctx, req, &resp)));
  return resp;
}

Result<std::vector<v1::Sandbox>> Client::Clone(const std::string& sandbox_id, uint32_t count,
                                               const std::string& session_id,
                                               const v1::SandboxSpec& overrides) {
  grpc::ClientContext ctx;
  Prepare(&ctx, false);
  v1::CloneSandboxRequest req;
  req.set_sandbox_id(sandbox_id);
  req.set_count(count);
  req.set_session_id(session_id);
  *req.mutable_overrides() = overrides;
  v1::CloneSandboxResponse resp;
  BRAGG_RETURN_IF_ERROR(FromGrpc(stub_->CloneSandbox(&ctx, req, &resp)));
  return std::vector<v1::Sandbox>(resp.sandboxes().begin(), resp.sandboxes().end());
}

Status Client::Destroy(const std::string& sandbox_id) {
  grpc::ClientContext ctx;
  Prepare(&ctx, true);
  v1::DestroySandboxRequest req;
  req.set_sandbox_id(sandbox_id);
  v1::DestroySandboxResponse resp;
  return FromGrpc(stub_->DestroySandbox(&ctx, req, &resp));
}

Result<v1::Sandbox> Client::Get(const std::string& sandbox_id) {
  grpc::ClientContext ctx;
  Prepare(&ctx, true);
  v1::GetSandboxRequest req;
  req.set_sandbox_id(sandbox_id);
  v1::Sandbox resp;
  BRAGG_RETURN_IF_ERROR(FromGrpc(stub_->GetSandbox(&ctx, req, &resp)));
  return resp;
}

Result<std::vector<v1::Sandbox>> Client::List(const std::string& session_id) {
  grpc::ClientContext ctx;
  Prepare(&ctx, true);
  v1::ListSandboxesRequest req;
  req.set_session_id(session_id);
  v1::ListSandboxesResponse resp;
  BRAGG_RETURN_IF_ERROR(FromGrpc(stub_->ListSandboxes(&ctx, req, &resp)));
  return std::vector<v1::Sandbox>(resp.sandboxes().begin(), resp.sandboxes().end());
}

Result<v1::RunResponse> Client::Run(const RunArgs& args) {
  grpc::ClientContext ctx;
  Prepare(&ctx, false);
  v1::RunRequest req;
  req.set_sandbox_id(args.sandbox_id);
  for (const auto& a : args.argv) {
    req.add_argv(a);
  }
  req.mutable_env()->insert(args.env.begin(), args.env.end());
  req.set_cwd(args.cwd);
  req.set_timeout_ms(args.timeout_ms);
  req.set_stdin(args.stdin);
  req.set_max_output_bytes(args.max_output_bytes);
  v1::RunResponse resp;
  BRAGG_RETURN_IF_ERROR(FromGrpc(stub_->Run(&ctx, req, &resp)));
  return resp;
}

Result<v1::ExecResult> Client::Exec(const v1::ExecStart& start, int stdin_fd,
                                    const OutputFn& on_output) {
  grpc::ClientContext ctx;
  Prepare(&ctx, false);
  auto stream = stub_->Exec(&ctx);
  v1::ExecRequest first;
  *first.mutable_start() = start;
  first.mutable_start()->set_stdin(stdin_fd >= 0);
  if (!stream->Write(first)) {
    return FromGrpc(stream->Finish());
  }
  std::thread feeder;
  Pipe wake;
  if (stdin_fd >= 0) {
    BRAGG_ASSIGN_OR_RETURN(wake, MakePipe());
    feeder = std::thread([&stream, stdin_fd, wake_fd = wake.read.get()] {
      v1::ExecRequest msg;
      std::string buf(kChunkBytes, '\0');
      for (;;) {
        // Waits for input or for the command's end (a terminal may never reach EOF).
        struct pollfd fds[2] = {{stdin_fd, POLLIN, 0}, {wake_fd, POLLIN, 0}};
        if (::poll(fds, 2, -1) < 0) {
          if (errno == EINTR) {
            continue;
          }
          break;
        }
        if (fds[1].revents != 0) {
          return;
        }
        ssize_t n = ::read(stdin_fd, buf.data(), buf.size());
        if (n < 0 && (errno == EINTR || errno == EAGAIN)) {
          continue;
        }
        if (n <= 0) {
          break;
        }
        msg.set_stdin(buf.data(), static_cast<size_t>(n));
        if (!stream->Write(msg)) {
          return;
        }
      }
      stream->WritesDone();
    });
  } else {
    stream->WritesDone();
  }
  v1::ExecResponse resp;
  std::optional<v1::ExecResult> result;
  while (!result.has_value() && stream->Read(&resp)) {
    switch (resp.kind_case()) {
      case v1::ExecResponse::kStdout:
        on_output(false, resp.stdout());
        break;
      case v1::ExecResponse::kStderr:
        on_output(true, resp.stderr());
        break;
      case v1::ExecResponse::kResult:
        result = resp.result();
        break;
      default:
        break;
    }
  }
  if (feeder.joinable()) {
    wake.write.Reset();  // wakes the feeder
    feeder.join();
    if (result.has_value()) {
      // Input the command never read is moot; this ends our half of the stream.
      ctx.TryCancel();
    }
  }
  Status st = FromGrpc(stream->Finish());
  if (result.has_value()) {
    return *result;
  }
  return st.ok() ? absl::InternalError("Exec ended without a result") : st;
}

Result<v1::FileInfo> Client::Upload(const std::string& sandbox_id, const std::string& path,
                                    uint32_t mode, bool make_parents, const NextChunkFn& next) {
  grpc::ClientContext ctx;
  Prepare(&ctx, false);
  v1::FileInfo resp;
  auto writer = stub_->WriteFile(&ctx, &resp);
  v1::WriteFileRequest msg;
  v1::WriteFileHeader* h = msg.mutable_header();
  h->set_sandbox_id(sandbox_id);
  h->set_path(path);
  h->set_mode(mode);
  h->set_make_parents(make_parents);
  bool ok = writer->Write(msg);
  Status source_error;
  while (ok) {
    auto more = next(msg.mutable_chunk());
    if (!more.ok()) {
      source_error = more.status();
      ctx.TryCancel();
      break;
    }
    if (!*more) {
      break;
    }
    ok = writer->Write(msg);
  }
  writer->WritesDone();
  Status st = FromGrpc(writer->Finish());
  BRAGG_RETURN_IF_ERROR(source_error);
  BRAGG_RETURN_IF_ERROR(st);
  return resp;
}

Result<v1::OpenTransferResponse> Client::OpenTransfer(const v1::OpenTransferRequest& req) {
  grpc::ClientContext ctx;
  Prepare(&ctx, true);
  v1::OpenTransferResponse resp;
  BRAGG_RETURN_IF_ERROR(FromGrpc(stub_->OpenTransfer(&ctx, req, &resp)));
  if (resp.ticket().size() != kTicketBytes) {
    return absl::InternalError(fmt::format("OpenTransfer: a ticket of {} bytes, expected {}",
                                           resp.ticket().size(), kTicketBytes));
  }
  return resp;
}

bool Client::FallBack(const Status& status) {
  if (status.code() == absl::StatusCode::kUnimplemented) {
    data_off_ = true;  // an agent without the data channel
    return true;
  }
  if (status.code() == absl::StatusCode::kUnavailable) {
    // A data socket this client cannot reach (another mount namespace, a firewall): after a
    // few tries in a row, stop asking for tickets it cannot use.
    if (data_failures_.fetch_add(1) + 1 >= 3) {
      data_off_ = true;
    }
    return true;
  }
  return false;
}

namespace {

Ticket TicketOf(const v1::OpenTransferResponse& resp) {
  Ticket t;
  std::memcpy(t.data(), resp.ticket().data(), t.size());
  return t;
}

}  // namespace

Result<v1::FileInfo> Client::DataUpload(const std::string& sandbox_id, const std::string& path,
                                        uint32_t mode, bool make_parents, std::string_view data,
                                        int fd, off_t offset, uint64_t size) {
  v1::OpenTransferRequest req;
  req.set_sandbox_id(sandbox_id);
  req.set_path(path);
  req.set_direction(v1::TRANSFER_DIRECTION_UPLOAD);
  req.set_size(size);
  req.set_mode(mode);
  req.set_make_parents(make_parents);
  BRAGG_ASSIGN_OR_RETURN(v1::OpenTransferResponse resp, OpenTransfer(req));
  Result<DataStatus> st =
      fd >= 0 ? data_->UploadFile(resp.data_endpoint(), TicketOf(resp), fd, offset, size)
              : data_->Upload(resp.data_endpoint(), TicketOf(resp), data);
  BRAGG_RETURN_IF_ERROR(st.status());
  data_failures_ = 0;
  v1::FileInfo info;
  info.set_path(path);
  info.set_type(v1::FILE_TYPE_REGULAR);
  info.set_size(st->bytes);
  info.set_mode(st->mode);
  info.set_mtime_unix_ns(st->mtime_ns);
  return info;
}

Result<v1::FileInfo> Client::WriteFile(const std::string& sandbox_id, const std::string& path,
                                       std::string_view data, uint32_t mode, bool make_parents) {
  if (uses_data_channel()) {
    auto r = DataUpload(sandbox_id, path, mode, make_parents, data, -1, 0, data.size());
    if (r.ok() || !FallBack(r.status())) {
      return r;
    }
  }
  return Upload(sandbox_id, path, mode, make_parents, [&data](std::string* chunk) -> Result<bool> {
    if (data.empty()) {
      return false;
    }
    size_t n = std::min(data.size(), kChunkBytes);
    chunk->assign(data.data(), n);
    data.remove_prefix(n);
    return true;
  });
}

Result<v1::FileInfo> Client::WriteFileFromFd(const std::string& sandbox_id, const std::string& path,
                                             int fd, uint32_t mode, bool make_parents) {
  struct stat st;
  off_t at = ::lseek(fd, 0, SEEK_CUR);
  if (uses_data_channel() && ::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && at >= 0) {
    // A regular file's size is known up front: the bytes go with sendfile from its offset.
    uint64_t size = st.st_size > at ? static_cast<uint64_t>(st.st_size - at) : 0;
    auto r = DataUpload(sandbox_id, path, mode, make_parents, {}, fd, at, size);
    if (r.ok()) {
      (void)::lseek(fd, at + static_cast<off_t>(size), SEEK_SET);
      return r;
    }
    if (!FallBack(r.status())) {
      return r;
    }
  }
  return Upload(sandbox_id, path, mode, make_parents, [fd](std::string* chunk) -> Result<bool> {
    chunk->resize(kChunkBytes);
    for (;;) {
      ssize_t n = ::read(fd, chunk->data(), chunk->size());
      if (n < 0 && errno == EINTR) {
        continue;
      }
      if (n < 0) {
        return ErrnoError("read", "upload source");
      }
      chunk->resize(static_cast<size_t>(n));
      return n > 0;
    }
  });
}

Result<uint64_t> Client::DataDownload(const std::string& sandbox_id, const std::string& path,
                                      uint64_t offset, uint64_t length, std::string* out, int fd) {
  v1::OpenTransferRequest req;
  req.set_sandbox_id(sandbox_id);
  req.set_path(path);
  req.set_direction(v1::TRANSFER_DIRECTION_DOWNLOAD);
  req.set_offset(offset);
  req.set_length(length);
  BRAGG_ASSIGN_OR_RETURN(v1::OpenTransferResponse resp, OpenTransfer(req));
  BRAGG_ASSIGN_OR_RETURN(DataStatus st,
                         data_->Download(resp.data_endpoint(), TicketOf(resp), out, fd));
  data_failures_ = 0;
  return st.bytes;
}

Status Client::StreamDownload(const std::string& sandbox_id, const std::string& path,
                              uint64_t offset, uint64_t length, const ChunkFn& chunk) {
  grpc::ClientContext ctx;
  Prepare(&ctx, false);
  v1::ReadFileRequest req;
  req.set_sandbox_id(sandbox_id);
  req.set_path(path);
  req.set_offset(offset);
  req.set_length(length);
  auto reader = stub_->ReadFile(&ctx, req);
  v1::ReadFileResponse msg;
  Status sink_error;
  while (reader->Read(&msg)) {
    sink_error = chunk(msg.mutable_chunk());
    if (!sink_error.ok()) {
      ctx.TryCancel();
      break;
    }
  }
  Status st = FromGrpc(reader->Finish());
  BRAGG_RETURN_IF_ERROR(sink_error);
  return st;
}

Result<std::string> Client::ReadFile(const std::string& sandbox_id, const std::string& path,
                                     uint64_t offset, uint64_t length) {
  std::string out;
  if (uses_data_channel()) {
    auto r = DataDownload(sandbox_id, path, offset, length, &out, -1);
    if (r.ok()) {
      return out;
    }
    if (!FallBack(r.status())) {
      return r.status();
    }
    out.clear();
  }
  BRAGG_RETURN_IF_ERROR(
      StreamDownload(sandbox_id, path, offset, length, [&out](std::string* chunk) -> Status {
        if (out.empty()) {
          out = std::move(*chunk);
        } else {
          out += *chunk;
        }
        return absl::OkStatus();
      }));
  return out;
}

Result<uint64_t> Client::ReadFileToFd(const std::string& sandbox_id, const std::string& path,
                                      int fd) {
  if (uses_data_channel()) {
    auto r = DataDownload(sandbox_id, path, 0, 0, nullptr, fd);
    if (r.ok() || !FallBack(r.status())) {
      return r;
    }
  }
  uint64_t total = 0;
  BRAGG_RETURN_IF_ERROR(
      StreamDownload(sandbox_id, path, 0, 0, [fd, &total](std::string* chunk) -> Status {
        BRAGG_RETURN_IF_ERROR(WriteAll(fd, *chunk));
        total += chunk->size();
        return absl::OkStatus();
      }));
  return total;
}

Result<std::vector<v1::FileInfo>> Client::ListDir(const std::string& sandbox_id,
                                                  const std::string& path) {
  grpc::ClientContext ctx;
  Prepare(&ctx, true);
  v1::ListDirRequest req;
  req.set_sandbox_id(sandbox_id);
  req.set_path(path);
  v1::ListDirResponse resp;
  BRAGG_RETURN_IF_ERROR(FromGrpc(stub_->ListDir(&ctx, req, &resp)));
  return std::vector<v1::FileInfo>(resp.entries().begin(), resp.entries().end());
}

Result<v1::FileInfo> Client::Stat(const std::string& sandbox_id, const std::string& path) {
  grpc::ClientContext ctx;
  Prepare(&ctx, true);
  v1::StatRequest req;
  req.set_sandbox_id(sandbox_id);
  req.set_path(path);
  v1::FileInfo resp;
  BRAGG_RETURN_IF_ERROR(FromGrpc(stub_->Stat(&ctx, req, &resp)));
  return resp;
}

Result<v1::FileInfo> Client::MakeDir(const std::string& sandbox_id, const std::string& path,
                                     bool parents, uint32_t mode) {
  grpc::ClientContext ctx;
  Prepare(&ctx, true);
  v1::MakeDirRequest req;
  req.set_sandbox_id(sandbox_id);
  req.set_path(path);
  req.set_parents(parents);
  req.set_mode(mode);
  v1::FileInfo resp;
  BRAGG_RETURN_IF_ERROR(FromGrpc(stub_->MakeDir(&ctx, req, &resp)));
  return resp;
}

Status Client::Remove(const std::string& sandbox_id, const std::string& path, bool recursive) {
  grpc::ClientContext ctx;
  Prepare(&ctx, true);
  v1::RemoveRequest req;
  req.set_sandbox_id(sandbox_id);
  req.set_path(path);
  req.set_recursive(recursive);
  v1::RemoveResponse resp;
  return FromGrpc(stub_->Remove(&ctx, req, &resp));
}

Result<v1::FileInfo> Client::Move(const std::string& sandbox_id, const std::string& src,
                                  const std::string& dst, bool no_replace) {
  grpc::ClientContext ctx;
  Prepare(&ctx, true);
  v1::MoveRequest req;
  req.set_sandbox_id(sandbox_id);
  req.set_src(src);
  req.set_dst(dst);
  req.set_no_replace(no_replace);
  v1::FileInfo resp;
  BRAGG_RETURN_IF_ERROR(FromGrpc(stub_->Move(&ctx, req, &resp)));
  return resp;
}

Result<v1::ImageInfo> Client::ImportImage(const std::string& name, int fd, const std::string& ref) {
  grpc::ClientContext ctx;
  Prepare(&ctx, false);
  v1::ImageInfo resp;
  auto writer = stub_->ImportImage(&ctx, &resp);
  v1::ImportImageRequest msg;
  msg.mutable_header()->set_name(name);
  msg.mutable_header()->set_ref(ref);
  bool ok = writer->Write(msg);
  Status source_error;
  std::string* chunk = msg.mutable_chunk();
  // Larger pieces than file uploads: images are GiBs and the agent only spools them.
  constexpr size_t kImportChunkBytes = 1 << 20;
  while (ok) {
    chunk->resize(kImportChunkBytes);
    ssize_t n = ::read(fd, chunk->data(), chunk->size());
    if (n < 0 && errno == EINTR) {
      continue;
    }
    if (n < 0) {
      source_error = ErrnoError("read", "image archive");
      ctx.TryCancel();
      break;
    }
    if (n == 0) {
      break;
    }
    chunk->resize(static_cast<size_t>(n));
    ok = writer->Write(msg);
  }
  writer->WritesDone();
  Status st = FromGrpc(writer->Finish());
  BRAGG_RETURN_IF_ERROR(source_error);
  BRAGG_RETURN_IF_ERROR(st);
  return resp;
}

Result<std::vector<v1::ImageInfo>> Client::ListImages() {
  grpc::ClientContext ctx;
  Prepare(&ctx, true);
  v1::ListImagesResponse resp;
  BRAGG_RETURN_IF_ERROR(FromGrpc(stub_->ListImages(&ctx, v1::ListImagesRequest(), &resp)));
  return std::vector<v1::ImageInfo>(resp.images().begin(), resp.images().end());
}

Status Client::RemoveImage(const std::string& name) {
  grpc::ClientContext ctx;
  Prepare(&ctx, true);
  v1::RemoveImageRequest req;
  req.set_name(name);
  v1::RemoveImageResponse resp;
  return FromGrpc(stub_->RemoveImage(&ctx, req, &resp));
}

Result<v1::PruneImagesResponse> Client::PruneImages() {
  grpc::ClientContext ctx;
  Prepare(&ctx, false);
  v1::PruneImagesResponse resp;
  BRAGG_RETURN_IF_ERROR(FromGrpc(stub_->PruneImages(&ctx, v1::PruneImagesRequest(), &resp)));
  return resp;
}

}  // namespace bragg::pbox::client
