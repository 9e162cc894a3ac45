# The gVisor runtime (runsc), part of the agent library.
target_sources(pbox_agent PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/gvisor_runtime.cc)
