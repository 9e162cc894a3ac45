# The data channel: file bytes on a socket beside each gRPC listener (docs/pbox.md).
# The wire format is shared by the agent and the C++ client.
add_library(pbox_data_protocol STATIC ${CMAKE_CURRENT_SOURCE_DIR}/data_protocol.cc)
target_link_libraries(pbox_data_protocol PUBLIC bragg_common)

target_sources(pbox_agent PRIVATE
  ${CMAKE_CURRENT_SOURCE_DIR}/data_server.cc
  ${CMAKE_CURRENT_SOURCE_DIR}/transfer_tickets.cc)
target_link_libraries(pbox_agent PUBLIC pbox_data_protocol)
target_link_libraries(pbox_client PUBLIC pbox_data_protocol)
target_sources(pbox_client PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/client/data_client.cc)

bragg_test(pbox_data_protocol_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/data_protocol_test.cc
           LIBS pbox_agent TIMEOUT 60)
