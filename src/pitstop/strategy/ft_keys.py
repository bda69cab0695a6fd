"""``strategy=ft``'s keys, checked without torch: the launcher refuses a bad value before it starts anything. And
two facts the launcher and the groups share: the name of the job's secret, and whether the job is on one machine."""

from __future__ import annotations

from urllib.parse import urlsplit

from pitstop.config.checks import is_integer
from pitstop.errors import ConfigError

# The job's secret (hex): a heal's state is served only to, and accepted only from, a process that has it. The
# launcher that starts the Lighthouse makes one; a job on several machines exports the same value on each. It never
# goes into the config, the run dir, the logs or a tracker.
SECRET_ENV = "PITSTOP_FT_SECRET"
LOOPBACK = ("127.0.0.1", "::1", "localhost")


def on_loopback(lighthouse: str) -> bool:
    """True when the Lighthouse is reached over loopback (``127.0.0.1``, ``::1``, ``localhost``): then every group
    of the job runs on this machine, and each listens on loopback alone."""
    url = lighthouse if "://" in lighthouse else f"http://{lighthouse}"
    try:
        return urlsplit(url).hostname in LOOPBACK
    except ValueError:
        return False


def check_keys(replicas: int, replica_id: int | None, min_replicas: int, inner: str, nproc_per_node: int) -> None:
    """The rules between strategy=ft's keys, each refused in one line naming its key (each key's own range is
    declared next to it, in ``pitstop.config.schema.FT``, and checked before this)."""
    if not is_integer(min_replicas) or not 1 <= min_replicas <= replicas:
        raise ConfigError(f"strategy.min_replicas={min_replicas!r} must be between 1 and strategy.replicas={replicas}")
    if replica_id is not None and (not is_integer(replica_id) or not 0 <= replica_id < replicas):
        raise ConfigError(f"strategy.replica_id={replica_id!r} must be null or 0 .. strategy.replicas-1={replicas - 1}")
    if inner not in ("ddp", "fsdp"):
        raise ConfigError(f"strategy.inner={inner!r} is not a strategy inside a replica group: use ddp or fsdp")
    if inner == "fsdp" and nproc_per_node < 2:
        raise ConfigError(
            "strategy.inner=fsdp shards inside a replica group, which needs strategy.nproc_per_node >= 2 (HSDP: "
            "sharded inside a group, replicated across groups); or use strategy.inner=ddp"
        )
