"""DTensor interop: `placements` (layouts <-> placements, pure) and `runtime` (DeviceMesh
process groups, a DTensor's parts). The public functions are in `mc.dtensor`."""
