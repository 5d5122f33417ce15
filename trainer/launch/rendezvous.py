"""torchrun rendezvous handler ``disttrain``: stock c10d, plus the operator's target plan.

Worker pods run ``torchrun --rdzv-backend=disttrain`` (:data:`disttrain.api.constants.RDZV_BACKEND`). torchrun finds
this handler through its official plug-in point, the ``torchrun.handlers`` entry-point group (see
``torch/distributed/elastic/rendezvous/registry.py``: each entry point is loaded and *called*, and what it
returns is registered as the handler creator ``(RendezvousParameters) -> RendezvousHandler``); pyproject.toml
registers :func:`handler_creator`.

Everything is torch's own machinery: a :class:`DynamicRendezvousHandler` over a :class:`C10dRendezvousBackend`
(so the store is the job agent's TCPStore with ``is_host=false``, and ``join_timeout``, ``last_call_timeout``,
``close_timeout``, ``keep_alive_*`` and ``read_timeout`` mean exactly what they mean for ``c10d``). These
behaviours change, and only while the job agent has published a :class:`~disttrain.api.control.TargetPlan`
under ``TARGET_KEY`` (without one the handler is plain c10d):

* **The target is the trigger: a round completes as soon as the target node count has joined**, instead of
  waiting out ``last_call_timeout`` after ``min_nodes`` joined. (Stock c10d completes early only at ``max_nodes``.)
* **The target is also the floor: a round never completes with fewer nodes than the target** (clamped to
  [min_nodes, max_nodes]), whatever ``last_call_timeout`` says. Stock c10d completes with any ``min_nodes``
  after the last call, so a late node, or the survivors of a round whose heartbeats expired under CPU starvation,
  could form a group of their own beside the one training (split brain: two groups writing one checkpoint
  directory). The operator alone decides to continue with fewer nodes: it lowers the target itself when a
  replacement does not come within ``replacementWaitSeconds`` (``pendingTimeoutSeconds`` for a new pod).
* **Nodes listed in ``exclude``** (``DISTTRAIN_NODE_NAME`` of scale-down victims) stay out of the round: such a
  node leaves any list it is in and waits outside until it is no longer excluded or ``join_timeout`` passes
  (then torchrun fails as on any rendezvous timeout; the operator is deleting that pod anyway).
* **Nodes listed in ``lost``** (pods the operator declared lost: a dead node's pod lingers Terminating) are dropped
  from the finished round by the survivors re-joining it, as torch's sanitizer does only once their heartbeats
  expired (``keep_alive_interval`` x ``keep_alive_max_attempt``, about 3 s): the next round opens at once. And
  **the survivors of such a reform leave the round together**: the first to leave the round the reform was issued
  for takes every participant out in one write (:meth:`_TargetAwareOpExecutor._exit_with_target`), where stock
  c10d has each node remove itself, then write itself into the wait list, one compare-and-set at a time.
* **A round of more than 32 nodes (rdzv-conf ``per_node_joins_above``) is joined by per-node records**
  (:mod:`disttrain.trainer.launch.joins`): a node that finds the round open takes a slot in one of 32 small
  counters and writes a record of its own, and waits (polling a closed mark of a few bytes); a waiting node, at a
  random moment, reads the records and, once the live ones (beat fresh, not excluded or lost) reach the target,
  writes the complete round into torch's state in one compare-and-set (:meth:`_TargetAwareOpExecutor._join_by_record`).
  Stock, every join is a compare-and-set of the whole state: N nodes wrote N states of size N one at a time, and a
  round of 256 simulated nodes never formed. A node that comes after the round closed waits for the next one in
  torch's wait list, as stock.
* **A node that waits in a join while its own beat runs writes no keep-alive into the state**: the beat keeps it
  alive for torch's sanitizer and the job agent (:meth:`_TargetAwareOpExecutor._keep_alive_or_sync`). Nor, in a
  round of more than 32 nodes, does it after the round (:meth:`_TargetAwareOpExecutor._beat_keeps_alive`), and
  its monitor loop reads the state less often the more nodes it holds (:func:`monitor_read_seconds`).
* **Waiting nodes do not restart a healthy group** (``num_nodes_waiting`` answers 0). Stock torchrun restarts
  the workers the moment a new node waits, which loses every step since the last checkpoint; here the operator
  re-forms the group with a ``drain`` directive (checkpoint at the step boundary, then exit), so a scale-up
  loses no step.

Three changes hold with or without a target. **A node whose write of the state lost the race pauses before it
decides again** (:func:`lost_write_backoff`, full jitter over a span that doubles with each lost write in a row),
then reads the state afresh; torch writes again at once, and with every node of a large round doing so almost no
write landed. **A node that waits in a join re-reads the state every tenth of a
second** (:func:`sync_poll_seconds`), where torch sleeps a whole second before each re-read of a state it caches
for a second: a reform waits on several such reads in a row (the survivors leaving the old round, the last node
joining, the completion being seen), so the stock pacing alone cost 1-2 s of every reform. Only the join reads
fresh: the agent's monitor loop (``num_nodes_waiting``, ten times a second) keeps torch's one-second cache. And
**ranks follow the nodes' stable node indices** (``DISTTRAIN_NODE_INDEX``), not the order in which nodes arrived,
so survivors keep their ranks and a replacement takes the ranks of the node it replaces
(:mod:`disttrain.trainer.launch.rank_order`; the executor re-orders the ranks right after the stock assignment when it
marks a round complete).

Beside torch's heartbeats, **each node beats ten times a second** under a key of its own
(:mod:`disttrain.trainer.launch.beat`), which the job agent's silence rule reads, and **reaches the rendezvous state
over a connection of its own**, apart from the one torchrun's blocking reads use.

The changes are made by wrapping the stock join operation (:class:`_TargetAwareOpExecutor`), not by copying it.
Workers must run with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (the pod builder sets it): with a shared store a
scale-up deadlocks whenever the running node sorts first and keeps rank 0. It reuses its cached store address, so
it never publishes MASTER_ADDR/MASTER_PORT for the new round; the new node waits for them, the old one for the new
node's rank info, and both exit 1 after the 60 s store read timeout (measured with torch 2.13).

This module imports torch and never kopf or the operator.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any, Optional

from torch.distributed import DistStoreError, Store, TCPStore
from torch.distributed.elastic.events import NodeState, get_logging_handler
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    c10d_rendezvous_backend,
)
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dyn
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from disttrain.api import constants, control, env, storeauth
from disttrain.api.spec import DEFAULT_SILENCE_S, beat_interval_seconds
from disttrain.trainer.agent import heartbeats
from disttrain.trainer.launch import joins, rank_order
from disttrain.trainer.launch.beat import NodeBeat
from disttrain.trainer.store import channel, relay
from disttrain.trainer.store.resilient import ResilientStore

log = logging.getLogger("disttrain.rendezvous")

DEFAULT_PORT = 29400
"""The store port when ``--rdzv-endpoint`` names none (``c10d``'s default)."""

SYNC_POLL_S = 0.1
"""How often a node waiting in a join re-reads the rendezvous state in a small job (torch: once a second)."""
SYNC_POLL_NODES = 32
"""Above this many nodes in the state the pause grows with them, so the store serves at most about
``SYNC_POLL_NODES / SYNC_POLL_S`` state reads a second however large the job (never slower than torch's second)."""


def sync_poll_seconds(nodes: int) -> float:
    """The pause between two reads of the rendezvous state by a node that waits, with ``nodes`` in the state."""
    return min(1.0, SYNC_POLL_S * max(1.0, nodes / SYNC_POLL_NODES))


MONITOR_READS_PER_S = 32.0
"""How many reads of the rendezvous state a second, summed over a large job's nodes, torchrun's monitor loops make
while the operator steers (see :meth:`DisttrainRendezvousHandler.num_nodes_waiting`)."""


def monitor_read_seconds(nodes: int) -> float:
    """How long a node's monitor loop serves ``num_nodes_waiting`` from the state it read last, with ``nodes`` in
    it while the operator steers: torch's one second up to :data:`MONITOR_READS_PER_S` nodes, then longer.

    Why: torchrun asks ten times a second and torch re-reads the whole state (a few hundred bytes per node) once a
    second. At 1,024 nodes that is a quarter of a megabyte, a thousand times a second, through the one agent; the
    answer is 0 anyway while a target plan is published."""
    return max(1.0, nodes / MONITOR_READS_PER_S)


LOST_WRITE_BACKOFF_S = 0.05
"""The first pause of a node whose write of the rendezvous state lost the race (see :func:`lost_write_backoff`)."""
LOST_WRITE_BACKOFF_MAX_S = 2.0
"""The longest pause after lost writes in a row, for up to :data:`SYNC_POLL_NODES` nodes; it grows with the nodes."""


def lost_write_backoff(lost_in_a_row: int, nodes: int, draw: Optional[Callable[[], float]] = None) -> float:
    """The pause before a node re-reads the state after its ``lost_in_a_row``-th lost write in a row (``nodes`` in
    the state): full jitter over an exponentially growing span, capped where the span lets about one node in
    :data:`SYNC_POLL_NODES` try at once.

    Why: every write of the state is a compare-and-set of the whole state, and a lost one hands torch the winner's
    state, on which it decides and writes again at once. With every node of a round joining together, each success
    made all the others lose and retry together: a herd of N retries per success, whose read-to-write windows
    (long on a loaded machine) overlap so that almost every write loses (128 simulated nodes: 11,032 of 11,177
    writes lost, no round in 60 s, ``bench/scale_sim.py``). Spread out, the writes mostly land."""
    if lost_in_a_row <= 0 or LOST_WRITE_BACKOFF_S <= 0:
        return 0.0
    cap = LOST_WRITE_BACKOFF_MAX_S * max(1.0, nodes / SYNC_POLL_NODES)
    span = min(cap, LOST_WRITE_BACKOFF_S * 2 ** min(lost_in_a_row - 1, 32))
    return float(span * (draw or random.random)())


def sync_fresh(holder: Any) -> None:
    """Read the shared state now: torch's holder serves a state read in the last second from its cache, which would
    hide the very change a waiting node polls for. Called only from the join (the heartbeat thread is stopped then)."""
    cached = getattr(holder, "_cache_duration", None)
    if cached is None:
        holder.sync()
        return
    holder._cache_duration = 0
    try:
        holder.sync()
    finally:
        holder._cache_duration = cached


def events_recorded() -> bool:
    """Whether torch's rendezvous events go anywhere (by default they go to a ``NullHandler``).

    torch builds each event's name with ``inspect.stack()``, twice, *before* it checks this, and records an event on
    every state write: 5-10 ms of CPU on an idle core, about 0.5 s per write on a loaded 2-core machine (measured).
    Each write is a compare-and-set of the whole state, and that time fell between the node's read and its write: a
    node completing a round lost the race to the other nodes' keep-alives for tens of seconds. So the executor and
    the handler build an event only when it is recorded."""
    return not isinstance(get_logging_handler("dynamic_rendezvous"), logging.NullHandler)


def read_target(store: Store) -> Optional[control.TargetPlan]:
    """The agent's current TargetPlan, or None when none was published (or it cannot be parsed)."""
    return control.read_model(store, control.TARGET_KEY, control.TargetPlan)


NodeBeats = Callable[[frozenset[str]], dict[str, datetime]]
"""Reads the last beat of each named node that beats (a launcher's last beat, as it leaves, is none)."""

STORE_AWAY_RETRY_S = 0.5
"""Pause before a rendezvous operation that failed on the agent's store runs again (see
:meth:`_TargetAwareOpExecutor.run`)."""
BEATS_REREAD_S = 1.0
"""How long a read of the nodes' beats serves the sanitizer of :class:`_ReconnectingStateHolder`, at least: a third
of torch's expiry when that is longer (5 s at a keep-alive of 5 s x 3), so the reads of every node of a large job
stay few while a live node's beat, read at most that long ago, still falls within the expiry."""

STATE_REREAD_S = 2.0
"""How often a node that waits on its join record reads the state whatever the closed mark says (a round the
rendezvous closed, a closer that died between its write and the mark)."""

COMPLETION_GRACE_S = 10.0
"""How long after a node first sees a round complete its sanitizer keeps every participant of that round
(:class:`_ReconnectingStateHolder`)."""


def beating_now(beats: Optional[NodeBeats], nodes: list[Any], expiry: timedelta) -> set[Any]:
    """The ``nodes`` whose own beat is fresh (within torch's ``expiry``); all of them when beats are not read."""
    if beats is None or not nodes:
        return set(nodes)
    expire = datetime.now(timezone.utc) - expiry
    names = {heartbeats.node_name(node): node for node in nodes}
    try:
        last = beats(frozenset(names))  # read in batches (trainer/store/batchread.py)
    except Exception as exc:  # noqa: BLE001 - the beats only rule nodes out; without them torch's expiry decides
        log.debug("the nodes' beats could not be read: %s", exc)
        return set(nodes)
    return {names[name] for name, at in last.items() if name in names and at >= expire}


class _TargetAwareOpExecutor(dyn._DistributedRendezvousOpExecutor):
    """The stock executor, with the join operation wrapped by :meth:`_join_with_target` and ranks assigned by
    node index (:meth:`_mark_rendezvous_complete`)."""

    def __init__(
        self,
        node: Any,
        state_holder: Any,
        settings: dyn.RendezvousSettings,
        target: Callable[[], Optional[control.TargetPlan]],
        node_name: str,
        store: Store,
        node_index: Optional[int],
        pod_uid: str = "",
    ) -> None:
        super().__init__(node, state_holder, settings)
        self._pod_uid = pod_uid
        self.beating: Callable[[], bool] = lambda: False
        """Whether this node's own beat (:mod:`disttrain.trainer.launch.beat`) is being written (set by the
        handler, which owns the beat)."""
        self._target = target
        self._node_name = node_name
        self._store = store
        self._node_index = node_index
        self._floor_logged_round = -1
        self._names: dict[Any, str] = {}  # participant -> DISTTRAIN_NODE_NAME, from its identity key
        self._indices: dict[Any, int] = {}  # participant -> DISTTRAIN_NODE_INDEX, from its published index key
        self.beats: Optional[NodeBeats] = None
        self.per_node_joins_above = joins.PER_NODE_JOINS_ABOVE
        """Rounds of more nodes than this join by records (rdzv-conf ``per_node_joins_above``)."""
        """The nodes' own beats (set by :func:`create_handler`): a node whose beat is silent is not taken into a round
        it joined by record (:mod:`disttrain.trainer.launch.joins`)."""
        self._record_round: Optional[int] = None
        """The round this node wrote its join record for, and the store generation it wrote it in."""
        self._record_generation = 0
        self._record_wanted = 0
        self._close_try_at = 0.0
        self._closing: Optional[list[Any]] = None
        """The participants this node is about to write complete (:meth:`_mark_rendezvous_complete`)."""
        self._closed_round: Optional[int] = None
        """The round this node wrote complete, to be marked closed (:func:`joins.mark_closed`) once it sees it so."""

    def run(
        self,
        state_handler: Callable[[dyn._RendezvousContext, float], dyn._Action],
        deadline: float,
        update_deadline: Optional[Callable[[timedelta], float]] = None,
    ) -> None:
        """The stock operation, retried while the agent's store is away, until the operation's own deadline: the
        operator recreates a lost agent behind the same address within seconds, and a node whose workers wait for
        the next round in place must still be there to take it. Every operation is a loop of re-reads and
        compare-and-sets of the shared state, so running it again is safe."""
        joining = isinstance(state_handler, dyn._RendezvousJoinOp)
        if isinstance(state_handler, dyn._RendezvousJoinOp):
            join = state_handler

            def state_handler(ctx: dyn._RendezvousContext, deadline: float) -> dyn._Action:
                return self._join_polling(join, ctx, deadline)

        elif isinstance(state_handler, dyn._RendezvousExitOp):
            leave = state_handler

            def state_handler(ctx: dyn._RendezvousContext, deadline: float) -> dyn._Action:
                return self._exit_with_target(leave, ctx, deadline)

        elif isinstance(state_handler, dyn._RendezvousKeepAliveOp) and self._beat_keeps_alive():
            return

        while True:
            try:
                if joining:  # before this node can appear among the participants, so whoever completes reads it
                    self.publish_identity()
                super().run(state_handler, deadline, update_deadline)
                return
            except (RendezvousConnectionError, DistStoreError) as exc:
                if time.monotonic() + STORE_AWAY_RETRY_S > deadline:
                    raise
                log.warning(
                    "rendezvous %s: the agent's store is away (%s); trying again in %.1f s",
                    self._settings.run_id,
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                    STORE_AWAY_RETRY_S,
                )
                time.sleep(STORE_AWAY_RETRY_S)

    def _record(self, message: str, node_state: NodeState = NodeState.RUNNING) -> None:
        if events_recorded():
            super()._record(message, node_state)

    def _beat_keeps_alive(self) -> bool:
        """Whether torch's keep-alive timer, after a round, writes nothing: in a round of more than
        :attr:`per_node_joins_above` nodes while this node's beat runs, which keeps it alive instead. Each keep-alive
        is a compare-and-set of the whole state: 256 simulated nodes lost 622 of 649, their reads slowed to 0.25 s."""
        return self.beating() and len(self._state_holder.state.participants) > self.per_node_joins_above

    def publish_identity(self) -> None:
        """This node's index (for the ranks) and pod (for the job agent's silence report,
        :mod:`disttrain.trainer.agent.heartbeats`)."""
        rank_order.publish_index(self._store, self._settings.run_id, self._node, self._node_index)
        if self._node_name:
            identity = heartbeats.NodeIdentity(self._node_name, self._pod_uid)
            self._store.set(heartbeats.identity_key(self._settings.run_id, self._node), identity.to_json())

    def _join_polling(self, join: dyn._RendezvousJoinOp, ctx: dyn._RendezvousContext, deadline: float) -> dyn._Action:
        """The join, re-read every :func:`sync_poll_seconds` while it only waits (``SYNC``) instead of the stock
        executor's one-second sleep (see :meth:`_await_news` for a node waiting on its join record); any other
        action (a heartbeat, joining, completing, a timeout) goes back to the stock loop, which applies it to
        ``self._state``, the state read last."""
        self._mark_closed(ctx.state)
        action = self._join_with_target(join, ctx, deadline)
        while action is dyn._Action.SYNC:
            self._await_news(ctx.state, deadline)
            sync_fresh(self._state_holder)
            self._state = self._state_holder.state
            ctx = dyn._RendezvousContext(self._node, self._state, self._settings)
            self._mark_closed(ctx.state)
            action = self._join_with_target(join, ctx, deadline)
        return action

    def _mark_closed(self, state: Any) -> None:
        """Once the round this node wrote complete is seen so, the mark that the nodes waiting on records poll."""
        if state.complete and self._closed_round == state.round:
            self._closed_round = None
            joins.mark_closed(self._store, self._settings.run_id, state.round)

    def _await_news(self, state: Any, deadline: float) -> None:
        """One pause of :func:`sync_poll_seconds`; for a node that waits on its join record in the open round,
        until the round is marked closed (a key of a few bytes, polled at that pacing), its turn to try closing
        the round comes, :data:`STATE_REREAD_S` passed, or the deadline: the state is read only then."""
        if state.complete or self._record_round != state.round:
            time.sleep(sync_poll_seconds(len(state.participants) + len(state.wait_list) + len(state.redundancy_list)))
            return
        pause = sync_poll_seconds(self._record_wanted)
        until = min(time.monotonic() + STATE_REREAD_S, self._close_try_at, deadline)
        while True:
            left = until - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(pause, left))
            if joins.is_closed(self._store, self._settings.run_id, state.round):
                return

    def _join_with_target(
        self, join: dyn._RendezvousJoinOp, ctx: dyn._RendezvousContext, deadline: float
    ) -> dyn._Action:
        state = ctx.state
        if state.closed:
            return join(ctx, deadline)
        target = self._target()
        if target is None:
            return join(ctx, deadline)
        if state.complete and (target.lost or target.exclude) and self._drop_lost(ctx, target):
            return dyn._Action.KEEP_ALIVE  # marks the state dirty: the next sync writes it (or rereads it)
        if self._node_name and self._node_name in target.exclude:
            if ctx.node in state.participants and not state.complete:
                return dyn._Action.REMOVE_FROM_PARTICIPANTS
            if ctx.node in state.wait_list:
                return dyn._Action.REMOVE_FROM_WAIT_LIST
            if ctx.node in state.redundancy_list:
                return dyn._Action.REMOVE_FROM_REDUNDANCY_LIST
            if ctx.node not in state.participants:
                if time.monotonic() > deadline:
                    return dyn._Action.ERROR_TIMEOUT
                return dyn._Action.SYNC  # wait outside the rendezvous; polled about once a second
        wanted = min(max(target.nodes, ctx.settings.min_nodes), ctx.settings.max_nodes)
        if not state.complete and ctx.node not in state.participants and wanted > self.per_node_joins_above:
            return self._join_by_record(ctx, target, wanted, deadline)
        if not state.complete and ctx.node in state.participants and len(state.participants) >= wanted:
            log.info(
                "rendezvous %s round %d: %d of target %d nodes joined (target generation %d); completing",
                ctx.settings.run_id,
                state.round,
                len(state.participants),
                target.nodes,
                target.generation,
            )
            return dyn._Action.MARK_RENDEZVOUS_COMPLETE
        action = join(ctx, deadline)
        if action is dyn._Action.MARK_RENDEZVOUS_COMPLETE and len(state.participants) < wanted:
            # The last call ran out below the target: keep waiting (join_timeout still bounds the wait, and the
            # operator lowers the target when the missing nodes do not come).
            if self._floor_logged_round != state.round:
                self._floor_logged_round = state.round
                log.info(
                    "rendezvous %s round %d: %d node(s) joined, below the target of %d (generation %d); not completing",
                    ctx.settings.run_id,
                    state.round,
                    len(state.participants),
                    target.nodes,
                    target.generation,
                )
            return self._keep_alive_or_sync(ctx)
        if action is dyn._Action.KEEP_ALIVE:
            return self._keep_alive_or_sync(ctx)
        return action

    def _join_by_record(
        self, ctx: dyn._RendezvousContext, target: control.TargetPlan, wanted: int, deadline: float
    ) -> dyn._Action:
        """Joining an open round of ``wanted`` nodes by a record of this node's own (:mod:`joins`): written once per
        round (again after the agent's store came back empty), then ``SYNC`` until the round completes, except
        when this node's turn to try closing it comes and enough live nodes have joined: then the completion, in
        one write of the state (:meth:`_mark_rendezvous_complete` adds the participants)."""
        state = ctx.state
        now = time.monotonic()
        if now > deadline:
            if ctx.node in state.wait_list and now <= deadline + 5:  # torch's rollback period
                return dyn._Action.REMOVE_FROM_WAIT_LIST
            return dyn._Action.ERROR_TIMEOUT
        self._record_wanted = wanted
        generation = self._store_generation()
        if self._record_round != state.round or self._record_generation != generation:
            node = ctx.node
            record = joins.JoinRecord(
                state.round, node.addr, node.pid, node.local_id, self._node_name, self._node_index
            )
            bucket = joins.bucket_of(record)
            slot = joins.take_slot(self._store, self._settings.run_id, bucket, record)
            joins.write_record(self._store, self._settings.run_id, bucket, slot, record)
            self._record_round, self._record_generation = state.round, generation
            self._close_try_at = now + random.random() * joins.close_try_period(wanted)
            return dyn._Action.SYNC
        if now < self._close_try_at:
            return dyn._Action.SYNC
        self._close_try_at = now + joins.close_try_period(wanted)
        chosen = self._participants_to_close(state, target, wanted)
        if chosen is None:
            return dyn._Action.SYNC
        self._closing = chosen
        log.info(
            "rendezvous %s round %d: %d of target %d nodes joined by record (target generation %d); completing",
            ctx.settings.run_id,
            state.round,
            len(chosen),
            target.nodes,
            target.generation,
        )
        return dyn._Action.MARK_RENDEZVOUS_COMPLETE

    def _store_generation(self) -> int:
        generation = getattr(self._state_holder, "_generation", None)
        return int(generation()) if callable(generation) else 0

    def _participants_to_close(self, state: Any, target: control.TargetPlan, wanted: int) -> Optional[list[Any]]:
        """The participants of the open round if it can close now on ``wanted`` nodes (:func:`joins.choose`)."""
        run_id = self._settings.run_id
        counters = joins.read_counters(self._store, run_id)
        if joins.joined_count(counters, state.round) + len(state.participants) < wanted:
            return None  # too few yet, seen in 32 small values: the records are read once they can close the round
        if not joins.claim_closing(self._store, run_id, state.round, str(self._node)):
            return None  # another node is trying
        chosen = self._choose(state, target, wanted, joins.read_records(self._store, run_id, state.round, counters))
        if chosen is None:
            joins.release_closing(self._store, run_id, str(self._node))
        elif joins.is_closed(self._store, run_id, state.round):
            return None  # another node closed it while these reads took their time: a write now would only lose
        return chosen

    def _choose(
        self, state: Any, target: control.TargetPlan, wanted: int, records: dict[str, joins.JoinRecord]
    ) -> Optional[list[Any]]:
        joined: dict[Any, joins.JoinRecord] = {}
        for record in records.values():
            node = dyn._NodeDesc(record.addr, record.pid, record.local_id)
            joined[node] = record
            if record.name:
                self._names[node] = record.name
            if record.index is not None:
                self._indices[node] = record.index
        if len(joined) + len(state.participants) < wanted:
            return None
        expiry = self._settings.keep_alive_interval * self._settings.keep_alive_max_attempt
        alive = beating_now(self.beats, [node for node in joined if node not in state.participants], expiry)
        alive.add(self._node)
        refused = {*target.exclude, *target.lost}
        return joins.choose(list(state.participants), joined, wanted, refused, alive.__contains__)

    def _drop_lost(self, ctx: dyn._RendezvousContext, target: control.TargetPlan) -> bool:
        """Drop the participants of the finished round that the operator declared lost or excluded, as torch's own
        sanitizer does once their heartbeats expire (keep_alive_interval x keep_alive_max_attempt later): with no
        participant left the next round opens. Whether any was dropped (the state is then to be written)."""
        state = ctx.state
        gone = self._lost_participants(state, target, ctx.node)
        if not gone:
            return False
        for node in gone:
            del state.participants[node]
            state.last_heartbeats.pop(node, None)
        dyn._remove_participant_epilogue(state, ctx.settings)
        log.info(
            "rendezvous %s round %d: dropping %s, declared lost or excluded by the operator",
            ctx.settings.run_id,
            state.round,
            ", ".join(self._names[node] for node in gone),
        )
        return True

    def _keep_alive_or_sync(self, ctx: dyn._RendezvousContext) -> dyn._Action:
        """A keep-alive of a node that waits in a join, written into the shared state only when this node's own beat
        is not being written: each is a compare-and-set of the whole state, and a reform of 128 simulated nodes
        spent about 400 of its 540 landed writes on them. torch's sanitizer (:meth:`_ReconnectingStateHolder.
        _alive_by_beat`) and the job agent count the beat instead (after the round: :meth:`_beat_keeps_alive`)."""
        if not dyn._should_keep_alive(ctx):
            return dyn._Action.SYNC
        return dyn._Action.SYNC if self.beating() else dyn._Action.KEEP_ALIVE

    def _exit_with_target(
        self, leave: dyn._RendezvousExitOp, ctx: dyn._RendezvousContext, deadline: float
    ) -> dyn._Action:
        """The stock exit, except in a reform: the first survivor to leave the round the operator's reform was issued
        for (a target naming lost nodes, for that complete round) takes every participant out of it in one write,
        which opens the next round; the others then find themselves out of it and write nothing.

        Why: stock, each survivor removes itself (one compare-and-set of the whole state each), the round opens only
        once the last one did, and a survivor that left meanwhile writes itself into the wait list before it can
        join: three writes per node, one at a time. 128 simulated nodes needed a minute for them. Every survivor of
        a reform re-joins (the directive, or the failed collective, ends its round), so nobody is taken out of a
        group that goes on; a directive of an earlier round no longer matches the state's round."""
        action = leave(ctx, deadline)
        if action is not dyn._Action.REMOVE_FROM_PARTICIPANTS:
            return action
        state = ctx.state
        target = self._target()
        if target is None or not target.lost or not state.complete or state.round != target.round:
            return action
        leaving = list(state.participants)
        for node in leaving:
            del state.participants[node]
            state.last_heartbeats.pop(node, None)
        dyn._remove_participant_epilogue(state, ctx.settings)  # no participant left: the next round opens
        log.info(
            "rendezvous %s round %d: reform (target generation %d): the %d participants leave it together",
            ctx.settings.run_id,
            target.round,
            target.generation,
            len(leaving),
        )
        return dyn._Action.KEEP_ALIVE  # marks the state dirty: the next sync writes it (or rereads it)

    def _lost_participants(self, state: Any, target: control.TargetPlan, me: Any) -> list[Any]:
        """Participants of the finished round whose pod the operator declared lost or excluded (a scale-down victim
        that died, or was picked as the victim of a scale-down issued with the loss): neither comes back to it.

        Lost pods count only in the round the loss was declared for (the target's round, or any while it names
        none): every survivor checks each round it sees complete, and in a later round the check would read every
        participant's identity, on every node at once."""
        lost = {*target.exclude}
        if target.round == control.NO_ROUND or target.round == state.round:
            lost.update(target.lost)  # a loss is declared for its round: a later round was formed without the node
        if not lost:
            return []
        unknown = [node for node in state.participants if node not in self._names]  # read together, not one by one
        found = heartbeats.read_identities(self._store, self._settings.run_id, [str(node) for node in unknown])
        for node in unknown:
            if (identity := found[str(node)]) is not None:
                self._names[node] = identity.name
        return [node for node in state.participants if node != me and self._names.get(node, "") in lost]

    def _indices_of(self, nodes: list[Any]) -> dict[Any, Optional[int]]:
        """Each node's published index, read once per node: the completion is retried whenever another node's
        write (a keep-alive) lands between this node's read of the state and its compare-and-set, and store reads
        inside that window, slow on a loaded machine, made it lose every time (a round retried for minutes)."""
        missing = [node for node in nodes if node not in self._indices]
        for node, index in rank_order.read_indices(self._store, self._settings.run_id, missing).items():
            if index is not None:  # a node publishes its index before it joins; misses are not cached
                self._indices[node] = index
        return {node: self._indices.get(node) for node in nodes}

    def _mark_rendezvous_complete(self) -> None:
        """The stock completion (ranks by node descriptor), then the ranks re-assigned by node index. A node closing
        a round joined by records (:meth:`_join_by_record`) first puts the chosen nodes in, with a heartbeat of now,
        out of the wait and redundancy lists, as torch's own join would have."""
        closing, self._closing = self._closing, None
        if closing is not None:
            now = datetime.now(timezone.utc)
            for node in closing:
                self._state.participants.setdefault(node, 0)
                self._state.last_heartbeats[node] = now
                self._state.wait_list.discard(node)
                self._state.redundancy_list.discard(node)
            self._closed_round = self._state.round
        super()._mark_rendezvous_complete()
        state = self._state
        indices = self._indices_of(list(state.participants))
        ordered = rank_order.rank_order(list(state.participants), indices)
        for rank, node in enumerate(ordered):
            state.participants[node] = rank
        log.info(
            "rendezvous %s round %d complete: group ranks by node index: %s",
            self._settings.run_id,
            state.round,
            ", ".join(f"{rank}=index {indices[node]} ({node!r})" for rank, node in enumerate(ordered)),
        )


