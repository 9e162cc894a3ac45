// The image calls of the Pbox service: import (streamed upload, spooled to the store's scratch
// directory, then unpacked), list, remove, prune.

#include <fcntl.h>

#include "common/fs.h"
#include "fmt/format.h"
#include "pbox/service.h"
#include "spdlog/spdlog.h"

namespace bragg::pbox {
namespace {

void InfoToProto(const ImageInfo& info, v1::ImageInfo* out) {
  out->set_name(info.name);
  out->set_kind(info.kind);
  out->set_format(info.format);
  for (const std::string& l : info.layers) {
    out->add_layers(l);
  }
  out->set_bytes(info.bytes);
  out->set_created_unix_ms(info.created_unix_ms);
  out->set_sandboxes(info.sandboxes);
}

// Import errors name the spooled archive, and the layers split out of it, by their paths in
// the agent's scratch directory: the client is told "the uploaded archive" and "its tarball"
// instead (where the agent keeps its files is not the client's business).
Status HideScratchPaths(const Status& status, const std::string& spool_path,
                        const std::string& scratch_dir) {
  std::string message(status.message());
  auto replace_all = [&message](const std::string& what, auto&& with) {
    if (what.empty()) {
      return;
    }
    for (size_t at = message.find(what); at != std::string::npos; at = message.find(what, at)) {
      size_t end = at + what.size();
      std::string by = with(&end);
      message.replace(at, end - at, by);
      at += by.size();
    }
  };
  replace_all(spool_path, [](size_t*) { return std::string("the uploaded archive"); });
  // Anything else under the scratch directory: the path runs to the next ':', space or quote.
  replace_all(scratch_dir, [&message](size_t* end) {
    *end = std::min(message.size(), message.find_first_of(": \"'", *end));
    return std::string("its tarball");
  });
  return Status(status.code(), message);
}

grpc::Status NoStore() {
  return grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "this agent has no image store");
}

}  // namespace

grpc::Status PboxService::ImportImage(grpc::ServerContext* ctx,
                                      grpc::ServerReader<v1::ImportImageRequest>* reader,
                                      v1::ImageInfo* resp) {
  if (auto s = Authorize(ctx); !s.ok()) {
    return s;
  }
  if (images_ == nullptr) {
    return NoStore();
  }
  v1::ImportImageRequest msg;
  if (!reader->Read(&msg) || !msg.has_header()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "the first message of an ImportImage must be its header");
  }
  const std::string name = msg.header().name();
  const std::string ref = msg.header().ref();
  auto spool = TempDir::Create(images_->scratch_dir(), "upload-");
  if (!spool.ok()) {
    return ToGrpc(spool.status());
  }
  const std::string path = spool->path() + "/archive";
  {
    auto fd = OpenFile(path, O_WRONLY | O_CREAT | O_EXCL, 0600);
    if (!fd.ok()) {
      return ToGrpc(fd.status());
    }
    uint64_t received = 0;
    while (reader->Read(&msg)) {
      if (msg.has_header()) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            "ImportImage: a second header in one call");
      }
      received += msg.chunk().size();
      if (received > images_->max_image_bytes()) {
        return grpc::Status(
            grpc::StatusCode::RESOURCE_EXHAUSTED,
            fmt::format("the image archive is larger than the agent's limit of {} bytes "
                        "(pboxd --max-image-bytes)",
                        images_->max_image_bytes()));
      }
      if (Status s = WriteAll(fd->get(), msg.chunk()); !s.ok()) {
        return ToGrpc(Annotate(s, "spooling the image upload"));
      }
    }
    if (ctx->IsCancelled()) {
      return grpc::Status(grpc::StatusCode::CANCELLED, "import cancelled by the client");
    }
  }
  auto info = images_->Import(name, path, ref);
  if (!info.ok()) {
    spdlog::warn("image import {} refused: {}", name, std::string(info.status().message()));
    return ToGrpc(Annotate(HideScratchPaths(info.status(), path, images_->scratch_dir()),
                           fmt::format("importing image \"{}\"", name)));
  }
  InfoToProto(*info, resp);
  return grpc::Status::OK;
}

grpc::Status PboxService::ListImages(grpc::ServerContext* ctx, const v1::ListImagesRequest*,
                                     v1::ListImagesResponse* resp) {
  if (auto s = Authorize(ctx); !s.ok()) {
    return s;
  }
  if (images_ == nullptr) {
    return NoStore();
  }
  for (const ImageInfo& info : images_->List()) {
    InfoToProto(info, resp->add_images());
  }
  return grpc::Status::OK;
}

grpc::Status PboxService::RemoveImage(grpc::ServerContext* ctx, const v1::RemoveImageRequest* req,
                                      v1::RemoveImageResponse*) {
  if (auto s = Authorize(ctx); !s.ok()) {
    return s;
  }
  if (images_ == nullptr) {
    return NoStore();
  }
  return ToGrpc(images_->Remove(req->name()));
}

grpc::Status PboxService::PruneImages(grpc::ServerContext* ctx, const v1::PruneImagesRequest*,
                                      v1::PruneImagesResponse* resp) {
  if (auto s = Authorize(ctx); !s.ok()) {
    return s;
  }
  if (images_ == nullptr) {
    return NoStore();
  }
  auto pruned = images_->Prune();
  if (!pruned.ok()) {
    return ToGrpc(pruned.status());
  }
  for (const std::string& l : pruned->layers) {
    resp->add_removed_layers(l);
  }
  resp->set_bytes_freed(pruned->bytes);
  return grpc::Status::OK;
}

}  // namespace bragg::pbox
