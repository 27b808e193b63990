"""Owns the web console of `scheduled-d api`, served under /ui: server-rendered pages
(pages.py, Jinja2 templates with autoescape in templates/), its session, CSRF and security
headers (session.py), and its own stylesheet and script in static/ (shipped in the wheel;
no Node.js at build or run time, no CDN). `install_console` adds it to the API's app."""

from __future__ import annotations

from fastapi import FastAPI

from scheduled_d.api.ui.pages import router


def install_console(app: FastAPI) -> None:
    app.include_router(router)
