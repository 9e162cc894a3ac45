# pbox-init (PID 1 of every native sandbox), its wire protocol and the agent's client.

# The wire format only: no dependencies beyond the C++ standard library, so that the static
# pbox-init and fuzzers can link it.
add_library(pbox_init_protocol STATIC init_protocol.cc)
target_include_directories(pbox_init_protocol PUBLIC ${PROJECT_SOURCE_DIR}/src)

add_library(pbox_init_client STATIC init_client.cc)
target_link_libraries(pbox_init_client PUBLIC pbox_init_protocol pbox_init_fds bragg_common)

# fd hygiene for pbox-init's processes: no dependencies, like the protocol.
add_library(pbox_init_fds STATIC init_fds.cc)
target_include_directories(pbox_init_fds PUBLIC ${PROJECT_SOURCE_DIR}/src)

# Runs inside sandboxes whose root has no host libraries: fully static.
add_executable(pbox-init init_main.cc init_server.cc init_helpers.cc init_pid_namespace.cc)
target_link_libraries(pbox-init PRIVATE pbox_init_protocol pbox_init_fds)
target_link_options(pbox-init PRIVATE -static -static-libstdc++ -static-libgcc)

bragg_test(pbox_init_protocol_test SOURCES init_protocol_test.cc LIBS pbox_init_protocol
           TIMEOUT 120)
bragg_test(pbox_init_fds_test SOURCES init_fds_test.cc LIBS pbox_init_fds TIMEOUT 60)
bragg_test(pbox_init_test SOURCES init_test.cc LIBS pbox_init_client TIMEOUT 300)
target_compile_definitions(pbox_init_test PRIVATE PBOX_INIT_PATH="$<TARGET_FILE:pbox-init>")
add_dependencies(pbox_init_test pbox-init)
