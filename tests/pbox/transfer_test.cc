// The data channel against a real pboxd: round trips of every size class, tickets that are
// wrong, reused, expired or misdirected, clients that die mid-upload, hostile bytes on the
// data socket, concurrent transfers, a full disk, and the gRPC path beside it.

#include <dirent.h>
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <random>
#include <thread>

#include "agent_fixture.h"
#include "common/fs.h"
#include "fmt/format.h"
#include "pbox/wire/data_protocol.h"

namespace bragg::pbox::testing {
namespace {

using Clock = std::chrono::steady_clock;
namespace v1 = bragg::pbox::v1;

std::string RandomBytes(size_t n, uint64_t seed) {
  std::string s(n, '\0');
  std::mt19937_64 rng(seed);
  for (size_t i = 0; i < n; ++i) {
    s[i] = static_cast<char>(rng());
  }
  return s;
}

size_t OpenFds(pid_t pid) {
  size_t n = 0;
  DIR* d = ::opendir(fmt::format("/proc/{}/fd", pid).c_str());
  if (d == nullptr) {
    return 0;
  }
  while (struct dirent* e = ::readdir(d)) {
    n += e->d_name[0] != '.';
  }
  ::closedir(d);
  return n;
}

// Polls `pred` for up to `limit` (generous: the machine may be loaded).
template <typename Pred>
bool Eventually(Pred pred, std::chrono::milliseconds limit = std::chrono::seconds(20)) {
  auto deadline = Clock::now() + limit;
  while (Clock::now() < deadline) {
    if (pred()) {
      return true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return pred();
}

// A raw connection to the data socket, for what the client library never sends.
class Raw {
 public:
  explicit Raw(const std::string& endpoint) {
    EXPECT_EQ(endpoint.rfind("unix://", 0), 0u) << endpoint;
    std::string path = endpoint.substr(7);
    fd_ = UniqueFd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    struct sockaddr_un addr = {};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, path.data(), path.size());
    EXPECT_EQ(::connect(fd_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0)
        << std::strerror(errno);
    struct timeval tv = {20, 0};
    ::setsockopt(fd_.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  }
  void Send(std::string_view data) {
    while (!data.empty()) {
      ssize_t n = ::send(fd_.get(), data.data(), data.size(), MSG_NOSIGNAL);
      if (n <= 0) {
        return;  // the agent may close on us: what it answered is what the test checks
      }
      data.remove_prefix(static_cast<size_t>(n));
    }
  }
  void Upload(const Ticket& ticket, uint64_t declared, std::string_view body, bool trailer = true) {
    Send(EncodeDataRequest({.op = DataOp::kUpload, .size = declared, .ticket = ticket}));
    Send(body);
    if (trailer) {
      Send(kUploadTrailer);
    }
  }
  // The agent's status frame; a Status with code Unavailable if it only closed.
  Result<DataStatus> Reply() {
    char head[kDataStatusHeadBytes];
    size_t got = 0;
    while (got < sizeof(head)) {
      ssize_t n = ::recv(fd_.get(), head + got, sizeof(head) - got, 0);
      if (n <= 0) {
        return absl::UnavailableError("closed without a status");
      }
      got += static_cast<size_t>(n);
    }
    DataStatus st;
    BRAGG_ASSIGN_OR_RETURN(uint32_t len, ParseDataStatusHead({head, sizeof(head)}, &st));
    st.message.resize(len);
    if (len > 0 && ::recv(fd_.get(), st.message.data(), len, MSG_WAITALL) != len) {
      return absl::UnavailableError("short status message");
    }
    return st;
  }
  // True once the agent has closed its end.
  bool Closed() {
    struct pollfd p = {fd_.get(), POLLIN, 0};
    if (::poll(&p, 1, 20000) != 1) {
      return false;
    }
    char c;
    ssize_t n = ::recv(fd_.get(), &c, 1, MSG_DONTWAIT);
    return n == 0 || (n < 0 && errno == ECONNRESET);
  }
  int fd() const { return fd_.get(); }

 private:
  UniqueFd fd_;
};

class TransferTest : public SharedAgentTest<TransferTest> {
 public:
  static std::vector<std::string> AgentFlags() {
    return {"--max-sandboxes", "16", "--transfer-ticket-ttl-ms", "400"};
  }

 protected:
  void SetUp() override {
    SharedAgentTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) {
      return;
    }
    auto grpc_only =
        client::Client::Connect({.endpoint = agent_->unix_endpoint(), .data_channel = false});
    ASSERT_TRUE(grpc_only.ok());
    grpc_client_ = std::move(*grpc_only);
    stub_ = v1::Pbox::NewStub(grpc::CreateChannel("unix:" + agent_->unix_endpoint().substr(7),
                                                  grpc::InsecureChannelCredentials()));
  }

  void TearDown() override {
    for (const auto& id : created_) {
      (void)client_->Destroy(id);
    }
  }
  std::string NewSandbox(uint64_t disk_bytes = 0) {
    v1::SandboxSpec spec;
    spec.set_memory_bytes(256 << 20);
    if (disk_bytes != 0) {
      spec.set_disk_bytes(disk_bytes);
    }
    auto sb = client_->Create(spec);
    EXPECT_TRUE(sb.ok()) << sb.status();
    if (!sb.ok()) {
      return "";
    }
    created_.push_back(sb->id());
    return sb->id();
  }
  Result<v1::OpenTransferResponse> Open(const std::string& id, const std::string& path,
                                        v1::TransferDirection dir, uint64_t size = 0) {
    grpc::ClientContext ctx;
    v1::OpenTransferRequest req;
    req.set_sandbox_id(id);
    req.set_path(path);
    req.set_direction(dir);
    req.set_size(size);
    req.set_make_parents(true);
    v1::OpenTransferResponse resp;
    BRAGG_RETURN_IF_ERROR(client::FromGrpc(stub_->OpenTransfer(&ctx, req, &resp)));
    return resp;
  }
  static Ticket TicketOf(const v1::OpenTransferResponse& r) {
    Ticket t;
    EXPECT_EQ(r.ticket().size(), t.size());
    std::memcpy(t.data(), r.ticket().data(), t.size());
    return t;
  }
  // Names in `dir` of the sandbox (temporary upload files start with ".pbox-upload-").
  std::vector<std::string> Names(const std::string& id, const std::string& dir) {
    std::vector<std::string> out;
    auto entries = client_->ListDir(id, dir);
    EXPECT_TRUE(entries.ok()) << entries.status();
    if (entries.ok()) {
      for (const auto& e : *entries) {
        out.push_back(e.path());
      }
    }
    return out;
  }
  bool Leftovers(const std::string& id, const std::string& dir) {
    for (const auto& n : Names(id, dir)) {
      if (n.rfind(".pbox-upload-", 0) == 0) {
        return true;
      }
    }
    return false;
  }

  std::unique_ptr<client::Client> grpc_client_;
  std::unique_ptr<v1::Pbox::Stub> stub_;
  std::vector<std::string> created_;
};

// Both paths write what a symlink in the last place names (inside the sandbox, a dangling link
// included) and leave the link; a file that exists keeps its permission bits.
TEST_F(TransferTest, BothPathsFollowLinksAndKeepAnExistingFilesMode) {
  std::string id = NewSandbox();
  ASSERT_TRUE(client_->uses_data_channel());
  auto sh = [&](const std::string& script) {
    auto r = client_->Run({.sandbox_id = id, .argv = {"/bin/sh", "-c", script}});
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->result().exit_code() : -1;
  };
  for (auto* c : {client_.get(), grpc_client_.get()}) {
    const bool data = c == client_.get();
    SCOPED_TRACE(data ? "data channel" : "gRPC");
    const std::string d = data ? "/tmp/ln-d" : "/tmp/ln-g";
    ASSERT_EQ(sh(fmt::format("mkdir -p {0}/sub && printf old > {0}/sub/target && chmod 600 "
                             "{0}/sub/target && ln -s sub/target {0}/rel && ln -s {0}/rel "
                             "{0}/chain && ln -s {0}/sub/new {0}/dangling && ln -s "
                             "../../../../../{0}/sub/up {0}/climb",
                             d)),
              0);
    auto w = c->WriteFile(id, d + "/chain", "through two links", 0644);
    ASSERT_TRUE(w.ok()) << w.status();
    auto back = c->ReadFile(id, d + "/sub/target");
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, "through two links");
    auto st = c->Stat(id, d + "/sub/target");
    ASSERT_TRUE(st.ok()) << st.status();
    EXPECT_EQ(st->mode() & 07777, 0600u) << "an existing file keeps its mode";
    EXPECT_EQ(sh(fmt::format("test -L {0}/chain && test -L {0}/rel", d)), 0)
        << "the links are still links";
    ASSERT_TRUE(c->WriteFile(id, d + "/dangling", "made", 0640).ok());
    back = c->ReadFile(id, d + "/sub/new");
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, "made");
    st = c->Stat(id, d + "/sub/new");
    ASSERT_TRUE(st.ok()) << st.status();
    EXPECT_EQ(st->mode() & 07777, 0640u) << "a new file gets the requested mode";
    // A relative link that climbs past the root stops at the sandbox's root.
    ASSERT_TRUE(c->WriteFile(id, d + "/climb", "inside", 0644).ok());
    back = c->ReadFile(id, d + "/sub/up");
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(*back, "inside");
  }
}

TEST_F(TransferTest, RoundTripsEverySizeBothWays) {
  std::string id = NewSandbox();
  ASSERT_TRUE(client_->uses_data_channel());
  for (size_t size : {size_t{0}, size_t{1}, size_t{1} << 20, (size_t{64} << 20) + 1}) {
    SCOPED_TRACE(size);
    std::string data = RandomBytes(size, size);
    const std::string path = fmt::format("/tmp/rt/{}.bin", size);
    auto w = client_->WriteFile(id, path, data, 0640);
    ASSERT_TRUE(w.ok()) << w.status();
    EXPECT_EQ(w->size(), size);
    EXPECT_EQ(w->mode(), 0640u);
    // Read back both ways: the data channel and the gRPC stream see the same bytes.
    auto r = client_->ReadFile(id, path);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(*r == data);
    auto g = grpc_client_->ReadFile(id, path);
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_TRUE(*g == data);
    // And a gRPC upload reads back over the data channel.
    ASSERT_TRUE(grpc_client_->WriteFile(id, path + ".g", data).ok());
    auto back = client_->ReadFile(id, path + ".g");
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_TRUE(*back == data);
  }
  ASSERT_TRUE(client_->uses_data_channel());
  EXPECT_FALSE(grpc_client_->uses_data_channel());
  // Ranges, as ReadFile's offset/length.
  auto part = client_->ReadFile(id, "/tmp/rt/1048576.bin", 1000, 24);
  ASSERT_TRUE(part.ok()) << part.status();
  EXPECT_EQ(*part, RandomBytes(1 << 20, 1 << 20).substr(1000, 24));
  // Fds: a regular file goes out with sendfile, and comes back into a file.
  TempDir tmp;
  std::string src = tmp.path() + "/src";
  std::string data = RandomBytes(3 << 20, 99);
  ASSERT_TRUE(WriteStringToFile(src, data).ok());
  UniqueFd in(::open(src.c_str(), O_RDONLY | O_CLOEXEC));
  ASSERT_TRUE(client_->WriteFileFromFd(id, "/tmp/fromfd", in.get()).ok());
  std::string dst = tmp.path() + "/dst";
  UniqueFd out(::open(dst.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0600));
  auto n = client_->ReadFileToFd(id, "/tmp/fromfd", out.get());
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, data.size());
  EXPECT_TRUE(*ReadFileToString(dst) == data);
  EXPECT_FALSE(Leftovers(id, "/tmp/rt"));
}

TEST_F(TransferTest, TcpClientsUseTheDataPortWithTheirToken) {
  std::string id = NewSandbox();
  auto c = client::Client::Connect({.endpoint = agent_->tcp_endpoint(), .token = agent_->token()});
  ASSERT_TRUE(c.ok());
  std::string data = RandomBytes(1 << 20, 5);
  auto w = (*c)->WriteFile(id, "/tmp/tcp.bin", data);
  ASSERT_TRUE(w.ok()) << w.status();
  auto r = (*c)->ReadFile(id, "/tmp/tcp.bin");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(*r == data);
  EXPECT_TRUE((*c)->uses_data_channel());
  // No token: no ticket.
  auto bad = client::Client::Connect({.endpoint = agent_->tcp_endpoint(), .token = "wrong"});
  ASSERT_TRUE(bad.ok());
  auto refused = (*bad)->WriteFile(id, "/tmp/tcp2.bin", "x");
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnauthenticated);
}

