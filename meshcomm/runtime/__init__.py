"""The runtime: a mesh bound to torch.distributed and what runs on top of it.

`bind` (`init_mesh`, `BoundMesh`: one process group per set of mesh axes), `checks` (check
mode: the ranks of a group agree on a call before it runs), `collectives` (the public
`mc.collectives`), `launch` (`run_ranks`: a function on N local processes; a launched
process printing once), `compiler` (marks for torch.compile, set when dynamo loads).
It sits above the executors (`meshcomm.executors.distributed` runs a plan on a bound mesh)
and below the public API.
"""

from .bind import BoundMesh, default_backend, init_mesh

__all__ = ["BoundMesh", "default_backend", "init_mesh"]
