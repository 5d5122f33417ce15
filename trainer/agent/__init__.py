"""The job agent: ``python -m disttrain.trainer.agent``, one small pod per job (one process in local mode).

It hosts the rendezvous store and guards it (:mod:`.guardian`), judges silent nodes from their heartbeats
(:mod:`.heartbeats`), follows its job through the API server and writes the status fields (:mod:`.reporting`).

May import: ``disttrain.api``, :mod:`disttrain.trainer.store`, :mod:`disttrain.trainer.checkpoint` (to read what
was committed). Never the launcher or the training loop."""
