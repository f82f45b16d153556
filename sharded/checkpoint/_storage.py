"""Reading DCP checkpoints without trusting them: data only, verified, errors that name the file.

DCP's own ``FileSystemReader`` unpickles the ``.metadata`` index with plain ``pickle`` (a
crafted file runs code) and its default planner loads non-tensor values with
``torch.load(weights_only=False)``; ``torch.load`` also does not check the CRC32 that every
DCP record carries, so a flipped bit in a tensor loads as a silently wrong number. Here the
index is unpickled with an allow-list of DCP's own metadata classes, every record's checksums
are verified before use, values load with ``weights_only=True``, and any failure names the file,
the key and the rank. Importing this module imports DCP: import it only when saving or loading.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import pickle
import sys
import zipfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorProperties, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from .._common.errors import on_rank
from ._fit_checks import CheckpointError
from ._paths import KeyPath
from ._versions import version_note

__all__ = ["METADATA_FILE", "DataOnlyPlanner", "Index", "VerifyingReader", "read_index"]

METADATA_FILE = ".metadata"
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
# Fields newer torch versions appended to TensorProperties' pickled state, in order, which a
# reader can drop: they describe the saved tensor, not where its elements go (see ._versions).
_INFORMATIONAL_PROPERTIES = ("strides",)
_SAFE_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # rebuilds a torch.layout from its name
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}




@dataclass(frozen=True)
class Index:
    """What a checkpoint holds, from its index alone.

    Attributes:
        paths: each of DCP's flat keys -> the nested path it was saved from
            (``"optim.state.blocks.0.qkv.weight.step"`` -> ``("optim", "state", "blocks.0.qkv.weight", "step")``).
        tensors: for the keys that are tensors, the saved (global) shape and dtype.
    """

    paths: dict[str, KeyPath]
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]]


def read_index(directory: Path) -> Index:
    """The checkpoint's index, unpickled safely, after checking every data file it names is
    there and long enough (a truncated file is found here, before anything is read)."""
    metadata = read_metadata(directory)
    recorded = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    paths: dict[str, KeyPath] = {}
    tensors = {}
    for key, entry in metadata.state_dict_metadata.items():
        path = recorded.get(key)
        if not isinstance(path, tuple) or not path:
            raise CheckpointError(on_rank(
                f"{directory}: no nested path recorded for key '{key}'; only checkpoints saved with "
                "DCP's default planner can be loaded"
            ))
        paths[key] = path
        if isinstance(entry, TensorStorageMetadata):
            tensors[key] = (tuple(entry.size), entry.properties.dtype)
    return Index(paths, tensors)


def read_metadata(directory: Path) -> Metadata:
    """DCP's index of the checkpoint in ``directory``, after checking its data files are whole."""
    path = directory / METADATA_FILE
    if not directory.is_dir():
        raise CheckpointError(on_rank(f"{directory}: no such checkpoint directory"))
    if not path.is_file():
        raise CheckpointError(on_rank(
            f"{path} is missing: {directory} is not a complete checkpoint (a save that did not "
            "finish writes no index)"
        ))
    try:
        with open(path, "rb") as stream:
            metadata = _IndexUnpickler(stream).load()
    except Exception as error:
        raise CheckpointError(on_rank(
            f"{path}: unreadable checkpoint index ({type(error).__name__}: {error}); {version_note(directory)}"
        )) from error
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise CheckpointError(on_rank(f"{path} is not a torch.distributed.checkpoint index"))
    _check_data_files(directory, metadata)
    return metadata


def _check_data_files(directory: Path, metadata: Metadata) -> None:
    needed: dict[str, int] = defaultdict(int)
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed[info.relative_path], info.offset + info.length)
    for relative, end in sorted(needed.items()):
        path = directory / relative
        if not path.is_file():
            raise CheckpointError(on_rank(f"{path} is missing; the checkpoint index lists it"))
        size = path.stat().st_size
        if size < end:
            raise CheckpointError(on_rank(f"{path} is truncated: {size} bytes, the checkpoint index needs {end}"))


