"""Secrets by meaning, not by last key (issue 46): a credential planted by every route through a config is refused in
one line naming its key and never its bytes, near spellings and token formats are known without taking pitstop's
own names (``author``, ``tokenizer``, ``sort_key``) for credentials, and every sink's filter (the tracker's params
and tags, the metrics file, the log records) leaves the planted bytes out. Pure logic on OmegaConf configs; the
real commands are ``system/test_secrets.py``'s."""

from __future__ import annotations

import io
import json
import logging

import pytest
from omegaconf import OmegaConf

from pitstop.config.credentials import credential_name, mask
from pitstop.config.secrets import find_secrets, mask_logs, redact, sweep_overrides
from pitstop.telemetry.logger.mlflow import MLflowLogger
from pitstop.telemetry.metrics import MetricsFile

S = "hunter2-s3cr3t"  # the planted secret: its bytes must be in no refusal and no sink's output
GHP = "ghp_" + "A1b2C3d4" * 4  # token formats, planted whole (each is its own secret)
FORMATS = {
    "github": GHP,
    "aws key id": "AKIAIOSFODNN7EXAMPLE",
    "slack": "xoxb-2048-4096-abcdefghijKLMN",
    "sk-": "sk-proj-" + "Zx9" * 10,
    "jwt": "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0In0.c2lnbmF0dXJlLWhlcmU",
    "pem": "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n-----END OPENSSH PRIVATE KEY-----",
    "hugging face": "hf_" + "qWeRtY12" * 4,  # (a route the issue does not list)
    "gitlab": "glpat-" + "x7Y8z9" * 4,
}

# route: (config, the key the first refusal names). Each plants S (or a token) where the old guard, which looked at
# the last key of a path only, let it through.
ROUTES = {
    "list item under a credential key": ({"svc": {"api_keys": [S]}}, "svc.api_keys"),
    "inner key of a credential dict": ({"svc": {"credentials": {"user": "u", "pass": S}}}, "svc.credentials"),
    "Authorization header in storage options": (
        {"data": {"storage_options": {"client_kwargs": {"headers": {"Authorization": f"Bearer {S}"}}}}},
        "data.storage_options.client_kwargs.headers.Authorization",
    ),
    "header at any nesting": (
        {"loader": {"http": {"a": [{"headers": {"X-Api-Key": S}}]}}},
        "loader.http.a.0.headers.X-Api-Key",
    ),
    "oc.create": ({"svc": {"opts": "${oc.create:{user: u, api_key: " + S + "}}"}}, "svc.opts"),
    "oc.decode (not in the issue)": ({"svc": "${oc.decode:'{pwd: " + S + "}'}"}, "svc"),
    "oc.env default (not in the issue)": (
        {"svc": {"url": "${oc.env:PITSTOP_UNSET_X,'https://h/x?token=" + S + "'}"}},
        "svc.url",
    ),
    "a token as a dict's key (not in the issue)": ({"svc": {GHP: 1}}, "svc.***"),
    "a credential's variable into a plain key (not in the issue)": (
        {"svc": {"x": "${oc.env:AWS_SECRET_ACCESS_KEY}"}},
        "svc.x",
    ),
    "a command's flag, as a launcher's setup line (not in the issue)": (
        {"hydra": {"launcher": {"setup": [f"export A=1; tool login --password {S}", f"tool --token={S}"]}}},
        "hydra.launcher.setup.0",
    ),
    "curl -u user:password in a setup line (red team)": (
        {"hydra": {"launcher": {"setup": [f"curl -u alice:{S} https://h/x"]}}},
        "hydra.launcher.setup.0",
    ),
    "mysql -pPASSWORD in a setup line (red team)": (
        {"hydra": {"launcher": {"setup": [f"mysql -uroot -p{S} db < x.sql"]}}},
        "hydra.launcher.setup.0",
    ),
    "JSON inside a string (not in the issue)": ({"svc": {"j": '{"api_key": "%s"}' % S}}, "svc.j"),
    "sweeper params": ({"hydra": {"sweeper": {"params": {"+svc.api_key": S}}}}, "hydra.sweeper.params.+svc.api_key"),
    "api-key": ({"svc": {"api-key": S}}, "svc.api-key"),
    "apikey": ({"svc": {"apikey": S}}, "svc.apikey"),
    "apiKey": ({"svc": {"apiKey": S}}, "svc.apiKey"),
    "pwd": ({"db": {"pwd": S}}, "db.pwd"),
    "auth": ({"http": {"auth": S}}, "http.auth"),
    "auth_header": ({"http": {"auth_header": S}}, "http.auth_header"),
    "bearer": ({"http": {"bearer": S}}, "http.bearer"),
    "clientSecret": ({"oidc": {"clientSecret": S}}, "oidc.clientSecret"),
    "X-Auth-Token": ({"headers": {"X-Auth-Token": S}}, "headers.X-Auth-Token"),
    "token as user info": ({"data": {"root": f"https://{GHP}@github.com/o/r"}}, "data.root"),
    "opaque token as user info": ({"data": {"root": "https://a8F3k2L9q0Zx7Wm4Tn6Pv1@host/d"}}, "data.root"),
    "?access_token=": ({"data": {"root": f"https://h/d?access_token={S}"}}, "data.root"),
    "?token=": ({"data": {"root": f"https://h/d?v=1&token={S}"}}, "data.root"),
    "sig= (SAS)": ({"data": {"root": f"https://a.blob.core.windows.net/c?sv=2022&sig={S}"}}, "data.root"),
    "X-Amz-Signature": ({"ckpt": {"dir": f"https://b.s3.amazonaws.com/k?X-Amz-Signature={S}"}}, "ckpt.dir"),
    "postgresql://u:p@h": ({"svc": {"db": f"postgresql://u:{S}@h:5432/d"}}, "svc.db"),
    "ADO Password=": ({"svc": {"db": f"Server=h;Database=d;User Id=u;Password={S};"}}, "svc.db"),
    "Azure AccountKey=": ({"svc": {"conn": f"DefaultEndpointsProtocol=https;AccountKey={S};"}}, "svc.conn"),
    "Basic header value": ({"svc": {"header": "Basic aHVudGVyOmh1bnRlcjItczNjcjN0"}}, "svc.header"),
    **{f"format: {name}": ({"run": {"name": token}}, "run.name") for name, token in FORMATS.items()},
}


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_secret_planted_by_each_route_is_refused_naming_its_key_not_its_bytes(route):
    tree, key = ROUTES[route]
    lines = find_secrets(OmegaConf.create(tree))
    planted = [S, *FORMATS.values(), "aHVudGVyOmh1bnRlcjItczNjcjN0", "a8F3k2L9q0Zx7Wm4Tn6Pv1"]
    assert lines and lines[0].startswith(f"{key}: ") and "never go" in lines[0], lines
    assert not [p for p in planted if any(p in line for line in lines)]
    assert all("\n" not in line for line in lines)


