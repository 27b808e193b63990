"""The clients: the library over the REST API (ApiClient, ApiLeaseBackend)."""
