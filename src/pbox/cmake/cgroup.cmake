# Cgroups (v1 and v2) and CPU sets for the agent.
add_library(pbox_cgroup STATIC
  ${CMAKE_CURRENT_SOURCE_DIR}/cpuset.cc
  ${CMAKE_CURRENT_SOURCE_DIR}/cgroup.cc
  ${CMAKE_CURRENT_SOURCE_DIR}/cgroup_v1.cc
  ${CMAKE_CURRENT_SOURCE_DIR}/cgroup_v2.cc)
target_link_libraries(pbox_cgroup PUBLIC bragg_common)

bragg_test(pbox_cpuset_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/cpuset_test.cc LIBS pbox_cgroup)
bragg_test(pbox_cgroup_v2_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/cgroup_v2_test.cc
           LIBS pbox_cgroup)
bragg_test(pbox_cgroup_v1_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/cgroup_v1_test.cc
           LIBS pbox_cgroup LABELS root TIMEOUT 300)
bragg_test(pbox_cgroup_v2_kernel_test SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/cgroup_v2_kernel_test.cc
           LIBS pbox_cgroup LABELS root TIMEOUT 120)
