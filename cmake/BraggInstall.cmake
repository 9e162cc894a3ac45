# `cmake --install BUILD --prefix PREFIX` (`make install PREFIX=...`): one self-contained tree.
#
#   PREFIX/bin/                  the CLIs and servers: pboxd with pbox-init beside it (where the
#                                agent looks), pbox, pbox-fusion, pbox-slurm, bragg-gateway,
#                                bragg-engine, bragg-train, bragg-rl, bragg-reshard, bragg-pack
#   PREFIX/lib/bragg/python/     the Python packages (pbox with its generated stubs, bragg_pack
#                                and bragg_train with their extensions, bragg_gateway,
#                                bragg_reshard, bragg_rl),
#                                for PYTHONPATH
#   PREFIX/include/bragg/        the public headers of the C++ libraries, generated ones included
#   PREFIX/lib/lib*.a            the C++ libraries (static, position-independent)
#   PREFIX/lib/cmake/Bragg/      BraggConfig.cmake: find_package(Bragg) gives bragg::common,
#                                bragg::pack, bragg::pbox_wire and bragg::pbox_client
#   PREFIX/share/bragg/          the gRPC API (proto/), deploy/ (Slurm, Kubernetes)
#   PREFIX/lib/systemd/system/   pboxd.service, with this prefix's paths
#   PREFIX/share/doc/bragg/      LICENSE, NOTICE, README.md, pbox.md
#
# Nothing installed refers back to the source or build tree (tests/install checks it).

include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

# What a user runs, and the Python packages as the build assembles them under <build>/python.
set(BRAGG_PROGRAMS pboxd pbox-init pbox pbox-fusion bragg-gateway bragg-engine bragg-train
                   bragg-rl bragg-reshard bragg-pack)
set(BRAGG_PYTHON_TARGETS pbox_python bragg_pack_core bragg_train_core gateway_python bragg_rl_python
                         bragg_reshard_python)
# Everything `pip install .` ships, and nothing else (pyproject.toml builds this target only).
add_custom_target(bragg_wheel DEPENDS ${BRAGG_PROGRAMS} ${BRAGG_PYTHON_TARGETS})

# Under pip (scikit-build-core sets SKBUILD): the programs go to the environment's bin/ (the
# wheel's scripts; pbox-init stays beside pboxd, where the agent looks), the packages to its
# site-packages; pbox-slurm's shebang becomes the environment's Python. The C++ libraries,
# headers and package config are `make install`'s alone.
if(SKBUILD)
  install(TARGETS ${BRAGG_PROGRAMS} RUNTIME DESTINATION ${SKBUILD_SCRIPTS_DIR})
  install(PROGRAMS ${PROJECT_SOURCE_DIR}/deploy/slurm/pbox-slurm DESTINATION ${SKBUILD_SCRIPTS_DIR})
  install(DIRECTORY ${CMAKE_BINARY_DIR}/python/ DESTINATION ${SKBUILD_PLATLIB_DIR}
          PATTERN __pycache__ EXCLUDE PATTERN "*.pyc" EXCLUDE)
  return()
endif()

set(BRAGG_INSTALL_PYTHONDIR ${CMAKE_INSTALL_LIBDIR}/bragg/python CACHE STRING
    "Where `make install` puts Bragg's Python packages, relative to the prefix")
set(BRAGG_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/Bragg)

# --- the C++ libraries and their headers ----------------------------------------------------
set_target_properties(bragg_common PROPERTIES EXPORT_NAME common)
set_target_properties(bragg_pack PROPERTIES EXPORT_NAME pack)
install(TARGETS bragg_common bragg_pack pbox_wire pbox_client
        EXPORT BraggTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/bragg)

