"""Places named by URL (``s3://``, ``gs://``, ...): fsspec filesystems opened with the user's storage options.

``loader.storage_options`` and ``ckpt.storage_options`` are fsspec keyword arguments for the data's and the
checkpoints' filesystem (for another S3 API: ``{client_kwargs: {endpoint_url: ...}}``).  Credentials are never
among them: the config is saved with every run, so a key in it would end up in the run dir and in the
tracking store.  They come from the environment (``AWS_ACCESS_KEY_ID``...), where the storage library
looks for them anyway, and a config that carries one is refused.
"""

from __future__ import annotations

import os
from typing import Any

from pitstop.errors import ConfigError

SECRET_WORDS = ("key", "secret", "token", "password", "passwd", "credential")
CREDENTIAL_ENV = {
    "s3": "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL for another S3 API)",
    "gs": "GOOGLE_APPLICATION_CREDENTIALS",
    "gcs": "GOOGLE_APPLICATION_CREDENTIALS",
    "az": "AZURE_STORAGE_CONNECTION_STRING",
    "abfs": "AZURE_STORAGE_CONNECTION_STRING",
}


def is_url(path: Any) -> bool:
    """A remote place (``scheme://``); ``file://`` and plain paths are local."""
    text = str(path)
    return "://" in text and not text.startswith("file://")


def scheme(url: str) -> str:
    return url.split("://", 1)[0] if "://" in url else "file"


def credential_vars(url: str) -> str:
    return CREDENTIAL_ENV.get(scheme(url), "the storage backend's variables")


def is_permission_error(e: BaseException) -> bool:
    """Wrong or missing credentials, or no permission (as s3fs, gcsfs or botocore say it)."""
    text = f"{type(e).__name__} {e}".lower()
    return isinstance(e, PermissionError) or any(
        w in text
        for w in (
            "credentials",
            "access denied",
            "accessdenied",
            "invalidaccesskeyid",
            "signaturedoesnotmatch",
            "forbidden",
            "security token",
        )
    )


def credentials_hint(url: str) -> str:
    return (
        f"check the credentials in the environment ({credential_vars(url)}); pitstop never takes them from the config"
    )


def storage_options(options: Any, key: str) -> dict:
    """``options`` (a config node or dict) as a plain dict, refusing anything that looks like a credential."""
    if options is None:
        return {}
    from omegaconf import OmegaConf

    if OmegaConf.is_config(options):
        options = OmegaConf.to_container(options, resolve=True)
    if not isinstance(options, dict):
        raise ConfigError(
            f"{key} must be a mapping of fsspec options (e.g. {{client_kwargs: {{endpoint_url: URL}}}}), "
            f"got {options!r}"
        )

    def walk(node: dict, where: str) -> None:
        for k, v in node.items():
            name = f"{where}.{k}"
            if _looks_secret(str(k)):
                raise ConfigError(_refusal(name, f"remove {name}"))
            if isinstance(v, dict):
                walk(v, name)

    walk(options, key)
    return options


_OPTIONS: dict[str, dict] = {}  # root URL -> the storage options of everything under it (see use_options)


def use_options(root: str, options: dict) -> None:
    """Open everything under ``root`` with ``options`` in this process (the checkpoint manager registers
    ``ckpt.dir`` once, so the layout's functions stay functions of a path)."""
    if is_url(root):
        _OPTIONS[str(root).rstrip("/")] = dict(options)


def options_for(url: str) -> dict:
    best = max((r for r in _OPTIONS if url == r or url.startswith(r + "/")), key=len, default=None)
    return _OPTIONS[best] if best is not None else {}


def credentials_in_overrides(args: list[str]) -> str | None:
    """A command-line override that would put a credential into ``*.storage_options`` (checked before Hydra
    composes the config, because Hydra saves the overrides and the config in the run dir first)."""
    import re

    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or "storage_options" not in key:
            continue
        key = key.lstrip("+~")
        names = key.split("storage_options", 1)[1].split(".") + re.findall(r"([A-Za-z_][\w-]*)\s*:", value)
        if any(_looks_secret(name) for name in names):
            return _refusal(key, "drop that override")
    return None


def _looks_secret(name: str) -> bool:
    return any(w in name.lower() for w in SECRET_WORDS)


def _refusal(name: str, then: str) -> str:
    return (
        f"{name}: credentials never go in the config (it is saved with the run); set them in the environment "
        f"instead (e.g. AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) and {then}"
    )


def filesystem(url: str, options: dict | None = None) -> tuple[Any, str]:
    """``(fsspec filesystem, path within it)`` for ``url``: ``options``, else those registered for it."""
    from fsspec.core import url_to_fs

    return url_to_fs(url, **(options if options is not None else options_for(url)))


def join(root: str, name: str) -> str:
    return f"{str(root).rstrip('/')}/{name}" if is_url(root) else os.path.join(root, name)
