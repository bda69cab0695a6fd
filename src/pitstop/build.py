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