CREDENTIAL_NAMES = [
    "api-key", "apikey", "apiKey", "API_KEY", "x-api-key", "pwd", "passwd", "pass", "passphrase", "auth",
    "auth_header", "Authorization", "bearer", "client_secret", "AWS_SECRET_ACCESS_KEY", "sas_token", "sastoken",
    "access_tokens", "AccountKey", "X-Amz-Signature", "X-Amz-Security-Token", "sig", "cookie", "credentials", "token",
    "hf_token", "github_token",
]  # fmt: skip
PLAIN_NAMES = [
    "author", "authors", "authority", "tokenizer", "tokens_per_step", "max_tokens", "sort_key", "label_key",
    "image_keys", "exclude_keys", "keep_last_k", "keys", "monkey", "passage", "bypass", "compass", "auth_type",
    "token_url", "secret_name", "signature_version", "key_file", "keyboard", "key", "pad_token", "eos_token",
    "bos_token", "unk_token", "mask_token", "cls_token", "sep_token", "pad_token_id", "eos_token_id", "image_token",
]  # fmt: skip


def test_near_spellings_name_a_credential_and_whole_words_keep_plain_names_plain():
    assert [n for n in CREDENTIAL_NAMES if not credential_name(n)] == []
    assert credential_name("key", storage=True)  # (fsspec's key: a credential under storage options only)
    assert [n for n in PLAIN_NAMES if credential_name(n)] == []