TEST_F(TransferTest, BadReusedExpiredAndMisdirectedTicketsAreRefusedAlike) {
  std::string id = NewSandbox();
  ASSERT_TRUE(client_->WriteFile(id, "/t/keep", "original").ok());
  auto t = Open(id, "/t/keep", v1::TRANSFER_DIRECTION_UPLOAD, 5);
  ASSERT_TRUE(t.ok()) << t.status();
  {
    Raw raw(t->data_endpoint());
    raw.Upload(TicketOf(*t), 5, "fresh");
    auto st = raw.Reply();
    ASSERT_TRUE(st.ok()) << st.status();
    EXPECT_EQ(st->code, absl::StatusCode::kOk) << st->message;
    EXPECT_EQ(st->bytes, 5u);
  }
  std::vector<std::string> refusals;
  auto refused = [&](const Ticket& ticket, DataOp op, uint64_t size, std::string_view body) {
    Raw raw(t->data_endpoint());
    if (op == DataOp::kUpload) {
      raw.Upload(ticket, size, body);
    } else {
      raw.Send(EncodeDataRequest({.op = op, .size = 0, .ticket = ticket}));
    }
    auto st = raw.Reply();
    ASSERT_TRUE(st.ok()) << st.status();
    EXPECT_EQ(st->code, absl::StatusCode::kPermissionDenied) << st->message;
    refusals.push_back(st->message);
    EXPECT_TRUE(raw.Closed());
  };
  // Reused.
  refused(TicketOf(*t), DataOp::kUpload, 5, "again");
  // Forged: random, and the real one with one bit flipped.
  Ticket forged{};
  for (size_t i = 0; i < forged.size(); ++i) {
    forged[i] = static_cast<uint8_t>(i);
  }
  refused(forged, DataOp::kUpload, 5, "forge");
  auto t2 = Open(id, "/t/other", v1::TRANSFER_DIRECTION_UPLOAD, 3);
  ASSERT_TRUE(t2.ok());
  Ticket flipped = TicketOf(*t2);
  flipped[20] ^= 0x40;
  refused(flipped, DataOp::kUpload, 3, "abc");
  // Misdirected: a download ticket presented for an upload (it is burnt by the attempt).
  auto d = Open(id, "/t/keep", v1::TRANSFER_DIRECTION_DOWNLOAD);
  ASSERT_TRUE(d.ok());
  refused(TicketOf(*d), DataOp::kUpload, 4, "evil");
  refused(TicketOf(*d), DataOp::kDownload, 0, "");
  // Expired (the agent runs with --transfer-ticket-ttl-ms 400): its temporary file goes too.
  auto e = Open(id, "/t/late", v1::TRANSFER_DIRECTION_UPLOAD, 4);
  ASSERT_TRUE(e.ok());
  EXPECT_TRUE(Leftovers(id, "/t"));
  EXPECT_TRUE(Eventually([&] { return !Leftovers(id, "/t"); }));
  refused(TicketOf(*e), DataOp::kUpload, 4, "late");
  // Every refusal says the same thing.
  for (const auto& m : refusals) {
    EXPECT_EQ(m, refusals[0]);
  }
  EXPECT_EQ(*client_->ReadFile(id, "/t/keep"), "fresh");
  auto names = Names(id, "/t");
  EXPECT_EQ(names, std::vector<std::string>{"keep"});
}

