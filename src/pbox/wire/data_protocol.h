#pragma once

// Wire format of the data channel (docs/pbox.md "Data channel"): the socket beside each gRPC
// listener where file bytes move without HTTP/2 framing, each transfer admitted by a ticket
// from the OpenTransfer RPC. All integers are little-endian. Pure functions, no I/O: the agent
// (data_server.cc) and the C++ client both use them.
//
// Client -> agent, one request:
//   "PBXD" | u8 version (1) | u8 op (1 upload, 2 download) | u16 0 | u64 size | ticket[32]
// Upload: then exactly `size` bytes, then the trailer "PBXE" (so the agent sees too much data
// before it commits anything). Agent -> client: a status frame
//   "PBXS" | u32 code (absl/gRPC canonical) | u64 bytes | u32 mode | u32 0 | i64 mtime_ns |
//   u32 message length (<= kMaxMessageBytes) | message
// Download: the agent answers with a status frame whose `bytes` is the count that follows,
// then those bytes. A connection that ended a transfer with status OK carries the next
// request; any other status closes it.

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"

namespace bragg::pbox {

inline constexpr size_t kTicketBytes = 32;
using Ticket = std::array<uint8_t, kTicketBytes>;

enum class DataOp : uint8_t { kUpload = 1, kDownload = 2 };

struct DataRequest {
  DataOp op = DataOp::kUpload;
  uint64_t size = 0;  // upload: bytes that follow; download: 0
  Ticket ticket{};
};

struct DataStatus {
  absl::StatusCode code = absl::StatusCode::kOk;
  uint64_t bytes = 0;
  uint32_t mode = 0;
  int64_t mtime_ns = 0;
  std::string message;
};

inline constexpr size_t kDataRequestBytes = 48;
inline constexpr size_t kDataStatusHeadBytes = 36;  // a status frame before its message
inline constexpr size_t kMaxMessageBytes = 4096;
inline constexpr std::string_view kUploadTrailer = "PBXE";

// Exactly kDataRequestBytes bytes.
std::string EncodeDataRequest(const DataRequest& request);
// InvalidArgument unless `bytes` is one well-formed request (size, magic, version, op,
// reserved bits zero, size zero for downloads).
Result<DataRequest> ParseDataRequest(std::string_view bytes);

// A whole status frame; the message is cut to kMaxMessageBytes.
std::string EncodeDataStatus(const DataStatus& status);
// Parses the kDataStatusHeadBytes head of a status frame into `out` (message left empty) and
// returns the length of the message that follows. InvalidArgument if malformed.
Result<uint32_t> ParseDataStatusHead(std::string_view head, DataStatus* out);

// The data socket of a unix gRPC socket: "<path>.data".
std::string DataSocketPathFor(std::string_view grpc_socket_path);

}  // namespace bragg::pbox
