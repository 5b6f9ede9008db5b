"""The GPU seam: what gpuguard needs from a GPU vendor's library, apart from the operating
system (gpuguard/host/, the OS seam).

A scan, an inspection and a reap's re-check read GPUs through one `GpuSource`
(source.py): read() gives a `GpuReading` (reading.py: each GPU's gauges, the processes
holding memory on it, what failed), close() lets the library go. vendors.py chooses the
source, apart from the OS: NVML (nvml/, the only package that imports pynvml) is the one
vendor today. What the OS adds to any vendor's reading stays in the OS seam and comes
through the Platform as a hook: Windows' WDDM counters size the holders a vendor lists
but cannot size (os_memory.py applies it). docs/design.md, "The GPU seam", says where a
second vendor plugs in.
"""
