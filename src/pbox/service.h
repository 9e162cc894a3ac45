#pragma once

// The gRPC face of the agent: bragg.pbox.v1.Pbox over the SandboxManager.

#include <memory>
#include <string>

#include "bragg/pbox/v1/pbox.grpc.pb.h"
#include "pbox/client_limiter.h"
#include "pbox/metrics.h"
#include "pbox/sandbox_manager.h"
#include "pbox/transfer_tickets.h"

namespace bragg::pbox {

// Series the service and the manager report to. Owned by the agent's Registry.
struct AgentMetrics {
  Counter* sandboxes_created = nullptr;
  Counter* sandboxes_destroyed = nullptr;
  Counter* rejections = nullptr;
  Counter* execs = nullptr;
  Counter* exec_timeouts = nullptr;
  Counter* oom_kills = nullptr;
  Counter* bytes_uploaded = nullptr;
  Counter* bytes_downloaded = nullptr;
  Histogram* create_seconds = nullptr;
  Histogram* exec_seconds = nullptr;
  Histogram* upload_seconds = nullptr;
  Histogram* download_seconds = nullptr;

  // Registers every series in `registry` (which must outlive the returned struct's use).
  static AgentMetrics Register(Registry* registry);
};

struct ServiceInfo {
  std::string version;
  std::string default_runtime;
  std::vector<std::string> runtimes;
  std::string cpuset;
  std::vector<std::string> images;
  std::string hostname;
  std::string cgroup_version;
  std::string mode;                 // "root" or "rootless"
  std::vector<std::string> limits;  // the cgroup controllers sandboxes have
  uint32_t uid = 0;
  std::string root_fs;  // "overlayfs" or "fuse-overlayfs"
};

// Thread-safe; every call may run concurrently.
class PboxService final : public bragg::pbox::v1::Pbox::Service {
 public:
  // `token`: required on TCP connections ("authorization: Bearer <token>"); unix-socket
  // peers are trusted by the socket's file mode. Empty: TCP calls are all refused.
  // `images` (borrowed, may be null: no image calls) must outlive the service. `limits`: the
  // per-client caps and refusal pacing of client_limiter.h, keyed by each call's ClientKey.
  PboxService(SandboxManager* manager, const AgentMetrics* metrics, ServiceInfo info,
              std::string token, ImageStore* images = nullptr, ClientLimits limits = {});

  grpc::Status Session(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<v1::SessionEvent, v1::SessionRequest>* stream) override;
  grpc::Status CreateSandbox(grpc::ServerContext* ctx, const v1::CreateSandboxRequest* req,
                             v1::Sandbox* resp) override;
  grpc::Status CloneSandbox(grpc::ServerContext* ctx, const v1::CloneSandboxRequest* req,
                            v1::CloneSandboxResponse* resp) override;
  grpc::Status DestroySandbox(grpc::ServerContext* ctx, const v1::DestroySandboxRequest* req,
                              v1::DestroySandboxResponse* resp) override;
  grpc::Status GetSandbox(grpc::ServerContext* ctx, const v1::GetSandboxRequest* req,
                          v1::Sandbox* resp) override;
  grpc::Status ListSandboxes(grpc::ServerContext* ctx, const v1::ListSandboxesRequest* req,
                             v1::ListSandboxesResponse* resp) override;
  grpc::Status Exec(grpc::ServerContext* ctx,
                    grpc::ServerReaderWriter<v1::ExecResponse, v1::ExecRequest>* stream) override;
  grpc::Status Run(grpc::ServerContext* ctx, const v1::RunRequest* req,
                   v1::RunResponse* resp) override;
  grpc::Status WriteFile(grpc::ServerContext* ctx, grpc::ServerReader<v1::WriteFileRequest>* reader,
                         v1::FileInfo* resp) override;
  grpc::Status ReadFile(grpc::ServerContext* ctx, const v1::ReadFileRequest* req,
                        grpc::ServerWriter<v1::ReadFileResponse>* writer) override;
  grpc::Status ListDir(grpc::ServerContext* ctx, const v1::ListDirRequest* req,
                       v1::ListDirResponse* resp) override;
  grpc::Status Stat(grpc::ServerContext* ctx, const v1::StatRequest* req,
                    v1::FileInfo* resp) override;
  grpc::Status MakeDir(grpc::ServerContext* ctx, const v1::MakeDirRequest* req,
                       v1::FileInfo* resp) override;
  grpc::Status Remove(grpc::ServerContext* ctx, const v1::RemoveRequest* req,
                      v1::RemoveResponse* resp) override;
  grpc::Status Move(grpc::ServerContext* ctx, const v1::MoveRequest* req,
                    v1::FileInfo* resp) override;
  grpc::Status OpenTransfer(grpc::ServerContext* ctx, const v1::OpenTransferRequest* req,
                            v1::OpenTransferResponse* resp) override;
  grpc::Status Info(grpc::ServerContext* ctx, const v1::InfoRequest* req,
                    v1::InfoResponse* resp) override;
  grpc::Status Health(grpc::ServerContext* ctx, const v1::HealthRequest* req,
                      v1::HealthResponse* resp) override;

