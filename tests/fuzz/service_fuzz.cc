// Fuzzes the agent's request handling for every API call: the real PboxService and
// SandboxManager behind an in-process gRPC server, over a FakeRuntime (no processes, real
// SandboxFs in a temp dir, real InitClient). Each input is a short script of calls against a
// fresh sandbox; every call must finish with a status (never a crash or a hang) whose message
// names no host path of the agent's, calls without the token must be refused, and after the
// script nothing is left: no sandbox, cgroup, CPU placement, frozen layer (CloneSandbox),
// imported image, image layer, upload spool or fd.
//
// Input: records  u8 op, u16 length (LE), `length` bytes.
//   op & 0x1f: the RPC, in the order of the proto's service (0 Session .. 15 Health, 16
//   CloneSandbox, 17 ImportImage, 18 ListImages, 19 RemoveImage, 20 PruneImages, 21
//   OpenTransfer; 22-31 Health); op & 0x80: send no token. The agent offers its data
//   channel, so OpenTransfer runs for real: it opens files and issues tickets, which must all
//   be gone (their temporary files and fds with them) once they expire.
//   unary RPCs: the bytes are the request message;
//   client-streaming RPCs (Session, Exec, WriteFile, ImportImage): the bytes are a sequence
//   of u16-length-prefixed request messages.
// Any string field named sandbox_id that equals "SB" is replaced by the live sandbox's id.
//
// With PBOX_FUZZ_ENDPOINT=unix:///path.sock the same scripts run against a real pboxd instead
// (corpus replay: the sandbox is created and destroyed through the API; no leak accounting).
// With PBOX_FUZZ_VERBOSE set, every call's status is printed (for checking what a seed reaches).

#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "bragg/pbox/v1/pbox.grpc.pb.h"
#include "common/fs.h"
#include "fake_runtime.h"
#include "pbox/cgroup/cpuset.h"
#include "pbox/image/image_store.h"
#include "pbox/metrics.h"
#include "pbox/sandbox_manager.h"
#include "pbox/service.h"
#include "pbox/transfer_tickets.h"
#include "spdlog/spdlog.h"

namespace pb = bragg::pbox;
namespace v1 = bragg::pbox::v1;
using google::protobuf::Message;

