"""``sharded.use_for_torch_fsdp``: code that calls torch's ``fully_shard`` by name gets ours.

Two clients stand in for the frameworks: one imports torch's name inside the function that
wraps the model, at call time (Accelerate); one is a module that bound torch's name when it was
imported, before the route (Megatron-Core, torchtitan). On real ranks: the call-time client
shards with ours, and trains bit for bit as calling ``sharded.fully_shard`` directly does; the
import-time client keeps torch's (which still works) unless named in ``also_in``; leaving the
route, by exit or by exception, puts torch's very objects back. In one process: the route's
bookkeeping (nesting, restore order, restoring twice) and its errors.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import types

import pytest
import torch
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

from tests._fsdp_reference import SGD, full_tensors, optimizers_for, shard_gpt, train_both
from tests._harness import run_on_ranks
from tests._models import gpt

TORCH_PATHS = (
    "torch.distributed.fsdp",
    "torch.distributed.fsdp._fully_shard",
    "torch.distributed._composable.fsdp",
    "torch.distributed._composable.fsdp.fully_shard",
)
DEFINITION = "torch.distributed.fsdp._fully_shard._fully_shard"  # where torch defines it
TORCHS = importlib.import_module(DEFINITION).fully_shard
CLIENT = "tests_route_import_time_client"

# A Megatron/torchtitan-shaped client: it binds torch's name when it is imported.
IMPORT_TIME_CLIENT = '''
from torch.distributed.fsdp import fully_shard

def parallelize(model):
    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)
'''


def call_time_client(model):
    """An Accelerate-shaped client: it looks torch's name up when it wraps the model."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


def import_time_client() -> types.ModuleType:
    """The import-time client, imported (under :data:`CLIENT`, so ``also_in`` can name it)."""
    module = types.ModuleType(CLIENT)
    exec(IMPORT_TIME_CLIENT, module.__dict__)
    sys.modules[CLIENT] = module
    return module


def torch_names() -> dict[str, object]:
    """What each of torch's paths (and the defining module) holds as ``fully_shard`` now."""
    return {path: importlib.import_module(path).fully_shard for path in (*TORCH_PATHS, DEFINITION)}


def assert_torchs_everywhere(client: types.ModuleType, what: str) -> None:
    wrong = {path: value for path, value in torch_names().items() if value is not TORCHS}
    assert not wrong, f"{what}: not torch's fully_shard at {sorted(wrong)}"
    assert client.fully_shard is TORCHS, f"{what}: the client's fully_shard is not torch's"


def trained(model, rank):
    """The model's full parameters after a few SGD steps (the same batches on every call)."""
    train_both([(model, optimizers_for(SGD, model)[0])], rank, steps=3)
    return full_tensors(model.parameters())


def assert_ours(model, what: str) -> None:
    from sharded.fsdp import FSDPModule

    for module in (model, *model.blocks):
        assert isinstance(module, FSDPModule), f"{what}: {type(module).__mro__} is not sharded's"


def assert_bit_identical(params, reference, what: str) -> None:
    for index, (a, b) in enumerate(zip(params, reference, strict=True)):
        assert torch.equal(a, b), f"{what}: parameter {index} differs by {(a - b).abs().max():.3g}"


# ------------------------------------------------------------------ on ranks


def _route_cases(rank, world):
    import sharded

    client = import_time_client()
    reference = trained(shard_gpt(gpt()), rank)  # sharded.fully_shard, called directly

    with sharded.use_for_torch_fsdp() as route:
        assert set(route.paths) == {f"{path}.fully_shard" for path in TORCH_PATHS}, route.paths
        assert all(torch_names()[path] is sharded.fully_shard for path in TORCH_PATHS)
        model = call_time_client(gpt())
        assert_ours(model, "call-time client")
        assert_bit_identical(trained(model, rank), reference, "call-time client")

        kept = client.parallelize(gpt())  # bound torch's before the route: keeps it, and it works
        assert isinstance(kept, TorchFSDPModule) and not isinstance(kept, sharded.fsdp.FSDPModule)
        kept(torch.zeros(2, 8, dtype=torch.long)).sum().backward()
    assert_torchs_everywhere(client, "after the route")

    for also_in in ([client], [CLIENT]):  # the module, or its name
        with sharded.use_for_torch_fsdp(also_in=also_in):
            model = client.parallelize(gpt())
            assert_ours(model, f"import-time client in also_in={also_in}")
            assert_bit_identical(trained(model, rank), reference, f"also_in={also_in}")
        assert_torchs_everywhere(client, f"after also_in={also_in}")

    with pytest.raises(ZeroDivisionError):
        with sharded.use_for_torch_fsdp(also_in=[client]):
            call_time_client(gpt())
            1 / 0
    assert_torchs_everywhere(client, "after an exception inside the route")


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_clients_calling_torchs_name_train_with_ours_until_restored(world_size):
    run_on_ranks(_route_cases, world_size)


