# The image store's unpacker and image-archive reader: libarchive (tar behind gzip/zstd/xz)
# and libcrypto (SHA-256 of each layer, its content address).
pkg_check_modules(LIBARCHIVE REQUIRED IMPORTED_TARGET libarchive)
pkg_check_modules(LIBCRYPTO REQUIRED IMPORTED_TARGET libcrypto)

add_library(pbox_images STATIC
  ${CMAKE_CURRENT_SOURCE_DIR}/layer_unpack.cc
  ${CMAKE_CURRENT_SOURCE_DIR}/image_archive.cc)
target_link_libraries(pbox_images PUBLIC bragg_common PkgConfig::LIBARCHIVE
                      PRIVATE PkgConfig::LIBCRYPTO nlohmann_json::nlohmann_json)
