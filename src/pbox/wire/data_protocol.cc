#include "pbox/wire/data_protocol.h"

#include <cstring>

#include "fmt/format.h"

namespace bragg::pbox {
namespace {

constexpr std::string_view kRequestMagic = "PBXD";
constexpr std::string_view kStatusMagic = "PBXS";
constexpr uint8_t kVersion = 1;

template <typename T>
void Put(std::string* out, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) {
    out->push_back(static_cast<char>(static_cast<uint64_t>(v) >> (8 * i) & 0xff));
  }
}

template <typename T>
T Get(std::string_view in, size_t at) {
  uint64_t v = 0;
  for (size_t i = 0; i < sizeof(T); ++i) {
    v |= static_cast<uint64_t>(static_cast<uint8_t>(in[at + i])) << (8 * i);
  }
  return static_cast<T>(v);
}

}  // namespace

std::string EncodeDataRequest(const DataRequest& request) {
  std::string out;
  out.reserve(kDataRequestBytes);
  out.append(kRequestMagic);
  Put<uint8_t>(&out, kVersion);
  Put<uint8_t>(&out, static_cast<uint8_t>(request.op));
  Put<uint16_t>(&out, 0);
  Put<uint64_t>(&out, request.size);
  out.append(reinterpret_cast<const char*>(request.ticket.data()), request.ticket.size());
  return out;
}

Result<DataRequest> ParseDataRequest(std::string_view bytes) {
  if (bytes.size() != kDataRequestBytes) {
    return absl::InvalidArgumentError(
        fmt::format("data request of {} bytes, expected {}", bytes.size(), kDataRequestBytes));
  }
  if (bytes.substr(0, 4) != kRequestMagic) {
    return absl::InvalidArgumentError("not a pbox data request (bad magic)");
  }
  if (Get<uint8_t>(bytes, 4) != kVersion) {
    return absl::InvalidArgumentError(
        fmt::format("data request version {} is not supported (expected {})",
                    Get<uint8_t>(bytes, 4), kVersion));
  }
  DataRequest req;
  uint8_t op = Get<uint8_t>(bytes, 5);
  if (op != static_cast<uint8_t>(DataOp::kUpload) &&
      op != static_cast<uint8_t>(DataOp::kDownload)) {
    return absl::InvalidArgumentError(fmt::format("data request op {} is unknown", op));
  }
  req.op = static_cast<DataOp>(op);
  if (Get<uint16_t>(bytes, 6) != 0) {
    return absl::InvalidArgumentError("data request reserved bits are set");
  }
  req.size = Get<uint64_t>(bytes, 8);
  if (req.op == DataOp::kDownload && req.size != 0) {
    return absl::InvalidArgumentError("a download request carries size 0");
  }
  std::memcpy(req.ticket.data(), bytes.data() + 16, kTicketBytes);
  return req;
}

std::string EncodeDataStatus(const DataStatus& status) {
  std::string_view message = status.message;
  if (message.size() > kMaxMessageBytes) {
    message = message.substr(0, kMaxMessageBytes);
  }
  std::string out;
  out.reserve(kDataStatusHeadBytes + message.size());
  out.append(kStatusMagic);
  Put<uint32_t>(&out, static_cast<uint32_t>(status.code));
  Put<uint64_t>(&out, status.bytes);
  Put<uint32_t>(&out, status.mode);
  Put<uint32_t>(&out, 0);
  Put<int64_t>(&out, status.mtime_ns);
  Put<uint32_t>(&out, static_cast<uint32_t>(message.size()));
  out.append(message);
  return out;
}

Result<uint32_t> ParseDataStatusHead(std::string_view head, DataStatus* out) {
  if (head.size() != kDataStatusHeadBytes) {
    return absl::InvalidArgumentError(
        fmt::format("data status of {} bytes, expected {}", head.size(), kDataStatusHeadBytes));
  }
  if (head.substr(0, 4) != kStatusMagic) {
    return absl::InvalidArgumentError("not a pbox data status (bad magic)");
  }
  uint32_t code = Get<uint32_t>(head, 4);
  if (code > static_cast<uint32_t>(absl::StatusCode::kUnauthenticated)) {
    return absl::InvalidArgumentError(fmt::format("data status code {} is unknown", code));
  }
  uint32_t length = Get<uint32_t>(head, 32);
  if (length > kMaxMessageBytes) {
    return absl::InvalidArgumentError(
        fmt::format("data status message of {} bytes is over {}", length, kMaxMessageBytes));
  }
  out->code = static_cast<absl::StatusCode>(code);
  out->bytes = Get<uint64_t>(head, 8);
  out->mode = Get<uint32_t>(head, 16);
  out->mtime_ns = Get<int64_t>(head, 24);
  out->message.clear();
  return length;
}

std::string DataSocketPathFor(std::string_view grpc_socket_path) {
  return std::string(grpc_socket_path) + ".data";
}

}  // namespace bragg::pbox