namespace {

constexpr char kToken[] = "fuzz-token-0123456789abcdef";
constexpr auto kCallDeadline = std::chrono::seconds(20);

[[noreturn]] void Die(const std::string& what) {
  std::cerr << "service_fuzz: " << what << "\n";
  std::abort();
}

int LowestFreeFd() {
  int fd = ::dup(0);
  ::close(fd);
  return fd;
}

// The agent, in process.
struct World {
  bragg::TempDir dir;
  std::unique_ptr<pb::ImageStore> images;
  pb::fuzz::FakeCgroupManager cgroups;
  pb::fuzz::FakeRuntime runtime;
  std::unique_ptr<pb::CpuAllocator> cpus;
  pb::Registry registry;
  pb::AgentMetrics metrics;
  std::unique_ptr<pb::SandboxManager> manager;
  std::unique_ptr<pb::TransferTickets> tickets;
  std::unique_ptr<pb::PboxService> service;
  std::unique_ptr<grpc::Server> server;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Pbox::Stub> stub;
  bool real = false;  // PBOX_FUZZ_ENDPOINT: a real agent, nothing above but channel/stub
};

World* world = nullptr;

// The tickets' clock: moved past every ticket's expiry when an input's script is done.
std::atomic<int64_t> ticket_clock_ms{0};

void Init() {
  world = new World();  // lives until exit: the fuzzer never tears it down
  ::signal(SIGPIPE, SIG_IGN);
  spdlog::set_level(spdlog::level::off);
  // Invalid UTF-8 in string fields is refused by the parser, which also logs it: noise here.
  google::protobuf::SetLogHandler(
      [](google::protobuf::LogLevel, const char*, int, const std::string&) {});
  if (const char* ep = std::getenv("PBOX_FUZZ_ENDPOINT"); ep != nullptr && *ep != '\0') {
    std::string target = ep;
    if (target.rfind("unix://", 0) == 0) {
      target = "unix:" + target.substr(7);
    }
    world->real = true;
    world->channel = grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
    world->stub = v1::Pbox::NewStub(world->channel);
    return;
  }
  auto dir = bragg::TempDir::Create("/tmp", "pbox-fuzz-world-");
  if (!dir.ok()) {
    Die("temp dir: " + dir.status().ToString());
  }
  world->dir = std::move(*dir);
  auto images = pb::ImageStore::Create(world->dir.path() + "/images", {});
  if (!images.ok()) {
    Die("image store: " + images.status().ToString());
  }
  world->images = std::move(*images);
  world->cpus = std::make_unique<pb::CpuAllocator>(pb::CpuSet({0, 1}));
  world->metrics = pb::AgentMetrics::Register(&world->registry);
  pb::SandboxDefaults defaults;
  defaults.max_memory_bytes = 8ull << 30;
  world->manager = std::make_unique<pb::SandboxManager>(
      std::map<std::string, pb::Runtime*>{{"native", &world->runtime}}, "native",
      world->images.get(), &world->cgroups, world->cpus.get(), defaults, /*max_sandboxes=*/8);
  if (bragg::Status s = bragg::MakeDirs(world->dir.path() + "/frozen", 0700); !s.ok()) {
    Die("frozen layers dir: " + s.ToString());
  }
  world->manager->set_layers_dir(world->dir.path() + "/frozen");
  pb::ServiceInfo info{.version = "fuzz", .default_runtime = "native", .runtimes = {"native"}};
  world->service = std::make_unique<pb::PboxService>(world->manager.get(), &world->metrics, info,
                                                     kToken, world->images.get());
  world->tickets = std::make_unique<pb::TransferTickets>(pb::TransferTicketOptions{}, [] {
    return pb::TransferTickets::Clock::time_point(std::chrono::milliseconds(ticket_clock_ms));
  });
  // In process, callers are not unix peers: the (never dialled) TCP port is what they get.
  world->service->EnableDataChannel(world->tickets.get(), "unix:///pbox-fuzz.sock.data", 65000);
  grpc::ServerBuilder builder;
  builder.RegisterService(world->service.get());
  builder.SetMaxReceiveMessageSize(16 << 20);
  world->server = builder.BuildAndStart();
  if (!world->server) {
    Die("cannot start the in-process server");
  }
  world->channel = world->server->InProcessChannel(grpc::ChannelArguments());
  world->stub = v1::Pbox::NewStub(world->channel);
}

// Replaces sandbox_id == "SB" anywhere in `m` with `id`.
void Substitute(Message* m, const std::string& id) {
  const auto* d = m->GetDescriptor();
  const auto* r = m->GetReflection();
  for (int i = 0; i < d->field_count(); ++i) {
    const auto* f = d->field(i);
    if (f->is_repeated()) {
      continue;
    }
    if (f->type() == google::protobuf::FieldDescriptor::TYPE_STRING && f->name() == "sandbox_id" &&
        r->GetString(*m, f) == "SB") {
      r->SetString(m, f, id);
    } else if (f->type() == google::protobuf::FieldDescriptor::TYPE_MESSAGE && r->HasField(*m, f)) {
      Substitute(r->MutableMessage(m, f), id);
    }
  }
}

std::vector<std::string> SplitStream(std::string_view bytes) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos + 2 <= bytes.size() && out.size() < 64) {
    size_t len = static_cast<uint8_t>(bytes[pos]) | (static_cast<uint8_t>(bytes[pos + 1]) << 8);
    pos += 2;
    len = std::min(len, bytes.size() - pos);
    out.emplace_back(bytes.substr(pos, len));
    pos += len;
  }
  return out;
}

