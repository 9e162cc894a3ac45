# Per-client fairness of the agent's admission (caps on in-flight calls, refusal pacing).
add_library(pbox_client_limiter STATIC ${CMAKE_CURRENT_SOURCE_DIR}/client_limiter.cc)
target_link_libraries(pbox_client_limiter PUBLIC bragg_common)

bragg_test(pbox_client_limiter_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/client_limiter_test.cc
           LIBS pbox_client_limiter)
