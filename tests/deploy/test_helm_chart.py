"""deploy/helm/loomserve: rendered by Helm's own engine and validated against Kubernetes' schemas.

Helm renders through helm-python-sdk (Helm's Go SDK behind a C ABI; no cluster, no `helm`
binary), and every object is checked by kubernetes-validate against the OpenAPI schemas of the
oldest and newest Kubernetes it ships, strictly (an unknown field fails). Both are installed by
.ci/run. The checks after that are the ones schemas cannot make: Services select the pods they
serve, the gateways' worker endpoint names the headless Service, and every LOOMSERVE_* variable
and probe is one the CLI and the gateway really have.

The workers' autoscaling (off by default) is checked the same way: its HPA against Kubernetes'
schemas, its KEDA ScaledObject against KEDA's own CRD schema (vendored under schemas/, since
kubernetes-validate ships none for custom resources), and its PromQL against the metrics the
worker really exports.

With `models`, the chart makes a worker group per model (a StatefulSet and a headless Service
each, workers named after their model); every check above runs on every group, and the gateways
must reach each group's Service and be given no model of their own.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import all_versions, latest_version

from loomserve.gateway.http.app import _open_routes
from loomserve.worker.metrics import WorkerMetrics
from tests.deploy.test_compose import envvars, parse

CHART = Path(__file__).resolve().parents[2] / "deploy/helm/loomserve"
KUBERNETES = sorted({min(all_versions(), key=lambda v: tuple(map(int, v.split(".")))),
                     latest_version()})  # fmt: skip
RELEASE, NAMESPACE = "loomserve", "serving"
KEDA_SCHEMA = Path(__file__).parent / "schemas/keda-scaledobject-v1alpha1.json"
DEPLOYMENT_DOC = Path(__file__).resolve().parents[2] / "docs/deployment.md"

# Everything switched on or away from its default.
CUSTOM: dict[str, Any] = {
    "fullnameOverride": "llm",
    "image": {"repository": "registry.example/loomserve", "tag": "0.1.0-cuda"},
    "imagePullSecrets": [{"name": "registry"}],
    "metrics": {"podAnnotations": False, "serviceMonitor": {"enabled": True, "labels": {"a": "b"}}},
    "worker": {
        "replicas": 3,
        "port": 6000,
        "metricsPort": 9200,
        "env": {
            "LOOMSERVE_SLOTS": 16,
            "LOOMSERVE_MODEL": "/models/m.gguf",
            "LOOMSERVE_SERVED_MODEL_NAME": "my-model",
            "LOOMSERVE_LOG_JSON": 0,
        },
        "gpu": {"count": 1},
        "startupSeconds": 1200,
        "volumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "models"}}],
        "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}],
        "volumeClaimTemplates": [
            {
                "metadata": {"name": "cache"},
                "spec": {
                    "accessModes": ["ReadWriteOnce"],
                    "resources": {"requests": {"storage": "10Gi"}},
                },
            }
        ],
        "nodeSelector": {"nvidia.com/gpu.present": "true"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    },
    "gateway": {
        "port": 8080,
        "env": {"LOOMSERVE_CHAT_TEMPLATE": "chatml"},
        "apiKeySecret": {"name": "loomserve-api-key"},
        "service": {"type": "LoadBalancer", "port": 80},
        "autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 12},
    },
}


# Two models, a worker group each: `worker` holds what they share, each model what is its own
# (a chat model on GPUs, a small embedding model on CPUs that scales by itself), with the
# workers' autoscaling switched on in `worker` and off again for the chat model.
TWO_MODELS: dict[str, Any] = {
    "metrics": {"serviceMonitor": {"enabled": True}},
    "worker": {
        "env": {"LOOMSERVE_THREADS": 4, "LOOMSERVE_SLOTS": 8},
        "gpu": {"count": 1},
        "autoscaling": {"enabled": True, "provider": "keda", "maxReplicas": 6},
    },
    "models": [
        {
            "name": "chat",
            "file": "/models/chat.gguf",
            "replicas": 2,
            "env": {"LOOMSERVE_SLOTS": 16},
            "autoscaling": {"enabled": False},
        },
        {
            "name": "Embed.v1",
            "file": "/models/embed.gguf",
            "port": 6000,
            "env": {"LOOMSERVE_EMBEDDINGS": "true", "LOOMSERVE_SLOTS": 4},
            "gpu": {"count": 0},
            "resources": {"limits": {"memory": "2Gi"}},
            "autoscaling": {"maxReplicas": 3, "targetRequestsPerWorker": 6},
        },
    ],
}


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    """The chart's objects as `helm template` would print them."""
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    objects = []
    for path, text in sorted(manifests.items()):
        if path.endswith(".yaml"):
            objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return objects