template <typename Req>
bool Parse(std::string_view bytes, const std::string& id, Req* req) {
  if (!req->ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    return false;
  }
  Substitute(req, id);
  return true;
}

template <typename Req>
std::vector<Req> ParseStream(std::string_view bytes, const std::string& id) {
  std::vector<Req> out;
  for (const std::string& b : SplitStream(bytes)) {
    Req r;
    if (Parse(b, id, &r)) {
      out.push_back(std::move(r));
    }
  }
  return out;
}

void Check(const grpc::Status& s, bool authed, const char* call) {
  static const bool verbose = std::getenv("PBOX_FUZZ_VERBOSE") != nullptr;
  if (verbose) {
    std::cerr << call << ": " << s.error_code() << " " << s.error_message() << "\n";
  }
  if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    Die(std::string(call) + " hung (no answer within the deadline)");
  }
  if (s.error_code() == grpc::StatusCode::UNKNOWN) {
    Die(std::string(call) + " failed with UNKNOWN: " + s.error_message());
  }
  if (!world->real && !authed && s.error_code() != grpc::StatusCode::UNAUTHENTICATED) {
    Die(std::string(call) + " without a token was not refused (" + std::to_string(s.error_code()) +
        ")");
  }
  // The agent's own directories (its state, the image store's spool, sandbox roots: all
  // under /tmp/pbox-fuzz-* here) are none of a client's business.
  if (!world->real && s.error_message().find("/tmp/pbox-fuzz-") != std::string::npos) {
    Die(std::string(call) + " told the client a host path: " + s.error_message());
  }
  if (!s.ok() && s.error_code() != grpc::StatusCode::CANCELLED && s.error_message().empty()) {
    Die(std::string(call) + " failed without a message (code " + std::to_string(s.error_code()) +
        ")");
  }
}

// Writes the client's messages of a bidirectional stream while the caller reads the
// server's: the in-process transport does not buffer, so a client that wrote everything
// before reading would deadlock against a server that answers each message.
template <typename Stream, typename Req>
void WriteAll(Stream* stream, const std::vector<Req>& reqs) {
  for (const auto& r : reqs) {
    if (!stream->Write(r)) {
      break;
    }
  }
  stream->WritesDone();
}

// The fake runtime's commands exit at once, so only a tiny timeout can expire. (A huge
// timeout_ms used to overflow the deadline's nanoseconds and kill the command at once.)
void CheckTimedOut(bool timed_out, uint64_t timeout_ms, const char* call) {
  if (!world->real && timed_out && (timeout_ms == 0 || timeout_ms >= 1000)) {
    Die(std::string(call) + " reported a timeout with timeout_ms " + std::to_string(timeout_ms));
  }
}