class _IndexUnpickler(pickle.Unpickler):
    """Unpickles DCP's index and refuses any global that is not one of its plain data types."""

    def find_class(self, module: str, name: str) -> Any:
        if not _is_index_type(module, name):
            raise pickle.UnpicklingError(f"refusing global {module}.{name}: not part of a checkpoint index")
        return index_class(super().find_class(module, name))


def _is_index_type(module: str, name: str) -> bool:
    if (module, name) in _SAFE_GLOBALS:
        return True
    if module == "torch":
        return isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format))
    if module in _METADATA_MODULES and module in sys.modules:
        found = getattr(sys.modules[module], name, None)
        return isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum))
    return False


def index_class(found: type) -> type:
    """The class the index unpickler builds for ``found``: ``found`` itself, except torch's
    ``TensorProperties`` where this torch lacks a field newer ones write."""
    if found is TensorProperties and not _knows_all_informational_fields():
        return _TensorPropertiesOfNewerTorch
    return found


def _knows_all_informational_fields() -> bool:
    known = {field.name for field in dataclasses.fields(TensorProperties)}
    return all(name in known for name in _INFORMATIONAL_PROPERTIES)


class _TensorPropertiesOfNewerTorch(TensorProperties):
    """torch's ``TensorProperties``, rebuilt from the state of a newer torch's: the fields this
    torch knows, the informational ones dropped, any other raising."""

    def __setstate__(self, state: Any) -> None:
        own = _own_state_length()
        if isinstance(state, tuple) and len(state) > own:
            extra = len(state) - own
            if extra > len(_INFORMATIONAL_PROPERTIES):
                raise ValueError(
                    f"TensorProperties carries {extra} fields this torch does not know (it knows "
                    f"{', '.join(_INFORMATIONAL_PROPERTIES)} as information only)"
                )
            state = state[:own]
        super().__setstate__(state)


def _own_state_length() -> int:
    """How many values this torch's ``TensorProperties`` pickles."""
    return len(TensorProperties(dtype=torch.float32).__getstate__())


class DataOnlyPlanner(DefaultLoadPlanner):
    """DCP's default load planner over an already flat state dict, loading non-tensor values
    with ``weights_only=True`` (the default planner unpickles them without restriction)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


class VerifyingReader(FileSystemReader):
    """DCP's file-system reader with a safe index and verified records (see the module doc)."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.directory = directory

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(self.directory)
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is not None and hasattr(self, "load_id"):
            storage_meta.load_id = self.load_id  # as DCP's reader does
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list[ReadItem]] = defaultdict(list)
        for item in plan.items:
            by_file[self.storage_data[item.storage_index].relative_path].append(item)
        for relative, items in by_file.items():
            path = self.directory / relative
            with open(path, "rb") as stream:
                for item in items:
                    self._read_item(stream, path, item, planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_item(self, stream: IO[bytes], path: Path, item: ReadItem, planner: LoadPlanner) -> None:
        info = self.storage_data[item.storage_index]
        where = f"{path}, key '{item.storage_index.fqn}'"
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(on_rank(f"{where}: stored with transforms {info.transform_descriptors}, which this reader does not support"))
        stream.seek(info.offset)
        record = stream.read(info.length)
        if len(record) != info.length:
            raise CheckpointError(on_rank(f"{where}: the file ends inside this record (truncated while being read)"))
        try:
            _check_record(record)
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(record))
            else:
                _copy_tensor(record, item, planner)
        except Exception as error:
            raise CheckpointError(on_rank(f"{where}: unreadable record ({type(error).__name__}: {error})")) from error


def _check_record(record: bytes) -> None:
    """Raise unless every member of the record's zip archive matches its CRC32."""
    with zipfile.ZipFile(io.BytesIO(record)) as archive:
        damaged = archive.testzip()
    if damaged is not None:
        raise ValueError(f"checksum mismatch in '{damaged}'")


def _copy_tensor(record: bytes, item: ReadItem, planner: LoadPlanner) -> None:
    saved = torch.load(io.BytesIO(record), map_location="cpu", weights_only=True)
    piece = saved[tuple(slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths))]
    target = planner.resolve_tensor(item).detach()
    if target.shape != piece.shape:
        raise ValueError(f"holds a piece of shape {tuple(piece.shape)} where {tuple(target.shape)} is expected")
    target.copy_(piece)
    planner.commit_tensor(item, target)
