"""Shared test configuration: tests marked ``gpu`` skip themselves when CuPy finds no device."""

from __future__ import annotations

import functools

import pytest


@functools.lru_cache(maxsize=1)
def gpu_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU found (CuPy sees no device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def module_cache_dir(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """A kernel cache of the test module's own (tests never touch the user's cache); use with
    ``pytestmark = pytest.mark.usefixtures("module_cache_dir")``."""
    mp = pytest.MonkeyPatch()
    mp.setenv("FUSEC_CACHE_DIR", str(tmp_path_factory.mktemp("fusec_cache")))
    yield
    mp.undo()
