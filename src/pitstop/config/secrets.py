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

import base64
import binascii
import functools
import logging
import re
import unicodedata
from typing import Any, Iterator

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, ListConfig, OmegaConf

from pitstop.errors import stop_command

UNSET = (None, "", "???")
STORAGE_WORDS = ("key", "secret", "token", "password", "passwd", "credential")  # under *.storage_options
# A word that says credential on its own (whole words of a key's name: ``author`` is not ``auth``).
WORDS = {
    "pwd", "pass", "passphrase", "auth", "oauth", "authorization", "bearer", "cookie", "cookies", "sig",
    "signature", "sas", "cred", "creds", "apikey", "apikeys", "privatekey", "accesskey", "secretkey", "accountkey",
    "sessionkey", "authkey",
}  # fmt: skip
# Words that make ``key``/``keys``/``tokens`` a credential when they come first (``api_key``, ``access_tokens``;
# ``sort_key``, ``max_tokens`` stay plain).
QUALIFIERS = {
    "api", "access", "secret", "private", "account", "session", "signing", "master", "encryption", "client", "ssh",
    "sas", "shared", "auth", "storage", "subscription", "license", "refresh", "bearer", "id", "personal", "service",
    "deploy", "app",
}  # fmt: skip
# A last word that makes the name about a credential, not the credential (``auth_type``, ``token_url``,
# ``secret_name``, ``key_file``, fsspec's ``config_kwargs.signature_version``): its value is a setting or a
# reference (a URL, a path, a variable's name), checked as any other value.
DESCRIPTORS = {
    "type", "types", "kind", "method", "methods", "mode", "scheme", "enabled", "enable", "required", "provider",
    "env", "var", "vars", "url", "uri", "endpoint", "file", "path", "dir", "name", "names", "version", "length",
    "len", "ttl", "timeout", "seconds", "expiry", "expires", "id", "ids", "index", "count", "limit", "size",
}  # fmt: skip
# Words before ``token`` that make it a vocabulary's token, not a credential (a language model's ``pad_token``,
# ``eos_token``, ``image_token``).
TOKEN_ROLES = {
    "pad", "eos", "bos", "unk", "mask", "cls", "sep", "start", "end", "stop", "special", "image", "vision", "audio",
    "video", "chat", "system", "user", "assistant", "tool", "extra", "additional", "default", "decoder", "encoder",
    "max", "min", "num", "new", "first", "last", "sentinel", "placeholder",
}  # fmt: skip
CODE_KEYS = {"_target_", "_partial_", "_recursive_", "_convert_"}  # (they name code: hydra.callbacks.secrets)
_CONCAT = re.compile(r"secret|passw|credential|token$|tokens$")  # (inside one word: ``clientSecret``'s, ``sastoken``)

