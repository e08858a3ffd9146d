"""The `loomserve` command: its options and environment variables, its packaging, and `serve`
running the real worker and gateways on the tiny model."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import click
import httpx
import pytest
from click.testing import CliRunner

from loomserve.cli.main import main
from loomserve.cli.options import build_gateway_config
from loomserve.gateway.config import unnamed_key_tenant
from tests.procs import free_port
from tests.tiny_model import write_tiny_model

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("cli", "gateway", "protocol", "worker")
# Client conventions kept on purpose: the benchmark reads the key every OpenAI client reads.
FOREIGN_ENVVARS = {("bench", "api_key"): "OPENAI_API_KEY"}


# --- options and environment variables ---------------------------------------------------


def test_help_lists_every_command() -> None:
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0, result.output
    for command in ("serve", "worker", "gateway", "bench", "worker-health"):
        assert re.search(rf"^\s+{command}\s", result.output, re.MULTILINE), command


def test_version_and_short_help() -> None:
    version = CliRunner().invoke(main, ["--version"])
    assert version.exit_code == 0
    assert version.output.strip() == f"loomserve, version {importlib.metadata.version('loomserve')}"
    for args in (["-h"], ["gateway", "-h"], ["serve", "-h"]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0 and "Usage:" in result.output, args


def all_options() -> Iterator[tuple[str, click.Option]]:
    for name, command in sorted(main.commands.items()):
        for param in command.params:
            if isinstance(param, click.Option):
                yield name, param


@pytest.mark.parametrize(
    ("command_name", "option"),
    list(all_options()),
    ids=[f"{name}-{option.name}" for name, option in all_options()],
)
def test_every_option_has_help_and_a_working_envvar(
    command_name: str, option: click.Option, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert option.help, f"{option.opts[0]} has no help text"
    envvar = envvar_of(command_name, option)
    expected_prefix = "LOOMSERVE_"
    if (command_name, option.name) in FOREIGN_ENVVARS:
        expected_prefix = FOREIGN_ENVVARS[command_name, option.name]
    assert envvar.startswith(expected_prefix), envvar
    # The env var must give the option the same value its command-line form does.
    default = parse(command_name, [])[option.name]
    for text in candidate_values(option, tmp_path):
        args = [option.opts[0], text] if not option.is_flag else [flag_word(option, text)]
        try:
            from_argv = parse(command_name, args)[option.name]
        except click.UsageError:
            continue
        if from_argv == default:
            continue
        monkeypatch.setenv(envvar, text)
        assert parse(command_name, [])[option.name] == from_argv, envvar
        return
    pytest.fail(f"found no value to try {option.opts[0]} of {command_name} with")


def envvar_of(command_name: str, option: click.Option) -> str:
    """The environment variable click reads for the option, as `loomserve <command>` runs."""
    if option.envvar:
        return option.envvar if isinstance(option.envvar, str) else option.envvar[0]
    parent = main.make_context("loomserve", [command_name], resilient_parsing=True)
    command = main.commands[command_name]
    context = command.make_context(command_name, [], parent=parent, resilient_parsing=True)
    return f"{context.auto_envvar_prefix}_{option.name.upper()}"


def parse(command_name: str, args: list[str]) -> dict:
    parent = main.make_context("loomserve", [command_name], resilient_parsing=True)
    command = main.commands[command_name]
    with command.make_context(command_name, list(args), parent=parent) as context:
        return context.params


def flag_word(option: click.Option, text: str) -> str:
    if text == "true":
        return option.opts[0]
    return option.secondary_opts[0] if option.secondary_opts else "--no-such-flag"


def candidate_values(option: click.Option, tmp_path: Path) -> list[str]:
    if option.is_flag:
        return ["true", "false"]
    if isinstance(option.type, click.Choice):
        return [str(choice) for choice in option.type.choices]
    existing = tmp_path / "keys.txt"
    existing.write_text("key-from-file\n")
    return ["7", "0.5", "3,50", str(existing), "some-text", "inf"]


def test_gateway_and_worker_configs_are_built_from_environment_variables(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loomserve.cli.options import build_gateway_config, build_worker_config

    monkeypatch.setenv("LOOMSERVE_MODEL", str(tiny_model_path))
    monkeypatch.setenv("LOOMSERVE_SLOTS", "3")
    monkeypatch.setenv("LOOMSERVE_STRATEGY", "balanced")
    monkeypatch.setenv("LOOMSERVE_GATEWAY_TIMEOUT", "2.5")
    monkeypatch.setenv("LOOMSERVE_FLASH_ATTN", "off")
    monkeypatch.setenv("LOOMSERVE_BATCH_INVARIANT", "false")
    monkeypatch.setenv("LOOMSERVE_API_KEY", "first\nsecond\n")
    monkeypatch.setenv("LOOMSERVE_WORKER_ENDPOINT", "tcp://10.0.0.7:5555 tcp://workers:5555")
    worker_params = parse("worker", [])
    worker = build_worker_config(worker_params.pop("bind"), **worker_params)
    assert (worker.model_path, worker.slots, worker.strategy) == (tiny_model_path, 3, "balanced")
    assert (worker.gateway_timeout, worker.flash_attn, worker.batch_invariant) == (
        2.5,
        "off",
        False,
    )
    gateway_params = parse("gateway", [])
    gateway = build_gateway_config(gateway_params.pop("worker_endpoint"), **gateway_params)
    assert gateway.worker_endpoints == ("tcp://10.0.0.7:5555", "tcp://workers:5555")
    assert set(gateway.api_keys) == {"first", "second"}
    # Keys without a name are tenants of their own, named by a hash, never by the key.
    assert gateway.api_keys["first"] == unnamed_key_tenant("first") != "first"
    assert gateway.api_keys["first"] != gateway.api_keys["second"]


def test_api_key_file_names_the_keys_tenants(tmp_path: Path, tiny_model_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(
        "# team keys\n  # rotate these monthly\n\talice:sk-alice\nbob:sk-bob:with-colon\n"
        "sk-bare\n:sk-odd\n\n"
    )
    params = parse("gateway", ["--model", str(tiny_model_path), "--api-key-file", str(keys)])
    gateway = build_gateway_config(params.pop("worker_endpoint"), **params)
    assert gateway.api_keys == {
        "sk-alice": "alice",
        "sk-bob:with-colon": "bob",
        "sk-bare": unnamed_key_tenant("sk-bare"),
        ":sk-odd": unnamed_key_tenant(":sk-odd"),
    }
    assert gateway.key_priorities == {}


def test_a_key_file_name_without_a_key_is_refused_naming_its_line(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    """`carol:` was once the literal key "carol:", without a word: a key left out."""
    keys = tmp_path / "keys"
    keys.write_text("alice:sk-alice\n# bob is away\ncarol:\n")
    params = parse("gateway", ["--model", str(tiny_model_path), "--api-key-file", str(keys)])
    with pytest.raises(click.BadParameter, match=r"line 3: a name and ':' with no key"):
        build_gateway_config(params.pop("worker_endpoint"), **params)
    served = CliRunner().invoke(
        main, ["serve", "--model", str(tiny_model_path), "--api-key-file", str(keys)]
    )
    assert served.exit_code == 2 and "line 3" in served.output


def test_a_key_with_whitespace_is_refused_from_every_source(
    tmp_path: Path, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`open sesame` once meant the keys `open` (flag), `open` and `sesame` (environment),
    and a key file's indented comment was a key: now each source refuses it, saying why."""
    model = ["--model", str(tiny_model_path)]
    flag = CliRunner().invoke(main, ["gateway", *model, "--api-key", "open sesame"])
    assert flag.exit_code == 2 and "cannot contain whitespace" in flag.output
    env = CliRunner().invoke(main, ["gateway", *model], env={"LOOMSERVE_API_KEY": "open sesame"})
    assert env.exit_code == 2 and "cannot contain whitespace" in env.output
    assert "sesame" not in flag.output + env.output  # the secret is not echoed
    keys = tmp_path / "keys"
    keys.write_text("# ok\nalice:open sesame\n")
    params = parse("gateway", [*model, "--api-key-file", str(keys)])
    with pytest.raises(click.BadParameter, match=r"line 2: .*whitespace"):
        build_gateway_config(params.pop("worker_endpoint"), **params)


