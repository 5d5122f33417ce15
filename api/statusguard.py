"""Which status fields are the operator's memory, and the admission rule that keeps everyone else off them.

The job agent may write only :data:`~disttrain.api.status.AGENT_FIELDS`. Everything else in the status (phase,
restart totals and ``byReason``, ``handledPods``, ``control``, ...) is what the operator remembers between
reconciles, and no other writer may change it. RBAC cannot say that (it grants ``patch`` on the whole status
subresource), so the chart installs a ValidatingAdmissionPolicy (``templates/statusguard.yaml``): an update of
``disttrainjobs/status`` by the job's own agent (ServiceAccount ``<job>-agent`` in the job's namespace) is refused
when it changes one of :func:`operator_fields`. The chart lists the fields literally; a test keeps that list equal
to this one, so a new status field is guarded from the day it is added.
"""

from __future__ import annotations

from disttrain.api.status import AGENT_FIELDS, DistTrainJobStatus


def operator_fields() -> tuple[str, ...]:
    """Wire names of every status field but the agent's, in model order."""
    names = [field.alias or name for name, field in DistTrainJobStatus.model_fields.items()]
    return tuple(name for name in names if name not in AGENT_FIELDS)


def unchanged_rule(field: str) -> str:
    """CEL: ``status.<field>`` is the same before and after the update (absent in both counts as the same)."""
    new = f"(has(object.status) && has(object.status.{field}))"
    old = f"(has(oldObject.status) && has(oldObject.status.{field}))"
    return f"{new} == {old} && (!{new} || object.status.{field} == oldObject.status.{field})"