# Tokens by their format; each with the service that issues it (named in the refusal, never the value).
TOKEN_FORMATS = [
    ("a GitHub token", r"gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}"),
    ("an AWS access key id", r"(?:AKIA|ASIA|AGPA|AIDA|AROA|ANPA|ANVA|AIPA)[0-9A-Z]{16}(?![0-9A-Za-z])"),
    ("a Slack token", r"xox[abposr]-[A-Za-z0-9-]{10,}"),
    ("an API secret key (sk-...)", r"sk-(?:proj-|ant-)?[A-Za-z0-9_-]{20,}|[sr]k_live_[A-Za-z0-9]{16,}"),
    ("a Hugging Face token", r"hf_[A-Za-z0-9]{30,}"),
    ("a GitLab token", r"glpat-[A-Za-z0-9_-]{20,}"),
    ("a Google API key", r"AIza[0-9A-Za-z_-]{35}"),
    ("an npm token", r"npm_[A-Za-z0-9]{36}"),
    ("a PyPI token", r"pypi-[A-Za-z0-9_-]{50,}"),
    ("a JWT", r"eyJ[A-Za-z0-9_-]{4,}\.eyJ[A-Za-z0-9_-]{4,}\.[A-Za-z0-9_-]*"),
    ("a private key", r"-----BEGIN[A-Z ]*PRIVATE KEY-----(?:[\s\S]*?-----END[A-Z ]*PRIVATE KEY-----|[\s\S]*)"),
]
_FORMAT = re.compile("|".join(f"(?P<f{i}>{rx})" for i, (_, rx) in enumerate(TOKEN_FORMATS)))
_BOUNDARY = re.compile(r"[A-Za-z0-9]")
URL_USERINFO = re.compile(r"([A-Za-z][\w+.-]*://)([^/\s:@?#]*)(?::([^/\s@]*))?@")
# ``name=value`` (a query, an ADO connection string, a command line) or ``name: value`` (a flow-style dict, as an
# override or ``oc.create`` writes it, or JSON's ``"name": "value"``); a name starts after a separator, a value is a
# bracketed whole or a run; and a command line's ``--name value``.
_PAIR = re.compile(
    r"(?:^|(?<=[?&;,\s{(\['\"-]))(?P<q>[\"']?)(?P<name>[A-Za-z_+~][\w.+~-]*(?: [A-Za-z]\w*)*)(?P=q)\s*"
    r"(?:=|:(?!//))\s*(?P<value>\{[^{}]*\}|\[[^\[\]]*\]|\"[^\"]*\"|'[^']*'|[^&;\s,'\"\]})]+)"
)
_FLAG = re.compile(r"(?<!\S)--?(?P<name>[A-Za-z][\w-]*)[ \t]+(?P<value>[^\s-]\S*)")
# ``curl -u user:password`` (a uid:gid pair, ``docker -u 1000:1000``, is no password) and a MySQL client's
# ``-pPASSWORD`` (only beside the client's name: ``-p8080`` is a port elsewhere)
_USER_PASS = re.compile(r"(?<!\S)(?:-u|--user)[ \t]*[^\s:]+:(?P<value>[^\s]+)")
_MYSQL = re.compile(r"\b(?:mysql|mysqldump|mysqladmin|mariadb)\b")
_ATTACHED_PASS = re.compile(r"(?<!\S)-p(?P<value>[^\s-]\S*)")
_BEARER = re.compile(r"(?i:\bbearer)\s+([A-Za-z0-9._~+/=-]{8,})")
_BASIC = re.compile(r"\bBasic\s+([A-Za-z0-9+/]{8,}={0,2})(?![\w+/=])")
_ENV = re.compile(r"\$\{oc\.env:\s*['\"]?([A-Za-z_]\w*)")  # (a credential's variable read into a plain key)
_TOKENISH = re.compile(r"(?=[^\d]*\d)(?=[^A-Za-z]*[A-Za-z])[A-Za-z0-9._~+/=-]{20,}")


# ---- names --------------------------------------------------------------------------------------------------------
def words(name: str) -> list[str]:
    """A key's name as lower-case words: ``X-Amz-Signature``, ``apiKey``, ``AWS_SECRET_ACCESS_KEY``, ``+a.b``."""
    name = unicodedata.normalize("NFKC", name)  # (full-width ``ｐａｓｓｗｏｒｄ`` is ``password``)
    split = re.sub(r"([a-z0-9])([A-Z])|([A-Z])([A-Z][a-z])", r"\1\3_\2\4", name)
    return [w for w in re.split(r"[^A-Za-z0-9]+", split.lower()) if w]


@functools.lru_cache(maxsize=4096)
def credential_name(name: str, storage: bool = False) -> bool:
    """Whether a key's name (one part of a key path) says it holds a credential;
    ``storage``: the name is below a ``*.storage_options``, where fsspec's names are shorter (``key``)."""
    if storage and any(w in name.lower() for w in STORAGE_WORDS):
        return True
    ws = words(name)
    if not ws or ws[-1] in DESCRIPTORS:  # (a key named ``key`` alone is fsspec's only under storage options, above)
        return False
    for i, w in enumerate(ws):
        if w in ("key", "keys", "tokens"):  # (``api_key``, ``access_tokens``; not ``sort_key``, ``max_tokens``)
            if i and ws[i - 1] in QUALIFIERS:
                return True
        elif w == "token" and i and ws[i - 1] in TOKEN_ROLES:  # (``pad_token``: a vocabulary's)
            continue
        elif w in WORDS or _CONCAT.search(w):
            return True
    return False


def _credential_at(path: tuple[str, ...]) -> int | None:
    """The index of the first part of ``path`` that names a credential (everything below it is the credential's)."""
    storage = False
    for i, part in enumerate(path):
        if credential_name(part, storage):
            return i
        storage = storage or part.endswith("storage_options")
    return None