class _ReconnectingStateHolder(dyn._BackendRendezvousStateHolder):
    """torch's state holder, for a store that may be lost and recreated empty behind the same address.

    After a reconnection the state in the new store is the one the first survivor put back (the signed store writes
    back the last valid state it saw), with every heartbeat as old as the outage. torch's sanitizer, which runs after
    each read, would drop every participant whose heartbeat is older than ``keep_alive_interval x
    keep_alive_max_attempt`` by this node's clock, and a dropped node never heartbeats again: the agent would report
    the whole running group silent. So for one expiry after this node saw a reconnection
    (:attr:`ResilientStore.generation` moved), every state it reads has its heartbeats raised to at least the time it
    saw it, and a state so changed is written back. Each read, not only the first: the survivors reconnect one by
    one, and a survivor's write that lost the race puts old heartbeats back (seen in CI: a node dropped itself). A
    node that really died meanwhile is found one expiry after that floor, by its silence in the new store.

    Also, for :data:`COMPLETION_GRACE_S` after this node first saw a round complete, its sanitizer drops no
    participant of that round (:meth:`_sanitize_holding_completion`): a participant learns that its round completed
    only at its next read of the state, and until then it neither heartbeats as a member nor, as rank 0, publishes the
    round's ``MASTER_ADDR``. Dropped by another node's write before it read (a starved launcher, a new pod's first
    seconds), it waited for the next round while the others waited out the store's read timeout for the address it
    was to publish, and every node exited 1. The hold is local: the shared state keeps every heartbeat as written,
    so the job agent's silence rule is unchanged, and a participant that dies in the window is still dropped at once
    when the operator declares its pod lost."""

    def __init__(
        self,
        backend: Any,
        settings: dyn.RendezvousSettings,
        generation: Callable[[], int],
        beats: Optional[NodeBeats] = None,
    ) -> None:
        super().__init__(backend, settings)
        self._generation = generation
        self._seen_generation = generation()
        self._floor: Optional[datetime] = None
        self._floor_until = 0.0
        self._completion_seen: Optional[tuple[int, float]] = None
        """(round, monotonic time) this node first saw the latest complete round."""
        self._lost_in_a_row = 0
        """This node's writes of the state lost in a row (:func:`lost_write_backoff`)."""
        self._beats = beats
        self._beats_read: tuple[float, frozenset[str], dict[str, datetime]] = (float("-inf"), frozenset(), {})
        """(monotonic time, the nodes asked, their beats then) of the last read of the nodes' own beats."""

    def sync(self) -> Optional[bool]:
        """torch's sync; after a lost write, a pause (:func:`lost_write_backoff`) and a fresh read, so the caller
        decides its next write on the state as it is after the pause, not as the write found it."""
        has_set = super().sync()
        if has_set is None:
            return None
        if has_set:
            self._lost_in_a_row = 0
            return True
        self._lost_in_a_row += 1
        state = self._state
        pause = lost_write_backoff(
            self._lost_in_a_row, len(state.participants) + len(state.wait_list) + len(state.redundancy_list)
        )
        if pause > 0:
            time.sleep(pause)
            sync_fresh(self)
        return False

    def _sanitize(self) -> None:
        generation = self._generation()
        if generation != self._seen_generation:
            self._seen_generation = generation
            self._floor = datetime.now(timezone.utc)
            expiry = self._settings.keep_alive_interval * self._settings.keep_alive_max_attempt
            self._floor_until = time.monotonic() + expiry.total_seconds()
            log.info(
                "rendezvous %s round %d: the agent's store came back; heartbeats held up for %.0f s",
                self._settings.run_id,
                self._state.round,
                expiry.total_seconds(),
            )
        floor = self._floor
        if floor is not None and time.monotonic() < self._floor_until:
            beats = self._state.last_heartbeats
            raised = [node for node, beat in beats.items() if beat < floor]
            for node in raised:
                beats[node] = floor
            if raised:
                # Written by the next sync (at once: torchrun's monitor loop syncs ten times a second), so the other
                # nodes read it too.
                self.mark_dirty()
        self._sanitize_holding_completion()

    def _sanitize_holding_completion(self) -> None:
        """torch's sanitizer, with some nodes counted alive whatever their heartbeat in the state says: the
        participants of a round completed less than :data:`COMPLETION_GRACE_S` ago (by this node's first sight of
        it), and every node whose own beat is fresh (:meth:`_alive_by_beat`). Their heartbeats are read as now, then
        put back as they were, so nothing is written for it."""
        state = self._state
        if not state.complete:
            self._completion_seen = None
        elif self._completion_seen is None or self._completion_seen[0] != state.round:
            self._completion_seen = (state.round, time.monotonic())
        recent = self._completion_seen is not None and time.monotonic() - self._completion_seen[1] < COMPLETION_GRACE_S
        alive = set(state.participants) if recent else set()
        alive |= self._alive_by_beat(state)
        beats = state.last_heartbeats
        held = {node: beats[node] for node in alive if node in beats}
        now = datetime.now(timezone.utc)
        for node in held:
            beats[node] = now
        try:
            super()._sanitize()
        finally:
            for node, beat in held.items():
                beats[node] = beat

    def _alive_by_beat(self, state: Any) -> set[Any]:
        """The nodes whose heartbeat in the state expired while their launcher still beats under its own key (ten
        times a second, :mod:`disttrain.trainer.launch.beat`). Every heartbeat is a compare-and-set of the one
        shared state; with many nodes they collide and time out, and torch's sanitizer dropped live nodes by the
        dozen (64 and 128 simulated nodes, ``bench/scale_sim.py``). A node's own key has no such contention. Read
        only when a heartbeat expired, at most every :data:`BEATS_REREAD_S`."""
        if self._beats is None:
            return set()
        expire = datetime.now(timezone.utc) - self._settings.keep_alive_interval * self._settings.keep_alive_max_attempt
        expired = {node: heartbeats.node_name(node) for node, beat in state.last_heartbeats.items() if beat < expire}
        if not expired:
            return set()
        read_at, asked, last = self._beats_read
        names = frozenset(expired.values())
        expiry = self._settings.keep_alive_interval * self._settings.keep_alive_max_attempt
        if time.monotonic() - read_at >= max(BEATS_REREAD_S, expiry.total_seconds() / 3) or not names <= asked:
            try:
                last = self._beats(names)
            except Exception as exc:  # noqa: BLE001 - the beats only spare nodes; without them torch's expiry decides
                log.debug("rendezvous %s: the nodes' beats could not be read: %s", self._settings.run_id, exc)
                last = {}
            self._beats_read = (time.monotonic(), names, last)
        return {node for node, name in expired.items() if name in last and last[name] >= expire}


