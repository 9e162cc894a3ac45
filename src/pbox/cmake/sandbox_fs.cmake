# SandboxFs: file operations confined to a sandbox's root filesystem (openat2 RESOLVE_IN_ROOT).
add_library(pbox_fs STATIC ${CMAKE_CURRENT_SOURCE_DIR}/sandbox_fs.cc)
target_link_libraries(pbox_fs PUBLIC bragg_common)

bragg_test(pbox_fs_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/sandbox_fs_test.cc LIBS pbox_fs
           LABELS root TIMEOUT 300)