def test_a_key_means_the_same_from_the_flag_the_environment_and_a_file(
    tmp_path: Path, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loomserve.cli.serve import child_env

    model = ["--model", str(tiny_model_path)]
    secret = "sk-Ab3.x/y+z=="
    flag = parse("gateway", [*model, "--api-key", secret])
    # serve hands its keys to the gateways through the environment: one a line.
    monkeypatch.setenv(
        "LOOMSERVE_API_KEY", child_env({"api_key": (secret, "sk-2")})["LOOMSERVE_API_KEY"]
    )
    env = parse("gateway", model)
    monkeypatch.delenv("LOOMSERVE_API_KEY")
    keys = tmp_path / "keys"
    keys.write_text(f"{secret}\n")
    file = parse("gateway", [*model, "--api-key-file", str(keys)])
    configs = [build_gateway_config(p.pop("worker_endpoint"), **p) for p in (flag, env, file)]
    assert secret in configs[0].api_keys and set(configs[1].api_keys) == {secret, "sk-2"}
    assert configs[0].api_keys[secret] == configs[1].api_keys[secret] == configs[2].api_keys[secret]
    assert set(configs[2].api_keys) == {secret}


def test_a_key_file_bounds_each_keys_priorities(tmp_path: Path, tiny_model_path: Path) -> None:
    from loomserve.gateway.config import PriorityRange

    keys = tmp_path / "keys"
    keys.write_text(
        "batch:sk-batch priority=5..100\nchat:sk-chat priority=0..\n"
        "fixed:sk-fixed priority=3\nsk-any\nneg:sk-neg priority=-10..-1\n"
    )
    params = parse("gateway", ["--model", str(tiny_model_path), "--api-key-file", str(keys)])
    gateway = build_gateway_config(params.pop("worker_endpoint"), **params)
    assert gateway.key_priorities == {
        "sk-batch": PriorityRange(5, 100),
        "sk-chat": PriorityRange(0, None),
        "sk-fixed": PriorityRange(3, 3),
        "sk-neg": PriorityRange(-10, -1),
    }
    chat = gateway.key_priorities["sk-chat"]
    assert (chat.clamp(-1000), chat.clamp(0), chat.clamp(7)) == (0, 0, 7)
    batch = gateway.key_priorities["sk-batch"]
    assert (batch.clamp(0), batch.clamp(50), batch.clamp(10**6)) == (5, 50, 100)
    for bad in ("priority=9..1", "priority=high", "priority=..", "prio=1", "x"):
        keys.write_text(f"sk-key {bad}\n")
        params = parse("gateway", ["--model", str(tiny_model_path), "--api-key-file", str(keys)])
        with pytest.raises(click.BadParameter, match="line 1"):
            build_gateway_config(params.pop("worker_endpoint"), **params)


# --- packaging ---------------------------------------------------------------------------


def test_every_third_party_import_is_a_declared_dependency() -> None:
    """`pip install .` on a fresh machine must bring everything the packages import."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    server = {requirement_name(r) for r in project["dependencies"]}
    bench = server | {requirement_name(r) for r in project["optional-dependencies"]["bench"]}
    distributions = importlib.metadata.packages_distributions()
    stdlib = sys.stdlib_module_names
    missing = {}
    for path in (p for package in PACKAGES for p in (ROOT / package).rglob("*.py")):
        for module in imported_modules(path):
            if module in stdlib or module in ("loomserve", "__future__"):
                continue
            names = {normalize(d) for d in distributions.get(module, [module])}
            # The load generator may use its extra; nothing else may.
            declared = bench if "bench" in path.relative_to(ROOT).parts else server
            if not names & declared:
                missing.setdefault(module, []).append(str(path.relative_to(ROOT)))
    assert not missing, f"imported but not in [project] dependencies: {missing}"


def test_the_distribution_holds_every_package() -> None:
    """Every folder with Python in it installs as loomserve.<folder path>, from that folder."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = config["tool"]["setuptools"]["packages"]
    package_dir = config["tool"]["setuptools"]["package-dir"]
    for folder in {p.parent for package in PACKAGES for p in (ROOT / package).rglob("*.py")}:
        dotted = "loomserve." + ".".join(folder.relative_to(ROOT).parts)
        assert (folder / "__init__.py").exists(), f"{dotted} is not a package"
        assert dotted in packages, f"{dotted} is left out of the distribution"
    assert package_dir == {f"loomserve.{package}": package for package in PACKAGES}
    assert config["project"]["scripts"]["loomserve"] == "loomserve.cli.main:main"


def test_bare_package_names_are_banned() -> None:
    """ruff refuses `import worker`: installed, only loomserve.worker exists."""
    banned = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["lint"][
        "flake8-tidy-imports"
    ]["banned-api"]
    assert set(banned) == set(PACKAGES)


def requirement_name(requirement: str) -> str:
    return normalize(re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0])


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module.split(".")[0])
    return modules