class DisttrainRendezvousHandler(dyn.DynamicRendezvousHandler):
    """A :class:`DynamicRendezvousHandler` that follows the operator's target plan (see the module docstring)."""

    def __init__(
        self, node: Any, settings: dyn.RendezvousSettings, backend_name: str, store: Store, state_holder: Any
    ) -> None:
        super().__init__(node, settings, backend_name, store, state_holder)
        self._target_store = store
        self._newest_target: Optional[control.TargetPlan] = None
        self._replayed_target: Optional[int] = None
        self.beat: Optional[NodeBeat] = None
        """This node's liveness beat to the job agent (:mod:`disttrain.trainer.launch.beat`), from creation to
        :meth:`shutdown`."""
        self._leave_open = False
        self._store_away = False
        self._monitor_read_at = float("-inf")
        self._op_executor = _TargetAwareOpExecutor(
            node,
            state_holder,
            settings,
            self.target,
            os.environ.get(env.NODE_NAME, ""),
            store,
            rank_order.node_index_from_env(os.environ),
            os.environ.get(env.POD_UID, ""),
        )
        self._op_executor.beating = lambda: self.beat is not None and self.beat.beating

    def _record(self, message: str, node_state: NodeState = NodeState.RUNNING, rank: Optional[int] = None) -> None:
        if events_recorded():
            super()._record(message, node_state, rank)

    def target(self) -> Optional[control.TargetPlan]:
        """The agent's target plan; never one older than the newest this node read (a replay of an older plan is
        logged and the newer one kept), so a round never completes on an old node count or exclude list."""
        plan = read_target(self._target_store)
        newest = self._newest_target
        if plan is None or newest is None or plan.job_uid != newest.job_uid or plan.generation >= newest.generation:
            self._newest_target = plan or newest
            return plan
        if self._replayed_target != plan.generation:
            self._replayed_target = plan.generation
            log.warning(
                "rendezvous %s: target plan generation %d is older than the %d read before: kept the newer",
                self._settings.run_id,
                plan.generation,
                newest.generation,
            )
        return newest

    def next_rendezvous(self) -> RendezvousInfo:
        """torch's, then the round joined in ``$DISTTRAIN_RENDEZVOUS_ROUND``, which torchrun passes to the workers it
        starts (and the launcher hands to those that take the round in place): a directive issued for an earlier
        round is not theirs (:func:`disttrain.api.control.judge_directive`)."""
        info = super().next_rendezvous()
        os.environ[env.RENDEZVOUS_ROUND] = str(self._state_holder.state.round)
        return info

    def get_backend(self) -> str:
        return constants.RDZV_BACKEND  # torchrun checks that the handler reports the backend it asked for

    def leave_open(self) -> None:
        """Make :meth:`shutdown` leave the rendezvous open: this node ends with a failure of its own (the launcher
        ends the pod so that the operator counts it) and the job goes on with a replacement, which must be able to
        join. Stock torchrun closes the rendezvous when an agent fails, which ends every other node too."""
        self._leave_open = True

    def shutdown(self) -> bool:
        """Stop heartbeating; close the rendezvous only when this node finished training (see :meth:`leave_open`)."""
        if self.beat is not None:
            self.beat.leave()
        if self._leave_open:
            self._stop_heartbeats()
            return True
        return super().shutdown()

    def num_nodes_waiting(self) -> int:
        """0 while the operator steers (it re-forms the group by a drain at a checkpoint); else c10d's count.

        Also 0 while the agent's store is away: torchrun's monitor loop asks this ten times a second, and torch
        would end the node on the first failed read; the group trains on without the store and the client
        reconnects to the agent's replacement (:mod:`disttrain.trainer.store.resilient`).

        While a target plan is known the state is read at most every :func:`monitor_read_seconds` (one second up to
        32 nodes): the answer is 0 then, and the read only keeps the cached state from growing stale."""
        if self._newest_target is not None:
            nodes = len(self._state_holder.state.participants)
            if time.monotonic() - self._monitor_read_at < monitor_read_seconds(nodes):
                return 0
            self._monitor_read_at = time.monotonic()
        try:
            waiting = super().num_nodes_waiting()
            if waiting and self.target() is not None:
                return 0
        except (dyn.RendezvousError, DistStoreError) as exc:
            if not self._store_away:
                log.warning(
                    "rendezvous %s: the agent's store is away (%s); training goes on", self._settings.run_id, exc
                )
            self._store_away = True
            return 0
        self._store_away = False
        return waiting

    def join_by_records(self, above: int, beats: NodeBeats) -> None:
        """Rounds of more than ``above`` nodes join by records (:mod:`disttrain.trainer.launch.joins`); ``beats``
        reads the nodes' beats for the node that closes such a round."""
        executor = self._op_executor
        if isinstance(executor, _TargetAwareOpExecutor):
            executor.per_node_joins_above = above
            executor.beats = beats

    def republish_identity(self) -> None:
        """After the store came back empty: this node's index and pod, which the agent's silence report and the next
        round's ranks read (written once per join otherwise)."""
        executor = self._op_executor
        if isinstance(executor, _TargetAwareOpExecutor):
            executor.publish_identity()


