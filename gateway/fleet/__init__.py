"""The replicas: which there are (configured, from DNS), whether each answers (probes),
and what their engines publish (KV events)."""
