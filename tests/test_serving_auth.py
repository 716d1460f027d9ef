"""API keys: each speaks for one user with a role (``[[serve.keys]]``, the keys file), plain
hashes keep working, and without keys every loopback caller is one trusted caller."""

from __future__ import annotations

from pathlib import Path

import click
import pytest

from pipeline.serving.auth import Authenticator
from pipeline.serving.commands import _keys
from pipeline.serving.errors import ApiError
from pipeline.serving.settings import ServeSettings, hash_key
from pipeline.settings import load_settings


def bearer(key: str) -> str:
    return f"Bearer {key}"


def test_a_key_speaks_for_its_user_with_its_role() -> None:
    cfg = ServeSettings(
        keys=[
            {"sha256": hash_key("sk-bob"), "user": "bob"},
            {"sha256": hash_key("sk-ops").upper(), "user": "review", "role": "operator"},
        ],
        api_key_hashes=[hash_key("sk-old"), hash_key("sk-bob")],  # bob's: keys wins
    )
    assert not cfg.open_access
    assert [(k.user, k.role) for k in cfg.accepted_keys] == [
        ("bob", "user"),
        ("review", "operator"),
        (None, "user"),
    ]
    auth = Authenticator(cfg.accepted_keys)
    bob, ops, old = (auth.caller(bearer(k)) for k in ("sk-bob", "sk-ops", "sk-old"))
    assert (bob.user, bob.operator, bob.keyed) == ("bob", False, True)
    assert bob.key_id == hash_key("sk-bob")[:16] and bob.voter("feedback") == bob.key_id
    assert (ops.user, ops.operator) == ("review", True)
    # A plain hash is a user of its own, named by its key id as before.
    assert (old.user, old.operator) == (hash_key("sk-old")[:16], False)
    assert not bob.may_act_for("alice") and bob.may_act_for("bob") and bob.may_act_for(None)
    assert ops.may_act_for("alice")
    with pytest.raises(ApiError) as unknown:
        auth.caller(bearer("sk-forged"))
    assert unknown.value.status == 401


def test_without_keys_every_loopback_caller_is_one_trusted_voter() -> None:
    """Issue 37: every bearer string was a voter of its own, so 100 forged tokens were 100
    votes. On loopback without keys a bearer string says nothing about who sends it."""
    auth = Authenticator([])
    callers = [auth.caller(bearer(f"forged-{i}")) for i in range(100)] + [auth.caller(None)]
    assert {c.voter("feedback") for c in callers} == {"loopback"}
    assert {c.voter("gui") for c in callers} == {"loopback:gui"}  # one voter per source
    assert all(c.operator and not c.keyed for c in callers)  # trusted: loopback only
    # Sessions a client does not name stay apart per bearer string, as before.
    assert len({c.key_id for c in callers}) == 101 and callers[-1].key_id == "anonymous"


@pytest.mark.parametrize(
    ("keys", "match"),
    [
        ([{"sha256": "abc", "user": "bob"}], "sha256"),
        ([{"sha256": hash_key("k"), "user": ""}], "user"),
        ([{"sha256": hash_key("k"), "user": "bob\n"}], "printable"),
        ([{"sha256": hash_key("k"), "role": "admin"}], "role"),
        ([{"sha256": hash_key("k"), "key": "k"}], "Extra inputs"),  # never the raw key
        (
            [{"sha256": hash_key("k"), "user": "a"}, {"sha256": hash_key("k"), "user": "b"}],
            "listed twice",
        ),
    ],
)
def test_bad_key_entries_are_refused_when_settings_load(keys: list[dict], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ServeSettings(keys=keys)


def test_a_plain_hash_must_be_sha256_hex() -> None:
    with pytest.raises(ValueError, match="not a sha256 hex digest"):
        ServeSettings(api_key_hashes=["sk-raw-key-by-mistake"])


def test_keys_from_toml(tmp_path: Path) -> None:
    path = tmp_path / "liverl.toml"
    path.write_text(
        f'[serve]\napi_key_hashes = ["{hash_key("k0")}"]\n'
        f'[[serve.keys]]\nsha256 = "{hash_key("k1")}"\nuser = "bob"\n'
        f'[[serve.keys]]\nsha256 = "{hash_key("k2")}"\nuser = "ops"\n'
        'role = "operator"\n'
    )
    cfg = load_settings(path).serve
    assert [(k.user, k.role) for k in cfg.accepted_keys] == [
        ("bob", "user"),
        ("ops", "operator"),
        (None, "user"),
    ]


def test_the_keys_file_names_users_and_operators(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LIVERL_SERVE_API_KEYS", "sk-env")
    keys = tmp_path / "keys"
    keys.write_text("# plain keys stay valid\nsk-plain\n\nsk-bob bob\nsk-ops review operator\n")
    hashes, entries = _keys(("sk-cli",), keys)
    assert hashes == [hash_key(k) for k in ("sk-cli", "sk-env", "sk-plain")]
    assert [(e.sha256, e.user, e.role) for e in entries] == [
        (hash_key("sk-bob"), "bob", "user"),
        (hash_key("sk-ops"), "review", "operator"),
    ]
    keys.write_text("sk-ops review admin\n")
    with pytest.raises(click.UsageError, match=r"keys:1: expected"):
        _keys((), keys)


def test_a_keyed_post_names_its_user_and_an_operator_says_so() -> None:
    """The reward workers leave out a keyed post whose user does not own the session unless
    it says ``operator`` (processors/rewards.foreign_poster): the gateway writes both."""
    from pipeline.serving.auth import Caller
    from pipeline.serving.feedback import poster

    bob = Caller("kb", "bob", operator=False, keyed=True)
    ops = Caller("ko", "review", operator=True, keyed=True)
    assert poster(bob, "feedback") == {"key_id": "kb", "user_id": "bob"}
    assert poster(ops, "gui") == {"key_id": "ko", "user_id": "review", "operator": True}
    assert poster(Caller("kx", "kx"), "gui") == {"key_id": "loopback:gui"}
