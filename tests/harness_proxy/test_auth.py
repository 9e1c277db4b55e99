"""Per-execution bearer tokens."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from base.execution_token import mint_token, read_secret, verify_token, write_secret
from harness_proxy.auth import bearer_token

SECRET = b"k" * 32


@given(st.from_regex(r"[A-Za-z0-9_-]{1,64}", fullmatch=True))
def test_minted_tokens_verify_to_their_execution(execution_id):
    token = mint_token(SECRET, execution_id)
    assert token.startswith(f"gyre.{execution_id}.0.t.")
    assert verify_token(SECRET, token) == (execution_id, 0, True)
    assert verify_token(b"other secret", token) is None


@given(st.integers(min_value=0, max_value=10**10 - 1))
def test_the_version_floor_is_signed_with_the_execution(min_version):
    token = mint_token(SECRET, "ex-1", min_version=min_version)
    assert verify_token(SECRET, token) == ("ex-1", min_version, True)
    prefix, eid, version, mode, mac = token.split(".")
    # A harness cannot lower its own floor (or raise it): the MAC covers the version.
    assert verify_token(SECRET, f"{prefix}.{eid}.{min_version + 1}.{mode}.{mac}") is None
    if min_version:
        assert verify_token(SECRET, f"{prefix}.{eid}.0.{mode}.{mac}") is None


def test_an_eval_token_says_so_and_cannot_be_turned_into_a_training_one():
    token = mint_token(SECRET, "ex-1", min_version=3, train=False)
    assert verify_token(SECRET, token) == ("ex-1", 3, False)
    prefix, eid, version, mode, mac = token.split(".")
    assert mode == "e"
    # The MAC covers the mode: an eval run cannot claim the training sampling, nor the reverse.
    assert verify_token(SECRET, f"{prefix}.{eid}.{version}.t.{mac}") is None


def test_tampered_tokens_are_refused():
    token = mint_token(SECRET, "ex-1")
    prefix, eid, version, mode, mac = token.split(".")
    assert verify_token(SECRET, f"{prefix}.ex-2.{version}.{mode}.{mac}") is None
    assert verify_token(SECRET, f"{prefix}.{eid}.{version}.{mode}.{mac[:-1]}{'0' if mac[-1] != '0' else '1'}") is None
    assert verify_token(SECRET, f"other.{eid}.{version}.{mode}.{mac}") is None
    assert verify_token(SECRET, f"{prefix}.{eid}.00.{mode}.{mac}") is None
    assert verify_token(SECRET, f"{prefix}.{eid}.{version}.x.{mac}") is None
    assert verify_token(SECRET, f"{prefix}.{eid}.{version}.{mac}") is None
    assert verify_token(SECRET, token + ".x") is None
    assert verify_token(SECRET, token.upper()) is None


@given(st.text(max_size=300))
def test_arbitrary_strings_never_verify_and_never_raise(text):
    assert verify_token(SECRET, text) is None


@pytest.mark.parametrize("bad", ["", "a.b", "x" * 65, "sp ace", "é"])
def test_minting_refuses_ids_outside_the_alphabet(bad):
    with pytest.raises(ValueError):
        mint_token(SECRET, bad)
    with pytest.raises(ValueError):
        mint_token(b"", "ok")
    for version in (-1, 10**10, True, 1.0):
        with pytest.raises(ValueError):
            mint_token(SECRET, "ok", min_version=version)


def test_bearer_header_parsing():
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer  abc ") == "abc"
    assert bearer_token("Basic abc") is None
    assert bearer_token("Bearer ") is None
    assert bearer_token(None) is None


def test_the_secret_file_is_private_and_checked(tmp_path):
    path = tmp_path / "proxy.secret"
    secret = bytes(range(32))
    write_secret(path, secret)
    assert path.stat().st_mode & 0o777 == 0o600
    assert read_secret(path) == secret
    path.chmod(0o644)
    with pytest.raises(ValueError, match="want 0600"):
        read_secret(path)
    path.chmod(0o600)
    path.write_text("abcd")
    with pytest.raises(ValueError, match="at least 16 bytes"):
        read_secret(path)
