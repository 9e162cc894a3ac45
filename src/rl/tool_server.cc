#include "rl/tool_server.h"

#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "common/fs.h"
#include "common/str_cat.h"

namespace bragg::rl {
namespace {

constexpr size_t kMaxReplyBytes = 1 << 20;
constexpr size_t kStderrKeep = 2048;

ToolReply Failure(std::string failure, std::string observation) {
  ToolReply r;
  r.error = true;
  r.failure = std::move(failure);
  r.observation = std::move(observation);
  return r;
}

}  // namespace

Result<std::unique_ptr<ToolServer>> ToolServer::Start(pbox::client::Client* client,
                                                      std::string sandbox_id,
                                                      std::vector<std::string> argv) {
  if (argv.empty()) {
    return absl::InvalidArgumentError("the tool server's argv is empty");
  }
  std::unique_ptr<ToolServer> s(new ToolServer(client, std::move(sandbox_id), std::move(argv)));
  BRAGG_RETURN_IF_ERROR(s->Launch());
  return s;
}

ToolServer::~ToolServer() { Stop(std::chrono::milliseconds(500)); }

Status ToolServer::Launch() {
  BRAGG_ASSIGN_OR_RETURN(Pipe in, MakePipe());
  // Writing to a server that died must fail with EPIPE, not kill us.
  ::signal(SIGPIPE, SIG_IGN);
  {
    std::lock_guard<std::mutex> l(mu_);
    out_.clear();
    err_.clear();
    exited_ = false;
    exit_.clear();
    oom_ = false;
  }
  stdin_ = std::move(in.write);
  pbox::client::v1::ExecStart start;
  start.set_sandbox_id(sandbox_id_);
  for (const std::string& a : argv_) {
    start.add_argv(a);
  }
  exec_ = std::thread([this, start, read = std::make_shared<UniqueFd>(std::move(in.read))] {
    auto result = client_->Exec(start, read->get(), [this](bool is_stderr, std::string_view data) {
      std::lock_guard<std::mutex> l(mu_);
      if (is_stderr) {
        err_.append(data);
        if (err_.size() > kStderrKeep) {
          err_.erase(0, err_.size() - kStderrKeep);
        }
      } else {
        out_.append(data);
      }
      cv_.notify_all();
    });
    std::lock_guard<std::mutex> l(mu_);
    exited_ = true;
    if (!result.ok()) {
      exit_ = Cat("exec failed: ", result.status().message());
    } else if (!result->error().empty()) {
      exit_ = Cat("could not start: ", result->error());
    } else if (result->oom_killed()) {
      oom_ = true;
      exit_ = "killed by the sandbox's OOM killer";
    } else if (result->signal() != 0) {
      exit_ = Cat("killed by signal ", result->signal());
    } else {
      exit_ = Cat("exit ", result->exit_code());
    }
    cv_.notify_all();
  });
  return absl::OkStatus();
}

void ToolServer::Stop(std::chrono::milliseconds grace) {
  stdin_.Reset();  // EOF: a well-behaved server exits
  if (!exec_.joinable()) {
    return;
  }
  {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait_for(l, grace, [this] { return exited_; });
    if (!exited_) {
      l.unlock();
      // Every process of the sandbox but its init (pbox's sandboxes are pid namespaces).
      (void)client_->Run(
          {.sandbox_id = sandbox_id_, .argv = {"kill", "-KILL", "-1"}, .timeout_ms = 5000});
    }
  }
  exec_.join();
}

Status ToolServer::Restart() {
  std::lock_guard<std::mutex> call(call_mu_);
  Stop(std::chrono::milliseconds(0));
  return Launch();
}

bool ToolServer::alive() const {
  std::lock_guard<std::mutex> l(mu_);
  return !exited_;
}

std::string ToolServer::exit_description() const {
  std::lock_guard<std::mutex> l(mu_);
  return exit_;
}

std::variant<std::string, ToolReply> ToolServer::Exchange(const std::string& line,
                                                          std::chrono::milliseconds timeout) {
  {
    std::lock_guard<std::mutex> l(mu_);
    out_.clear();  // a reply that came late to an earlier call is not this call's
  }
  if (!stdin_.valid() || !WriteAll(stdin_.get(), line).ok()) {
    return Failure(Cat("exited: ", exit_description()), "error: tool server died\n");
  }
  std::unique_lock<std::mutex> l(mu_);
  bool ready = cv_.wait_for(l, timeout, [this] {
    return exited_ || out_.find('\n') != std::string::npos || out_.size() > kMaxReplyBytes;
  });
  size_t nl = out_.find('\n');
  if (nl == std::string::npos) {
    if (!ready) {
      return Failure("timeout", "error: tool timed out\n");
    }
    if (out_.size() > kMaxReplyBytes) {
      return Failure("bad reply: over 1 MiB without a newline", "error: tool output too long\n");
    }
    return Failure(oom_ ? std::string("oom") : Cat("exited: ", exit_),
                   oom_ ? "error: tool ran out of memory\n" : "error: tool crashed\n");
  }
  std::string reply = out_.substr(0, nl);
  out_.erase(0, nl + 1);
  return reply;
}

ToolReply ToolServer::Call(std::string_view text, std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> call(call_mu_);
  auto t0 = std::chrono::steady_clock::now();
  auto finish = [&](ToolReply r) {
    r.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    return r;
  };
  std::string line = nlohmann::json{{"text", std::string(text)}}.dump(
                         -1, ' ', false, nlohmann::json::error_handler_t::replace) +
                     "\n";
  auto exchanged = Exchange(line, timeout);
  if (auto* failed = std::get_if<ToolReply>(&exchanged)) {
    return finish(std::move(*failed));
  }
  const std::string& reply = std::get<std::string>(exchanged);
  nlohmann::json j = nlohmann::json::parse(reply, nullptr, false);
  ToolReply r;
  r.bytes = reply.size() + 1;
  if (!j.is_object()) {
    r = Failure(Cat("bad reply: not a JSON object: ", reply.substr(0, 80)),
                "error: bad tool reply\n");
    r.bytes = reply.size() + 1;
    return finish(std::move(r));
  }
  if (auto it = j.find("done"); it != j.end() && it->is_boolean()) {
    r.done = it->get<bool>();
  }
  if (auto it = j.find("observation"); it != j.end() && it->is_string()) {
    r.observation = it->get<std::string>();
  } else if (!r.done) {
    r = Failure("bad reply: no \"observation\" string", "error: bad tool reply\n");
    r.bytes = reply.size() + 1;
    return finish(std::move(r));
  }
  if (auto it = j.find("tool"); it != j.end() && it->is_string()) {
    r.tool = it->get<std::string>();
  }
  if (auto it = j.find("error"); it != j.end() && it->is_boolean()) {
    r.error = it->get<bool>();
  }
  return finish(std::move(r));
}

VerifierOutput ToolServer::Verify(std::string_view rollout_json,
                                  std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> call(call_mu_);
  VerifierOutput out;
  nlohmann::json rollout = nlohmann::json::parse(rollout_json, nullptr, false);
  if (!rollout.is_object()) {
    out.failure = "the rollout to verify is not a JSON object";
    return out;
  }
  bool exited;
  {
    std::lock_guard<std::mutex> l(mu_);
    exited = exited_;
  }
  if (exited) {
    // Crashed, OOM-killed or timed out on the last turn (and not restarted since): the reward
    // needs a server. Its exit is kept for the message should the new one fail too.
    std::string before = exit_description();
    Stop(std::chrono::milliseconds(0));
    if (Status st = Launch(); !st.ok()) {
      out.failure = Cat("restarting the tool server (", before, ") to verify: ", st.message());
      return out;
    }
  }
  std::string line = nlohmann::json{{"verify", std::move(rollout)}}.dump(
                         -1, ' ', false, nlohmann::json::error_handler_t::replace) +
                     "\n";
  auto exchanged = Exchange(line, timeout);
  if (auto* failed = std::get_if<ToolReply>(&exchanged)) {
    std::lock_guard<std::mutex> l(mu_);
    out.failure = Cat("the tool server's verify: ", failed->failure, ": ",
                      err_.substr(err_.size() > 200 ? err_.size() - 200 : 0));
    return out;
  }
  const std::string& reply = std::get<std::string>(exchanged);
  nlohmann::json j = nlohmann::json::parse(reply, nullptr, false);
  if (!j.is_object()) {
    out.failure =
        Cat("the tool server's verify: bad reply: not a JSON object: ", reply.substr(0, 80));
    return out;
  }
  if (auto it = j.find("error"); it != j.end() && !it->is_null() && *it != false) {
    // Bounded like the other failures' texts: the reply itself may be up to 1 MiB.
    std::string why = it->is_string() ? it->get<std::string>() : it->dump();
    out.failure = Cat("the tool server's verify failed: ", why.substr(0, 200));
    return out;
  }
  auto it = j.find("reward");
  if (it != j.end() && it->is_number()) {
    out.output = it->dump();
  } else {
    out.output = reply;  // no number: the caller reports what was answered
  }
  return out;
}

}  // namespace bragg::rl
