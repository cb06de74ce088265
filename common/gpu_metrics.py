"""GPU utilization, memory and power of this process's own CUDA devices, read from NVML at scrape time.

Series carry the GPU's UUID in a label named `UUID`, as the DCGM exporter's do, so the two join.
Without NVML (no driver or no GPU, e.g. a CPU run) the collector exports nothing and logs only at
debug level: that is the normal CPU case, not a fault.
"""

from __future__ import annotations

import logging

import torch
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)


def device_uuid(device: torch.device) -> str:
    """NVML's UUID ("GPU-8-4-4-4-12 hex") of a torch CUDA device; "" on the CPU or when CUDA cannot say.

    Taken from CUDA's own device properties, so CUDA_VISIBLE_DEVICES and device ordering cannot
    point it at another GPU; NVML by index is the fallback.
    """
    if device.type != "cuda":
        return ""
    try:
        raw = str(torch.cuda.get_device_properties(device).uuid)
    except Exception as e:  # an old torch without .uuid
        log.debug("no CUDA UUID for %s: %s", device, e)
        raw = ""
    hexes = raw.removeprefix("GPU-").replace("-", "").lower()
    if len(hexes) == 32 and all(c in "0123456789abcdef" for c in hexes):
        return f"GPU-{hexes[:8]}-{hexes[8:12]}-{hexes[12:16]}-{hexes[16:20]}-{hexes[20:]}"
    try:
        import pynvml

        pynvml.nvmlInit()
        index = torch.cuda._get_nvml_device_index(device)  # honours CUDA_VISIBLE_DEVICES
        uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(index))
        return uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    except Exception as e:
        log.debug("no NVML UUID for %s: %s", device, e)
        return ""


class GpuCollector(Collector):
    """dflash_ring_gpu_{utilization_ratio,memory_used_bytes,power_watts}{UUID} for the given GPUs."""

    def __init__(self, uuids: list[str]):
        self._nvml = None
        self._handles: dict[str, object] = {}
        uuids = [u for u in uuids if u]
        if not uuids:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as e:  # ImportError, or NVMLError: no library, no driver
            log.debug("NVML unavailable, no GPU metrics: %s", e)
            return
        self._nvml = pynvml
        for uuid in uuids:
            try:
                self._handles[uuid] = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            except pynvml.NVMLError as e:  # e.g. a MIG instance, whose UUID NVML spells differently
                log.info("no NVML handle for %s (%s): its GPU metrics come from DCGM only", uuid, e)

    def collect(self):
        if not self._handles:
            return
        nvml = self._nvml
        util = GaugeMetricFamily(
            "dflash_ring_gpu_utilization_ratio",
            "Fraction of the last sample period a kernel ran on the GPU (0-1)",
            labels=["UUID"],
        )
        mem = GaugeMetricFamily(
            "dflash_ring_gpu_memory_used_bytes", "GPU memory in use (all processes)", labels=["UUID"]
        )
        power = GaugeMetricFamily("dflash_ring_gpu_power_watts", "GPU power draw", labels=["UUID"])
        for uuid, h in self._handles.items():
            for family, read in (
                (util, lambda: nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0),
                (mem, lambda: nvml.nvmlDeviceGetMemoryInfo(h).used),
                (power, lambda: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0),
            ):
                try:
                    family.add_metric([uuid], float(read()))
                except nvml.NVMLError:
                    pass  # not supported on this GPU: leave the series out
        yield util
        yield mem
        yield power
