# The pbox Python package: stubs generated from the proto into pbox/_proto/, plus the package
# sources, assembled under ${CMAKE_BINARY_DIR}/python so that
# `PYTHONPATH=<build>/python /usr/bin/python3 -c "import pbox"` works; and its pytest suite.

find_package(Protobuf REQUIRED)
find_program(GRPC_PYTHON_PLUGIN grpc_python_plugin REQUIRED)
find_program(PBOX_PYTHON3 python3 PATHS /usr/bin NO_DEFAULT_PATH REQUIRED)
find_program(SED_PROGRAM sed REQUIRED)

set(PBOX_PY_OUT ${CMAKE_BINARY_DIR}/python)
set(PBOX_PY_PROTO_OUT ${PBOX_PY_OUT}/pbox/_proto)
set(PBOX_PY_GEN_TMP ${CMAKE_BINARY_DIR}/python-gen)
set(PBOX_PY_PROTO ${PROJECT_SOURCE_DIR}/proto/bragg/pbox/v1/pbox.proto)
set(PBOX_PY_INIT ${CMAKE_BINARY_DIR}/python-proto-init.py)
file(CONFIGURE OUTPUT ${PBOX_PY_INIT} CONTENT "\"\"\"Generated from proto/bragg/pbox/v1/pbox.proto (private).\"\"\"\n")
file(GLOB PBOX_PY_SOURCES CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/python/pbox/*.py)

# protoc writes bragg/pbox/v1/pbox_pb2{,_grpc}.py; they move into the private subpackage
# pbox._proto and the stub's absolute import of the messages becomes a relative one, so the
# package does not claim the top-level name "bragg".
add_custom_command(
  OUTPUT ${PBOX_PY_PROTO_OUT}/pbox_pb2.py ${PBOX_PY_PROTO_OUT}/pbox_pb2_grpc.py
         ${PBOX_PY_PROTO_OUT}/__init__.py
  COMMAND ${CMAKE_COMMAND} -E rm -rf ${PBOX_PY_GEN_TMP}
  COMMAND ${CMAKE_COMMAND} -E make_directory ${PBOX_PY_GEN_TMP} ${PBOX_PY_PROTO_OUT}
  COMMAND protobuf::protoc --proto_path=${PROJECT_SOURCE_DIR}/proto
          --python_out=${PBOX_PY_GEN_TMP} --grpc_out=${PBOX_PY_GEN_TMP}
          --plugin=protoc-gen-grpc=${GRPC_PYTHON_PLUGIN} ${PBOX_PY_PROTO}
  COMMAND ${CMAKE_COMMAND} -E copy ${PBOX_PY_GEN_TMP}/bragg/pbox/v1/pbox_pb2.py
          ${PBOX_PY_GEN_TMP}/bragg/pbox/v1/pbox_pb2_grpc.py ${PBOX_PY_PROTO_OUT}/
  COMMAND ${SED_PROGRAM} -i -e "s/^from bragg\\.pbox\\.v1 import pbox_pb2/from . import pbox_pb2/"
          ${PBOX_PY_PROTO_OUT}/pbox_pb2_grpc.py
  COMMAND ${CMAKE_COMMAND} -E copy ${PBOX_PY_INIT} ${PBOX_PY_PROTO_OUT}/__init__.py
  DEPENDS ${PBOX_PY_PROTO} ${PBOX_PY_INIT}
  COMMENT "protoc: bragg/pbox/v1/pbox.proto (Python)")

set(PBOX_PY_COPIED)
foreach(src ${PBOX_PY_SOURCES})
  get_filename_component(name ${src} NAME)
  add_custom_command(
    OUTPUT ${PBOX_PY_OUT}/pbox/${name}
    COMMAND ${CMAKE_COMMAND} -E copy_if_different ${src} ${PBOX_PY_OUT}/pbox/${name}
    DEPENDS ${src}
    COMMENT "python: pbox/${name}")
  list(APPEND PBOX_PY_COPIED ${PBOX_PY_OUT}/pbox/${name})
endforeach()

add_custom_target(pbox_python ALL
  DEPENDS ${PBOX_PY_PROTO_OUT}/pbox_pb2.py ${PBOX_PY_PROTO_OUT}/pbox_pb2_grpc.py
          ${PBOX_PY_PROTO_OUT}/__init__.py ${PBOX_PY_COPIED})

add_test(NAME pbox_python
         COMMAND ${PBOX_PYTHON3} -m pytest -q -x -p no:cacheprovider
                 ${PROJECT_SOURCE_DIR}/tests/pbox/python)
set_tests_properties(pbox_python PROPERTIES
  ENVIRONMENT "PYTHONPATH=${PBOX_PY_OUT};PBOXD=$<TARGET_FILE:pboxd>"
  LABELS root
  TIMEOUT 900)

# The hardening probes of the same suite with gVisor as the runtime under test (skipped where
# runsc is missing): isolation, a short leak run, auth, the sandboxes' open-files limit. A
# subset that fits ~90 s on a loaded 2-core machine (about 20-30 s here); the rest of the suite
# exercises the agent rather than the runtime. Differences on gVisor are marked in the tests
# and listed in docs/pbox.md ("The gVisor runtime").
set(PBOX_PY_TESTS ${PROJECT_SOURCE_DIR}/tests/pbox/python)
add_test(NAME pbox_python_gvisor
         COMMAND ${PBOX_PYTHON3} -m pytest -q -p no:cacheprovider
                 ${PBOX_PY_TESTS}/test_isolation.py ${PBOX_PY_TESTS}/test_leaks.py
                 ${PBOX_PY_TESTS}/test_auth.py ${PBOX_PY_TESTS}/test_fd_limit.py)
set_tests_properties(pbox_python_gvisor PROPERTIES
  ENVIRONMENT "PYTHONPATH=${PBOX_PY_OUT};PBOXD=$<TARGET_FILE:pboxd>;PBOX_TEST_RUNTIME=gvisor;PBOX_LEAK_CYCLES=60;PBOX_LEAK_WARMUP=30;PBOX_LEAK_CONCURRENCY=3"
  LABELS "root;integration;gvisor"
  TIMEOUT 240)