set(_src ${PROJECT_SOURCE_DIR}/src)
# bragg::common: every header but http_server.h (that one is bragg_common_http's, on httplib).
file(GLOB _common_headers ${_src}/common/*.h)
list(FILTER _common_headers EXCLUDE REGEX "/http_server\\.h$")
install(FILES ${_common_headers} DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/bragg/common)
file(GLOB _pack_headers ${_src}/pack/*.h)
install(FILES ${_pack_headers} DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/bragg/pack)
install(FILES ${_src}/pbox/wire/data_protocol.h
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/bragg/pbox/wire)
install(FILES ${_src}/pbox/client/client.h ${_src}/pbox/client/cluster_client.h
              ${_src}/pbox/client/data_client.h ${_src}/pbox/client/endpoints.h
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/bragg/pbox/client)
install(FILES ${CMAKE_BINARY_DIR}/gen/bragg/pbox/v1/pbox.pb.h
              ${CMAKE_BINARY_DIR}/gen/bragg/pbox/v1/pbox.grpc.pb.h
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/bragg/bragg/pbox/v1)

install(EXPORT BraggTargets NAMESPACE bragg:: FILE BraggTargets.cmake
        DESTINATION ${BRAGG_INSTALL_CMAKEDIR})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/BraggConfig.cmake.in
                              ${CMAKE_BINARY_DIR}/BraggConfig.cmake
                              INSTALL_DESTINATION ${BRAGG_INSTALL_CMAKEDIR})
# 0.x: a minor version may change the API, so only the same major.minor is compatible.
write_basic_package_version_file(${CMAKE_BINARY_DIR}/BraggConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_BINARY_DIR}/BraggConfig.cmake ${CMAKE_BINARY_DIR}/BraggConfigVersion.cmake
        DESTINATION ${BRAGG_INSTALL_CMAKEDIR})

# --- programs ---------------------------------------------------------------------------------
install(TARGETS ${BRAGG_PROGRAMS} RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(PROGRAMS ${PROJECT_SOURCE_DIR}/deploy/slurm/pbox-slurm DESTINATION ${CMAKE_INSTALL_BINDIR})

# --- Python: the packages exactly as the build assembles them under <build>/python ------------
install(DIRECTORY ${CMAKE_BINARY_DIR}/python/ DESTINATION ${BRAGG_INSTALL_PYTHONDIR}
        PATTERN __pycache__ EXCLUDE PATTERN "*.pyc" EXCLUDE)

# --- data: the API for other languages, the deployment files ----------------------------------
install(DIRECTORY ${PROJECT_SOURCE_DIR}/proto/ DESTINATION ${CMAKE_INSTALL_DATADIR}/bragg/proto)
install(DIRECTORY ${PROJECT_SOURCE_DIR}/deploy/ DESTINATION ${CMAKE_INSTALL_DATADIR}/bragg/deploy
        PATTERN pbox-slurm EXCLUDE PATTERN *.in EXCLUDE)
install(FILES ${PROJECT_SOURCE_DIR}/LICENSE ${PROJECT_SOURCE_DIR}/NOTICE
              ${PROJECT_SOURCE_DIR}/README.md ${PROJECT_SOURCE_DIR}/docs/pbox.md
              ${PROJECT_SOURCE_DIR}/docs/security.md
        DESTINATION ${CMAKE_INSTALL_DOCDIR})
# The systemd unit names its programs by absolute path: written at install time, for the prefix
# of that install (`cmake --install --prefix` may differ from the configured one).
install(CODE "
  set(BRAGG_BINDIR \"\${CMAKE_INSTALL_PREFIX}/${CMAKE_INSTALL_BINDIR}\")
  set(BRAGG_DOCDIR \"\${CMAKE_INSTALL_PREFIX}/${CMAKE_INSTALL_DOCDIR}\")
  set(unit \"${CMAKE_INSTALL_LIBDIR}/systemd/system/pboxd.service\")
  set(unit \"\$ENV{DESTDIR}\${CMAKE_INSTALL_PREFIX}/\${unit}\")
  message(STATUS \"Installing: \${unit}\")
  configure_file(${PROJECT_SOURCE_DIR}/deploy/systemd/pboxd.service.in \${unit} @ONLY)
  set(user_unit \"${CMAKE_INSTALL_LIBDIR}/systemd/user/pboxd.service\")
  set(user_unit \"\$ENV{DESTDIR}\${CMAKE_INSTALL_PREFIX}/\${user_unit}\")
  message(STATUS \"Installing: \${user_unit}\")
  configure_file(${PROJECT_SOURCE_DIR}/deploy/systemd/pboxd-user.service.in \${user_unit} @ONLY)
")
