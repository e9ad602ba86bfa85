"""docker/k8s/: the fleet manifests parse, every llmserve command in them is one the CLI takes,
and their Service reaches the pod that serves HTTP (built here, not run: there is no cluster)."""

from __future__ import annotations

import os
import re

import pytest
import yaml

from llmserve.cli import parse_args

K8S = os.path.join(os.path.dirname(__file__), os.pardir, "docker", "k8s")
# what LeaderWorkerSet puts in each pod's environment, for $(VAR) in args
LWS_ENV = {"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1", "LWS_LEADER_ADDRESS": "llmserve-0.llmserve"}


def pods(doc: dict) -> list[tuple[dict, dict]]:
    """(labels, pod spec) of each kind of pod a workload runs."""
    if doc["kind"] == "Deployment":
        template = doc["spec"]["template"]
        return [(template["metadata"]["labels"], template["spec"])]
    if doc["kind"] == "LeaderWorkerSet":
        group = doc["spec"]["leaderWorkerTemplate"]
        own = {"leaderworkerset.sigs.k8s.io/name": doc["metadata"]["name"]}     # LWS labels its pods so
        return [({**own, **template.get("metadata", {}).get("labels", {})}, template["spec"])
                for template in (group["leaderTemplate"], group["workerTemplate"])]
    return []


def serve_args(container: dict):
    command = [re.sub(r"\$\((\w+)\)", lambda m: LWS_ENV[m.group(1)], arg) for arg in container["args"]]
    assert command[:2] == ["llmserve", "serve"], command
    return parse_args(command[1:])


@pytest.mark.parametrize("name", ["replicas.yaml", "leaderworkerset.yaml"])
def test_manifests_parse_and_run_the_clis_commands(name, monkeypatch):
    for var in [v for v in os.environ if v.startswith("LLMSERVE_")]:
        monkeypatch.delenv(var)
    with open(os.path.join(K8S, name)) as f:
        docs = [doc for doc in yaml.safe_load_all(f) if doc is not None]
    [service] = [doc for doc in docs if doc["kind"] == "Service"]
    [workload] = [doc for doc in docs if pods(doc)]
    heads = []
    for labels, spec in pods(workload):
        for container in spec["containers"]:
            args = serve_args(container)
            assert {m["name"] for m in container["volumeMounts"]} <= {v["name"] for v in spec["volumes"]}
            assert int(container["resources"]["limits"]["nvidia.com/gpu"]) == args.dp * args.tp * args.pp // args.nnodes
            if not args.headless:
                heads.append(args)
                assert service["spec"]["selector"].items() <= labels.items()
                assert args.host == "0.0.0.0" and args.port in {p["containerPort"] for p in container["ports"]}
                assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    [head] = heads
    assert service["spec"]["ports"][0]["targetPort"] in ("http", head.port)
