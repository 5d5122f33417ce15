"""Utilities that both the operator and the trainer use and that are no part of the contract: a free local port,
the order of Kubernetes resourceVersions, a ``Popen`` for forked processes. Imports nothing of disttrain's."""
