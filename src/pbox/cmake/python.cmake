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

# The suite's integration and hostile-input files with gVisor as the runtime under test
# (skipped where runsc is missing): the API, files, commands, hostile input, cloning,
# isolation, auth, a short leak run and the open-files limit. Not the whole suite: it took
# 10 min on gVisor at load ~45 on this 2-core machine (the rest exercises the agent rather
# than the runtime: asyncio client, cluster placement, images, faults, TCP, overload).
# Choice and timings in docs/pbox.md ("The gVisor runtime"); differences there are marked in
# the tests.
set(PBOX_PY_TESTS ${PROJECT_SOURCE_DIR}/tests/pbox/python)
set(PBOX_PY_GVISOR_FILES test_api.py test_files.py test_run_exec.py test_hostile.py
    test_clone.py test_isolation.py test_auth.py test_leaks.py test_fd_limit.py)
list(TRANSFORM PBOX_PY_GVISOR_FILES PREPEND ${PBOX_PY_TESTS}/)
add_test(NAME pbox_python_gvisor
         COMMAND ${PBOX_PYTHON3} -m pytest -q -p no:cacheprovider ${PBOX_PY_GVISOR_FILES})
set_tests_properties(pbox_python_gvisor PROPERTIES
  ENVIRONMENT "PYTHONPATH=${PBOX_PY_OUT};PBOXD=$<TARGET_FILE:pboxd>;PBOX_TEST_RUNTIME=gvisor;PBOX_LEAK_CYCLES=60;PBOX_LEAK_WARMUP=30;PBOX_LEAK_CONCURRENCY=3"
  LABELS "root;integration;gvisor"
  TIMEOUT 900)