void Call(uint8_t op, std::string_view bytes, const std::string& id) {
  bool authed = (op & 0x80) == 0 || world->real;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + kCallDeadline);
  if (authed) {
    ctx.AddMetadata("authorization", std::string("Bearer ") + kToken);
  }
  v1::Pbox::Stub& stub = *world->stub;
  switch (op & 0x1f) {
    case 0: {  // Session
      auto reqs = ParseStream<v1::SessionRequest>(bytes, id);
      auto stream = stub.Session(&ctx);
      std::thread writer([&] { WriteAll(stream.get(), reqs); });
      v1::SessionEvent ev;
      while (stream->Read(&ev)) {
      }
      writer.join();
      Check(stream->Finish(), authed, "Session");
      return;
    }
    case 1: {
      v1::CreateSandboxRequest req;
      v1::Sandbox resp;
      if (Parse(bytes, id, &req)) {
        grpc::Status st = stub.CreateSandbox(&ctx, req, &resp);
        Check(st, authed, "CreateSandbox");
        // Limits that reach cgroupfs must be sane numbers (NaN passed a `< 0 || > 4096` check).
        double q = resp.spec().cpu_quota();
        if (st.ok() && !(q >= 0 && q <= 4096)) {
          Die("CreateSandbox accepted cpu_quota " + std::to_string(q));
        }
      }
      return;
    }
    case 2: {
      v1::DestroySandboxRequest req;
      v1::DestroySandboxResponse resp;
      if (Parse(bytes, id, &req)) {
        Check(stub.DestroySandbox(&ctx, req, &resp), authed, "DestroySandbox");
      }
      return;
    }
    case 3: {
      v1::GetSandboxRequest req;
      v1::Sandbox resp;
      if (Parse(bytes, id, &req)) {
        Check(stub.GetSandbox(&ctx, req, &resp), authed, "GetSandbox");
      }
      return;
    }
    case 4: {
      v1::ListSandboxesRequest req;
      v1::ListSandboxesResponse resp;
      if (Parse(bytes, id, &req)) {
        Check(stub.ListSandboxes(&ctx, req, &resp), authed, "ListSandboxes");
      }
      return;
    }
    case 5: {  // Exec
      auto reqs = ParseStream<v1::ExecRequest>(bytes, id);
      auto stream = stub.Exec(&ctx);
      std::thread writer([&] { WriteAll(stream.get(), reqs); });
      v1::ExecResponse resp;
      bool timed_out = false;
      while (stream->Read(&resp)) {
        timed_out |= resp.has_result() && resp.result().timed_out();
      }
      writer.join();
      Check(stream->Finish(), authed, "Exec");
      uint64_t timeout_ms = reqs.empty() ? 0 : reqs[0].start().timeout_ms();
      CheckTimedOut(timed_out, timeout_ms, "Exec");
      return;
    }
    case 6: {
      v1::RunRequest req;
      v1::RunResponse resp;
      if (Parse(bytes, id, &req)) {
        Check(stub.Run(&ctx, req, &resp), authed, "Run");
        CheckTimedOut(resp.result().timed_out(), req.timeout_ms(), "Run");
      }
      return;
    }
    case 7: {  // WriteFile
      auto reqs = ParseStream<v1::WriteFileRequest>(bytes, id);
      v1::FileInfo resp;
      auto stream = stub.WriteFile(&ctx, &resp);
      for (const auto& r : reqs) {
        if (!stream->Write(r)) {
          break;
        }
      }
      stream->WritesDone();
      Check(stream->Finish(), authed, "WriteFile");
      return;
    }
    case 8: {
      v1::ReadFileRequest req;
      if (Parse(bytes, id, &req)) {
        auto stream = stub.ReadFile(&ctx, req);
        v1::ReadFileResponse resp;
        while (stream->Read(&resp)) {
        }
        Check(stream->Finish(), authed, "ReadFile");
      }
      return;
    }
    case 9: {
      v1::ListDirRequest req;
      v1::ListDirResponse resp;
      if (Parse(bytes, id, &req)) {
        Check(stub.ListDir(&ctx, req, &resp), authed, "ListDir");
      }
      return;
    }
    case 10: {
      v1::StatRequest req;
      v1::FileInfo resp;
      if (Parse(bytes, id, &req)) {
        Check(stub.Stat(&ctx, req, &resp), authed, "Stat");
      }
      return;
    }
    case 11: {
      v1::MakeDirRequest req;
      v1::FileInfo resp;
      if (Parse(bytes, id, &req)) {
        Check(stub.MakeDir(&ctx, req, &resp), authed, "MakeDir");
      }
      return;
    }
    case 12: {
      v1::RemoveRequest req;
      v1::RemoveResponse resp;
      if (Parse(bytes, id, &req)) {
        Check(stub.Remove(&ctx, req, &resp), authed, "Remove");
      }
      return;
    }
    case 13: {
      v1::MoveRequest req;
      v1::FileInfo resp;
      if (Parse(bytes, id, &req)) {
        Check(stub.Move(&ctx, req, &resp), authed, "Move");
      }
      return;
    }
    case 14: {
      v1::InfoRequest req;
      v1::InfoResponse resp;
      if (Parse(bytes, id, &req)) {
        Check(stub.Info(&ctx, req, &resp), authed, "Info");
      }
      return;
    }
    case 16: {
      v1::CloneSandboxRequest req;
      v1::CloneSandboxResponse resp;
      if (Parse(bytes, id, &req)) {
        grpc::Status st = stub.CloneSandbox(&ctx, req, &resp);
        Check(st, authed, "CloneSandbox");
        if (st.ok() && static_cast<uint32_t>(resp.sandboxes_size()) != req.count()) {
          Die("CloneSandbox(" + std::to_string(req.count()) + ") returned " +
              std::to_string(resp.sandboxes_size()) + " sandboxes");
        }
      }
      return;
    }
    case 17: {  // ImportImage
      auto reqs = ParseStream<v1::ImportImageRequest>(bytes, id);
      v1::ImageInfo resp;
      auto stream = stub.ImportImage(&ctx, &resp);
      for (const auto& r : reqs) {
        if (!stream->Write(r)) {
          break;
        }
      }
      stream->WritesDone();
      Check(stream->Finish(), authed, "ImportImage");
      return;
    }
    case 18: {
      v1::ListImagesRequest req;
      v1::ListImagesResponse resp;
      if (Parse(bytes, id, &req)) {
        Check(stub.ListImages(&ctx, req, &resp), authed, "ListImages");
      }
      return;
    }
    case 19: {
      v1::RemoveImageRequest req;
      v1::RemoveImageResponse resp;
      if (Parse(bytes, id, &req)) {
        Check(stub.RemoveImage(&ctx, req, &resp), authed, "RemoveImage");
      }
      return;
    }
    case 20: {
      v1::PruneImagesRequest req;
      v1::PruneImagesResponse resp;
      if (Parse(bytes, id, &req)) {
        Check(stub.PruneImages(&ctx, req, &resp), authed, "PruneImages");
      }
      return;
    }
    case 21: {
      v1::OpenTransferRequest req;
      v1::OpenTransferResponse resp;
      if (Parse(bytes, id, &req)) {
        grpc::Status st = stub.OpenTransfer(&ctx, req, &resp);
        Check(st, authed, "OpenTransfer");
        if (st.ok() && (resp.ticket().size() != 32 || resp.data_endpoint().empty())) {
          Die("OpenTransfer succeeded without a 32-byte ticket and an endpoint");
        }
      }
      return;
    }
    default: {
      v1::HealthRequest req;
      v1::HealthResponse resp;
      if (Parse(bytes, id, &req)) {
        Check(stub.Health(&ctx, req, &resp), authed, "Health");
      }
      return;
    }
  }
}

