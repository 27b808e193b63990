"""Owns the /v1 routers, one module per resource; create_app includes them in order."""
