"""The fault-and-load suite: every test injects a real fault (a killed or stopped process, a
corrupted file, a full filesystem, a flood of clients) and asserts exact outcomes."""

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/faults/" in str(item.path):
            item.add_marker(pytest.mark.faults)