TEST_F(TransferTest, ShortLongAndMismatchedUploadsLeaveNothing) {
  std::string id = NewSandbox();
  ASSERT_TRUE(client_->WriteFile(id, "/u/keep", "old").ok());
  struct Case {
    const char* name;
    uint64_t ticket_size, declared;
    std::string body;
    bool trailer;
    absl::StatusCode code;
  };
  const std::string big = RandomBytes(2 << 20, 3);
  std::vector<Case> cases = {
      {"too much data", 10, 10, std::string(14, 'x'), false, absl::StatusCode::kInvalidArgument},
      {"declared size differs", 10, 11, std::string(11, 'x'), true,
       absl::StatusCode::kInvalidArgument},
      {"short then no trailer", 2 << 20, 2 << 20, big.substr(0, 1 << 20), false,
       absl::StatusCode::kUnavailable},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    for (const char* path : {"/u/keep", "/u/new"}) {
      auto t = Open(id, path, v1::TRANSFER_DIRECTION_UPLOAD, c.ticket_size);
      ASSERT_TRUE(t.ok()) << t.status();
      Raw raw(t->data_endpoint());
      raw.Upload(TicketOf(*t), c.declared, c.body, c.trailer);
      if (c.code == absl::StatusCode::kUnavailable) {
        ::shutdown(raw.fd(), SHUT_WR);  // the client is gone mid-upload
        auto st = raw.Reply();
        if (st.ok()) {
          EXPECT_NE(st->code, absl::StatusCode::kOk);
        }
      } else {
        auto st = raw.Reply();
        ASSERT_TRUE(st.ok()) << st.status();
        EXPECT_EQ(st->code, c.code) << st->message;
      }
    }
    EXPECT_TRUE(Eventually([&] { return Names(id, "/u") == std::vector<std::string>{"keep"}; }));
    EXPECT_EQ(*client_->ReadFile(id, "/u/keep"), "old");
  }
}

