"""Tests that need 8 (fake CPU) devices. JAX reads the device count once, at start, so these run in their
own pytest process, launched by tests/test_sharding.py with JAX_NUM_CPU_DEVICES=8; the main suite's
process (one device) does not collect them (see tests/conftest.py)."""

import jax
import pytest


@pytest.fixture(scope="session", autouse=True)
def eight_devices():
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices: run through tests/test_sharding.py (JAX_NUM_CPU_DEVICES=8)")
