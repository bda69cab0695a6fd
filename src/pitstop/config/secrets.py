"""Credentials never reach a file, a log or the tracker: the whole composed config is checked before Hydra writes.

Hydra saves the composed config (``.hydra/config.yaml``), the overrides and its own settings in the run dir before
the task runs, and every value of the config is sent to the tracker as a param.  So a secret anywhere in it (a
YAML preset on any search path, an override, an interpolation or another resolver's output, an ``env_set`` of
Hydra's, a sweep) would be on disk and in MLflow before a check inside the task saw it.  :class:`SecretsGuard`, the
first of ``hydra.callbacks``, looks at the fully composed config in ``on_run_start`` (a single run) and
``on_multirun_start`` (every job of a sweep, composed as the launcher will compose it, ``hydra.sweeper.params``
included), before anything is written, and stops the command in one line that names the key (never the value) and
says how to pass the credential instead.

What counts as a secret, by meaning rather than by the last key:
- every set value at or below a key whose name says credential (:func:`credential_name`: ``secret``, ``token``,
  ``password``/``passwd``/``pwd``/``pass``, ``credentials``, ``auth``/``authorization``/``bearer``, ``cookie``,
  ``sig``/``signature``, ``api_key``/``api-key``/``apiKey``/``apikey``, ``access_key``...; whole words, so
  ``author``, ``tokenizer``, ``sort_key`` or ``tokens_per_step`` are not; under ``*.storage_options`` any name with
  ``key``, as fsspec's ``key``/``secret``): list items, a dict's values (``+svc.credentials={user: u, pass: S}``),
  an HTTP header (``storage_options.client_kwargs.headers.Authorization``), an interpolation of the environment
  (its value would be resolved into the tracker);
- in any value (:func:`secret_spans`): a URL's password (``https://user:pw@host``, ``postgresql://u:p@h``) or a
  token as its user info (``https://TOKEN@host``), a credential-named query parameter or ``name=value`` pair
  (``?access_token=``, ``sig=``, ``X-Amz-Signature=``, ADO's ``Password=...;``, Azure's ``AccountKey=...``), an
  ``Authorization`` value (``Bearer ...``, ``Basic <user:pass in base64>``), and a token by its format (GitHub
  ``ghp_``, AWS ``AKIA``, Slack ``xoxb-``, ``sk-``, Hugging Face ``hf_``, GitLab, Google, npm, PyPI, a JWT, a PEM
  private key), and an interpolation of a credential-named environment variable (``${oc.env:AWS_SECRET_ACCESS_KEY}``
  under any key: its value would be resolved into the tracker).

A value built by a resolver (``${oc.create:...}``, ``${oc.decode:...}``, ``${oc.env:...}``) is checked as written
and, where it resolves here, as resolved: a container it makes is walked like the config's own.

:func:`redact` is the one filter in front of every sink a run writes to (the tracker's params and tags, the
metrics file, ``summary.json``), and :func:`mask` the one for text (every log record, through
:func:`mask_logs`, and the command's error line): the same rules, credential-named entries left out, a secret
inside a text replaced by ``***``.  Hydra itself calls callbacks inside a ``try`` that turns an exception into a
warning: the guard ends the process with ``SystemExit(2)`` after its line instead.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Iterator

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, ListConfig, OmegaConf

from pitstop.config.credentials import (
    _unescaped,
    mask,
    secret_key,
    secret_spans,
)
from pitstop.errors import stop_command

_mask_key = functools.lru_cache(maxsize=4096)(mask)  # (a metrics record's few names, every step)


def redact(obj: Any, _path: tuple[str, ...] = ()) -> Any:
    """``obj`` (params, tags, a metrics record, a summary: dicts, lists, text, figures) as a sink may have it: an
    entry whose key path names a credential left out, every text masked. Dotted keys are paths (flat params)."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            here = (*_path, *str(k).split("."))
            if not isinstance(v, (int, float)) and secret_key(here, v) is not None:
                continue  # (a figure is not a credential: a metric's name never drops it)
            out[_mask_key(k) if isinstance(k, str) else k] = redact(v, here)
        return out
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact(v, _path) for v in obj)
    if isinstance(obj, str):
        return mask(obj)
    return obj


def mask_logs() -> None:
    """Mask every log record of this process before any handler sees it: a record factory, because the handlers
    are made later and by others (each rank's ``train.log``, Hydra's job logging, a library's own)."""
    made = logging.getLogRecordFactory()
    if getattr(made, "masks_secrets", False):
        return

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = made(*args, **kwargs)
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string: logging reports it at emit, as it would
            return record
        clean = mask(text)
        if clean != text:
            record.msg, record.args = clean, ()
        if record.exc_info and record.exc_info[1] is not None:
            record.exc_text = mask(_FORMATTER.formatException(record.exc_info))  # (an error's text can hold a URL)
        return record

    factory.masks_secrets = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(factory)


