"""Towards the engines: the connection pool, relaying a request and reading its stream,
failing over, and ejecting replicas that fail."""