TEST_F(TransferTest, KilledClientLeavesNoFileAndNoFd) {
  std::string id = NewSandbox();
  ASSERT_TRUE(client_->MakeDir(id, "/k").ok());
  // Warm every channel this test uses so that the fd count below is the agent's steady state.
  ASSERT_TRUE(client_->WriteFile(id, "/warm", "w").ok());
  EXPECT_FALSE(Open(id, "/no-such-file", v1::TRANSFER_DIRECTION_DOWNLOAD).ok());
  const pid_t agent = agent_->pid();
  size_t before = 0;
  ASSERT_TRUE(Eventually([&] {
    before = OpenFds(agent);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    return OpenFds(agent) == before;
  }));
  auto t = Open(id, "/k/big", v1::TRANSFER_DIRECTION_UPLOAD, 64 << 20);
  ASSERT_TRUE(t.ok()) << t.status();
  const Ticket ticket = TicketOf(*t);
  const std::string path = t->data_endpoint().substr(7);
  const std::string head =
      EncodeDataRequest({.op = DataOp::kUpload, .size = 64 << 20, .ticket = ticket});
  int ready[2];
  ASSERT_EQ(::pipe2(ready, O_CLOEXEC), 0);
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // Only async-signal-safe calls from here: raw socket calls, then death by SIGKILL.
    int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un addr = {};
    addr.sun_family = AF_UNIX;
    std::memcpy(addr.sun_path, path.data(), path.size());
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
      ::_exit(1);
    }
    (void)!::write(fd, head.data(), head.size());
    static char chunk[1 << 20];
    for (int i = 0; i < 8; ++i) {
      (void)!::write(fd, chunk, sizeof(chunk));
    }
    (void)!::write(ready[1], "r", 1);
    ::pause();
    ::_exit(0);
  }
  ::close(ready[1]);
  char c;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  ::close(ready[0]);
  // Mid-upload: the temporary file exists and the agent holds the connection.
  EXPECT_TRUE(Leftovers(id, "/k"));
  ::kill(child, SIGKILL);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(Eventually([&] { return Names(id, "/k").empty(); }));
  EXPECT_TRUE(Eventually([&] { return OpenFds(agent) <= before; }))
      << "agent fds: " << OpenFds(agent) << " before: " << before;
}