# --- serve: the real worker and gateways, supervised ------------------------------------------


def children_of(pid: int) -> dict[int, list[str]]:
    """The live child processes of pid, with their command lines."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (FileNotFoundError, ProcessLookupError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found[int(stat.parent.name)] = [word.decode() for word in cmdline if word]
    return found


def role(cmdline: list[str]) -> str:
    return (
        cmdline[cmdline.index("loomserve.cli.main") + 1] if "loomserve.cli.main" in cmdline else "?"
    )


def gone(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def listeners(port: int) -> int:
    """How many sockets listen on 127.0.0.1:port (SO_REUSEPORT lets several)."""
    count = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        if state == "0A" and local == f"0100007F:{port:04X}":
            count += 1
    return count


def wait_until(condition, timeout: float, message: str, served: Served | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    pytest.fail(message + (f"\n{served.log_tail()}" if served else ""))


@dataclass(slots=True)
class Served:
    """A running `loomserve serve` and where it answers."""

    process: subprocess.Popen
    url: str
    port: int
    log_path: Path

    def log_tail(self, chars: int = 4000) -> str:
        return "--- serve log ---\n" + self.log_path.read_text(errors="replace")[-chars:]

    def events(self) -> list[dict]:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return [json.loads(line) for line in lines if line.startswith("{")]

    def completion(self, prompt: str = "hello world", **extra) -> httpx.Response:
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, **extra}
        return httpx.post(f"{self.url}/v1/completions", json=body, timeout=30)

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("LOOMSERVE_")}


@pytest.fixture(scope="module")
def served(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    argv = [sys.executable, "-m", "loomserve.cli.main", "serve", "--model", str(tiny_model_path)]
    argv += ["--gateways", "2", "--port", str(port), "--slots", "4", "--ctx-size", "512"]
    argv += ["--threads", "1", "--worker-timeout", "1", "--heartbeat-interval", "0.25"]
    argv += ["--log-json"]
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            argv, cwd=ROOT, env=clean_env(), stdout=log, stderr=subprocess.STDOUT
        )
    handle = Served(process, f"http://127.0.0.1:{port}", port, log_path)
    try:
        wait_until(handle.healthy, 90, "serve never became healthy", handle)
        wait_until(lambda: listeners(port) == 2, 30, "the second gateway never listened", handle)
        yield handle
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_serve_answers_through_one_port_shared_by_two_gateways(served: Served) -> None:
    children = children_of(served.process.pid)
    assert sorted(role(c) for c in children.values()) == ["gateway", "gateway", "worker"]
    response = served.completion()
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"]
    # Many connections, so both gateways' sockets in the reuse-port group get some.
    for _ in range(10):
        assert served.completion(max_tokens=2).status_code == 200
    wait_until(lambda: any(e.get("event") == "ready" for e in served.events()), 10, "no ready line")
    ready = next(e for e in served.events() if e.get("event") == "ready")
    assert ready["url"] == served.url


def test_serve_restarts_a_killed_worker(served: Served) -> None:
    (old_worker,) = [p for p, c in children_of(served.process.pid).items() if role(c) == "worker"]
    os.kill(old_worker, signal.SIGKILL)

    def new_worker() -> bool:
        workers = [p for p, c in children_of(served.process.pid).items() if role(c) == "worker"]
        return bool(workers) and workers != [old_worker]

    wait_until(new_worker, 30, "the worker was not restarted", served)
    wait_until(
        lambda: served.completion().status_code == 200, 60, "serving did not recover", served
    )
    crash = [e for e in served.events() if e.get("event") == "child exited"]
    assert crash and crash[-1]["child"] == "worker"
    assert crash[-1]["status"] == "killed by SIGKILL"


def test_serve_restarts_a_killed_gateway(served: Served) -> None:
    gateways = [p for p, c in children_of(served.process.pid).items() if role(c) == "gateway"]
    os.kill(gateways[0], signal.SIGKILL)

    def replaced() -> bool:
        now = [p for p, c in children_of(served.process.pid).items() if role(c) == "gateway"]
        return len(now) == 2 and gateways[0] not in now and listeners(served.port) == 2

    wait_until(replaced, 30, "the gateway was not restarted", served)
    wait_until(served.healthy, 30, "not healthy after the gateway restart", served)


def test_sigterm_stops_serve_and_all_its_children(served: Served) -> None:
    children = children_of(served.process.pid)
    assert len(children) == 3
    starting = next(e for e in served.events() if e.get("event") == "starting")
    workdir = Path(starting["workers"][0].removeprefix("ipc://")).parent
    assert workdir.exists()
    served.process.send_signal(signal.SIGTERM)
    assert served.process.wait(timeout=30) == 0, served.log_tail()
    assert all(gone(pid) for pid in children), "serve left processes behind"
    assert not workdir.exists(), "serve left its temp dir behind"
    stopped = [e["child"] for e in served.events() if e.get("event") == "stopped"]
    assert sorted(stopped[:2]) == ["gateway-1", "gateway-2"] and stopped[2] == "worker"
    # A clean stop is quiet: the gateways leave with nothing open, which the worker (when it
    # notices before its own stop) logs at info, "gateway gone", not as a lost gateway.
    events = served.events()
    since = max(i for i, e in enumerate(events) if e.get("event") == "stopping")
    loud = [e for e in events[since:] if e.get("level") in ("warning", "error", "critical")]
    assert not loud, loud


def test_serve_refuses_a_port_in_use(tiny_model_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "loomserve.cli.main", "serve", "--model", str(tiny_model_path),
             "--port", str(port)],
            cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr


def test_serve_rejects_a_missing_model(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "loomserve.cli.main", "serve",
         "--model", str(tmp_path / "nope.gguf")],
        cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "no model file" in result.stderr


def run_serve(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "loomserve.cli.main", "serve", "--log-json", *args]
    return subprocess.run(
        [*argv, "--port", str(free_port())],
        cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def started_children(result: subprocess.CompletedProcess[str]) -> list[str]:
    lines = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    return [line["child"] for line in lines if line.get("event") == "started"]


def test_serve_rejects_a_model_that_is_not_gguf(tmp_path: Path) -> None:
    """`--model /etc/hostname` crash-looped five workers and four gateways; now one line."""
    text = tmp_path / "hostname"
    text.write_text("build-box\n")
    result = run_serve("--model", str(text))
    assert result.returncode == 2, result.stderr
    assert f"{text} is not a GGUF model file" in result.stderr
    assert started_children(result) == [] and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("template", "says"),
    [
        ("chatgpt", "is not a llama.cpp built-in template, a file or Jinja text"),
        ("{% for m in messages %}{{ m }}", "the chat template does not compile"),
    ],
)
def test_serve_rejects_a_chat_template_before_starting_anything(
    tiny_model_path: Path, template: str, says: str
) -> None:
    result = run_serve("--model", str(tiny_model_path), "--chat-template", template)
    assert result.returncode == 2, result.stderr
    assert says in result.stderr and "Traceback" not in result.stderr
    assert started_children(result) == []


def test_a_child_failing_on_its_configuration_is_not_restarted(tiny_model_path: Path) -> None:
    """A --strategy that does not load fails in the worker (serve cannot check it without
    the worker's imports): it exits with EX_CONFIG once, and serve gives up with it."""
    result = run_serve(
        "--model", str(tiny_model_path), "--strategy", "no_such_module:Strategy", "--threads", "1"
    )
    assert result.returncode == os.EX_CONFIG, result.stderr
    assert started_children(result).count("worker") == 1
    assert "worker cannot start" in result.stderr
    assert "giving up: child failed on its configuration" in result.stderr
    assert "restarting" not in result.stderr and "Traceback" not in result.stderr


def test_a_gateway_whose_model_template_does_not_compile_exits_as_misconfigured(
    tmp_path: Path,
) -> None:
    """Its model's own template is compiled when the gateway starts, past what serve checks:
    one line and EX_CONFIG, which serve's supervisor does not restart."""
    model = write_tiny_model(tmp_path / "broken.gguf", chat_template="{% for m in messages %}")
    argv = [sys.executable, "-m", "loomserve.cli.main", "gateway", "--model", str(model)]
    argv += ["--worker", f"tcp://127.0.0.1:{free_port()}", "--port", str(free_port())]
    result = subprocess.run(
        [*argv, "--log-json"], cwd=ROOT, env=clean_env(), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == os.EX_CONFIG, result.stderr
    (line,) = [json.loads(text) for text in result.stderr.splitlines() if "cannot start" in text]
    assert line["event"] == "gateway cannot start"
    assert "the chat template does not compile" in line["error"]
    assert "Traceback" not in result.stderr


def test_worker_health_fails_without_a_worker() -> None:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    argv = [sys.executable, "-m", "loomserve.cli.main", "worker-health", "--worker", endpoint]
    result = subprocess.run(
        [*argv, "--timeout", "0.3"],
        cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 1
    assert f"no answer from {endpoint}" in result.stderr


def test_bench_without_its_extra_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from loomserve.cli.main import _bench_command

    for name in [m for m in sys.modules if m.startswith(("loomserve.cli.bench", "tqdm"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "tqdm", None)  # as if `pip install loomserve` alone
    result = CliRunner().invoke(_bench_command(), ["--base-url", "http://127.0.0.1:1"])
    assert result.exit_code == 1
    assert "pip install 'loomserve[bench]'" in result.output
