"""Checkpoints: the manager over ``torch.distributed.checkpoint`` (:mod:`.manager`), what is saved (:mod:`.state`),
each rank's writing (:mod:`.saving`), the commit across the group (:mod:`.groupcommit`), rank 0's commit and
retention (:mod:`.committer`), the on-disk commit protocol without torch (:mod:`.commit`), the fence of stale groups
(:mod:`.fence`), raw-bytes storage (:mod:`.storage`, :mod:`.digesting`, :mod:`.writeback`) and the automatic
interval (:mod:`.autointerval`).

May import: ``disttrain.api``, torch, :mod:`disttrain.trainer.metrics`. Never the agent, the launcher or the loop."""
