"""disttrain: elastic distributed PyTorch training on Kubernetes.

The code lives in the repository's top-level ``api/``, ``common/``, ``operator/`` and ``trainer/``; the layout is
explained in docs/map.md.
"""
