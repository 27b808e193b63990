"""The public path of the REST API's Python client, `schedctl.client.ApiClient` (named in
docs/api.md). The client itself is schedctl.clients.client; this module only keeps
the path users' code imports."""

from schedctl.clients.client import ApiClient

__all__ = ["ApiClient"]