TEST_F(TransferTest, HostileBytesOnTheDataSocket) {
  std::string id = NewSandbox();
  const pid_t agent = agent_->pid();
  auto t = Open(id, "/h/x", v1::TRANSFER_DIRECTION_DOWNLOAD);
  ASSERT_FALSE(t.ok());  // no such file yet
  auto probe = Open(id, "/h/x", v1::TRANSFER_DIRECTION_UPLOAD, 1);
  ASSERT_TRUE(probe.ok());
  const std::string endpoint = probe->data_endpoint();
  size_t before = OpenFds(agent);
  std::mt19937_64 rng(11);
  std::vector<std::string> inputs = {
      "",
      "P",
      "PBXD",
      std::string(kDataRequestBytes, '\0'),
      std::string(kDataRequestBytes, '\xff'),
      "GET / HTTP/1.1\r\nHost: x\r\n\r\n" + std::string(64, 'a'),
      "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + std::string(64, 'b'),
  };
  for (int i = 0; i < 40; ++i) {
    std::string junk = "PBXD" + RandomBytes(kDataRequestBytes - 4 + (i % 3) * 50, rng());
    junk[4] = 1;
    junk[5] = static_cast<char>(1 + i % 2);
    inputs.push_back(junk);
  }
  for (const std::string& in : inputs) {
    Raw raw(endpoint);
    raw.Send(in);
    ::shutdown(raw.fd(), SHUT_WR);
    auto st = raw.Reply();
    if (st.ok()) {
      EXPECT_NE(st->code, absl::StatusCode::kOk) << "input of " << in.size() << " bytes";
    }
    EXPECT_TRUE(raw.Closed());
  }
  // Still serving, with the real ticket, and nothing leaked.
  Raw raw(endpoint);
  raw.Upload(TicketOf(*probe), 1, "1");
  auto st = raw.Reply();
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->code, absl::StatusCode::kOk) << st->message;
  EXPECT_EQ(*client_->ReadFile(id, "/h/x"), "1");
  // What stays: the probe's two fds went; `raw` (socket and its splice pipe) and the client's
  // pooled connection remain.
  EXPECT_TRUE(Eventually([&] { return OpenFds(agent) <= before + 2; }))
      << OpenFds(agent) << " vs " << before;
}