std::string CreateSandboxForInput() {
  if (!world->real) {
    auto sb = world->manager->Create("", pb::SandboxSettings{});
    if (!sb.ok()) {
      Die("creating the input's sandbox: " + sb.status().ToString());
    }
    return (*sb)->id();
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + kCallDeadline);
  v1::CreateSandboxRequest req;
  req.mutable_spec()->set_memory_bytes(64 << 20);
  req.mutable_spec()->set_disk_bytes(16 << 20);
  v1::Sandbox resp;
  grpc::Status s = world->stub->CreateSandbox(&ctx, req, &resp);
  if (!s.ok()) {
    Die("creating the input's sandbox on the agent: " + s.error_message());
  }
  return resp.id();
}

void CleanUp(const std::string& id) {
  if (!world->real) {
    // Every ticket of the script lapses; dropping it discards what it held open.
    ticket_clock_ms += world->tickets->ttl().count() + 1000;
    world->tickets->Sweep();
    if (world->tickets->outstanding() != 0) {
      Die("transfer tickets outstanding after their expiry: " +
          std::to_string(world->tickets->outstanding()));
    }
    world->manager->DestroyAll();
    // Imported images outlive a call by design: each input starts from an empty store.
    for (const pb::ImageInfo& info : world->images->List()) {
      if (info.kind == "imported") {
        if (bragg::Status s = world->images->Remove(info.name); !s.ok()) {
          Die("removing imported image " + info.name + " with no sandbox left: " + s.ToString());
        }
      }
    }
    if (auto pruned = world->images->Prune(); !pruned.ok()) {
      Die("pruning the image store: " + pruned.status().ToString());
    }
    return;
  }
  // Every sandbox the script created on the real agent goes too.
  grpc::ClientContext lctx;
  lctx.set_deadline(std::chrono::system_clock::now() + kCallDeadline);
  v1::ListSandboxesResponse list;
  grpc::Status s = world->stub->ListSandboxes(&lctx, v1::ListSandboxesRequest(), &list);
  if (!s.ok()) {
    Die("the agent stopped answering: " + s.error_message());
  }
  for (const auto& sb : list.sandboxes()) {
    grpc::ClientContext dctx;
    dctx.set_deadline(std::chrono::system_clock::now() + kCallDeadline);
    v1::DestroySandboxRequest req;
    req.set_sandbox_id(sb.id());
    v1::DestroySandboxResponse resp;
    (void)world->stub->DestroySandbox(&dctx, req, &resp);
  }
}

