# The pbox agent: generated gRPC code, the agent library, pboxd.

pkg_check_modules(SECCOMP REQUIRED IMPORTED_TARGET libseccomp)
find_program(GRPC_CPP_PLUGIN grpc_cpp_plugin REQUIRED)

set(PBOX_PROTO ${PROJECT_SOURCE_DIR}/proto/bragg/pbox/v1/pbox.proto)
set(PBOX_GEN ${CMAKE_BINARY_DIR}/gen)
set(PBOX_GEN_SRCS
    ${PBOX_GEN}/bragg/pbox/v1/pbox.pb.cc ${PBOX_GEN}/bragg/pbox/v1/pbox.grpc.pb.cc)
add_custom_command(
  OUTPUT ${PBOX_GEN_SRCS} ${PBOX_GEN}/bragg/pbox/v1/pbox.pb.h
         ${PBOX_GEN}/bragg/pbox/v1/pbox.grpc.pb.h
  COMMAND ${CMAKE_COMMAND} -E make_directory ${PBOX_GEN}
  COMMAND protobuf::protoc --proto_path=${PROJECT_SOURCE_DIR}/proto --cpp_out=${PBOX_GEN}
          --grpc_out=${PBOX_GEN} --plugin=protoc-gen-grpc=${GRPC_CPP_PLUGIN} ${PBOX_PROTO}
  DEPENDS ${PBOX_PROTO}
  COMMENT "protoc: bragg/pbox/v1/pbox.proto (C++)")
add_library(pbox_proto STATIC ${PBOX_GEN_SRCS})
target_include_directories(pbox_proto PUBLIC ${PBOX_GEN})
target_link_libraries(pbox_proto PUBLIC protobuf::libprotobuf gRPC::grpc++)
target_compile_options(pbox_proto PRIVATE -w)

add_library(pbox_agent STATIC
  ${CMAKE_CURRENT_SOURCE_DIR}/agent.cc
  ${CMAKE_CURRENT_SOURCE_DIR}/agent_config.cc
  ${CMAKE_CURRENT_SOURCE_DIR}/image_service.cc
  ${CMAKE_CURRENT_SOURCE_DIR}/frozen_layer.cc
  ${CMAKE_CURRENT_SOURCE_DIR}/image_store.cc
  ${CMAKE_CURRENT_SOURCE_DIR}/native_runtime.cc
  ${CMAKE_CURRENT_SOURCE_DIR}/sandbox.cc
  ${CMAKE_CURRENT_SOURCE_DIR}/sandbox_manager.cc
  ${CMAKE_CURRENT_SOURCE_DIR}/sandbox_manager_clone.cc
  ${CMAKE_CURRENT_SOURCE_DIR}/seccomp_filter.cc
  ${CMAKE_CURRENT_SOURCE_DIR}/service.cc)
target_link_libraries(pbox_agent PUBLIC
  pbox_proto pbox_cgroup pbox_fs pbox_images pbox_init_client pbox_metrics pbox_client_limiter
  bragg_common
  nlohmann_json::nlohmann_json PkgConfig::SECCOMP absl::synchronization)

bragg_test(pbox_sandbox_freeze_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/sandbox_freeze_test.cc
           LIBS pbox_agent)
bragg_test(pbox_agent_config_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/agent_config_test.cc
           LIBS pbox_agent TIMEOUT 60)

add_executable(pboxd ${CMAKE_CURRENT_SOURCE_DIR}/pboxd_main.cc)
target_link_libraries(pboxd PRIVATE pbox_agent CLI11::CLI11)
add_dependencies(pboxd pbox-init)

# C++ client library and the pbox CLI.
add_library(pbox_client STATIC ${CMAKE_CURRENT_SOURCE_DIR}/client/client.cc)
target_link_libraries(pbox_client PUBLIC pbox_proto bragg_common absl::synchronization)

add_executable(pbox ${CMAKE_CURRENT_SOURCE_DIR}/client/pbox_main.cc
                    ${CMAKE_CURRENT_SOURCE_DIR}/client/cli_common.cc
                    ${CMAKE_CURRENT_SOURCE_DIR}/client/sandbox_cli.cc
                    ${CMAKE_CURRENT_SOURCE_DIR}/client/exec_cli.cc
                    ${CMAKE_CURRENT_SOURCE_DIR}/client/files_cli.cc
                    ${CMAKE_CURRENT_SOURCE_DIR}/client/info_cli.cc
                    ${CMAKE_CURRENT_SOURCE_DIR}/client/image_cli.cc
                    ${CMAKE_CURRENT_SOURCE_DIR}/client/oci_dir_tar.cc)
target_link_libraries(pbox PRIVATE pbox_client CLI11::CLI11)
