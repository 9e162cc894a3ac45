#pragma once

// The agents of a cluster: endpoint lists, the endpoints file written by
// deploy/slurm/pbox-slurm, and $PBOX_ENDPOINTS. Same formats and rules as the Python client
// (python/pbox/cluster.py), so one file or variable serves both.
//
// Endpoints file (JSON):
//
//   {"job_id": "123", "token_file": "/shared/.pbox-slurm-123/token",
//    "nodes": [{"node": "n1", "host": "10.0.0.1", "port": 40123,
//               "endpoint": "tcp://10.0.0.1:40123", "cpuset": "56-63", ...}, ...]}
//
// Only nodes[].endpoint (or host and port) is required; a bare list of node objects is accepted
// too. token_file may be given per node or once at the top. $PBOX_ENDPOINTS is the path of such
// a file or a comma-separated list of tcp://HOST:PORT / unix:///path endpoints.

#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace bragg::pbox::client {

// The environment variable ClusterClient reads when given no endpoints.
inline constexpr const char* kEndpointsEnv = "PBOX_ENDPOINTS";

// One agent of the cluster. Value type.
struct Endpoint {
  std::string node;          // unique name: the file's "node", else "host", else the endpoint
  std::string endpoint;      // canonical: unix:///path or tcp://host:port
  std::string token_file;    // "" if none (the node's, else the file's top-level one)
  std::string cpuset;        // the agent's sandbox CPUs, e.g. "56-63"; "" if not given
  std::string trainer_cpus;  // the job's other CPUs on that node; "" if not given
};

// Validates one endpoint and returns its canonical form: "unix:///abs/path" and
// "tcp://HOST:PORT" (digits after the last ':') as given, "/abs/path" -> "unix:///abs/path".
// InvalidArgument otherwise.
[[nodiscard]] Result<std::string> CanonicalEndpoint(std::string_view endpoint);

// Number of distinct CPUs in a kernel-style CPU list ("0-3,8" -> 5). InvalidArgument for an
// empty list, junk, reversed ranges or CPUs above 65535.
[[nodiscard]] Result<size_t> CountCpuList(std::string_view text);

// Parses the endpoints file's text; `where` names the source in error messages.
// InvalidArgument for anything but the format above: not JSON, no or an empty "nodes" list, a
// node that is not an object or lacks both "endpoint" and a valid "host"/"port", fields of the
// wrong type, a malformed endpoint or cpuset, duplicate node names.
[[nodiscard]] Result<std::vector<Endpoint>> ParseEndpointsJson(std::string_view text,
                                                               std::string_view where);

// Reads and parses an endpoints file (at most 16 MiB). InvalidArgument for a missing,
// unreadable, oversized or malformed file.
[[nodiscard]] Result<std::vector<Endpoint>> LoadEndpointsFile(const std::string& path);

// A comma-separated list of endpoints; each node is named by its canonical endpoint. Blank
// items are skipped. InvalidArgument for an empty list, a bad endpoint or a duplicate.
[[nodiscard]] Result<std::vector<Endpoint>> ParseEndpointList(std::string_view list);

// Endpoints from `spec` as $PBOX_ENDPOINTS reads: text containing "://" is a list
// (ParseEndpointList), anything else the path of an endpoints file. Empty `spec`: the value of
// $PBOX_ENDPOINTS; InvalidArgument if that is unset or empty too.
[[nodiscard]] Result<std::vector<Endpoint>> LoadEndpoints(std::string_view spec = "");

// Reads a token file: its contents without surrounding whitespace (at most 64 KiB).
// InvalidArgument if it cannot be read, or holds bytes an HTTP header cannot carry.
[[nodiscard]] Result<std::string> ReadTokenFile(const std::string& path);

}  // namespace bragg::pbox::client