def one(objects: list[dict[str, Any]], kind: str, component: str) -> dict[str, Any]:
    found = [
        o
        for o in objects
        if o["kind"] == kind and o["metadata"]["labels"]["app.kubernetes.io/component"] == component
    ]
    assert len(found) == 1, f"{len(found)} {kind} objects for {component}"
    return found[0]


def scaled(provider: str, **more: Any) -> dict[str, Any]:
    """Values with the workers autoscaled by `provider` (keda or hpa)."""
    return {"worker": {"autoscaling": {"enabled": True, "provider": provider, **more}}}


CASES: dict[str, dict[str, Any]] = {
    "default": {},
    "custom": CUSTOM,
    "keda": scaled("keda", minReplicas=2, maxReplicas=6, targetRequestsPerWorker=20),
    "hpa": scaled("hpa", job="kubernetes-pods"),
    "two-models": TWO_MODELS,
}


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    values = CASES[request.param]
    return values, render(values)


def every(objects: list[dict[str, Any]], kind: str, component: str) -> list[dict[str, Any]]:
    """Every object of a kind and component: one per worker group, for the workers."""
    found = [
        o
        for o in objects
        if o["kind"] == kind and o["metadata"]["labels"]["app.kubernetes.io/component"] == component
    ]
    assert found, f"no {kind} for {component}"
    return found


def worker_groups(objects: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Each worker group's StatefulSet and its headless Service (the one it names)."""
    services = {s["metadata"]["name"]: s for s in every(objects, "Service", "worker")}
    statefulsets = every(objects, "StatefulSet", "worker")
    assert len(services) == len(statefulsets)
    return [(sts, services[sts["spec"]["serviceName"]]) for sts in statefulsets]


def test_helm_lints_the_chart_clean() -> None:
    for values in ({}, CUSTOM, TWO_MODELS):
        report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE)
        errors = [m for m in report["messages"] if m["severity"] >= 2]  # warnings and errors
        assert not report["errors"] and not errors, report


def test_every_object_is_valid_kubernetes(case: tuple[dict, list[dict[str, Any]]]) -> None:
    _, objects = case
    kinds = {o["kind"] for o in objects}
    assert {"StatefulSet", "Deployment", "Service"} <= kinds
    for obj in objects:
        if obj["apiVersion"] == "monitoring.coreos.com/v1":
            check_service_monitor(obj, objects)  # a CRD: no schema ships for it
            continue
        if obj["apiVersion"] == "keda.sh/v1alpha1":
            check_scaled_object(obj)
            continue
        for version in KUBERNETES:
            kubernetes_validate.validate(obj, version, strict=True)


def check_service_monitor(monitor: dict[str, Any], objects: list[dict[str, Any]]) -> None:
    """The fields the Prometheus Operator reads, and a Service they select by port name."""
    assert monitor["kind"] == "ServiceMonitor"
    spec = monitor["spec"]
    assert set(spec) == {"selector", "namespaceSelector", "endpoints"}
    assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    services = [o for o in objects if o["kind"] == "Service" and selects(spec["selector"], o)]
    # The gateways' Service, or every worker group's (each its own job, by its name).
    component = monitor["metadata"]["labels"]["app.kubernetes.io/component"]
    assert services == every(objects, "Service", component), monitor["metadata"]["name"]
    for service in services:
        ports = {p["name"] for p in service["spec"]["ports"]}
        for endpoint in spec["endpoints"]:
            assert set(endpoint) <= {"port", "path", "interval"}
            assert endpoint["port"] in ports and endpoint["path"] == "/metrics"


