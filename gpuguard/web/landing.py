"""The page at `/`, as exporter-toolkit's landing page: what this is and where its
telemetry is, so a browser pointed at the port finds the metrics."""

from __future__ import annotations

from html import escape


def landing_page(program: str, description: str, version: str,
                 links: list[tuple[str, str]]) -> bytes:
    """HTML naming the program and linking each (path, text)."""
    items = "".join(f'<li><a href="{escape(path)}">{escape(text)}</a></li>'
                    for path, text in links)
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{escape(program)}</title></head><body>"
        f"<h1>{escape(program)}</h1><p>{escape(description)}</p>"
        f"<p>version {escape(version)}</p><ul>{items}</ul></body></html>\n"
    ).encode()
