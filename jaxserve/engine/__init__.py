"""The engine: one loop that schedules a step, launches it on the device and advances requests by the
step before (`engine.py`), and its assembly from `EngineArgs` (`builder.py`)."""