void CheckNothingLeft(int fd_baseline) {
  if (world->real) {
    return;
  }
  if (world->manager->live() != 0) {
    Die("sandboxes left after DestroyAll: " + std::to_string(world->manager->live()));
  }
  // Destruction completes once the last command holding a sandbox has finished; gRPC may still
  // be releasing a call's state for a moment.
  for (int i = 0;
       i < 2000 && (pb::fuzz::FakeRuntime::live() != 0 || pb::fuzz::FakeCgroupManager::live() != 0);
       ++i) {
    ::usleep(1000);
  }
  if (pb::fuzz::FakeRuntime::live() != 0) {
    Die("runtime sandboxes leaked: " + std::to_string(pb::fuzz::FakeRuntime::live()));
  }
  if (pb::fuzz::FakeCgroupManager::live() != 0) {
    Die("cgroups leaked: " + std::to_string(pb::fuzz::FakeCgroupManager::live()));
  }
  for (uint32_t load : world->cpus->Load()) {
    if (load != 0) {
      Die("CPU placements leaked");
    }
  }
  // A frozen layer lives while a clone of it does; an upload's spool only during its call;
  // a layer until no image holds it and it is pruned.
  for (const char* sub : {"/frozen", "/images/store/tmp", "/images/store/layers"}) {
    std::string dir = world->dir.path() + sub;
    std::error_code ec;
    for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
      Die(std::string("left behind in ") + sub + ": " + e.path().filename().string());
    }
  }
  // fds: gRPC keeps a few of its own, so allow some slack but catch steady growth.
  if (int now = LowestFreeFd(); now > fd_baseline + 16) {
    Die("fd leak: lowest free fd " + std::to_string(now) + ", was " + std::to_string(fd_baseline));
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  Init();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (world == nullptr) {
    Init();
  }
  static const int fd_baseline = LowestFreeFd();
  std::string id = CreateSandboxForInput();
  size_t pos = 0;
  int calls = 0;
  while (pos + 3 <= size && calls < 16) {
    uint8_t op = data[pos];
    size_t len = data[pos + 1] | (static_cast<size_t>(data[pos + 2]) << 8);
    pos += 3;
    len = std::min(len, size - pos);
    Call(op, std::string_view(reinterpret_cast<const char*>(data + pos), len), id);
    pos += len;
    ++calls;
  }
  CleanUp(id);
  CheckNothingLeft(fd_baseline);
  return 0;
}