def test_plain_values_and_settings_of_a_credential_are_not_secrets():
    cfg = OmegaConf.create(
        {
            "a": {"author": "Ada", "tokenizer": "bpe", "sort_key": "name", "tokens_per_step": 4096, "max_tokens": 8},
            "b": {"root": "https://bob@h/x", "plain": "s3://bucket/key=1/part", "ssh": "ssh://git@github.com/o/r"},
            "c": {"auth": {"type": "basic", "enabled": True}, "use_auth": False, "token_url": "https://h/oauth/token"},
            "d": {"api_key": None, "password": "", "secret": "???", "credentials": {}, "api_keys": []},
            "e": "train.sort_key=value ckpt.keep_last_k=3 Basic augmentation, a bearer of news",
            "f": ["docker run -u 1000:1000 img", "python -m http.server -p8080", "ssh -p 2222 host"],
            "g": {"pad_token": "<pad>", "eos_token_id": 2, "key": "jpg", "image_token": "<image>"},
        }
    )
    assert find_secrets(cfg) == []


def test_the_sweeper_params_are_swept_before_the_command_lines_overrides():
    cfg = OmegaConf.create(
        {"hydra": {"sweeper": {"params": {"+svc": "leak", "optim": "sgd,adamw"}}, "overrides": {"task": ["seed=1"]}}}
    )
    assert sweep_overrides(cfg) == ["+svc=leak", "optim=sgd,adamw", "seed=1"]
    no_params = OmegaConf.create({"hydra": {"sweeper": {"params": None}, "overrides": {"task": ["seed=1"]}}})
    assert sweep_overrides(no_params) == ["seed=1"]


def test_every_sinks_record_leaves_credentials_out_and_masks_them_in_text():
    record = {
        "logger.tracking_uri": f"https://bob:{S}@mlflow/x",
        "ckpt.storage_options.client_kwargs.headers.Authorization": f"Bearer {S}",
        "svc": {"credentials": {"user": "u", "pass": S}, "api_keys": [S], "db": f"Server=h;Password={S};"},
        "sweep_overrides": f"['+svc.api_key={S}', 'data.root=https://h/d?access_token={S}', 'seed=3']",
        "runs": [{"dir": f"https://{GHP}@github.com/o/r"}],
        "tokens_per_s": 12.5,
        "seed": 3,
    }
    out = redact(record)
    assert S not in json.dumps(out) and GHP not in json.dumps(out)
    assert out["logger.tracking_uri"] == "https://bob:***@mlflow/x"
    assert out["svc"] == {"db": "Server=h;Password=***;"}
    assert out["runs"] == [{"dir": "https://***@github.com/o/r"}]
    assert (out["tokens_per_s"], out["seed"]) == (12.5, 3)  # (figures stay: a metric is not a credential)
    assert "seed=3" in out["sweep_overrides"]


def test_the_trackers_first_message_and_the_metrics_file_carry_no_secret(tmp_path):
    params = {"svc.api_key": S, "data.root": f"https://h/d?token={S}", "seed": "3"}
    hello = MLflowLogger(tracking_uri=f"file://{tmp_path}/mlruns").hello(
        str(tmp_path), params, {"sweep_overrides": f"+svc.pwd={S}"}
    )
    assert S not in json.dumps(hello) and hello["params"]["seed"] == "3"
    metrics = MetricsFile(str(tmp_path / "metrics.jsonl"))
    metrics.write({"step": 1, "loss": 0.5, "event": f"opened s3://u:{S}@b/x"})
    metrics.close()
    assert (
        S not in (tmp_path / "metrics.jsonl").read_text() and '"loss":0.5' in (tmp_path / "metrics.jsonl").read_text()
    )


def test_every_log_record_is_masked_before_any_handler_sees_it():
    mask_logs()
    mask_logs()  # (idempotent: one factory, not one per call)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    log = logging.getLogger("pitstop.test_secrets")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        log.info("reading %s with %s", f"s3://u:{S}@b/x", GHP)
        try:
            raise OSError(f"403 for https://h/d?access_token={S}")
        except OSError:
            log.exception("fetch failed")
        log.info("plain %d%%", 50)
    finally:
        log.removeHandler(handler)
    text = stream.getvalue()
    assert S not in text and GHP not in text
    assert "reading s3://u:***@b/x with ***" in text and "access_token=***" in text and "plain 50%" in text


def test_mask_reads_hydras_escaped_overrides():
    assert S not in mask(f"data.root=https\\://bob\\:{S}@h/x") and mask("seed=3 a.b=c") == "seed=3 a.b=c"
