"""Training state kept in memory across a node's loss: each rank's shards of the last good steps, a copy of a
partner's shards on another node, and the in-memory DCP reader that reshards them onto a new mesh.

Modules: :mod:`.catalogue` (what a group's state is made of, which step the survivors can rebuild, pure),
:mod:`.capture` (this rank's items of a state dict, copied to host memory), :mod:`.wire` (JSON and byte exchanges
over a gloo group, no pickle), :mod:`.keeper` (the versions a rank holds and their replication to its partner),
:mod:`.reader` (a ``StorageReader`` that serves DCP's load from the members' memory).

May import: torch, :mod:`disttrain.api`. Imported by the training loop's modules only.
"""