TEST_F(TransferTest, ConcurrentTransfers) {
  std::string a = NewSandbox(), b = NewSandbox();
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int t = 0; t < 16; ++t) {
    threads.emplace_back([&, t] {
      const std::string& id = t % 2 == 0 ? a : b;
      for (int i = 0; i < 4; ++i) {
        std::string data = RandomBytes(static_cast<size_t>(100000 + 997 * t + i), t * 10 + i);
        std::string path = fmt::format("/c/{}-{}", t, i);
        auto w = client_->WriteFile(id, path, data);
        auto r = w.ok() ? client_->ReadFile(id, path) : Result<std::string>(w.status());
        if (r.ok() && *r == data) {
          ++ok;
        } else {
          ADD_FAILURE() << path << ": " << (r.ok() ? "bytes differ" : r.status().ToString());
        }
      }
    });
  }
  for (auto& th : threads) {
    th.join();
  }
  EXPECT_EQ(ok.load(), 64);
}

TEST_F(TransferTest, FullDiskRefusesAndLeavesNothing) {
  std::string id = NewSandbox(8 << 20);
  // Larger than the disk: refused before a byte crosses.
  auto over = client_->WriteFile(id, "/d/huge", RandomBytes(16 << 20, 1));
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted) << over.status();
  // Two that each fit but not together: the second fills the disk mid-write (ENOSPC).
  const std::string part = RandomBytes(5 << 20, 2);
  auto t1 = Open(id, "/d/one", v1::TRANSFER_DIRECTION_UPLOAD, part.size());
  auto t2 = Open(id, "/d/two", v1::TRANSFER_DIRECTION_UPLOAD, part.size());
  ASSERT_TRUE(t1.ok() && t2.ok()) << t1.status() << t2.status();
  {
    Raw raw(t1->data_endpoint());
    raw.Upload(TicketOf(*t1), part.size(), part);
    auto st = raw.Reply();
    ASSERT_TRUE(st.ok()) << st.status();
    EXPECT_EQ(st->code, absl::StatusCode::kOk) << st->message;
  }
  {
    Raw raw(t2->data_endpoint());
    raw.Upload(TicketOf(*t2), part.size(), part);
    auto st = raw.Reply();
    ASSERT_TRUE(st.ok()) << st.status();
    EXPECT_EQ(st->code, absl::StatusCode::kResourceExhausted) << st->message;
  }
  EXPECT_TRUE(Eventually([&] { return Names(id, "/d") == std::vector<std::string>{"one"}; }));
  EXPECT_TRUE(*client_->ReadFile(id, "/d/one") == part);
  // The space came back: a small file fits.
  EXPECT_TRUE(client_->WriteFile(id, "/d/small", "s").ok());
}

