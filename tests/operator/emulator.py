"""kmock's KubernetesEmulator plus the server-set metadata a real apiserver always fills in.

kmock 0.8 stores objects exactly as posted. A real apiserver (see "Object Meta" in the Kubernetes API
conventions) sets ``metadata.uid`` (unique per incarnation), ``creationTimestamp``, ``resourceVersion`` (changes
on every write) and ``namespace`` (from the URL) on create. This subclass does that and nothing else, and it
implements the scale subresource of a custom resource as the CRD declares it (``specReplicasPath``
``.spec.nodes.replicas``): a PATCH of ``/scale`` with ``spec.replicas`` writes that path.
"""

from __future__ import annotations

import datetime
import itertools
import uuid
from typing import Any

import kmock

from disttrain.api import constants

_versions = itertools.count(1)


class ApiEmulator(kmock.KubernetesEmulator):
    async def _handle(self, request: Any) -> Any:
        data = request.data
        if request.resource is not None and isinstance(data, dict):
            if request.action == kmock.action.CREATE:
                meta = data.setdefault("metadata", {})
                if request.namespace:
                    meta["namespace"] = request.namespace
                meta["uid"] = str(uuid.uuid4())
                meta["creationTimestamp"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
                meta["resourceVersion"] = str(next(_versions))
                if request.resource.plural == constants.PLURAL:
                    meta["generation"] = 1
            elif request.action == kmock.action.UPDATE:
                if request.subresource == "scale" and request.resource.plural == constants.PLURAL:
                    replicas = (data.get("spec") or {}).get("replicas")
                    data.clear()
                    data["spec"] = {"nodes": {"replicas": replicas}}
                data.setdefault("metadata", {})["resourceVersion"] = str(next(_versions))
        return await super()._handle(request)
