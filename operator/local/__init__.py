"""Local mode: ``disttrain local run job.yaml`` runs the operator's ``reconcile``, the real job agent and the
real trainer as local processes, with node loss and live scaling.

A "node" is a torchrun agent and its workers in their own session, started from the same pod dict that
``disttrain.operator.pods.build_worker_pod`` produces for Kubernetes (only the rendezvous endpoint, ports
and paths are translated to localhost and the state directory). Nothing here imports torch: the agent and
the workers are subprocesses.
"""