_FORMATTER = logging.Formatter()


# ---- the guard ----------------------------------------------------------------------------------------------------
def _leaves(node: Any, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], Any, Any]]:
    """``(key path, raw value, resolved value or None)`` of every leaf; a value that does not resolve here (an
    unset environment variable, a key Hydra sets later) is looked at as written; a value a resolver makes into a
    container (``${oc.create:...}``, ``${oc.decode:...}``) is walked as well, under the key that holds it."""
    keys = node.keys() if isinstance(node, DictConfig) else range(len(node))
    for k in keys:
        child = node._get_node(k)
        here = (*path, str(k))
        if isinstance(child, (DictConfig, ListConfig)) and not child._is_interpolation():
            if not child._is_none() and not child._is_missing():
                yield from _leaves(child, here)
            continue
        raw = child._value() if child is not None else None
        try:
            resolved = node[k]
        except Exception:  # noqa: BLE001 - any resolution error: the raw value is what there is
            resolved = None
        if isinstance(resolved, (DictConfig, ListConfig)):
            yield here, raw, None
            if not resolved._is_none() and not resolved._is_missing():
                yield from _leaves(resolved, here)
        elif isinstance(resolved, (dict, list, tuple)):  # (a resolver's plain container: ``oc.decode``'s)
            yield here, raw, None
            yield from _plain_leaves(resolved, here)
        else:
            yield here, raw, resolved


def _plain_leaves(node: Any, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], Any, Any]]:
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for k, v in items:
        if isinstance(v, (dict, list, tuple)):
            yield from _plain_leaves(v, (*path, str(k)))
        else:
            yield (*path, str(k)), v, v


def _rank(path: tuple[str, ...]) -> int:
    """The config's own keys first, then Hydra's settings, then Hydra's records of the overrides (which only quote
    a key the others name)."""
    if path[0] != "hydra":
        return 0
    return 2 if path[1:2] == ("overrides",) or path[1:3] == ("job", "override_dirname") else 1


def find_secrets(cfg: DictConfig) -> list[str]:
    """The refusals for ``cfg``: one line each, the config's own keys first, Hydra's copies of them after."""
    found: list[tuple[int, str]] = []
    for path, raw, resolved in _leaves(cfg, ()):
        in_hydra = _rank(path)
        named = secret_key(path, raw)
        if named is not None:
            found.append((in_hydra, refusal(mask(named))))
            continue
        key = mask(".".join(path))  # (a key can be a token itself: ``{ghp_...: 1}``)
        texts = [_unescaped(str(v)) for v in (raw, resolved) if isinstance(v, str)] + [".".join(path)]
        spans = [s for t in texts for s in secret_spans(t)]
        if spans:
            what = spans[0][2]
            found.append((in_hydra, url_refusal(key) if what == "a URL with a password" else value_refusal(key, what)))
    lines = [line for _, line in sorted(found, key=lambda f: f[0])]
    return list(dict.fromkeys(lines))  # (every leaf under one credential names the same key)


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


def value_refusal(key: str, what: str) -> str:
    return (
        f"{key}: {what} never goes in the config (it is saved with the run and sent to the tracker); set the "
        f"credential in the environment instead (e.g. AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, "
        f"MLFLOW_TRACKING_PASSWORD, the service's own variable) or in fsspec's own config (~/.config/fsspec/), and "
        f"take it out of {key}"
    )


def check(cfg: DictConfig) -> None:
    """Stop the command (exit status 2) with one line if ``cfg`` holds a secret; Hydra has written nothing yet."""
    lines = find_secrets(cfg)
    if lines:
        stop_command(lines[0])


def sweep_overrides(config: DictConfig) -> list[str]:
    """What Hydra's basic sweeper sweeps: ``hydra.sweeper.params`` as ``key=value`` overrides, then the command
    line's (as ``BasicSweeper.sweep`` puts them together)."""
    params = OmegaConf.select(config, "hydra.sweeper.params")
    if params is None:
        return list(config.hydra.overrides.task)
    try:
        items = OmegaConf.to_container(params, resolve=True).items()
    except Exception:  # noqa: BLE001 - a value that does not resolve here: as written (the sweeper's own reading)
        items = OmegaConf.to_container(params, resolve=False).items()
    return [f"{k}={v}" for k, v in items] + list(config.hydra.overrides.task)


def _sweep_jobs(config: DictConfig) -> list[DictConfig]:
    """Every job of a sweep, composed as Hydra's sweeper and launcher will compose it (a preset chosen by a
    sweep of a group shows only there)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    loader = GlobalHydra.instance().config_loader()
    parsed = OverridesParser.create().parse_overrides(sweep_overrides(config))
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
