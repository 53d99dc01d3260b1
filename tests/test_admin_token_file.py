"""A mounted Secret is followed: the token the operator makes anew works without a daemon restart."""
import os

import pytest
from starlette.requests import Request

from stallfree.node_daemon.server.auth import Auth, SecretFile, watched_secret
from stallfree.node_daemon.server.errors import APIError


def request_with(token: str) -> Request:
    return Request({"type": "http", "headers": [(b"authorization", f"Bearer {token}".encode())]})


def replace_like_the_kubelet(path, value: str) -> None:
    # The kubelet writes a new file and swaps it in (a new inode), never edits in place.
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(value + "\n")
    os.replace(tmp, path)


def test_a_rewritten_token_file_is_used_at_once(tmp_path):
    path = tmp_path / "token"
    path.write_text("first\n")
    auth = Auth(watched_secret(str(path), "UNUSED_ENV"))
    auth.check_admin(request_with("first"))
    replace_like_the_kubelet(path, "second")
    with pytest.raises(APIError) as refused:
        auth.check_admin(request_with("first"))
    assert refused.value.status == 401
    auth.check_admin(request_with("second"))


def test_a_file_gone_mid_swap_keeps_the_last_token(tmp_path):
    path = tmp_path / "token"
    path.write_text("kept\n")
    secret = SecretFile(str(path))
    path.unlink()
    assert secret.current() == "kept"
    path.write_text("\n")  # an empty file is not a token: keep the last one
    assert secret.current() == "kept"


def test_an_unreadable_or_empty_file_is_a_start_up_error(tmp_path):
    with pytest.raises(ValueError, match="cannot read secret file"):
        SecretFile(str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("  \n")
    with pytest.raises(ValueError, match="is empty"):
        SecretFile(str(tmp_path / "empty"))


def test_without_a_file_the_environment_gives_the_token(monkeypatch):
    monkeypatch.setenv("SOME_TOKEN_ENV", "from-env")
    assert watched_secret(None, "SOME_TOKEN_ENV") == "from-env"
    assert Auth("from-env").admin_token == "from-env"
