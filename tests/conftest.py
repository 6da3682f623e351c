"""Shared test configuration: tests marked ``gpu`` skip themselves when CuPy finds no device, and
every test run gets its own kernel cache (``FUSEC_CACHE_DIR``, a private temporary directory
removed at the end), so no test reads or writes the user's ``~/.cache/fusec``."""

from __future__ import annotations

import functools
import os
import shutil
import tempfile

import pytest

_RUN_CACHE: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    # Set before any test module is imported (fusec reads the variable at each cache access); a
    # variable the caller set is replaced too: tests must not see a cache they did not make.
    d = tempfile.mkdtemp(prefix="fusec-test-cache-")  # mode 0700: the cache refuses others' directories
    _RUN_CACHE.append(d)
    os.environ["FUSEC_CACHE_DIR"] = d


def pytest_unconfigure(config: pytest.Config) -> None:
    while _RUN_CACHE:
        shutil.rmtree(_RUN_CACHE.pop(), ignore_errors=True)


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
