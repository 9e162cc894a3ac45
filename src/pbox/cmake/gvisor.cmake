# The gVisor runtime (runsc), part of the agent library.
target_sources(pbox_agent PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/gvisor_runtime.cc)
bragg_test(pbox_gvisor_runtime_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/gvisor_runtime_test.cc
           LIBS pbox_agent nlohmann_json::nlohmann_json)
