#pragma once

// C++ client of the pbox agent (bragg.pbox.v1). The pbox CLI is built on it.
//
//   auto client = Client::Connect({});                  // PBOX_ENDPOINT or the default socket
//   auto session = (*client)->OpenSession("trainer");   // sandboxes live while it is open
//   auto sb = (*client)->Create(spec, (*session)->id());
//   auto r = (*client)->Run(RunArgs{.sandbox_id = sb->id(), .argv = {"python3", "-c", "1"}});
//
// Thread-safe: one Client may be used from many threads (gRPC channels are).

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "bragg/pbox/v1/pbox.grpc.pb.h"
#include "common/status.h"

namespace bragg::pbox::client {

namespace v1 = bragg::pbox::v1;

struct ClientOptions {
  // "unix:///path.sock" or "tcp://host:port". Empty: $PBOX_ENDPOINT, else DefaultEndpoint()
  // (pbox/wire/default_paths.h: unix:///run/pbox/pbox.sock, or for a user without a system
  // agent, that user's rootless agent's socket).
  std::string endpoint;
  // Bearer token for TCP. Empty: $PBOX_TOKEN, else the contents of $PBOX_TOKEN_FILE.
  std::string token;
  // Deadline of unary calls other than Run/Create (ms). 0: none.
  uint32_t call_timeout_ms = 60000;
  // File bytes over the agent's data channel (docs/pbox.md "Data channel") when it offers
  // one, else over the WriteFile/ReadFile gRPC streams. false (or $PBOX_DATA_CHANNEL=0):
  // always the gRPC streams.
  bool data_channel = true;
};

class DataPool;

struct RunArgs {
  std::string sandbox_id;
  std::vector<std::string> argv;
  std::map<std::string, std::string> env;
  std::string cwd;
  uint64_t timeout_ms = 0;
  std::string stdin;
  uint64_t max_output_bytes = 0;
};

// Called with each piece of output as it arrives, on the calling thread.
using OutputFn = std::function<void(bool is_stderr, std::string_view data)>;

// A lease held open with the agent: when it is destroyed (or the process dies), the agent
// destroys every sandbox created in it. Not thread-safe; owns a background stream.
class Session {
 public:
  ~Session();
  const std::string& id() const { return id_; }
  // Ends the session now (the agent then destroys its sandboxes).
  Status Close();

 private:
  friend class Client;
  Session() = default;
  std::string id_;
  std::unique_ptr<grpc::ClientContext> ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::SessionRequest, v1::SessionEvent>> stream_;
  // Reads the stream until it ends. A call blocked on the stream is what answers the agent's
  // keepalive pings: a session whose client made no call for a while (a trainer's warm start)
  // would otherwise lose its connection, and the agent would end it with its sandboxes.
  std::thread reader_;
  bool closed_ = false;
};

class Client {
 public:
  // Resolves the endpoint and token; does not contact the agent (the first call does).
  static Result<std::unique_ptr<Client>> Connect(const ClientOptions& options);

  const std::string& endpoint() const { return endpoint_; }

  Result<v1::InfoResponse> Info();
  // `timeout_ms` 0: the call timeout of ClientOptions.
  Result<v1::HealthResponse> Health(uint32_t timeout_ms = 0);

  // `job_id` (e.g. $SLURM_JOB_ID) is sent to the agent with the session, for its logs.
  // DEADLINE_EXCEEDED if the agent has not opened it within `open_timeout_ms` (0: no limit).
  // `cpuset` (a CPU list such as "4-7"): the session's sandboxes run only on these CPUs, for a
  // long-lived agent that several jobs share; INVALID_ARGUMENT unless they lie within the
  // agent's sandbox CPUs. Empty: the agent's whole set.
  Result<std::unique_ptr<Session>> OpenSession(const std::string& client_name,
                                               const std::string& job_id = "",
                                               uint32_t open_timeout_ms = 30000,
                                               const std::string& cpuset = "");

  // Empty session_id: a detached sandbox, destroyed by DestroySandbox or its idle TTL.
  Result<v1::Sandbox> Create(const v1::SandboxSpec& spec, const std::string& session_id = "");
  // `count` sandboxes over a frozen copy of `sandbox_id`'s files (CloneSandbox). Empty
  // session_id: the source's session. `overrides`: non-zero fields replace the source's.
  Result<std::vector<v1::Sandbox>> Clone(const std::string& sandbox_id, uint32_t count,
                                         const std::string& session_id = "",
                                         const v1::SandboxSpec& overrides = {});
  Status Destroy(const std::string& sandbox_id);
  Result<v1::Sandbox> Get(const std::string& sandbox_id);
  Result<std::vector<v1::Sandbox>> List(const std::string& session_id = "");

  Result<v1::RunResponse> Run(const RunArgs& args);
  // Streams output to `on_output` and, if `stdin_fd` >= 0, copies that fd to the command's
  // stdin until EOF (on a helper thread). Returns the command's result.
  Result<v1::ExecResult> Exec(const v1::ExecStart& start, int stdin_fd, const OutputFn& on_output);

