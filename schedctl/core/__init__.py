"""The core: values and policies that know nothing of jobs (errors, bounds, backoff
and retry, closing, payload encryption, signatures, the SSRF guard)."""
