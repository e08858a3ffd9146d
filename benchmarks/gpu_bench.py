"""End to end against the GPU's ceiling: llama-batched-bench, loomserve and llama-server.

For one model it measures output tokens/s at each concurrency (1, 16, 64 by default):
  ceiling       llama-batched-bench's decode speed (S_TG) with that many sequences, prompts
                of --input-len tokens and --output-len new tokens: the engine and nothing else;
  loomserve     `loomserve serve`, under `loomserve bench` (closed loop, ignore_eos);
  llama-server  the same load on llama.cpp's own server, the same slots and context;
each at every sampling load of --loads (greedy, t1: temperature 1, topp: temperature 0.7 with
top_p 0.95) on the same running server, and writes gpu-bench.json (every figure and setting)
and gpu-bench.md (the table) to --out.
The binaries come from ../shared/gpu/build.sh (/tmp/k/build/bin on the GPU machine); leave
one out to skip its row. Runs on a CPU build too, with small settings, to check the script.

    python -m benchmarks.gpu_bench --model /tmp/m8b.gguf --bin /tmp/k/build/bin --out /tmp/r
    python -m benchmarks.gpu_bench --model tiny.gguf --bin BIN --slots 4 --ctx-size 256 \\
        --input-len 32 --output-len 16 --concurrency 1,4 --gpu-layers 0 --out /tmp/r
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import click
import httpx


@dataclass(frozen=True, slots=True)
class Settings:
    """One benchmark's load and server shape; the same for every contender."""

    model: Path
    slots: int
    ctx_size: int  # tokens per slot
    batch_tokens: int  # loomserve's tick budget; llama.cpp's -b and -ub
    input_len: int
    output_len: int
    concurrency: tuple[int, ...]
    prompts_per_stream: int  # requests per run: this many times the concurrency (at least 8)
    flash_attn: str
    gpu_layers: int
    loads: tuple[str, ...] = ("greedy",)  # names in LOADS, each run at every concurrency
    loomserve_args: str = ""  # extra `loomserve serve` options, e.g. "--backend-sampling off"

    def num_prompts(self, concurrency: int) -> int:
        return max(8, self.prompts_per_stream * concurrency)


# The sampling loads a run can measure: what every request of the load sets. llama-server adds
# its own top-k 40, top-p 0.95 and min-p 0.05 to a request that sets none of them.
LOADS: dict[str, dict[str, float]] = {
    "greedy": {"temperature": 0.0},
    "t1": {"temperature": 1.0},  # OpenAI's default: the full distribution
    "topp": {"temperature": 0.7, "top_p": 0.95},  # a common client default
}


def prompt_seed(load: str, concurrency: int) -> int:
    """Prompts of their own for each load and concurrency: one server serves them all and
    keeps what it prefilled in its prefix cache, so a load on an earlier load's prompts was
    timed on cache hits (with the concurrency as the seed, the sampled loads reused the
    greedy load's prompts)."""
    return concurrency * len(LOADS) + list(LOADS).index(load)


def load_arguments(load: str) -> list[str]:
    """`loomserve bench` options that make every request of the load sample as LOADS says."""
    fields = dict(LOADS[load])
    arguments = ["--temperature", str(fields.pop("temperature"))]
    return arguments + (["--extra-body", json.dumps(fields)] if fields else [])


