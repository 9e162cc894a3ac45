# The C++ cluster client: several agents (one per node of a job) behind one object, fed by an
# endpoint list, the endpoints file of deploy/slurm/pbox-slurm or $PBOX_ENDPOINTS.
target_sources(pbox_client PRIVATE
  ${CMAKE_CURRENT_SOURCE_DIR}/client/endpoints.cc
  ${CMAKE_CURRENT_SOURCE_DIR}/client/cluster_client.cc)
target_link_libraries(pbox_client PRIVATE nlohmann_json::nlohmann_json)

# The endpoints file and list parsers, against the rules of python/pbox/cluster.py (no agent).
bragg_test(pbox_endpoints_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/client/endpoints_test.cc
           LIBS pbox_client TIMEOUT 60)
