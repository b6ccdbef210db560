"""Per-device workspaces of the ops whose launches share scratch buffers
(decode attention's split-KV partials and counters, the streaming QKV GEMV's
split-K partials and counters).

``DeviceBuffers(kernel, make)``: ``get(device)`` returns ``make(device)``'s
buffers, allocated on first use and never replaced (a captured CUDA graph
keeps using them); the first use must not be inside a capture (RuntimeError
naming the fix). ``order(device)``: launches sharing the buffers run in
stream order: one from another stream than the previous one waits for that
stream first (not during a capture, whose order is the capture stream's).
"""

from __future__ import annotations

import threading
from typing import Any, Callable


class DeviceBuffers:
    def __init__(self, kernel: str, make: Callable[[Any], Any]):
        self._kernel, self._make = kernel, make
        self._lock = threading.Lock()
        self._bufs: dict[Any, Any] = {}
        self._last_stream: dict[Any, Any] = {}

    def __getitem__(self, device):
        """The buffers already allocated on ``device`` (KeyError if none)."""
        return self._bufs[device]

    def values(self):
        return self._bufs.values()

    def get(self, device):
        import torch

        bufs = self._bufs.get(device)
        if bufs is not None:
            return bufs
        with self._lock:
            bufs = self._bufs.get(device)
            if bufs is None:
                if torch.cuda.is_current_stream_capturing():
                    raise RuntimeError(f"flintgen {self._kernel}: the workspace is allocated on first use, "
                                       "which must not be inside a CUDA-graph capture: call op.warmup(device) "
                                       "(or flintgen.warmup(spec)) before capturing")
                bufs = self._make(device)
                self._bufs[device] = bufs
        return bufs

    def order(self, device) -> None:
        import torch

        if torch.cuda.is_current_stream_capturing():
            return
        stream = torch.cuda.current_stream(device)
        last = self._last_stream.get(device)
        if last is not None and last != stream:
            stream.wait_stream(last)
        self._last_stream[device] = stream