def connect_store(params: RendezvousParameters) -> Store:
    """The raw client of the agent's store, built from the parameters ``c10d`` reads (``store_type``,
    ``read_timeout``, ``is_host``), without torch's ``create_backend``: that also builds a backend over the *raw*
    client, whose constructor writes an unsigned ``torch.rendezvous.<run id>`` placeholder outside the job's key
    namespace on every node. The agent hosts the store, so a node hosts it only when told
    ``is_host=true``; torch's hostname guess is not made."""
    store_type = params.get("store_type", "tcp").strip().lower()
    if store_type != "tcp":
        raise ValueError(f"rdzv-conf store_type is {store_type!r}; the disttrain handler supports only 'tcp'")
    read_timeout = params.get_as_int("read_timeout", 60)
    if read_timeout is None or read_timeout <= 0:
        raise ValueError(f"rdzv-conf read_timeout is {read_timeout!r}; it must be a positive number of seconds")
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
    if params.get_as_bool("is_host") is True:
        return TCPStore(host, port, is_master=True, multi_tenant=True, timeout=timedelta(seconds=read_timeout))

    def client(timeout: timedelta) -> TCPStore:
        near_host, near_port = relay.route(host, port, storeauth.secret_from_env() or "")  # via the agent's front
        return TCPStore(near_host, near_port, is_master=False, multi_tenant=True, timeout=timeout)

    return ResilientStore(
        client, timedelta(seconds=read_timeout), name=f"agent store {host}:{port}", address=(host, port)
    )


