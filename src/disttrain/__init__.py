"""disttrain: elastic distributed PyTorch training on Kubernetes.

The code lives in the repository's top-level ``api/``, ``operator/`` and ``trainer/``; ``src/disttrain/`` holds
only this file, ``py.typed`` and symlinks to those three folders, so the path of every module matches its import
name (``src/disttrain/operator/reconcile.py`` is ``disttrain.operator.reconcile``). That is what lets an editable
install be a plain path entry that mypy, pyright and IDEs follow, instead of an import hook they cannot.
"""
