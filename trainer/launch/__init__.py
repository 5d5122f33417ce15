"""The worker pod's launcher: ``python -m disttrain.trainer.launch``, torchrun with our agent and rendezvous.

torchrun's official plug-in points only: the ``disttrain`` rendezvous handler (:mod:`.rendezvous`), a
``LocalElasticAgent`` subclass (:mod:`.launcher`), warm worker interpreters (:mod:`.warmstart`), the in-place
handover of the next round (:mod:`.handover`), the exit barrier (:mod:`.exitbarrier`), readiness; and local
mode's fork server (:mod:`.forkserver`), which starts whole pods as forks of one import of torch.

May import: ``disttrain.api``, :mod:`disttrain.trainer.store`, :mod:`disttrain.trainer.agent.heartbeats` (the
heartbeat identity it publishes). Never the training loop. This ``__init__`` imports nothing: ``warmstart``
must run before torch is imported."""