def _held(value: Any) -> bool:
    """A value that can carry a credential: set, and neither a flag nor (in what a run writes) a figure."""
    return not isinstance(value, bool) and value not in UNSET and not (isinstance(value, (list, dict)) and not value)


def secret_key(path: tuple[str, ...], value: Any) -> str | None:
    """The key to name if ``value`` at ``path`` is a credential by its name (the credential-named part: the whole
    of ``+svc.credentials={user: u, pass: S}`` is ``svc.credentials``), else None."""
    if not _held(value) or path[-1] in CODE_KEYS:
        return None
    i = _credential_at(path)
    if i is None:
        return None
    last = words(path[-1])
    if i < len(path) - 1 and last and last[-1] in DESCRIPTORS:  # (``auth.type: basic``: a setting of it)
        return None
    return ".".join(path[: i + 1]).lstrip("+~")


# ---- values -------------------------------------------------------------------------------------------------------
def _pair_secret(name: str) -> bool:
    """Whether a ``name=value`` pair's name (a query's, an override's dotted key) names a credential."""
    return _credential_at(tuple(p for p in name.lstrip("+~").split(".") if p)) is not None


def _basic(token: str) -> bool:
    try:
        return ":" in base64.b64decode(token, validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return False


def secret_spans(text: str) -> list[tuple[int, int, str]]:
    """``(start, end, what)`` of each credential inside ``text``; ``what`` names its kind, never its bytes."""
    spans: list[tuple[int, int, str]] = []
    for m in _FORMAT.finditer(text):
        if m.start() and _BOUNDARY.match(text[m.start() - 1]):
            continue
        what = TOKEN_FORMATS[int(m.lastgroup[1:])][0]
        spans.append((m.start(), m.end(), what))
    for m in URL_USERINFO.finditer(text):
        if m.group(3):
            spans.append((m.start(3), m.end(3), "a URL with a password"))
        elif m.group(2) and (_TOKENISH.fullmatch(m.group(2)) or _FORMAT.fullmatch(m.group(2))):
            spans.append((m.start(2), m.end(2), "a token as a URL's user info (TOKEN@host)"))
    at = 0
    while (m := _PAIR.search(text, at)) is not None:
        name, value = m.group("name"), m.group("value")
        if value.strip("\"'") not in UNSET and _pair_secret(name.rsplit(" ", 1)[-1] if " " in name else name):
            spans.append((m.start("value"), m.end("value"), f"a credential as a value ({mask(name)}=...)"))
            at = m.end()
        else:  # (a plain name's value is looked inside: ``oc.decode:'{pwd: S}'``, ``data.root=https://h?token=S``)
            at = m.start("value") + 1
    for m in _FLAG.finditer(text):
        if _pair_secret(m.group("name")):
            spans.append(
                (m.start("value"), m.end("value"), f"a credential as a command's flag (--{m.group('name')} ...)")
            )
    for m in _USER_PASS.finditer(text):
        if not m.group("value").isdigit():
            spans.append((m.start("value"), m.end("value"), "a password on a command line (-u user:...)"))
    if _MYSQL.search(text):
        for m in _ATTACHED_PASS.finditer(text):
            spans.append((m.start("value"), m.end("value"), "a password on a command line (-p...)"))
    for m in _ENV.finditer(text):
        if credential_name(m.group(1)):
            spans.append(
                (m.start(), m.end(), f"a credential's environment variable read into the config ({m.group(1)})")
            )
    for m in _BEARER.finditer(text):
        spans.append((m.start(1), m.end(1), "an Authorization header's value (Bearer ...)"))
    for m in _BASIC.finditer(text):
        if _basic(m.group(1)):
            spans.append((m.start(1), m.end(1), "an Authorization header's value (Basic ...)"))
    return sorted(spans)


def _unescaped(text: str) -> str:
    return text.replace("\\", "")  # (Hydra's overrides escape ``:`` and ``=`` in the values they record)


def mask(text: str) -> str:
    """``text`` with every credential in it (:func:`secret_spans`) replaced by ``***``."""
    if "\\" in text and secret_spans(_unescaped(text)):
        text = _unescaped(text)
    spans = secret_spans(text)
    if not spans:
        return text
    out, at = [], 0
    for start, end, _ in spans:
        if end <= at:
            continue
        out.append(text[at : max(start, at)])
        out.append("***")
        at = end
    out.append(text[at:])
    return "".join(out)


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
