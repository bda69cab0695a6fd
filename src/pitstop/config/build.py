"""``build``: ``hydra.utils.instantiate`` that lets pitstop's own one-line errors through unwrapped."""

from __future__ import annotations

from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate

from pitstop.errors import PitstopError


def build(node: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return instantiate(node, *args, **kwargs)
    except InstantiationException as e:
        cause = e.__cause__
        while cause is not None and not isinstance(cause, PitstopError):
            cause = cause.__cause__
        if cause is not None:
            raise cause from None
        raise


def target_modules(node: Any) -> set[str]:
    """The modules that the ``_target_``s of a config (a DictConfig or plain containers) name."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(node, (DictConfig, ListConfig)):
        node = OmegaConf.to_container(node, resolve=False)
    found: set[str] = set()
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key, value in item.items():
                if key == "_target_" and isinstance(value, str):
                    module = value.rsplit(".", 1)[0]
                    if module and not module.startswith("__") and module != value:
                        found.add(module)
                else:
                    stack.append(value)
        elif isinstance(item, list):
            stack.extend(item)
    return found
