"""A DCP ``StorageReader`` over the members' memory: ``dcp.load`` plans the reads for the new mesh (DCP's own
resharding), and each rank's reads are served from its own memory or fetched from the member that holds them.

Every rank calls :meth:`MemoryReader.read_data` once per load, so the fetch is a collective on the reader's gloo
group: the ranks trade their requests as JSON (:func:`~disttrain.trainer.replicas.wire.all_gather_json`), then the
bytes (:func:`~disttrain.trainer.replicas.wire.exchange`). Tensor bytes are reinterpreted as the dtype the catalogue
names; a non-tensor value from a peer is loaded with ``torch.load(weights_only=True)`` (tensors, containers, numbers
and NumPy's RNG state), never unpickled freely. Use with ``dcp.load(..., no_dist=True)``: the planning is local to
each rank (nothing pickled crosses ranks), the reader's exchange is the only collective.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from disttrain.trainer.replicas import capture as capture_mod
from disttrain.trainer.replicas import wire
from disttrain.trainer.replicas.catalogue import Catalogue, ItemKey


def metadata_of(catalogue: Catalogue) -> Metadata:
    """DCP's metadata of the group ``catalogue`` describes: each tensor's global shape and chunks."""
    entries: dict[str, Any] = {}
    for spec in catalogue.specs().values():
        if not spec.is_tensor:
            entries[spec.fqn] = BytesStorageMetadata()
            continue
        entry = entries.get(spec.fqn)
        if entry is None:
            entry = TensorStorageMetadata(
                properties=TensorProperties(dtype=capture_mod.dtype_of(spec.dtype)),
                size=torch.Size(spec.global_size),
                chunks=[],
            )
            entries[spec.fqn] = entry
        entry.chunks.append(ChunkStorageMetadata(offsets=torch.Size(spec.offsets), sizes=torch.Size(spec.sizes)))
    return Metadata(state_dict_metadata=entries)


def _key(index: MetadataIndex) -> ItemKey:
    return (index.fqn, tuple(int(x) for x in index.offset) if index.offset is not None else ())


class MemoryReader(StorageReader):
    """Serves ``dcp.load`` from ``local`` (what this rank holds at the chosen step) and from the peers that
    ``assignment`` names for the rest."""

    def __init__(
        self,
        catalogue: Catalogue,
        local: Mapping[ItemKey, capture_mod.Value],
        assignment: Mapping[ItemKey, int],
        rank: int,
        world_size: int,
        group: Optional[dist.ProcessGroup],
    ) -> None:
        super().__init__()
        self.catalogue = catalogue
        self.specs = catalogue.specs()
        self.local = local
        self.assignment = assignment
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.bytes_fetched = 0

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return metadata_of(self.catalogue)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        remote = [item for item in plan.items if _key(item.storage_index) not in self.local]
        requests: dict[int, list[list[Any]]] = {}
        for item in remote:
            key = _key(item.storage_index)
            holder = self.assignment.get(key)
            if holder is None or holder == self.rank:
                raise ValueError(f"no member holds {key[0]} at offsets {key[1]}")
            requests.setdefault(holder, []).append(
                [key[0], list(key[1]), list(item.storage_offsets), list(item.lengths)]
            )
        everyone = wire.all_gather_json({str(h): r for h, r in requests.items()}, self.group, self.world_size)
        outgoing: dict[int, list[bytes | torch.Tensor]] = {}
        for requester, asked in enumerate(everyone):
            for fqn, offsets, storage_offsets, lengths in asked.get(str(self.rank), []):
                outgoing.setdefault(requester, []).append(self._slice((fqn, tuple(offsets)), storage_offsets, lengths))
        sizes = {r: [_size(p) for p in parts] for r, parts in outgoing.items()}
        announced = wire.all_gather_json({str(r): s for r, s in sizes.items()}, self.group, self.world_size)
        incoming = {h: sum(doc.get(str(self.rank), [])) for h, doc in enumerate(announced) if h != self.rank}
        payloads = {r: torch.cat([_as_uint8(p) for p in parts]) for r, parts in outgoing.items() if parts}
        received = wire.exchange(payloads, {h: n for h, n in incoming.items() if n}, self.group)
        pieces: dict[int, list[torch.Tensor]] = {}
        for holder, doc in enumerate(announced):
            lengths = doc.get(str(self.rank), [])
            raw, offset = received.get(holder, torch.empty(0, dtype=torch.uint8)), 0
            for length in lengths:
                pieces.setdefault(holder, []).append(raw[offset : offset + length])
                offset += length
        cursor: dict[int, int] = {}
        for item in plan.items:
            key = _key(item.storage_index)
            if key in self.local:
                self._load_local(item, planner, key)
                continue
            holder = self.assignment[key]
            piece = pieces[holder][cursor.get(holder, 0)]
            cursor[holder] = cursor.get(holder, 0) + 1
            self.bytes_fetched += piece.numel()
            self._load_piece(item, planner, key, piece)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _slice(self, key: ItemKey, storage_offsets: list[int], lengths: list[int]) -> bytes | torch.Tensor:
        value = self.local.get(key)
        if value is None:
            raise ValueError(f"asked for {key[0]} at offsets {key[1]}, which this rank does not hold")
        if isinstance(value, bytes):
            return value
        tensor = value
        for dim, (start, length) in enumerate(zip(storage_offsets, lengths, strict=True)):
            tensor = tensor.narrow(dim, int(start), int(length))
        return tensor.contiguous()

    def _load_local(self, item: ReadItem, planner: LoadPlanner, key: ItemKey) -> None:
        value = self.local[key]
        if isinstance(value, bytes):
            planner.load_bytes(item, io.BytesIO(value))  # this process's own capture
            return
        source = value
        for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
            source = source.narrow(dim, int(start), int(length))
        self._commit(item, planner, source)

    def _load_piece(self, item: ReadItem, planner: LoadPlanner, key: ItemKey, piece: torch.Tensor) -> None:
        spec = self.specs[key]
        if not spec.is_tensor:
            _set_loaded(planner, item, wire.safe_load(bytes(piece.numpy().tobytes())))
            return
        dtype = capture_mod.dtype_of(spec.dtype)
        shape = [int(x) for x in item.lengths]
        source = piece.clone().view(dtype).reshape(shape) if piece.numel() else torch.empty(shape, dtype=dtype)
        self._commit(item, planner, source)

    @staticmethod
    def _commit(item: ReadItem, planner: LoadPlanner, source: torch.Tensor) -> None:
        target = planner.resolve_tensor(item).detach()
        if target.size() != source.size():
            raise ValueError(f"{item.dest_index.fqn}: read {tuple(source.size())}, expected {tuple(target.size())}")
        target.copy_(source)
        planner.commit_tensor(item, target)


def _set_loaded(planner: LoadPlanner, item: ReadItem, value: Any) -> None:
    """What ``DefaultLoadPlanner.load_bytes`` does with a value, without unpickling it again."""
    from torch.distributed.checkpoint._traverse import set_element

    mappings = getattr(planner, "mappings", None)
    original = getattr(planner, "original_state_dict", None)
    if mappings is not None and original is not None and item.dest_index.fqn in mappings:
        set_element(original, mappings[item.dest_index.fqn], value)
    else:
        planner.state_dict[item.dest_index.fqn] = value  # type: ignore[attr-defined]


def _size(part: bytes | torch.Tensor) -> int:
    return len(part) if isinstance(part, bytes) else part.numel() * part.element_size()


def _as_uint8(part: bytes | torch.Tensor) -> torch.Tensor:
    if isinstance(part, bytes):
        return torch.frombuffer(bytearray(part), dtype=torch.uint8) if part else torch.empty(0, dtype=torch.uint8)
    return capture_mod.as_bytes(part)
