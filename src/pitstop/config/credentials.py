"""What says credential: a key's name (whole words, near spellings, what a qualifier or a describing word makes
of ``key`` and ``token``) and a value's text (URL passwords and token user info, credential-named pairs, command-line
passwords, ``Authorization`` values, token formats), and :func:`mask`, which hides each in a text.

Pure functions of names and strings; :mod:`pitstop.config.secrets` walks a config with them and stands them
before every sink.
"""

from __future__ import annotations

import base64
import binascii
import functools
import re
import unicodedata
from typing import Any


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