def check_scaled_object(scaled_object: dict[str, Any]) -> None:
    """Valid against KEDA's CRD schema, as strictly as the rest (an unknown field fails)."""
    assert scaled_object["kind"] == "ScaledObject"
    schema = json.loads(KEDA_SCHEMA.read_text())
    jsonschema.Draft7Validator(schema).validate(scaled_object)


def selects(selector: dict[str, Any], obj: dict[str, Any]) -> bool:
    labels = obj["metadata"]["labels"]
    return selector["matchLabels"].items() <= labels.items()


def container(workload: dict[str, Any]) -> dict[str, Any]:
    (only,) = workload["spec"]["template"]["spec"]["containers"]
    return only


def env_of(workload: dict[str, Any]) -> dict[str, str]:
    env = container(workload)["env"]
    names = [e["name"] for e in env]
    assert len(names) == len(set(names)), f"a variable is set twice: {names}"
    return {e["name"]: e["value"] for e in env if "value" in e}


def test_services_select_their_pods_and_ports(case: tuple[dict, list[dict[str, Any]]]) -> None:
    _, objects = case
    pairs = [
        *worker_groups(objects),
        (one(objects, "Deployment", "gateway"), one(objects, "Service", "gateway")),
    ]
    workloads = [workload for workload, _ in pairs]
    for workload, service in pairs:
        component = workload["metadata"]["labels"]["app.kubernetes.io/component"]
        pod_labels = workload["spec"]["template"]["metadata"]["labels"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
        assert service["spec"]["selector"].items() <= pod_labels.items()
        assert service["spec"]["selector"]["app.kubernetes.io/component"] == component
        named = {p["name"] for p in container(workload)["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= named
        # A Service and a workload select no pods of another group's.
        for other in workloads:
            if other is not workload:
                labels = other["spec"]["template"]["metadata"]["labels"]
                assert not service["spec"]["selector"].items() <= labels.items()
                assert not workload["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_gateways_reach_every_worker_through_the_headless_service(
    case: tuple[dict, list[dict[str, Any]]],
) -> None:
    _, objects = case
    gateway = env_of(one(objects, "Deployment", "gateway"))
    reached = []
    for statefulset, headless in worker_groups(objects):
        assert headless["spec"]["clusterIP"] == "None"
        assert not headless["spec"]["publishNotReadyAddresses"], "loading workers get requests"
        zmq = next(p for p in headless["spec"]["ports"] if p["name"] == "zmq")["port"]
        reached.append(f"tcp://{headless['metadata']['name']}.{NAMESPACE}.svc.cluster.local:{zmq}")
        assert env_of(statefulset)["LOOMSERVE_BIND"] == f"tcp://0.0.0.0:{zmq}"
        # No CURVE keys from the chart yet: the worker must be told it may serve the pod network.
        assert env_of(statefulset)["LOOMSERVE_INSECURE_BIND"] == "true"
    # Every group, each once; and no model of the gateways' own: they learn each from its workers.
    assert gateway["LOOMSERVE_WORKER_ENDPOINT"].split(" ") == reached
    assert "LOOMSERVE_MODEL" not in gateway and "LOOMSERVE_SERVED_MODEL_NAME" not in gateway


def test_settings_are_real_options_of_the_commands(
    case: tuple[dict, list[dict[str, Any]]],
) -> None:
    _, objects = case
    workloads = [*every(objects, "StatefulSet", "worker"), one(objects, "Deployment", "gateway")]
    for workload in workloads:
        component = workload["metadata"]["labels"]["app.kubernetes.io/component"]
        command = container(workload)["command"]
        assert command == ["loomserve", component]
        names = {e["name"] for e in container(workload)["env"]}
        assert names <= envvars(component), names - envvars(component)
        parse(component, command[2:], env_of(workload))  # the values parse as the CLI will


def test_probes_use_the_real_health_endpoints(case: tuple[dict, list[dict[str, Any]]]) -> None:
    _, objects = case
    for statefulset in every(objects, "StatefulSet", "worker"):
        worker = container(statefulset)
        port = next(p["containerPort"] for p in worker["ports"] if p["name"] == "zmq")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            argv = worker[probe]["exec"]["command"]
            assert argv[:2] == ["loomserve", "worker-health"]
            endpoint = parse("worker-health", argv[2:], {})["worker_endpoint"]
            assert endpoint == f"tcp://127.0.0.1:{port}"
    gateway = container(one(objects, "Deployment", "gateway"))
    routes = {route.path for route in _open_routes(None).routes}  # type: ignore[arg-type]
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/health"
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/live"
    assert {"/health", "/live"} <= routes
    assert "startupProbe" not in gateway or gateway["startupProbe"]["httpGet"]["path"] in routes


def test_metrics_are_announced_where_they_are_served(
    case: tuple[dict, list[dict[str, Any]]],
) -> None:
    values, objects = case
    deployment = one(objects, "Deployment", "gateway")
    annotated = values.get("metrics", {}).get("podAnnotations", True)
    for workload, port in (
        *(
            (sts, env_of(sts)["LOOMSERVE_METRICS_PORT"])
            for sts in every(objects, "StatefulSet", "worker")
        ),
        (deployment, env_of(deployment)["LOOMSERVE_PORT"]),
    ):
        annotations = workload["spec"]["template"]["metadata"].get("annotations", {})
        if annotated:
            assert annotations["prometheus.io/scrape"] == "true"
            assert annotations["prometheus.io/port"] == port
            assert annotations["prometheus.io/path"] == "/metrics"
        else:
            assert "prometheus.io/scrape" not in annotations
    monitors = [o for o in objects if o["kind"] == "ServiceMonitor"]
    assert len(monitors) == (2 if values.get("metrics", {}).get("serviceMonitor") else 0)


def test_defaults_make_a_cpu_deployment() -> None:
    objects = render({})
    worker = container(one(objects, "StatefulSet", "worker"))
    assert "nvidia.com/gpu" not in str(worker["resources"])
    assert one(objects, "Deployment", "gateway")["spec"]["replicas"] == 2
    assert not [o for o in objects if o["kind"] == "HorizontalPodAutoscaler"]
    assert env_of(one(objects, "StatefulSet", "worker"))["LOOMSERVE_LOG_JSON"] == "true"


@pytest.mark.parametrize(
    ("cpu", "threads"), [("2", "2"), (4, "4"), ("1500m", "2"), ("250m", "1"), (0.5, "1")]
)
def test_a_cpu_workers_threads_match_its_cpu_limit(cpu: str | float, threads: str) -> None:
    """The default worker requests and limits the same CPUs (above its request a pod runs only
    on CPU other pods left idle) and runs one llama.cpp thread per CPU of the limit,
    rounded up as the worker reads a quota itself (worker/host_cpus.py)."""
    resources = container(one(render({}), "StatefulSet", "worker"))["resources"]
    assert resources["requests"]["cpu"] == resources["limits"]["cpu"] == "2"
    assert env_of(one(render({}), "StatefulSet", "worker"))["LOOMSERVE_THREADS"] == "2"
    limited = render({"worker": {"resources": {"limits": {"cpu": cpu}}}})
    assert env_of(one(limited, "StatefulSet", "worker"))["LOOMSERVE_THREADS"] == threads


def test_worker_env_threads_and_no_cpu_limit_are_respected() -> None:
    chosen = render({"worker": {"env": {"LOOMSERVE_THREADS": 6}}})
    assert env_of(one(chosen, "StatefulSet", "worker"))["LOOMSERVE_THREADS"] == "6"
    unlimited = render({"worker": {"resources": {"limits": {"cpu": None}}}})
    statefulset = one(unlimited, "StatefulSet", "worker")
    assert "cpu" not in container(statefulset)["resources"]["limits"]
    assert "LOOMSERVE_THREADS" not in env_of(statefulset)  # the worker reads its mask or quota


def test_a_worker_on_a_crowded_node_can_wait_passively() -> None:
    statefulset = one(render({}), "StatefulSet", "worker")
    assert "OMP_WAIT_POLICY" not in env_of(statefulset)  # libgomp's spin by default
    passive = render({"worker": {"openmpWaitPolicy": "PASSIVE"}})
    statefulset = one(passive, "StatefulSet", "worker")
    assert env_of(statefulset)["OMP_WAIT_POLICY"] == "PASSIVE"
    for version in KUBERNETES:
        kubernetes_validate.validate(statefulset, version, strict=True)


def test_one_model_keeps_the_objects_it_always_had() -> None:
    """Without `models`, one group of `worker`: its names and selector as before, so an
    upgrade keeps the StatefulSet (whose selector cannot change) and the gateways' endpoint."""
    objects = render({})
    statefulset = one(objects, "StatefulSet", "worker")
    assert statefulset["metadata"]["name"] == "loomserve-worker"
    assert statefulset["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/name": "loomserve",
        "app.kubernetes.io/instance": RELEASE,
        "app.kubernetes.io/component": "worker",
    }
    # Its name is the worker's own (worker.env, else its file's): the chart sets none.
    assert "LOOMSERVE_SERVED_MODEL_NAME" not in env_of(statefulset)


def test_each_model_gets_a_worker_group_named_after_it() -> None:
    objects = render(TWO_MODELS)
    groups = {env_of(sts)["LOOMSERVE_SERVED_MODEL_NAME"]: sts for sts, _ in worker_groups(objects)}
    assert set(groups) == {"chat", "Embed.v1"}
    chat, embed = groups["chat"], groups["Embed.v1"]
    assert chat["metadata"]["name"] == "loomserve-worker-chat"
    assert embed["metadata"]["name"] == "loomserve-worker-embed-v1"  # a DNS label
    # Each group's workers serve their model under its name, as the CLI reads the settings.
    for statefulset, name, file in ((chat, "chat", "/models/chat.gguf"),
                                    (embed, "Embed.v1", "/models/embed.gguf")):  # fmt: skip
        params = parse("worker", container(statefulset)["command"][2:], env_of(statefulset))
        assert (params["served_model_name"], params["model"]) == (name, file)
    # What `worker` sets reaches both; each model's own settings win for its group alone.
    chat_env, embed_env = env_of(chat), env_of(embed)
    assert chat_env["LOOMSERVE_THREADS"] == embed_env["LOOMSERVE_THREADS"] == "4"
    assert (chat_env["LOOMSERVE_SLOTS"], embed_env["LOOMSERVE_SLOTS"]) == ("16", "4")
    assert embed_env["LOOMSERVE_EMBEDDINGS"] == "true" and "LOOMSERVE_EMBEDDINGS" not in chat_env
    assert embed_env["LOOMSERVE_BIND"] == "tcp://0.0.0.0:6000"
    assert container(chat)["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container(embed)["resources"] == {
        "requests": {"cpu": "2", "memory": "2Gi"},
        "limits": {"cpu": "2", "memory": "2Gi"},
    }
    # Autoscaling per group: `worker` turns it on, the chat model off again (its replicas are
    # fixed), the embedding model scales on its own workers' queue with its own bounds.
    assert chat["spec"]["replicas"] == 2 and "replicas" not in embed["spec"]
    (scaler,) = worker_scalers(objects)
    assert scaler["spec"]["scaleTargetRef"]["name"] == embed["metadata"]["name"]
    assert (scaler["spec"]["minReplicaCount"], scaler["spec"]["maxReplicaCount"]) == (1, 3)
    (trigger,) = scaler["spec"]["triggers"]
    assert trigger["metadata"]["threshold"] == "6"
    assert trigger["metadata"]["query"].count(f'job="{embed["spec"]["serviceName"]}"') == 2


@pytest.mark.parametrize(
    ("values", "error"),
    [
        ({"models": [{"name": "a b"}]}, "no whitespace"),
        ({"models": [{"file": "/models/a.gguf"}]}, "no whitespace"),
        ({"models": [{"name": "..."}]}, "no letter or digit"),
        ({"models": [{"name": "Chat"}, {"name": "chat"}]}, "name them apart"),
        (
            {"models": [{"name": "chat", "replica": 2}]},
            r"models\[0\]\.replica is no worker setting",
        ),
        (
            {
                "models": [
                    {"name": "a"},
                    {"name": "b", "autoscaling": {"enabled": True, "minReplicas": 0}},
                ]
            },
            r"models\[1\]\.autoscaling\.minReplicas must be at least 1",
        ),
        ({"gateway": {"env": {"LOOMSERVE_MODEL": "/models/m.gguf"}}}, "from its workers"),
        ({"gateway": {"env": {"LOOMSERVE_SERVED_MODEL_NAME": "m"}}}, "from its workers"),
    ],
)
def test_bad_model_values_are_refused(values: dict[str, Any], error: str) -> None:
    with pytest.raises(helm.HelmError, match=error):
        render(values)


def test_custom_values_reach_the_objects() -> None:
    objects = render(CUSTOM)
    statefulset = one(objects, "StatefulSet", "worker")
    worker = container(statefulset)
    assert statefulset["spec"]["replicas"] == 3
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert worker["image"] == "registry.example/loomserve:0.1.0-cuda"
    assert (
        worker["startupProbe"]["failureThreshold"] * worker["startupProbe"]["periodSeconds"] >= 1200
    )
    env = env_of(statefulset)
    assert env["LOOMSERVE_SLOTS"] == "16" and env["LOOMSERVE_LOG_JSON"] == "0"
    assert statefulset["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "cache"

    deployment = one(objects, "Deployment", "gateway")
    assert "replicas" not in deployment["spec"], "the autoscaler owns the replica count"
    hpa = one(objects, "HorizontalPodAutoscaler", "gateway")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": deployment["metadata"]["name"],
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 12)
    key = next(e for e in container(deployment)["env"] if e["name"] == "LOOMSERVE_API_KEY")
    assert key["valueFrom"]["secretKeyRef"] == {"name": "loomserve-api-key", "key": "api-key"}
    service = one(objects, "Service", "gateway")
    assert service["spec"]["type"] == "LoadBalancer" and service["spec"]["ports"][0]["port"] == 80
    assert env_of(deployment)["LOOMSERVE_PORT"] == "8080"


def test_wiring_wins_over_settings_and_unknown_variables_are_refused() -> None:
    # The chart's ports must agree with its Services, whatever env says.
    objects = render({"worker": {"env": {"LOOMSERVE_BIND": "tcp://0.0.0.0:1"}}})
    assert env_of(one(objects, "StatefulSet", "worker"))["LOOMSERVE_BIND"] == "tcp://0.0.0.0:5555"
    with pytest.raises(helm.HelmError, match="no loomserve setting"):
        render({"gateway": {"env": {"SLOTS": "4"}}})


# --- the workers' autoscaling ------------------------------------------------------------


def worker_scalers(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        o
        for o in objects
        if o["kind"] in ("ScaledObject", "HorizontalPodAutoscaler")
        and o["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"
    ]


def worker_metric_names() -> set[str]:
    return {family.name for family in WorkerMetrics().registry.collect()}


def test_worker_autoscaling_is_off_by_default() -> None:
    for values in ({}, CUSTOM):
        objects = render(values)
        assert worker_scalers(objects) == []
        assert one(objects, "StatefulSet", "worker")["spec"]["replicas"] >= 1


def test_keda_scales_the_workers_on_their_queue_depth() -> None:
    objects = render(CASES["keda"])
    (scaled_object,) = worker_scalers(objects)
    check_scaled_object(scaled_object)
    statefulset = one(objects, "StatefulSet", "worker")
    assert "replicas" not in statefulset["spec"], "the autoscaler owns the replica count"
    spec = scaled_object["spec"]
    assert spec["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "name": statefulset["metadata"]["name"],
    }
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (2, 6)
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    assert trigger["metadata"]["threshold"] == "20"
    query = trigger["metadata"]["query"]
    # Waiting requests and busy slots (not free), of this release's workers only: the job the
    # ServiceMonitor gives them is the worker Service's name.
    used = set(re.findall(r"loomserve:[a-z_]+", query))
    assert used == {"loomserve:num_requests_waiting", "loomserve:num_requests_running"}
    assert used <= worker_metric_names()
    service = one(objects, "Service", "worker")["metadata"]["name"]
    assert query.count(f'namespace="{NAMESPACE}",job="{service}"') == 2
    scale_down = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
    assert scale_down["stabilizationWindowSeconds"] == 300


def prometheus_adapter_rule() -> dict[str, Any]:
    """The prometheus-adapter values docs/deployment.md tells operators to install."""
    text = DEPLOYMENT_DOC.read_text()
    block = re.search(r"```yaml\n(# prometheus-adapter.*?)```", text, re.DOTALL)
    assert block, "docs/deployment.md lost its prometheus-adapter rule"
    (rule,) = yaml.safe_load(block.group(1))["rules"]["external"]
    return rule


def test_the_hpa_alternative_asks_for_the_metric_the_documented_adapter_rule_serves() -> None:
    objects = render(CASES["hpa"])
    (hpa,) = worker_scalers(objects)
    assert hpa["kind"] == "HorizontalPodAutoscaler"  # validated against Kubernetes' schemas above
    statefulset = one(objects, "StatefulSet", "worker")
    assert hpa["spec"]["scaleTargetRef"]["name"] == statefulset["metadata"]["name"]
    assert "replicas" not in statefulset["spec"]
    (metric,) = hpa["spec"]["metrics"]
    external = metric["external"]
    assert external["metric"]["selector"] == {"matchLabels": {"job": "kubernetes-pods"}}
    assert external["target"] == {"type": "AverageValue", "averageValue": "8"}

    rule = prometheus_adapter_rule()
    assert rule["name"]["as"] == external["metric"]["name"]
    assert rule["resources"]["overrides"]["namespace"] == {"resource": "namespace"}
    query = rule["metricsQuery"]
    used = set(re.findall(r"loomserve:[a-z_]+", query + rule["seriesQuery"]))
    assert used == {"loomserve:num_requests_waiting", "loomserve:num_requests_running"}
    assert used <= worker_metric_names()
    # The HPA's selector and namespace reach both halves of the sum.
    assert query.count("<<.LabelMatchers>>") == 2


def test_scale_in_must_leave_the_worker_time_to_drain() -> None:
    """Scale-in is SIGTERM: the worker's drain must end before the kubelet's SIGKILL."""
    slow = {"LOOMSERVE_SHUTDOWN_TIMEOUT": "120"}
    with pytest.raises(helm.HelmError, match="terminationGracePeriodSeconds"):
        render({"worker": {**scaled("keda")["worker"], "env": slow}})
    fits = scaled("keda")
    fits["worker"] |= {"env": slow, "terminationGracePeriodSeconds": 150}
    statefulset = one(render(fits), "StatefulSet", "worker")
    assert statefulset["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 150
    # Without autoscaling the chart does not second-guess a long drain.
    render({"worker": {"env": slow}})


@pytest.mark.parametrize(
    ("more", "error"),
    [
        ({"provider": "cpu"}, "keda or hpa"),
        ({"minReplicas": 0}, "at least 1"),
        ({"minReplicas": 3, "maxReplicas": 2}, "at least minReplicas"),
    ],
)
def test_bad_autoscaling_values_are_refused(more: dict[str, Any], error: str) -> None:
    values = scaled("keda")
    values["worker"]["autoscaling"].update(more)
    with pytest.raises(helm.HelmError, match=error):
        render(values)
