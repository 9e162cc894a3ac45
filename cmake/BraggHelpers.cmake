# bragg_test(NAME SOURCES a.cc b.cc LIBS lib... [LABELS l...] [TIMEOUT s])
# One gtest binary per call, registered with ctest (LevelDB's leveldb_test()). Its main() is
# tests/support/gtest_main.cc: a binary whose every test skipped reports a skip to ctest.
function(bragg_test name)
  cmake_parse_arguments(T "" "TIMEOUT" "SOURCES;LIBS;LABELS" ${ARGN})
  add_executable(${name} ${T_SOURCES})
  target_link_libraries(${name} PRIVATE ${T_LIBS} GTest::gtest GTest::gmock bragg_gtest_main)
  add_test(NAME ${name} COMMAND ${name})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 300)
  endif()
  set_tests_properties(${name} PROPERTIES TIMEOUT ${T_TIMEOUT})
  if(T_LABELS)
    set_tests_properties(${name} PROPERTIES LABELS "${T_LABELS}")
  endif()
endfunction()

# Every ctest entry reports its skips. add_test is wrapped (once, here, before any part adds a
# test) so that no entry can be registered without this:
#   - exit code 77 is ctest's skip (SKIP_RETURN_CODE), so a test that cannot run here shows as
#     "Skipped", never as "Passed";
#   - $BRAGG_SKIP_FILE (<build>/skips/NAME.txt) collects each skipped case with its reason,
#     written by the gtest main (tests/support/gtest_main.cc), the pytest plugin
#     tests/support/bragg_pytest_skips.py (loaded through PYTEST_PLUGINS, importable through
#     PYTHONPATH) and the shell and Python tests that skip; `make test` lists them and, under
#     CI=true, fails on any skip tests/allowed-skips.txt does not name (scripts/test-summary).
# Arguments are passed on as given, semicolons included; an empty argument is dropped.
function(add_test)
  set(args "")
  math(EXPR last "${ARGC} - 1")
  foreach(i RANGE 0 ${last})
    string(REPLACE ";" "\\;" arg "${ARGV${i}}")
    list(APPEND args "${arg}")
  endforeach()
  _add_test(${args})
  if(ARGV0 STREQUAL "NAME")
    set(name ${ARGV1})
  else()
    set(name ${ARGV0})
  endif()
  set_tests_properties(${name} PROPERTIES SKIP_RETURN_CODE 77)
  set_property(TEST ${name} APPEND PROPERTY ENVIRONMENT_MODIFICATION
    "BRAGG_SKIP_FILE=set:${CMAKE_BINARY_DIR}/skips/${name}.txt"
    "PYTEST_PLUGINS=set:bragg_pytest_skips"
    "PYTHONPATH=path_list_append:${PROJECT_SOURCE_DIR}/tests/support")
endfunction()

# bragg_fuzz(NAME SOURCES a.cc... LIBS lib... CORPUS dir [DICT file] [SECONDS s])
# One fuzz target (a LLVMFuzzerTestOneInput function) per call, built one of two ways:
#   - -DBRAGG_LIBFUZZER=ON (clang, `make fuzz`): linked with libFuzzer; the build tree's
#     fuzz-targets/NAME names its binary, seed corpus and dictionary for scripts/run-fuzzers;
#   - otherwise (the normal gcc build): linked with tests/fuzz/fuzz_driver.cc, which replays
#     every file of CORPUS and then mutates inputs for SECONDS (default 5); registered with
#     ctest as NAME (label fuzz), so `make test` runs every target without a clang build.
# CORPUS and DICT are relative to the calling CMakeLists.txt's directory.
option(BRAGG_LIBFUZZER "Build the fuzz targets with libFuzzer (needs clang)" OFF)
function(bragg_fuzz name)
  cmake_parse_arguments(F "" "CORPUS;DICT;SECONDS" "SOURCES;LIBS" ${ARGN})
  if(NOT F_CORPUS)
    message(FATAL_ERROR "bragg_fuzz(${name}): CORPUS is required")
  endif()
  get_filename_component(F_CORPUS ${F_CORPUS} ABSOLUTE BASE_DIR ${CMAKE_CURRENT_SOURCE_DIR})
  if(F_DICT)
    get_filename_component(F_DICT ${F_DICT} ABSOLUTE BASE_DIR ${CMAKE_CURRENT_SOURCE_DIR})
  endif()
  if(NOT F_SECONDS)
    set(F_SECONDS 5)
  endif()
  add_executable(${name} ${F_SOURCES})
  target_link_libraries(${name} PRIVATE ${F_LIBS})
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR}/src ${CMAKE_CURRENT_SOURCE_DIR})
  if(BRAGG_LIBFUZZER)
    target_compile_options(${name} PRIVATE -fsanitize=fuzzer)
    target_link_options(${name} PRIVATE -fsanitize=fuzzer)
    file(GENERATE OUTPUT ${CMAKE_BINARY_DIR}/fuzz-targets/${name}
         CONTENT "bin=$<TARGET_FILE:${name}>\ncorpus=${F_CORPUS}\ndict=${F_DICT}\n")
  else()
    target_sources(${name} PRIVATE ${PROJECT_SOURCE_DIR}/tests/fuzz/fuzz_driver.cc)
    add_test(NAME ${name} COMMAND ${name} --seconds ${F_SECONDS} --max-len 8192 ${F_CORPUS})
    set_tests_properties(${name} PROPERTIES LABELS fuzz TIMEOUT 120)
  endif()
endfunction()

# bragg_python_package(PACKAGE TARGET target [EXTENSION SOURCES a.cc... LIBS lib...])
# Assembles python/PACKAGE/*.py under ${CMAKE_BINARY_DIR}/python/PACKAGE, so that
# PYTHONPATH=<build>/python imports it (and cmake/BraggInstall.cmake installs that directory).
# A pure-Python package: TARGET copies the files (built by default). With EXTENSION: TARGET is
# the pybind11 module PACKAGE._core, from SOURCES linked to LIBS, built beside the files it
# depends on (pybind11 is found once, in the root CMakeLists.txt; nothing is made without it).
function(bragg_python_package package)
  cmake_parse_arguments(P "EXTENSION" "TARGET" "SOURCES;LIBS" ${ARGN})
  if(P_EXTENSION AND NOT pybind11_FOUND)
    return()
  endif()
  set(out ${CMAKE_BINARY_DIR}/python/${package})
  file(GLOB py CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/python/${package}/*.py)
  set(copy ${P_TARGET})
  if(P_EXTENSION)
    set(copy ${P_TARGET}_pyfiles)
  endif()
  add_custom_target(${copy} ALL
    COMMAND ${CMAKE_COMMAND} -E make_directory ${out}
    COMMAND ${CMAKE_COMMAND} -E copy_if_different ${py} ${out}
    DEPENDS ${py}
    COMMENT "python: ${package}")
  if(P_EXTENSION)
    pybind11_add_module(${P_TARGET} MODULE ${P_SOURCES})
    target_link_libraries(${P_TARGET} PRIVATE ${P_LIBS})
    set_target_properties(${P_TARGET} PROPERTIES OUTPUT_NAME _core LIBRARY_OUTPUT_DIRECTORY ${out})
    add_dependencies(${P_TARGET} ${copy})
  endif()
endfunction()
