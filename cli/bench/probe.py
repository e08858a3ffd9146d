"""What the benchmark asks the server before the run: its model, and its tokenizer if exposed."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import httpx

from .client import api_root


class BenchSetupError(Exception):
    """The benchmark cannot start: the server is unreachable or refuses the set-up."""


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def first_model(base_url: str, api_key: str | None, timeout_s: float = 30.0) -> str:
    """The id of the first model in /v1/models, as vLLM's benchmark picks it."""
    url = api_root(base_url) + "/v1/models"
    try:
        response = httpx.get(url, headers=auth_headers(api_key), timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise BenchSetupError(f"cannot reach {url}: {exc}") from exc
    if response.status_code != 200:
        raise BenchSetupError(f"GET {url}: HTTP {response.status_code}: {response.text[:200]}")
    models = response.json().get("data") or []
    if not models:
        raise BenchSetupError(f"GET {url} lists no models; pass --model")
    return str(models[0]["id"])


class ServerTokenizer:
    """Counts tokens with the server's /tokenize (vLLM's and llama-server's shapes both work)."""

    def __init__(self, base_url: str, model: str, api_key: str | None) -> None:
        self.url = api_root(base_url) + "/tokenize"
        self.model = model
        self.http = httpx.Client(headers=auth_headers(api_key), timeout=60.0)
        self.body_key: str | None = None  # "prompt" (vLLM) or "content" (llama-server)

    def available(self) -> bool:
        """Whether the server tokenizes; settles which request shape it speaks."""
        for key in ("prompt", "content"):
            try:
                self.body_key = key
                # llama-server ignores a key it does not know and tokenizes "": zero tokens.
                if self.count(["hello world"])[0] > 0:
                    return True
            except (BenchSetupError, ValueError, KeyError, TypeError):
                continue
        self.body_key = None
        return False

    def count(self, texts: Sequence[str]) -> list[int]:
        """Token counts of texts, one request each over one kept-alive connection."""
        if self.body_key is None:
            raise BenchSetupError("the server has no /tokenize")
        counts = []
        for text in texts:
            body = {"model": self.model, self.body_key: text}
            try:
                response = self.http.post(self.url, json=body)
            except httpx.HTTPError as exc:
                raise BenchSetupError(f"POST {self.url}: {exc}") from exc
            if response.status_code != 200:
                raise BenchSetupError(f"POST {self.url}: HTTP {response.status_code}")
            reply = response.json()
            counts.append(int(reply["count"]) if "count" in reply else len(reply["tokens"]))
        return counts

    def close(self) -> None:
        self.http.close()


def server_identity(
    base_url: str, api_key: str | None, model: str | None = None, timeout_s: float = 10.0
) -> dict:
    """What the server says it is, for the result JSON: the benchmarked model's /v1/models
    entry (the first one's when model is None), the `server` header, loomserve's version (its
    /openapi.json names it), vLLM's /version and llama-server's /props (the fields that name a
    build), when they answer. A missing endpoint is left out, never an error."""
    root = api_root(base_url)
    identity: dict = {"base_url": base_url}
    with httpx.Client(headers=auth_headers(api_key), timeout=timeout_s) as http:

        def get(path: str) -> httpx.Response | None:
            try:
                response = http.get(root + path)
            except httpx.HTTPError:
                return None
            return response if response.status_code == 200 else None

        if models := get("/v1/models"):
            identity["server_header"] = models.headers.get("server")
            with contextlib.suppress(ValueError, AttributeError, IndexError, KeyError, TypeError):
                listed = models.json()["data"]
                ours = [m for m in listed if model is None or m.get("id") == model] or [{}]
                entry = {k: ours[0][k] for k in ("id", "owned_by", "meta") if k in ours[0]}
                # A name the server serves under another id (an alias): say which was asked.
                identity["model"] = entry if entry else {"id": model}
        if (openapi := get("/openapi.json")) is not None:
            with contextlib.suppress(ValueError, AttributeError, KeyError, TypeError):
                info = openapi.json()["info"]
                # Only loomserve's title: FastAPI's default info ("FastAPI", "0.1.0") that
                # other servers leave in place names no build.
                if str(info.get("title", "")).startswith("loomserve"):
                    identity["loomserve_version"] = info["version"]
        if (version := get("/version")) is not None:
            with contextlib.suppress(ValueError, AttributeError):
                identity["version"] = version.json().get("version")
        if (props := get("/props")) is not None:
            with contextlib.suppress(ValueError, AttributeError):
                body = props.json()
                keys = ("build_info", "model_path", "total_slots", "chat_template_name")
                identity["props"] = {k: body[k] for k in keys if k in body}
    return identity
