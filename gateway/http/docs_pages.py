"""/docs (Swagger UI) and /redoc (ReDoc) with their scripts served by the gateway itself.

FastAPI's own pages load Swagger UI and ReDoc from a CDN, so they render blank on a machine
without the internet. The fastapi-offline package ships the same assets; they are served
from ASSETS_URL, outside the API schema and without an API key, as the pages are.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

ASSETS_URL = "/docs-assets"


def install_docs_pages(app: FastAPI) -> None:
    """Mount the assets and add /docs and /redoc to an app made with docs_url=None and
    redoc_url=None."""
    assets = files("fastapi_offline") / "static"
    app.mount(ASSETS_URL, StaticFiles(directory=str(assets)), name="docs-assets")

    def urls(request: Request) -> tuple[str, str]:
        root = request.scope.get("root_path", "")  # behind a proxy that strips a prefix
        return f"{root}{app.openapi_url}", f"{root}{ASSETS_URL}"

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        openapi, assets = urls(request)
        return get_swagger_ui_html(
            openapi_url=openapi,
            title=f"{app.title} - Swagger UI",
            swagger_js_url=f"{assets}/swagger-ui-bundle.js",
            swagger_css_url=f"{assets}/swagger-ui.css",
            swagger_favicon_url=f"{assets}/favicon.png",
        )

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        openapi, assets = urls(request)
        return get_redoc_html(
            openapi_url=openapi,
            title=f"{app.title} - ReDoc",
            redoc_js_url=f"{assets}/redoc.standalone.js",
            redoc_favicon_url=f"{assets}/favicon.png",
            with_google_fonts=False,
        )