def keep_alive_interval(params: RendezvousParameters) -> float:
    """``keep_alive_interval`` in seconds, fractions allowed (torch's ``c10d`` reads whole seconds only). Each
    heartbeat is a compare-and-set of the whole state, so the spec keeps it at seconds; the job agent's fast
    silence rule reads the launchers' beats instead (:mod:`disttrain.trainer.launch.beat`)."""
    raw = params.get("keep_alive_interval", 5)
    try:
        seconds = float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"rdzv-conf keep_alive_interval is {raw!r}; it must be a number of seconds") from None
    if not 0.01 <= seconds <= 3_600:
        raise ValueError(f"rdzv-conf keep_alive_interval is {raw!r}; it must be within [0.01, 3600] seconds")
    return seconds


def beat_interval(params: RendezvousParameters) -> float:
    """The node beat's period (:func:`disttrain.api.spec.beat_interval_seconds`) for the job's largest size and
    rdzv-conf ``silent_after`` (``spec.rendezvous.silentAfterSeconds``; default 1 s)."""
    raw = params.get("silent_after", DEFAULT_SILENCE_S)
    try:
        silence = float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"rdzv-conf silent_after is {raw!r}; it must be a number of seconds") from None
    if not 0 < silence <= 3600:
        raise ValueError(f"rdzv-conf silent_after is {raw!r}; it must be within (0, 3600] seconds")
    return beat_interval_seconds(params.max_nodes, silence)