TEST_F(TransferTest, ASlowUploadKeepsTheSandboxFromItsIdleTtl) {
  v1::SandboxSpec spec;
  spec.set_memory_bytes(128 << 20);
  spec.set_idle_ttl_seconds(1);
  auto sb = client_->Create(spec);
  ASSERT_TRUE(sb.ok()) << sb.status();
  created_.push_back(sb->id());
  const std::string id = sb->id();
  const std::string body = RandomBytes(64 << 10, 9);
  auto t = Open(id, "/slow", v1::TRANSFER_DIRECTION_UPLOAD, body.size());
  ASSERT_TRUE(t.ok()) << t.status();
  Raw raw(t->data_endpoint());
  raw.Send(EncodeDataRequest({.op = DataOp::kUpload, .size = body.size(), .ticket = TicketOf(*t)}));
  // 3.2 s of trickle, well past the 1 s TTL (each piece within the stall limit).
  for (size_t i = 0; i < 16; ++i) {
    raw.Send(std::string_view(body).substr(i * 4096, 4096));
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  raw.Send(kUploadTrailer);
  auto st = raw.Reply();
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->code, absl::StatusCode::kOk) << st->message;
  auto back = client_->ReadFile(id, "/slow");
  ASSERT_TRUE(back.ok()) << back.status() << " (the idle TTL took the sandbox mid-upload)";
  EXPECT_TRUE(*back == body);
}

TEST_F(TransferTest, AnUploadIntoASandboxDestroyedMeanwhileFails) {
  std::string id = NewSandbox();
  const std::string body = RandomBytes(32 << 10, 10);
  auto t = Open(id, "/late", v1::TRANSFER_DIRECTION_UPLOAD, body.size());
  ASSERT_TRUE(t.ok()) << t.status();
  Raw raw(t->data_endpoint());
  raw.Send(EncodeDataRequest({.op = DataOp::kUpload, .size = body.size(), .ticket = TicketOf(*t)}));
  raw.Send(std::string_view(body).substr(0, body.size() / 2));
  ASSERT_TRUE(client_->Destroy(id).ok());
  raw.Send(std::string_view(body).substr(body.size() / 2));
  raw.Send(kUploadTrailer);
  auto st = raw.Reply();
  // Either the agent closed the connection with the sandbox or it says why; never OK.
  if (st.ok()) {
    EXPECT_EQ(st->code, absl::StatusCode::kNotFound) << st->message;
  }
}

