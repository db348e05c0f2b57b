"""Request state and scheduling, on the host (no device arrays): requests (one per choice), the scheduler
that plans each step as plain data (`step.py`), KV pages and the prefix cache, and `update_from_output`,
the one place that advances a request from a step's sampled tokens."""
