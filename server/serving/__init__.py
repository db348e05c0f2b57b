"""What the handlers share while the server runs: its Prometheus metrics (`metrics.py`)."""
