"""Auto-wrap policies: which submodules become units of their own.

The shapes users bring, all accepted wherever a policy is:

* FSDP1's callable ``policy(module, recurse, nonwrapped_numel) -> bool`` (asked with
  ``recurse=True`` whether to look inside ``module``, then with ``recurse=False`` whether to
  wrap it, given the parameters not yet wrapped below it), e.g. the functions here with
  ``functools.partial``;
* :class:`ModuleWrapPolicy` or a plain set of module classes (Lightning's
  ``auto_wrap_policy={Block}``, Megatron's ``sub_modules_to_wrap``).

The root is never chosen here: the caller makes it the unit for whatever is left.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Union

from torch import nn

from .._common.errors import on_rank

__all__ = [
    "ModuleWrapPolicy",
    "always_wrap_policy",
    "lambda_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "as_wrap_policy",
    "modules_to_wrap",
]

WrapPolicy = Callable[..., bool]
FORCE_LEAF_MODULES = (nn.MultiheadAttention,)  # their forward reads weights outside submodule calls
EXCLUDE_WRAP_MODULES = (nn.ModuleList, nn.ModuleDict)  # containers: no forward of their own


class ModuleWrapPolicy:
    """Wrap every instance of the given module classes."""

    def __init__(self, module_classes: Iterable[type]) -> None:
        self.module_classes = tuple(module_classes)

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        return True if recurse else isinstance(module, self.module_classes)

    def __repr__(self) -> str:
        return f"ModuleWrapPolicy({[c.__name__ for c in self.module_classes]})"


def always_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
    """Wrap every module."""
    return True


def lambda_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int, lambda_fn: Callable) -> bool:
    """Wrap the modules for which ``lambda_fn(module)`` is true."""
    return True if recurse else bool(lambda_fn(module))


def transformer_auto_wrap_policy(
    module: nn.Module, recurse: bool, nonwrapped_numel: int, transformer_layer_cls: Iterable[type]
) -> bool:
    """Wrap every instance of ``transformer_layer_cls`` (FSDP1's name for :class:`ModuleWrapPolicy`)."""
    return True if recurse else isinstance(module, tuple(transformer_layer_cls))


def size_based_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    min_num_params: int = int(1e8),
    force_leaf_modules: Optional[set] = None,
    exclude_wrap_modules: Optional[set] = None,
) -> bool:
    """Wrap a module once it holds at least ``min_num_params`` parameters not wrapped below it;
    never look inside ``force_leaf_modules``, never wrap ``exclude_wrap_modules``."""
    leaves = tuple(force_leaf_modules) if force_leaf_modules is not None else FORCE_LEAF_MODULES
    excluded = tuple(exclude_wrap_modules) if exclude_wrap_modules is not None else EXCLUDE_WRAP_MODULES
    if recurse:
        return not isinstance(module, leaves)
    return nonwrapped_numel >= min_num_params and not isinstance(module, excluded)


def as_wrap_policy(policy: Union[None, WrapPolicy, ModuleWrapPolicy, type, Iterable[type]]) -> Optional[WrapPolicy]:
    """Any accepted policy shape as an FSDP1-style callable (``None`` stays ``None``)."""
    if policy is None or callable(policy) and not isinstance(policy, type):
        return policy
    classes = [policy] if isinstance(policy, type) else list(policy)
    strays = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
    if strays:
        raise TypeError(on_rank(f"auto_wrap_policy: expected a callable or module classes, got {strays[0]!r}"))
    return ModuleWrapPolicy(classes)


def modules_to_wrap(root: nn.Module, policy: WrapPolicy, ignored: frozenset = frozenset()) -> list[nn.Module]:
    """The submodules of ``root`` that ``policy`` makes units, children before parents.

    ``ignored`` holds ids of parameters that are not counted. A module sharing a parameter with
    a module outside it (a tied embedding and head) is never chosen alone: a shared parameter
    must belong to one unit, so it stays with a common ancestor.
    """
    holders = _holders(root)
    chosen: list[nn.Module] = []

    def visit(module: nn.Module) -> int:
        params = {id(p): p.numel() for p in module.parameters() if id(p) not in ignored}
        if not policy(module=module, recurse=True, nonwrapped_numel=sum(params.values())):
            return sum(params.values())
        below = {id(p) for child in module.children() for p in child.parameters()}
        remaining = sum(n for i, n in params.items() if i not in below)
        remaining += sum(visit(child) for child in module.children())
        if module is not root and _self_contained(module, holders) and policy(module=module, recurse=False, nonwrapped_numel=remaining):
            chosen.append(module)
            return 0
        return remaining

    visit(root)
    return chosen


def _holders(root: nn.Module) -> dict[int, list[nn.Module]]:
    """Parameter id -> every module registering it directly."""
    holders: dict[int, list[nn.Module]] = {}
    for module in root.modules():
        for param in module._parameters.values():
            if param is not None:
                holders.setdefault(id(param), []).append(module)
    return holders


def _self_contained(module: nn.Module, holders: dict[int, list[nn.Module]]) -> bool:
    inside = {id(m) for m in module.modules()}
    return all(id(h) in inside for p in module.parameters() for h in holders[id(p)])