  // Images (image_service.cc).
  grpc::Status ImportImage(grpc::ServerContext* ctx,
                           grpc::ServerReader<v1::ImportImageRequest>* reader,
                           v1::ImageInfo* resp) override;
  grpc::Status ListImages(grpc::ServerContext* ctx, const v1::ListImagesRequest* req,
                          v1::ListImagesResponse* resp) override;
  grpc::Status RemoveImage(grpc::ServerContext* ctx, const v1::RemoveImageRequest* req,
                           v1::RemoveImageResponse* resp) override;
  grpc::Status PruneImages(grpc::ServerContext* ctx, const v1::PruneImagesRequest* req,
                           v1::PruneImagesResponse* resp) override;

  // Offers the data channel: OpenTransfer files tickets in `tickets` (borrowed; must outlive
  // the service's calls) and sends unix callers to `unix_endpoint` ("unix:///p.data"), TCP
  // callers to `tcp_port` (0: none). Without it OpenTransfer is UNIMPLEMENTED. Call before
  // serving.
  void EnableDataChannel(TransferTickets* tickets, std::string unix_endpoint, uint16_t tcp_port);

  // The limiter OpenTransfer admits transfers with (their slots live in tickets).
  ClientLimiter* limiter() { return &limiter_; }

  // Chunk size of ReadFile responses.
  static constexpr size_t kChunkBytes = 256 * 1024;

 private:
  // OK for unix-socket peers and TCP peers with the right token; UNAUTHENTICATED otherwise.
  grpc::Status Authorize(grpc::ServerContext* ctx) const;
  // Authorize, then find the sandbox and mark it used.
  grpc::Status Enter(grpc::ServerContext* ctx, const std::string& sandbox_id,
                     std::shared_ptr<Sandbox>* out);
  // The ClientKey of the call's client.
  static std::string ClientOf(grpc::ServerContext* ctx);
  // Counts a refusal (RESOURCE_EXHAUSTED) for `client`, holds it as its budget says, and
  // returns it.
  grpc::Status Refuse(const std::string& client, const Status& status);
  // Stat of `path` in `sb` into `out`, with `out->path` = path as asked.
  static grpc::Status StatInto(const Sandbox& sb, const std::string& path, v1::FileInfo* out);
  void Describe(const Sandbox& sb, v1::Sandbox* out) const;

  SandboxManager* manager_;
  const AgentMetrics* metrics_;
  const ServiceInfo info_;
  const std::string token_;
  ImageStore* images_;
  ClientLimiter limiter_;
  TransferTickets* tickets_ = nullptr;
  std::string data_unix_endpoint_;
  uint16_t data_tcp_port_ = 0;
};

// absl::Status -> grpc::Status (the canonical codes are the same numbers).
grpc::Status ToGrpc(const Status& status);

}  // namespace bragg::pbox
