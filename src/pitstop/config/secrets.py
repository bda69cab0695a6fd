"""Credentials never reach a file, a log or the tracker: the whole composed config is checked before Hydra writes.

Hydra saves the composed config (``.hydra/config.yaml``), the overrides and its own settings in the run dir before
the task runs, and every value of the config is sent to the tracker as a param.  So a secret anywhere in it (a
YAML preset on any search path, an override, an interpolation, an ``env_set`` of Hydra's) would be on disk and in
MLflow before a check inside the task saw it.  :class:`SecretsGuard`, the first of ``hydra.callbacks``, looks at
the fully composed config in ``on_run_start`` (a single run) and ``on_multirun_start`` (every job of a sweep,
composed as the launcher will compose it), before anything is written, and stops the command in one line that
names the key (never the value) and says how to pass the credential instead.

What counts as a secret:
- a key whose name says credential (``secret``, ``token``, ``password``, ``credential``, ``api_key``,
  ``access_key``, ...; under ``*.storage_options`` any name with ``key``, as fsspec's ``key``/``secret``) with a
  value set, an interpolation of the environment included (its value would be resolved into the tracker);
- a URL with a password in its userinfo (``https://user:pw@host/...``) in any value.

:func:`redact` is the same filter for what goes to the tracker, for runs made without Hydra (the compose API).
Hydra itself calls callbacks inside a ``try`` that turns an exception into a warning: the guard ends the process
with ``SystemExit(2)`` after its line instead.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Iterator

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, ListConfig

from pitstop.errors import stop_command

SECRET_NAME = re.compile(
    r"secret|token|passw|credential|api_?key|access_?key|private_?key|account_?key|session_?key|^key$", re.I
)
STORAGE_WORDS = ("key", "secret", "token", "password", "passwd", "credential")  # under *.storage_options
URL_PASSWORD = re.compile(r"([A-Za-z][\w+.-]*://)([^/\s:@]*):([^/\s@]+)@")
UNSET = (None, "", "???")


def _names_secret(path: tuple[str, ...]) -> bool:
    name = path[-1]
    if any(p.endswith("storage_options") for p in path[:-1]):
        return any(w in name.lower() for w in STORAGE_WORDS)
    return bool(SECRET_NAME.search(name))


def _leaves(node: Any, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], Any, Any]]:
    """``(key path, raw value, resolved value or None)`` of every leaf; a value that does not resolve here (an
    unset environment variable, a key Hydra sets later) is looked at as written."""
    keys = node.keys() if isinstance(node, DictConfig) else range(len(node))
    for k in keys:
        child = node._get_node(k)
        here = (*path, str(k))
        if isinstance(child, (DictConfig, ListConfig)):
            if not child._is_none() and not child._is_missing() and not child._is_interpolation():
                yield from _leaves(child, here)
            continue
        raw = child._value() if child is not None else None
        try:
            resolved = node[k]
        except Exception:  # noqa: BLE001 - any resolution error: the raw value is what there is
            resolved = None
        yield here, raw, resolved


def find_secrets(cfg: DictConfig) -> list[str]:
    """The refusals for ``cfg``: one line each, the config's own keys first, Hydra's copies of them after."""
    found: list[tuple[bool, str]] = []
    for path, raw, resolved in _leaves(cfg, ()):
        key = ".".join(path)
        texts = [str(v).replace("\\", "") for v in (raw, resolved) if isinstance(v, str)]
        if _names_secret(path) and raw not in UNSET and not (isinstance(raw, (list, dict)) and not raw):
            found.append((path[0] == "hydra", refusal(key)))
        elif any(URL_PASSWORD.search(t) for t in texts):
            found.append((path[0] == "hydra", url_refusal(key)))
    return [line for _, line in sorted(found, key=lambda f: f[0])]


def refusal(key: str) -> str:
    return (
        f"{key}: credentials never go in the config (it is saved with the run and sent to the tracker); set them "
        f"in the environment instead (e.g. AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, MLFLOW_TRACKING_PASSWORD) or "
        f"in fsspec's own config (~/.config/fsspec/), and remove {key}"
    )


def url_refusal(key: str) -> str:
    if key.endswith("tracking_uri"):
        how = "set MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD in the environment"
    else:
        how = (
            "set it in the environment (e.g. AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY for s3://) or in fsspec's own "
            "config (~/.config/fsspec/)"
        )
    return (
        f"{key}: a URL with a password (user:***@host) never goes in the config (it is saved with the run and sent "
        f"to the tracker); {how}, and drop the user:password@ part"
    )


def mask(text: str) -> str:
    """``text`` with any URL's password replaced by ``***``."""
    return URL_PASSWORD.sub(lambda m: f"{m.group(1)}{m.group(2)}:***@", text)


def redact(flat: dict[str, Any]) -> dict[str, Any]:
    """Params for the tracker: credential-named keys left out, URL passwords masked."""
    out = {}
    for key, value in flat.items():
        if _names_secret(tuple(key.split("."))) and value not in UNSET:
            continue
        out[key] = mask(value) if isinstance(value, str) else value
    return out


def check(cfg: DictConfig) -> None:
    """Stop the command (exit status 2) with one line if ``cfg`` holds a secret; Hydra has written nothing yet."""
    lines = find_secrets(cfg)
    if lines:
        stop_command(lines[0])


def _sweep_jobs(config: DictConfig) -> list[DictConfig]:
    """Every job of a sweep, composed as Hydra's sweeper and launcher will compose it (a preset chosen by a
    sweep of a group shows only there)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    loader = GlobalHydra.instance().config_loader()
    parsed = OverridesParser.create().parse_overrides(list(config.hydra.overrides.task))
    jobs = []
    for batch in BasicSweeper.split_arguments(parsed, max_batch_size=None):
        for overrides in batch:
            jobs.append(loader.load_sweep_config(config, list(overrides)))
    return jobs


def _with_hydra_config(cfg: DictConfig) -> None:
    """Check ``cfg`` with Hydra's own settings resolvable (``${hydra:...}``), as the task will see them."""
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.instance()
    before = hc.cfg
    try:
        hc.set_config(cfg)
        check(cfg)
    finally:
        hc.cfg = before


class SecretsGuard(Callback):
    """The first of ``hydra.callbacks`` (``conf/train.yaml``, ``conf/prepare.yaml``)."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _with_hydra_config(config)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            jobs = _sweep_jobs(config)
        except Exception as e:  # noqa: BLE001 - Hydra's internals moved: the sweep's own values are checked below
            logging.getLogger("pitstop.config").warning(
                "secrets: the sweep's jobs could not be composed here (%s: %s); only the sweep's own values are "
                "checked, not the presets a job would choose",
                type(e).__name__,
                e,
            )
            jobs = []
        for job in jobs:  # (first: a job names the key itself, the sweep's overrides only quote it)
            _with_hydra_config(job)
        check(config)
