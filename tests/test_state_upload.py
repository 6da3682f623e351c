"""Host -> device copies a plan makes outside its runs land before the next run can read them
(fusec.runtime.plan_device.Device), without a GPU: the order of calls against fakes of CuPy."""

from __future__ import annotations

import types

import numpy as np

from fusec.runtime.plan_device import Device


class _Log(list):
    pass


def _fakes(log: _Log):  # noqa: ANN202
    class Stream:
        def synchronize(self) -> None:
            log.append("sync")

    stream = Stream()

    class State:
        dtype, shape = np.dtype(np.int64), (3,)

        def set(self, host, stream=None) -> None:  # noqa: ANN001
            log.append(("set", host.tolist(), stream))

    cp = types.SimpleNamespace(cuda=types.SimpleNamespace(get_current_stream=lambda: stream))
    return cp, stream, State()


def test_set_state_returns_once_its_copy_has_landed() -> None:
    log = _Log()
    cp, stream, state = _fakes(log)
    dev = Device.__new__(Device)  # the copy path alone: no GPU memory behind it
    dev._cp = cp
    dev.state_array = lambda name: state
    dev.set_state("pos", [4, 5, 6])
    # the copy is ordered on one stream and that stream is synchronized before set_state returns:
    # a generation's prefill on its own non-blocking stream then reads the new positions
    assert log == [("set", [4, 5, 6], stream), "sync"]
