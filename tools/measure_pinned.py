"""Host bytes a run would pin, per module, measured on a CPU-only machine.

Runs the default serving simulation (eager, 30 steps: every pool key opens
at the first save) with ``torch.cuda.is_available`` patched to True, so code
that pins "where CUDA exists" asks for pinned memory, and ``torch.empty``
wrapped to record each ``pin_memory=True`` request (then allocate it
unpinned). Pinned bytes are reported as requested and as torch's caching
host allocator holds them (each block rounded up to a power of two, the
default in ATen/core/CachingHostAllocator.h). Run it against any tree:

    PYTHONPATH=<tree>/src python tools/measure_pinned.py
"""

from __future__ import annotations

import collections
import json
import sys

import torch


def main() -> None:
    requests: collections.Counter[str] = collections.Counter()
    requested: collections.Counter[str] = collections.Counter()
    rounded: collections.Counter[str] = collections.Counter()
    real_empty = torch.empty

    def spy(*args, **kw):
        pin = kw.pop("pin_memory", False)
        out = real_empty(*args, **kw)
        if pin:
            frame = sys._getframe(1)
            while frame is not None and "omni_prefix_cache" not in frame.f_code.co_filename:
                frame = frame.f_back
            where = frame.f_code.co_filename.split("omni_prefix_cache/")[-1] if frame else "?"
            nbytes = out.numel() * out.element_size()
            requests[where] += 1
            requested[where] += nbytes
            rounded[where] += 1 << max(0, (nbytes - 1).bit_length())
        return out

    torch.cuda.is_available = lambda: True
    torch.empty = spy
    import omni_prefix_cache
    from omni_prefix_cache.tools.simulate.engine import SimConfig, run_simulation

    res = run_simulation(SimConfig(steps=30, eager=True))
    stats = res.manager_stats or {}
    print(
        json.dumps(
            {
                "tree": omni_prefix_cache.__file__,
                "ok": res.ok,
                "pinned_requests": dict(requests),
                "pinned_bytes_requested": dict(requested),
                "pinned_bytes_pow2": dict(rounded),
                "pool_host_bytes": stats.get("pool_host_bytes"),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