def per_node_joins_above(params: RendezvousParameters) -> int:
    """rdzv-conf ``per_node_joins_above``: rounds of more nodes join by records (default
    :data:`joins.PER_NODE_JOINS_ABOVE`; 0: every round with a target)."""
    raw = params.get("per_node_joins_above", joins.PER_NODE_JOINS_ABOVE)
    try:
        above = int(raw)
    except (TypeError, ValueError):
        raise ValueError(f"rdzv-conf per_node_joins_above is {raw!r}; it must be a whole number of nodes") from None
    if above < 0:
        raise ValueError(f"rdzv-conf per_node_joins_above is {raw!r}; it must be 0 or more")
    return above


SUMMARY_FRESH_S = 2.0
"""How old the agent's beat summary may be for a node to use it instead of the beats themselves."""


def beats_reader(store: Store, run_id: str) -> NodeBeats:
    """:data:`NodeBeats` over the nodes' beat keys in ``store`` (one batched read for all the nodes asked). For more
    than ``heartbeats.SUMMARY_ABOVE_NODES`` nodes, the agent's ``heartbeats.BeatSummary`` answers for those it
    holds, when it is fresh (:data:`SUMMARY_FRESH_S`): one value instead of a signed value per node, for every node
    of a large round at once."""

    def read(nodes: frozenset[str]) -> dict[str, datetime]:
        found: dict[str, datetime] = {}
        asked = nodes
        if len(nodes) > heartbeats.SUMMARY_ABOVE_NODES:
            summary = heartbeats.read_beat_summary(store, run_id)
            if summary is not None and abs(time.time() - summary.time) <= SUMMARY_FRESH_S:
                held = {node: at for node, at in summary.beats.items() if node in nodes}
                found = {node: datetime.fromtimestamp(at, timezone.utc) for node, at in held.items()}
                asked = nodes.difference(held)
        if asked:
            beats = heartbeats.read_beats(store, run_id, asked)
            found.update({node: at for node, at in beats.times.items() if node not in beats.leaving})
        return found

    return read


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Build the handler from torchrun's parameters, exactly as ``c10d`` reads them, over the agent's store seen
    through the signed store (:mod:`disttrain.trainer.store.channel`): torch's own keys under it (the rendezvous
    state it
    unpickles, the per-round MASTER_ADDR/MASTER_PORT, rank-info and barrier keys) are sealed when written and
    verified before torch sees a byte, like the control keys; a forged or garbled value is absent to torch."""
    raw = connect_store(params)
    store = channel.scoped(raw)
    # The rendezvous state (joins and heartbeats) has a connection of its own: torchrun makes blocking reads on the
    # handler's store (the rank assignment waits for the other nodes' keys; the exit barrier), and one client runs
    # one call at a time, so on a shared connection a slow peer would hold this node's heartbeats up with it and
    # the job agent would report a live node silent.

    def another_connection() -> Store:
        return raw if params.get_as_bool("is_host") is True else connect_store(params)  # a host has one server

    raw_state = another_connection()
    state_store = channel.scoped(raw_state)
    backend = c10d_rendezvous_backend.C10dRendezvousBackend(state_store, params.run_id)

    def seconds(key: str) -> Optional[timedelta]:
        value = params.get_as_int(f"{key}_timeout")
        return None if value is None else timedelta(seconds=value)

    timeout = dyn.RendezvousTimeout(seconds("join"), seconds("last_call"), seconds("close"), seconds("heartbeat"))
    # As DynamicRendezvousHandler.from_backend, with a state holder that survives the store's loss.
    settings = dyn.RendezvousSettings(
        params.run_id,
        params.min_nodes,
        params.max_nodes,
        timeout,
        keep_alive_interval=timedelta(seconds=keep_alive_interval(params)),
        keep_alive_max_attempt=int(params.get_as_int("keep_alive_max_attempt", 3) or 3),
    )
    generation = (lambda: raw_state.generation) if isinstance(raw_state, ResilientStore) else (lambda: 0)

    holder = _ReconnectingStateHolder(backend, settings, generation, beats_reader(state_store, params.run_id))
    node = DisttrainRendezvousHandler._node_desc_generator.generate(params.local_addr)
    handler = DisttrainRendezvousHandler(node, settings, backend.name, store, holder)
    handler.join_by_records(per_node_joins_above(params), beats_reader(state_store, params.run_id))
    if isinstance(raw, ResilientStore):
        raw.on_reconnect.append(handler.republish_identity)
    # The beat has a connection of its own too: its writes, ten a second, stay out of the joins' way.
    beat_store = channel.scoped(another_connection())
    handler.beat = NodeBeat(beat_store, heartbeats.beat_key(params.run_id, node), beat_interval(params))
    handler.beat.start()
    return handler


def handler_creator() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The ``torchrun.handlers`` entry point: torchrun calls it and registers what it returns."""
    return create_handler
