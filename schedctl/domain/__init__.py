"""The domain: what a job, a run, a tenant, a job file, an alert setting and the
configuration are, and the validation of requests for them."""
