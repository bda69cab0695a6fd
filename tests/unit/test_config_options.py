"""Every config group in conf/ has its documented options, each a commented YAML file (the files only; nothing is
composed). Each option trains in tests/integration/test_config_groups.py.
"""

from __future__ import annotations

from pathlib import Path


from conftest import CONF, config_options


def test_every_group_has_its_documented_options():
    assert config_options("data") == ["digits", "imagefolder", "synthetic", "webdataset"]
    assert config_options("model") == ["cnn", "resnet18", "torchvision"]
    assert config_options("optim") == ["adamw", "sgd"]
    assert {"plain"} <= set(config_options("loader")) and config_options("strategy") == ["ddp", "fsdp", "ft", "single"]
    assert config_options("ckpt") == ["async_dcp", "async_dcp_pinned", "none", "sync_dcp", "sync_save"]
    faults = ["bad_node", "bitflip", "bug", "corrupt_peer_copy", "crash_at_step", "during_heal", "during_save"]
    faults += ["lose_node", "lose_node_and_partner", "none", "nonfinite", "poison", "preempt", "random", "slow_rank"]
    faults += ["stall"]
    assert config_options("fault") == faults
    assert config_options("logger") == ["mlflow", "none"] and config_options("loader") == ["cached", "plain"]
    for group in ("data", "model", "optim", "loader", "strategy", "ckpt", "fault", "logger", "trainer", "debug"):
        for name in config_options(group):  # small, commented YAML named for its variant
            assert Path(CONF, group, f"{name}.yaml").read_text().lstrip().startswith("#"), (group, name)
    assert Path(CONF, "train.yaml").read_text().startswith("# python -m recipe.train")


SCHEMA_GROUPS = ("ckpt", "loader", "strategy", "fault", "logger", "trainer")


def _fields(cls, prefix=""):
    """Every key of a schema, nested sections (trainer.hang, ckpt.local) flattened: (dotted name, field, owner)."""
    import dataclasses

    for f in dataclasses.fields(cls):
        if isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory):
            yield from _fields(f.default_factory, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f, cls


def test_every_schema_key_has_its_default_and_its_doc_in_one_place():
    from pitstop.config.schema import SCHEMAS

    for group, schemas in SCHEMAS.items():
        for cls in schemas.values():
            for name, f, owner in _fields(cls):
                if name != "_target_":  # (each schema's own class to build)
                    assert f.metadata.get("doc"), f"{group}.{name} ({owner.__name__}) has no doc"


def test_a_yaml_option_sets_only_what_differs_from_its_schemas_defaults(tmp_path):
    # a value restated in a YAML option would be a second home for its default
    import dataclasses

    from omegaconf import OmegaConf

    from conftest import compose_cfg

    for group in SCHEMA_GROUPS:
        for name in config_options(group):
            raw = OmegaConf.to_container(OmegaConf.load(Path(CONF, group, f"{name}.yaml")))
            raw.pop("defaults", None)
            kind = OmegaConf.get_type(compose_cfg([f"{group}={name}"], tmp_path)[group])
            assert dataclasses.is_dataclass(kind), (group, name, kind)
            defaults = OmegaConf.to_container(OmegaConf.structured(kind))
            for key, value in raw.items():
                assert value != defaults.get(key), f"{group}={name} restates {group}.{key}={value!r}, its default"
