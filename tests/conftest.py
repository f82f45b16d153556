"""On a device other than the CPU (``SHARDED_TEST_DEVICE``, tests/_device.py), only the modules
marked device-agnostic run; the rest were written for the CPU and say so as their skip reason."""

from __future__ import annotations

import pytest

from tests._device import DEVICE_AGNOSTIC, ENV_VAR, device_type_under_test


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{DEVICE_AGNOSTIC.name}: the module's tests run on the device {ENV_VAR} names (tests/_device.py)"
    )


def pytest_report_header(config: pytest.Config) -> str:
    return f"{ENV_VAR}: {device_type_under_test()}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    device_type = device_type_under_test()
    if device_type == "cpu":
        return
    written_for_cpu = pytest.mark.skip(
        reason=f"{ENV_VAR}={device_type}: this module builds its models on the CPU (not marked {DEVICE_AGNOSTIC.name})"
    )
    for item in items:
        if item.get_closest_marker(DEVICE_AGNOSTIC.name) is None:
            item.add_marker(written_for_cpu)
