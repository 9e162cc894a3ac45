"""deploy/k8s against Kubernetes' own OpenAPI schemas (kubernetes-validate, from the tools
environment of python/tools.lock), as `kubectl apply -k deploy/k8s` would render it.

- kustomization.yaml lists every manifest of the folder, and only files that exist;
- each resource, with the kustomization's namespace and image applied the way kustomize applies
  them, validates strictly (no unknown field) against the oldest and the newest Kubernetes the
  manifests are for;
- what the schemas cannot see: the probes point at the ports the programs listen on, pboxd's are
  grpc probes (the grpc.health.v1 pboxd serves), every container of Bragg's runs a program the
  image holds (scripts/build-image), the gateway's workers are the StatefulSet's stable names;
- a manifest with an unknown field fails, so the check cannot pass by accepting anything.

Run with the tools environment's Python (tests/CMakeLists.txt); under ctest, a missing
environment is a skip (exit 77) with its reason.
"""

from __future__ import annotations

import copy
import os
import re
import sys
import unittest
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
# The manifests use grpc probes (GA in 1.27); the newest schema the validator carries.
VERSIONS = ("1.28.0", "1.37.0")
NAMESPACED = {"Secret", "DaemonSet", "Deployment", "Service", "StatefulSet", "ConfigMap"}

try:
    import kubernetes_validate
    import yaml
except ImportError as e:  # not the tools environment
    reason = f"k8s_test.py: {e.name} missing: run scripts/install-deps (python/tools.lock)"
    print("SKIP:", reason)
    if os.environ.get("BRAGG_SKIP_FILE"):
        with open(os.environ["BRAGG_SKIP_FILE"], "a") as f:
            f.write(reason + "\n")
    sys.exit(77)


def image_programs() -> set:
    text = (REPO / "scripts" / "build-image").read_text()
    m = re.search(r"^programs=\(([^)]*)\)", text, re.M)
    assert m, "scripts/build-image has no programs=(...) list"
    return set(m.group(1).split())


def render() -> list:
    """The kustomization's resources with its namespace and images applied (the two
    transformers it uses), as (file, document) pairs."""
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    images = {i["name"]: f'{i["newName"]}:{i["newTag"]}' for i in kust.get("images", [])}
    out = []
    for name in kust["resources"]:
        for doc in yaml.safe_load_all((K8S / name).read_text()):
            if doc is None:
                continue
            doc = copy.deepcopy(doc)
            if doc["kind"] in NAMESPACED:
                doc["metadata"]["namespace"] = kust["namespace"]
            for c in containers(doc):
                c["image"] = images.get(c["image"], c["image"])
            out.append((name, doc))
    return out


def containers(doc: dict) -> list:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return spec.get("containers", []) + spec.get("initContainers", [])


class K8sManifestsTest(unittest.TestCase):
    def setUp(self) -> None:
        self.kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
        self.docs = render()

    def find(self, kind: str, name: str) -> dict:
        for _, d in self.docs:
            if d["kind"] == kind and d["metadata"]["name"] == name:
                return d
        self.fail(f"no {kind}/{name} in the rendered manifests")

    def test_kustomization_lists_every_manifest(self) -> None:
        listed = set(self.kust["resources"])
        present = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
        self.assertEqual(listed, present)
        self.assertEqual(self.kust["namespace"], "bragg")

    def test_every_resource_validates_strictly(self) -> None:
        self.assertGreaterEqual(len(self.docs), 7)
        for version in VERSIONS:
            for name, doc in self.docs:
                with self.subTest(file=name, kind=doc["kind"], version=version):
                    kubernetes_validate.validate(doc, version, strict=True)

    def test_an_unknown_field_fails(self) -> None:
        ds = copy.deepcopy(self.find("DaemonSet", "pboxd"))
        containers(ds)[0]["readinessProbe"]["grpc"]["sevrice"] = "typo"
        with self.assertRaises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(ds, VERSIONS[-1], strict=True)

    def test_bragg_containers_run_what_the_image_holds(self) -> None:
        image = f'{self.kust["images"][0]["newName"]}:{self.kust["images"][0]["newTag"]}'
        programs = image_programs()
        seen = 0
        for _, doc in self.docs:
            for c in containers(doc):
                if c["image"] != image:
                    continue
                seen += 1
                self.assertIn(c["command"][0], programs, c["name"])
        self.assertEqual(seen, 2)  # pboxd and the gateway

    def test_pboxd_probes_are_grpc_health_on_its_port(self) -> None:
        c = containers(self.find("DaemonSet", "pboxd"))[0]
        ports = {int(a.rsplit(":", 1)[1]) for a in c["args"]
                 if a.startswith("--listen=tcp://")}
        self.assertEqual(len(ports), 1)
        for probe in ("readinessProbe", "livenessProbe"):
            self.assertIn("grpc", c[probe], probe)
            self.assertEqual(c[probe]["grpc"]["port"], next(iter(ports)), probe)
        self.assertEqual(c["readinessProbe"]["grpc"]["service"], "bragg.pbox.v1.Pbox")
        # Guaranteed QoS with whole CPUs: the static CPU manager's exclusive cpuset.
        res = c["resources"]
        self.assertEqual(res["requests"], res["limits"])
        self.assertEqual(float(res["requests"]["cpu"]), int(res["requests"]["cpu"]))
        self.assertFalse([a for a in c["args"] if a.startswith("--cpus")])

    def test_gateway_probes_its_port_and_routes_to_the_statefulset(self) -> None:
        c = containers(self.find("Deployment", "bragg-gateway"))[0]
        listen = next(a for a in c["args"] if a.startswith("--listen="))
        port = int(listen.rsplit(":", 1)[1])
        self.assertEqual(c["ports"][0]["containerPort"], port)
        for probe in ("readinessProbe", "livenessProbe"):
            self.assertEqual(c[probe]["httpGet"]["path"], "/health")
        sts = self.find("StatefulSet", "sglang")
        svc = self.find("Service", sts["spec"]["serviceName"])
        self.assertEqual(svc["spec"]["clusterIP"], "None")
        wport = svc["spec"]["ports"][0]["port"]
        want = {f'http://{sts["metadata"]["name"]}-{i}.{svc["metadata"]["name"]}:{wport}'
                for i in range(sts["spec"]["replicas"])}
        got = {a.split("=", 1)[1] for a in c["args"] if a.startswith("--worker=")}
        self.assertEqual(got, want)


if __name__ == "__main__":
    unittest.main()
