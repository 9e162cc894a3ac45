# Prometheus metrics for pboxd: Registry (counters, gauges, histograms) and the /metrics server.
# cpp-httplib comes from Debian's libcpp-httplib-dev, which ships a pkg-config file only; its
# Cflags carry the feature macros the compiled libcpp-httplib.so was built with (ABI).
pkg_check_modules(HTTPLIB REQUIRED IMPORTED_TARGET cpp-httplib)

add_library(pbox_metrics STATIC metrics.cc)
target_link_libraries(pbox_metrics PUBLIC bragg_common PRIVATE PkgConfig::HTTPLIB)

bragg_test(pbox_metrics_test SOURCES metrics_test.cc LIBS pbox_metrics PkgConfig::HTTPLIB
           TIMEOUT 120)