  // File transfers use the data channel when the agent offers it (falling back to the gRPC
  // streams when it does not, or when its data socket cannot be reached), else the gRPC
  // streams. Either way an upload that fails leaves nothing at `path` on the data channel;
  // the gRPC stream writes in place.

  // Uploads `data` (streamed in chunks).
  Result<v1::FileInfo> WriteFile(const std::string& sandbox_id, const std::string& path,
                                 std::string_view data, uint32_t mode = 0644,
                                 bool make_parents = true);
  // Uploads everything readable from `fd` (a regular file: from its offset, with sendfile).
  Result<v1::FileInfo> WriteFileFromFd(const std::string& sandbox_id, const std::string& path,
                                       int fd, uint32_t mode = 0644, bool make_parents = true);
  Result<std::string> ReadFile(const std::string& sandbox_id, const std::string& path,
                               uint64_t offset = 0, uint64_t length = 0);
  // Streams the file into `fd`; returns the bytes written.
  Result<uint64_t> ReadFileToFd(const std::string& sandbox_id, const std::string& path, int fd);
  Result<std::vector<v1::FileInfo>> ListDir(const std::string& sandbox_id, const std::string& path);
  Result<v1::FileInfo> Stat(const std::string& sandbox_id, const std::string& path);
  Result<v1::FileInfo> MakeDir(const std::string& sandbox_id, const std::string& path,
                               bool parents = true, uint32_t mode = 0755);
  Status Remove(const std::string& sandbox_id, const std::string& path, bool recursive = false);
  Result<v1::FileInfo> Move(const std::string& sandbox_id, const std::string& src,
                            const std::string& dst, bool no_replace = false);

  // Images. ImportImage streams the archive read from `fd` (a rootfs tarball, a docker/
  // podman save archive or an OCI layout tar) to the agent; `ref` picks one image of an
  // archive holding several (see ImportImageHeader.ref).
  Result<v1::ImageInfo> ImportImage(const std::string& name, int fd, const std::string& ref = "");
  Result<std::vector<v1::ImageInfo>> ListImages();
  Status RemoveImage(const std::string& name);
  Result<v1::PruneImagesResponse> PruneImages();

  static constexpr size_t kChunkBytes = 256 * 1024;

  // Whether transfers use the data channel now.
  bool uses_data_channel() const { return data_ != nullptr && !data_off_.load(); }

  ~Client();

 private:
  // Fills `chunk` with the next piece of an upload: true if it holds data, false at the end.
  using NextChunkFn = std::function<Result<bool>(std::string* chunk)>;

  Client() = default;
  // Adds the token and, if `with_deadline`, a deadline of `timeout_ms` (0: the call timeout).
  void Prepare(grpc::ClientContext* ctx, bool with_deadline, uint32_t timeout_ms = 0) const;
  // One WriteFile call fed by `next`; a source error cancels the call and is returned.
  Result<v1::FileInfo> Upload(const std::string& sandbox_id, const std::string& path, uint32_t mode,
                              bool make_parents, const NextChunkFn& next);

  // The data channel: opens a transfer, then runs `move` with its data endpoint and ticket.
  // Unimplemented (and the channel is switched off for this client) when the agent offers
  // none; Unavailable when its data socket cannot be reached.
  Result<v1::OpenTransferResponse> OpenTransfer(const v1::OpenTransferRequest& req);
  // True if `status` from the data channel means "use the gRPC stream instead".
  bool FallBack(const Status& status);
  Result<v1::FileInfo> DataUpload(const std::string& sandbox_id, const std::string& path,
                                  uint32_t mode, bool make_parents, std::string_view data, int fd,
                                  off_t offset, uint64_t size);
  // A download over the data channel, into `out` or (out null) written to `fd`: the bytes.
  Result<uint64_t> DataDownload(const std::string& sandbox_id, const std::string& path,
                                uint64_t offset, uint64_t length, std::string* out, int fd);
  // Takes the next piece of a download (it may move from it); an error cancels the call.
  using ChunkFn = std::function<Status(std::string* chunk)>;
  // One ReadFile call (length 0: to the end), each chunk handed to `chunk`.
  Status StreamDownload(const std::string& sandbox_id, const std::string& path, uint64_t offset,
                        uint64_t length, const ChunkFn& chunk);

  std::unique_ptr<DataPool> data_;
  std::atomic<bool> data_off_{false};
  std::atomic<int> data_failures_{0};  // consecutive unreachable data sockets
  std::string endpoint_;
  std::string token_;
  std::string client_id_;  // "x-pbox-client": what the agent's per-client limits count by
  uint32_t call_timeout_ms_ = 0;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Pbox::Stub> stub_;
};

// Appended by FromGrpc to a failure to connect.
inline constexpr std::string_view kConnectHint =
    " (is pboxd running? check --endpoint or PBOX_ENDPOINT)";

// grpc::Status -> Status, keeping the agent's message.
Status FromGrpc(const grpc::Status& status);

}  // namespace bragg::pbox::client
