// Fuzzes the small parsers that read operator- or client-supplied text: sizes ("1.5GiB"),
// CPU lists ("0-3,8"), --image NAME=DIR flags and --listen addresses, the image archive
// reader (docker/podman save, OCI layouts: manifests, indexes, digests, links), and the
// binary request and status headers of the data channel (pbox/wire/data_protocol.h), which
// anyone who can reach the data socket may send. Each must accept or refuse with a
// message, never crash, and what it accepts must round-trip (an archive: every layer it
// returns is a file it copied into the scratch directory).
//
// Input: byte 0 selects the parser, the rest is the text.

#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <string>

#include "common/fs.h"
#include "common/units.h"
#include "pbox/agent.h"
#include "pbox/cgroup/cpuset.h"
#include "pbox/image/image_archive.h"
#include "pbox/image/image_store.h"
#include "pbox/wire/data_protocol.h"

namespace pb = bragg::pbox;

namespace {

[[noreturn]] void Die(const std::string& what, const std::string& input) {
  std::cerr << "parsers_fuzz: " << what << " (input \"" << input << "\")\n";
  std::abort();
}

void FuzzSize(const std::string& text) {
  auto v = bragg::ParseSize(text);
  if (!v.ok()) {
    if (v.status().message().empty()) {
      Die("size refused without a message", text);
    }
    return;
  }
  std::string formatted = bragg::FormatSize(*v);
  auto again = bragg::ParseSize(formatted);
  if (!again.ok()) {
    Die("FormatSize output " + formatted + " does not parse", text);
  }
  // One decimal is printed, so the round trip is exact for whole multiples only, and within
  // 5% of the unit otherwise.
  double a = static_cast<double>(*v);
  double b = static_cast<double>(*again);
  if (formatted.find('.') == std::string::npos ? *again != *v : std::abs(a - b) > 0.05 * a) {
    Die("size round trip " + std::to_string(*v) + " -> " + formatted, text);
  }
}

void FuzzCpuSet(const std::string& text) {
  auto s = pb::CpuSet::Parse(text);
  if (!s.ok()) {
    if (s.status().message().empty()) {
      Die("cpu list refused without a message", text);
    }
    return;
  }
  if (s->size() > 65536) {
    Die("cpu set larger than the CPU number range", text);
  }
  auto again = pb::CpuSet::Parse(s->ToString());
  if (!again.ok() || !(*again == *s)) {
    Die("cpu list round trip via " + s->ToString(), text);
  }
  // The allocator must hand out and take back any request without losing CPUs.
  if (!s->empty()) {
    pb::CpuAllocator alloc(*s);
    uint32_t n = static_cast<uint32_t>(text.size() % (s->size() + 2));
    auto got = alloc.Allocate(n);
    if (got.ok()) {
      if (!got->IsSubsetOf(*s) || got->size() != std::max<uint32_t>(n, 1)) {
        Die("allocator returned " + got->ToString(), text);
      }
      alloc.Release(*got);
      for (uint32_t load : alloc.Load()) {
        if (load != 0) {
          Die("allocator load not zero after release", text);
        }
      }
    } else if (n <= s->size()) {
      Die("allocator refused " + std::to_string(n), text);
    }
  }
}

void FuzzImageFlag(const std::string& text) {
  auto r = pb::ParseImageFlag(text);
  if (r.ok()) {
    if (r->first.empty() || r->second.empty() || r->second[0] != '/' ||
        r->first.find('/') != std::string::npos) {
      Die("image flag accepted a bad name or dir", text);
    }
  }
}

void FuzzListen(const std::string& text) {
  bool is_tcp = false;
  auto r = pb::ListenAddressToGrpc(text, &is_tcp);
  if (r.ok() && r->empty()) {
    Die("listen address accepted as empty", text);
  }
}

// The archive reader, on the bytes as an uploaded archive (1 MiB limit); odd first bytes of
// the text also pass a --ref.
void FuzzImageArchive(const std::string& bytes) {
  static auto dir = bragg::TempDir::Create("/tmp", "parsers-fuzz-");
  if (!dir.ok()) {
    Die("temp dir: " + dir.status().ToString(), "");
  }
  const std::string path = dir->path() + "/archive";
  const std::string scratch = dir->path() + "/scratch";
  if (!bragg::WriteStringToFile(path, bytes).ok() || !bragg::MakeDirs(scratch, 0700).ok()) {
    Die("cannot write the input", "");
  }
  const std::string ref = !bytes.empty() && (bytes[0] & 1) ? "a:1" : "";
  auto split = pb::SplitImageArchive(path, scratch, 1 << 20, ref);
  if (!split.ok() && split.status().message().empty()) {
    Die("archive refused without a message", "(binary)");
  }
  if (split.ok()) {
    if (split->layers.empty()) {
      Die("archive accepted with no layers", "(binary)");
    }
    for (const std::string& layer : split->layers) {
      if (layer != path && layer.rfind(scratch + "/", 0) != 0) {
        Die("layer outside the scratch directory: " + layer, "(binary)");
      }
    }
  }
  (void)bragg::RemoveTree(scratch);
}

void FuzzDataRequest(const std::string& bytes) {
  auto r = pb::ParseDataRequest(bytes);
  if (!r.ok()) {
    if (r.status().message().empty()) {
      Die("data request refused without a message", bytes);
    }
    return;
  }
  if (r->op != pb::DataOp::kUpload && r->op != pb::DataOp::kDownload) {
    Die("data request accepted with an unknown op", bytes);
  }
  if (pb::EncodeDataRequest(*r) != bytes) {
    Die("data request does not re-encode to its bytes", bytes);
  }
}

void FuzzDataStatus(const std::string& bytes) {
  pb::DataStatus st;
  auto len = pb::ParseDataStatusHead(bytes.substr(0, pb::kDataStatusHeadBytes), &st);
  if (!len.ok()) {
    return;
  }
  if (*len > pb::kMaxMessageBytes) {
    Die("data status message length beyond the bound", bytes);
  }
  st.message = bytes.substr(std::min(bytes.size(), pb::kDataStatusHeadBytes), *len);
  std::string again = pb::EncodeDataStatus(st);
  pb::DataStatus back;
  auto len2 = pb::ParseDataStatusHead(again.substr(0, pb::kDataStatusHeadBytes), &back);
  if (!len2.ok() || *len2 != st.message.size() || back.code != st.code || back.bytes != st.bytes) {
    Die("data status round trip", bytes);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) {
    return 0;
  }
  std::string text(reinterpret_cast<const char*>(data + 1), size - 1);
  switch (data[0] % 7) {
    case 0:
      FuzzSize(text);
      break;
    case 1:
      FuzzCpuSet(text);
      break;
    case 2:
      FuzzImageFlag(text);
      break;
    case 3:
      FuzzListen(text);
      break;
    case 4:
      FuzzImageArchive(text);
      break;
    case 5:
      FuzzDataRequest(text);
      break;
    default:
      FuzzDataStatus(text);
      break;
  }
  return 0;
}
