"""Page-lock the ring mapping (and a checkpoint snapshot's buffer) for the GPU, so copies run at PCIe speed.

Each process registers its own mapping once (cudaHostRegister is per process):
~48 ms per GB when the pages are already touched, and it lifts H2D from ~7 to
~55 GB/s on an H200 (see docs/benchmarks.md). Without CUDA this is a no-op.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

# cudaHostRegisterPortable: the pinning holds for every CUDA context of this process.
_PORTABLE = 1


class HostRegistration:
    def __init__(self, tensor: torch.Tensor):
        self._ptr: int | None = None
        if not torch.cuda.is_available() or tensor.numel() == 0:
            return
        rc = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel(), _PORTABLE)
        if int(rc) != 0:
            log.warning(
                "cudaHostRegister of %d bytes failed (error %s): copies to and from them will be unpinned",
                tensor.numel(),
                int(rc),
            )
            return
        self._ptr = tensor.data_ptr()

    @property
    def pinned(self) -> bool:
        return self._ptr is not None

    def close(self) -> None:
        if self._ptr is not None:
            torch.cuda.cudart().cudaHostUnregister(self._ptr)
            self._ptr = None