def load_names(loads: str) -> list[str]:
    names = [name.strip() for name in loads.split(",") if name.strip()]
    unknown = [name for name in names if name not in LOADS]
    if unknown or not names:
        raise click.BadParameter(f"loads are among {', '.join(LOADS)}", param_hint="--loads")
    if len(set(names)) < len(names):  # results are kept by load: a second run would replace
        raise click.BadParameter(
            "each load once; run the script again to repeat one", param_hint="--loads"
        )
    return names


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ceiling(binary: Path, settings: Settings, log: Path) -> dict[int, float]:
    """llama-batched-bench's decode tokens/s per number of sequences."""
    command = [
        str(binary),
        *("-m", str(settings.model), "-c", str(settings.slots * settings.ctx_size)),
        *("-b", str(settings.batch_tokens), "-ub", str(settings.batch_tokens)),
        *("-npp", str(settings.input_len), "-ntg", str(settings.output_len)),
        *("-npl", ",".join(map(str, settings.concurrency))),
        *("-fa", settings.flash_attn, "-ngl", str(settings.gpu_layers)),
        *("--output-format", "jsonl"),
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    log.write_text(" ".join(command) + "\n" + result.stdout + result.stderr)
    if result.returncode != 0:
        raise click.ClickException(f"llama-batched-bench failed; see {log}")
    speeds = {}
    for line in (result.stdout + result.stderr).splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            speeds[int(row["pl"])] = float(row["speed_tg"])
    return speeds


def loomserve_command(settings: Settings, port: int) -> list[str]:
    return [
        sys.executable,
        *("-m", "loomserve.cli.main", "serve", "--model", str(settings.model)),
        *("--port", str(port), "--slots", str(settings.slots)),
        *("--ctx-size", str(settings.ctx_size), "--batch-tokens", str(settings.batch_tokens)),
        *("--flash-attn", settings.flash_attn, "--gpu-layers", str(settings.gpu_layers)),
        *settings.loomserve_args.split(),
    ]


def llama_server_command(binary: Path, settings: Settings, port: int, extra: str) -> list[str]:
    return [
        str(binary),
        *("-m", str(settings.model), "--host", "127.0.0.1", "--port", str(port)),
        *("-np", str(settings.slots), "-c", str(settings.slots * settings.ctx_size)),
        *("-b", str(settings.batch_tokens), "-ub", str(settings.batch_tokens)),
        *("-fa", settings.flash_attn, "-ngl", str(settings.gpu_layers)),
        *extra.split(),
    ]


def wait_ready(base_url: str, process: subprocess.Popen, timeout: float) -> None:
    """Until /v1/models answers 200 (both servers answer it once the model is loaded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise click.ClickException(f"the server exited with {process.returncode}")
        try:
            if httpx.get(f"{base_url}/v1/models", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise click.ClickException(f"{base_url} not ready within {timeout:.0f} s")


def under_load(name: str, server: list[str], port: int, settings: Settings, out: Path) -> dict:
    """Start the server, run `loomserve bench` for each load at each concurrency, stop it; the
    summaries, by load and concurrency. One server serves every load, so they differ in
    sampling alone."""
    base_url = f"http://127.0.0.1:{port}"
    log = (out / f"{name}.log").open("w")
    process = subprocess.Popen(server, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    points = {}
    try:
        wait_ready(base_url, process, timeout=900)
        for load in settings.loads:
            points[load] = {}
            for concurrency in settings.concurrency:
                result_json = out / f"{name}-{load}-c{concurrency}.json"
                bench = [
                    sys.executable,
                    *("-m", "loomserve.cli.bench.command", "--base-url", base_url),
                    *("--input-len", str(settings.input_len)),
                    *("--output-len", str(settings.output_len)),
                    *("--max-concurrency", str(concurrency)),
                    *("--num-prompts", str(settings.num_prompts(concurrency))),
                    *("--ignore-eos", "--no-progress", "--result-json", str(result_json)),
                    *("--seed", str(prompt_seed(load, concurrency)), *load_arguments(load)),
                ]
                subprocess.run(bench, stdout=log, stderr=subprocess.STDOUT, check=True)
                points[load][concurrency] = json.loads(result_json.read_text())["summary"]
                click.echo(
                    f"{name} {load} c={concurrency}: "
                    f"{points[load][concurrency]['output_throughput']:,.0f} tok/s"
                )
    finally:
        os.killpg(process.pid, signal.SIGINT)  # its own session: the server and its children
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log.close()
    return points


def markdown(settings: Settings, results: dict) -> str:
    """The table: output tokens/s per contender, load and concurrency, and the share of the
    ceiling."""
    levels = settings.concurrency
    head = "| | " + " | ".join(f"c={c}" for c in levels) + " |"
    lines = [head, "|---|" + "---:|" * len(levels)]
    ceiling_row = results.get("ceiling", {})
    if ceiling_row:
        cells = [f"{ceiling_row[c]:,.0f}" if c in ceiling_row else "–" for c in levels]
        lines.append("| ceiling | " + " | ".join(cells) + " |")
    for name, by_load in results.items():
        if name == "ceiling":
            continue
        for load, row in by_load.items():
            cells = []
            for c in levels:
                if c not in row:
                    cells.append("–")
                    continue
                tokens = row[c]["output_throughput"]
                share = f" ({tokens / ceiling_row[c]:.0%})" if c in ceiling_row else ""
                cells.append(f"{tokens:,.0f}{share}")
            lines.append(f"| {name}, {load} | " + " | ".join(cells) + " |")
    loads = "; ".join(
        f"{load}: " + ", ".join(f"{k} {v:g}" for k, v in LOADS[load].items())
        for load in settings.loads
    )
    shape = (
        f"{settings.model.name}: {settings.slots} slots × {settings.ctx_size}, prompts of "
        f"{settings.input_len} tokens, {settings.output_len} output tokens (ignore_eos), "
        f"batch {settings.batch_tokens}, flash attention {settings.flash_attn}, "
        f"{settings.gpu_layers} GPU layers; loads ({loads})"
        + (f"; loomserve {settings.loomserve_args}" if settings.loomserve_args else "")
        + "; output tokens/s (share of the ceiling)."
    )
    return shape + "\n\n" + "\n".join(lines) + "\n"


@click.command(context_settings={"show_default": True})
@click.option("--model", type=click.Path(exists=True, path_type=Path), required=True)
@click.option(
    "--bin",
    "bin_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("/tmp/k/build/bin"),
    help="Where llama-batched-bench and llama-server are; a missing one is skipped.",
)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("gpu-bench"))
@click.option("--slots", default=64)
@click.option("--ctx-size", default=2048, help="Tokens per slot.")
@click.option("--batch-tokens", default=2048)
@click.option("--input-len", default=550)
@click.option("--output-len", default=128)
@click.option("--concurrency", default="1,16,64")
@click.option("--prompts-per-stream", default=4, help="Requests per run: this × concurrency.")
@click.option("--flash-attn", type=click.Choice(["on", "off", "auto"]), default="on")
@click.option("--gpu-layers", default=999)
@click.option("--server-args", default="", help="Extra llama-server arguments, e.g. '-cram 0'.")
@click.option("--only", default="ceiling,loomserve,llama-server", help="Contenders to run.")
@click.option(
    "--loads",
    default="greedy",
    help="Sampling loads, each run on the same server: greedy; t1 (temperature 1); topp "
    "(temperature 0.7, top_p 0.95). llama-server adds its own top-k 40, top-p 0.95 and "
    "min-p 0.05 to a request that sets none.",
)
@click.option("--loomserve-args", default="", help="Extra `loomserve serve` options.")
def main(
    model: Path,
    bin_dir: Path,
    out: Path,
    slots: int,
    ctx_size: int,
    batch_tokens: int,
    input_len: int,
    output_len: int,
    concurrency: str,
    prompts_per_stream: int,
    flash_attn: str,
    gpu_layers: int,
    server_args: str,
    only: str,
    loads: str,
    loomserve_args: str,
) -> None:
    """Output tokens/s of the ceiling, loomserve and llama-server at each concurrency."""
    settings = Settings(
        model=model.resolve(),
        slots=slots,
        ctx_size=ctx_size,
        batch_tokens=batch_tokens,
        input_len=input_len,
        output_len=output_len,
        concurrency=tuple(int(c) for c in concurrency.split(",")),
        prompts_per_stream=prompts_per_stream,
        flash_attn=flash_attn,
        gpu_layers=gpu_layers,
        loads=tuple(load_names(loads)),
        loomserve_args=loomserve_args,
    )
    out.mkdir(parents=True, exist_ok=True)
    wanted = set(only.split(","))
    batched_bench = shutil.which("llama-batched-bench", path=str(bin_dir))
    llama_server = shutil.which("llama-server", path=str(bin_dir))
    results: dict[str, dict] = {}
    if "ceiling" in wanted and batched_bench:
        results["ceiling"] = ceiling(Path(batched_bench), settings, out / "ceiling.log")
        click.echo(f"ceiling: {results['ceiling']}")
    if "loomserve" in wanted:
        port = free_port()
        results["loomserve"] = under_load(
            "loomserve", loomserve_command(settings, port), port, settings, out
        )
    if "llama-server" in wanted and llama_server:
        port = free_port()
        command = llama_server_command(Path(llama_server), settings, port, server_args)
        results["llama-server"] = under_load("llama-server", command, port, settings, out)
    table = markdown(settings, results)
    settings_json = asdict(settings) | {"model": str(settings.model), "server_args": server_args}
    (out / "gpu-bench.json").write_text(
        json.dumps({"settings": settings_json, "results": results}, indent=2) + "\n"
    )
    (out / "gpu-bench.md").write_text(table)
    click.echo(table)


if __name__ == "__main__":
    main()
