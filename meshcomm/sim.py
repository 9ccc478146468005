"""`mc.sim`: exact in-process simulation of N ranks: shards, collectives and plan execution
(docs/api.md § mc.sim). `import meshcomm.sim` and `from meshcomm.sim import scatter` work
as for every public namespace; the names and the code are `meshcomm.executors.sim`'s.
"""

from .executors.sim import *  # noqa: F403  (the one list of names: executors/sim/__init__)
from .executors.sim import __all__ as __all__