TEST_F(TransferTest, OpenTransferChecksLikeWriteFileAndReadFile) {
  std::string id = NewSandbox();
  // The same resolver as WriteFile/ReadFile: ".." stops at the sandbox root.
  ASSERT_TRUE(client_->WriteFile(id, "/etc/pbox-probe", "inside").ok());
  auto up = Open(id, "/../../../etc/pbox-probe", v1::TRANSFER_DIRECTION_DOWNLOAD);
  ASSERT_TRUE(up.ok()) << up.status();
  EXPECT_EQ(up->size(), 6u);
  EXPECT_EQ(Open(id, "/", v1::TRANSFER_DIRECTION_DOWNLOAD).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Open(id, "/", v1::TRANSFER_DIRECTION_UPLOAD, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Open(id, "/tmp", v1::TRANSFER_DIRECTION_UPLOAD, 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Open(id, "/tmp", v1::TRANSFER_DIRECTION_DOWNLOAD).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Open(id, "/x", v1::TRANSFER_DIRECTION_UNSPECIFIED).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Open("no-such-sandbox", "/x", v1::TRANSFER_DIRECTION_UPLOAD, 1).status().code(),
            absl::StatusCode::kNotFound);
  auto dir = client_->WriteFile(id, "/tmp", "x");
  EXPECT_FALSE(dir.ok());
  EXPECT_FALSE(Leftovers(id, "/"));
}

TEST(TransferFallbackTest, AgentWithoutDataChannelUsesGrpc) {
  if (std::string why = AgentTestSkipReason(); !why.empty()) {
    GTEST_SKIP() << why;
  }
  auto a = TestAgent::Start({.extra_flags = {"--data-channel=false"}});
  ASSERT_TRUE(a.ok()) << a.status();
  auto c = (*a)->NewClient();
  v1::SandboxSpec spec;
  spec.set_memory_bytes(128 << 20);
  auto sb = c->Create(spec);
  ASSERT_TRUE(sb.ok()) << sb.status();
  std::string data = RandomBytes(300000, 8);
  ASSERT_TRUE(c->WriteFile(sb->id(), "/f", data).ok());
  EXPECT_FALSE(c->uses_data_channel());
  auto r = c->ReadFile(sb->id(), "/f");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(*r == data);
  EXPECT_FALSE(::access(((*a)->unix_endpoint().substr(7) + ".data").c_str(), F_OK) == 0);
}

// A data channel of 2 connections and a 600 ms stall limit.
class DataLimitsTest : public SharedAgentTest<DataLimitsTest> {
 public:
  static std::vector<std::string> AgentFlags() {
    return {"--max-sandboxes",         "4",  "--max-data-connections", "2",
            "--data-stall-timeout-ms", "600"};
  }
};

TEST_F(DataLimitsTest, AHeaderSentAByteAtATimeIsCutOff) {
  // Each byte within the stall limit, the whole header in 4.8 s: the header's deadline is one,
  // so the connection (and its thread) goes well before the last byte.
  Raw raw(agent_->unix_endpoint() + ".data");
  const std::string head =
      EncodeDataRequest({.op = DataOp::kDownload, .size = 0, .ticket = Ticket{}});
  auto closed = [&] {
    struct pollfd p = {raw.fd(), POLLIN, 0};
    char c;
    return ::poll(&p, 1, 0) == 1 && ::recv(raw.fd(), &c, 1, MSG_DONTWAIT) <= 0;
  };
  const auto t0 = std::chrono::steady_clock::now();
  size_t sent = 0;
  while (sent < head.size() && !closed()) {
    if (::send(raw.fd(), head.data() + sent, 1, MSG_NOSIGNAL) != 1) {
      break;
    }
    ++sent;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_LT(sent, head.size()) << "the agent waited for the whole header, a byte at a time";
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(4));
}

TEST_F(DataLimitsTest, IdleConnectionsMakeRoomAtTheLimit) {
  v1::SandboxSpec spec;
  spec.set_memory_bytes(128 << 20);
  auto sb = client_->Create(spec);
  ASSERT_TRUE(sb.ok()) << sb.status();
  const std::string id = sb->id();
  // Two clients each keep one idle pooled data connection: the agent's limit of 2.
  auto a = agent_->NewClient();
  auto b = agent_->NewClient();
  auto c = agent_->NewClient();
  ASSERT_TRUE(a->WriteFile(id, "/a", "one").ok());
  ASSERT_TRUE(b->WriteFile(id, "/b", "two").ok());
  ASSERT_TRUE(a->uses_data_channel() && b->uses_data_channel());
  // The agent's threads of those connections go back to waiting (idle) just after replying.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  // A third client's transfer is not refused: an idle connection makes room for it.
  auto w = c->WriteFile(id, "/c", "three");
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_TRUE(c->uses_data_channel());
  // The clients whose idle connections went still transfer (they dial again, or fall back).
  for (int round = 0; round < 3; ++round) {
    for (auto* cl : {a.get(), b.get(), c.get()}) {
      auto r = cl->ReadFile(id, "/c");
      ASSERT_TRUE(r.ok()) << r.status();
      EXPECT_EQ(*r, "three");
    }
  }
  EXPECT_TRUE(client_->Destroy(id).ok());
}

}  // namespace
}  // namespace bragg::pbox::testing