# ------------------------------------------------------------------ in one process


@pytest.fixture
def client():
    """The import-time client; afterwards, torch's names must be torch's again (and are put
    back whatever happened, so that one failure here does not spread to the tests after it)."""
    from sharded.fsdp import _torch_route

    module = import_time_client()
    yield module
    sys.modules.pop(CLIENT, None)
    left = dict(torch_names(), client=module.fully_shard)
    for path in (*TORCH_PATHS, DEFINITION):
        importlib.import_module(path).fully_shard = TORCHS
    _torch_route._routes.clear()
    wrong = sorted(path for path, value in left.items() if value is not TORCHS)
    assert not wrong, f"after the test: not torch's fully_shard at {wrong}"


def test_nested_routes_restore_innermost_first(client):
    import sharded

    with sharded.use_for_torch_fsdp() as outer:
        with sharded.use_for_torch_fsdp(also_in=[client]) as inner:
            assert client.fully_shard is sharded.fully_shard
            with pytest.raises(RuntimeError, match=r"rank 0: .*1 route\(s\) made after it"):
                outer.restore()
            assert outer.active and inner.active  # the refused restore changed nothing
        assert client.fully_shard is TORCHS, "the inner route put the client's back"
        assert all(torch_names()[path] is sharded.fully_shard for path in TORCH_PATHS)
        assert torch_names()[DEFINITION] is TORCHS
    assert not outer.active


def test_restoring_twice_does_nothing_and_a_restored_route_cannot_be_entered(client):
    import sharded

    route = sharded.use_for_torch_fsdp()
    with route:
        route.restore()  # inside its own with: the exit's restore then does nothing
        assert_torchs_everywhere(client, "after restore()")
    route.restore()
    assert "restored" in repr(route)
    with pytest.raises(RuntimeError, match="restored already"):
        with route:
            pass


def test_also_in_replaces_only_torchs_fully_shard(client):
    import sharded

    other = types.ModuleType("tests_route_own_function")
    other.fully_shard = lambda module: module
    cases = [
        (ValueError, "module os has no attribute fully_shard", ["os"]),
        (ValueError, "tests_route_own_function.fully_shard is .*not torch's", [other]),
        (ValueError, "cannot import 'no_such_module_here'", ["no_such_module_here"]),
        (ValueError, "where torch defines fully_shard", [DEFINITION]),
        (TypeError, r"3 \(a int\) is neither a module", [3]),
    ]
    for error, message, also_in in cases:
        with pytest.raises(error, match=f"rank 0: use_for_torch_fsdp.*{message}"):
            sharded.use_for_torch_fsdp(also_in=[client, *also_in])
        assert_torchs_everywhere(client, f"after the refused also_in={also_in}")  # nothing replaced
    with sharded.use_for_torch_fsdp(also_in=client) as route:  # one module, not in a list
        assert route.paths[-1] == f"{CLIENT}.fully_shard" and client.fully_shard is sharded.fully_shard


def test_a_name_another_tool_replaced_is_neither_routed_nor_clobbered(client):
    import sharded
    import torch.distributed.fsdp as torch_fsdp

    def instrumented(*args, **kwargs):
        return TORCHS(*args, **kwargs)

    torch_fsdp.fully_shard = instrumented
    try:
        with pytest.raises(RuntimeError, match="torch.distributed.fsdp.fully_shard is .*instrumented"):
            sharded.use_for_torch_fsdp()
    finally:
        torch_fsdp.fully_shard = TORCHS
    route = sharded.use_for_torch_fsdp()
    torch_fsdp.fully_shard = instrumented
    with pytest.raises(RuntimeError, match="no longer sharded.fully_shard"):
        route.restore()
    torch_fsdp.fully_shard = sharded.fully_shard
    route.restore()


def test_import_sharded_stays_light_and_routes_nothing():
    code = (
        "import sys, sharded\n"
        "assert 'use_for_torch_fsdp' in sharded.__all__ and 'use_for_torch_fsdp' in dir(sharded)\n"
        "loaded = [m for m in ('sharded.fsdp._torch_route', 'sharded.fsdp.api', "
        "'torch.distributed._composable.fsdp') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
        "torch_fsdp = sys.modules.get('torch.distributed.fsdp')\n"
        "assert torch_fsdp is None or torch_fsdp.fully_shard.__module__.startswith('torch.'), torch_fsdp\n"
        "from sharded.fsdp._torch_route import use_for_torch_fsdp\n"
        "assert sharded.use_for_torch_fsdp is use_for_torch_fsdp\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
