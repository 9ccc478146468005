"""Layer 1, pure values: errors, meshes, the layout notation, layouts, reduction ops.

Nothing here plans, communicates or prints; every other layer builds on these.
"""
