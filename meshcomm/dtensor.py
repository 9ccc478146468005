"""`mc.dtensor`: meshcomm with torch DTensor, both ways (docs/dtensor.md).

- `to_placements(mesh, shape, layout)` / `from_placements(mesh, shape, placements)`: a
  layout as DTensor placements and back (pure: no process group needed).
- `from_dtensor(dt)` / `to_dtensor(sharded)`: a DTensor as a `Sharded` and back (no copy,
  no communication).
- `bind_device_mesh(device_mesh)`: a BoundMesh over a DeviceMesh's own process groups.

`mc.reshard(dt, dst)` reshards a DTensor directly and returns one.
"""

from __future__ import annotations

from .interop.placements import from_placements, to_placements
from .interop.runtime import bind_device_mesh
from .sharded import from_dtensor, to_dtensor

__all__ = ["bind_device_mesh", "from_dtensor", "from_placements", "to_dtensor", "to_placements"]
