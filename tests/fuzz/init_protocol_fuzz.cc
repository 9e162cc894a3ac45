// Fuzzes the pbox-init channel's wire format in both directions: whatever bytes and fd count
// arrive, DecodeFrame (used by pbox-init for agent frames and by the agent for init frames)
// must return a frame or an error, never crash, and what it accepts must survive a round trip
// through EncodeFrame unchanged.
//
// Input: byte 0 = number of SCM_RIGHTS fds the frame "arrived" with (mod kMaxFds + 2, so one
// past the limit is tried), the rest = the frame.

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <string_view>

#include "pbox/init/init_protocol.h"

namespace proto = bragg::pbox::init_protocol;

namespace {

[[noreturn]] void Die(const char* what, const std::string& detail) {
  std::cerr << "init_protocol_fuzz: " << what << ": " << detail << "\n";
  std::abort();
}

bool SameFrame(const proto::Frame& a, const proto::Frame& b) {
  if (a.index() != b.index()) {
    return false;
  }
  return std::visit(
      [&](const auto& x) {
        using T = std::decay_t<decltype(x)>;
        const T& y = std::get<T>(b);
        if constexpr (std::is_same_v<T, proto::SpawnFrame>) {
          return x.id == y.id && x.flags == y.flags && x.cwd == y.cwd && x.argv == y.argv &&
                 x.env == y.env;
        } else if constexpr (std::is_same_v<T, proto::KillFrame>) {
          return x.id == y.id && x.signal == y.signal && x.whole_tree == y.whole_tree;
        } else if constexpr (std::is_same_v<T, proto::SpawnedFrame>) {
          return x.id == y.id && x.pid == y.pid;
        } else if constexpr (std::is_same_v<T, proto::SpawnFailedFrame>) {
          return x.id == y.id && x.stage == y.stage && x.err == y.err && x.pid == y.pid &&
                 x.message == y.message;
        } else if constexpr (std::is_same_v<T, proto::ExitedFrame>) {
          return x.id == y.id && x.exit_code == y.exit_code && x.signal == y.signal &&
                 x.user_us == y.user_us && x.system_us == y.system_us &&
                 x.max_rss_kb == y.max_rss_kb;
        } else if constexpr (std::is_same_v<T, proto::StdinFrame>) {
          return x.id == y.id && x.data == y.data;
        } else if constexpr (std::is_same_v<T, proto::OutputFrame>) {
          return x.id == y.id && x.stream == y.stream && x.data == y.data;
        } else if constexpr (std::is_same_v<T, proto::ReadyFrame>) {
          return x.id == y.id;
        } else if constexpr (std::is_same_v<T, proto::OutputCreditFrame>) {
          return x.id == y.id && x.stream == y.stream && x.bytes == y.bytes;
        } else if constexpr (std::is_same_v<T, proto::StdinCreditFrame>) {
          return x.id == y.id && x.bytes == y.bytes;
        } else {
          static_assert(std::is_same_v<T, proto::ErrorFrame>);
          return x.id == y.id && x.message == y.message;
        }
      },
      a);
}

size_t FdsOf(const proto::Frame& f) {
  if (const auto* s = std::get_if<proto::SpawnFrame>(&f)) {
    return proto::SpawnFdCount(s->flags);
  }
  return 0;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) {
    return 0;
  }
  size_t num_fds = data[0] % (proto::kMaxFds + 2);
  std::string_view bytes(reinterpret_cast<const char*>(data + 1), size - 1);
  proto::DecodeResult r = proto::DecodeFrame(bytes, num_fds);
  if (!r.frame.has_value()) {
    if (r.error.empty()) {
      Die("rejected without an error message", std::string(bytes));
    }
    return 0;
  }
  if (!r.error.empty()) {
    Die("accepted with an error", r.error);
  }
  if (num_fds != FdsOf(*r.frame)) {
    Die("accepted a frame with the wrong fd count", std::to_string(num_fds));
  }
  // The decoder is strict, so an accepted frame is canonical: encoding it gives the same bytes.
  std::string wire;
  std::string error;
  if (!proto::EncodeFrame(*r.frame, &wire, &error)) {
    Die("accepted frame does not encode", error);
  }
  if (wire != bytes) {
    Die("re-encoding changed the frame",
        std::to_string(wire.size()) + " vs " + std::to_string(bytes.size()) + " bytes");
  }
  proto::DecodeResult again = proto::DecodeFrame(wire, num_fds);
  if (!again.frame.has_value() || !SameFrame(*again.frame, *r.frame)) {
    Die("round trip changed the frame", again.error);
  }
  // Every strict prefix of an accepted frame is truncated and must be refused.
  for (size_t cut : {size_t{0}, bytes.size() / 2, bytes.size() - 1}) {
    if (cut < bytes.size() && proto::DecodeFrame(bytes.substr(0, cut), num_fds).frame) {
      Die("accepted a truncated frame", std::to_string(cut));
    }
  }
  return 0;
}
