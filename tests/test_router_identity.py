"""Who a request is comes from credentials, never from a header a client sets: API keys (hashed, read again when
the file changes) map to a tenant and its objectives; no valid key is a 401 where keys are configured; anonymous
serving is one tenant; only the trusted gateway's tenant header is believed; an objective not allowed is a 403."""
from __future__ import annotations

import json
import os

import httpx
import pytest

from router_fakes import FAKE_MODEL, fake_replica
from stallfree.operator.router.api_keys import KeyBook, hash_key, parse_keys
from stallfree.operator.router.identity import ANONYMOUS, Caller, Unauthorized, identify, objective_for
from stallfree.operator.router.objectives import parse_objectives
from test_router_proxy import router

OBJECTIVES_JSON = json.dumps([{"name": "interactive", "priority": 10, "ttftP99Ms": 600000, "default": True},
                              {"name": "batch", "priority": -1, "ttftP99Ms": 600000}])
OBJECTIVES = parse_objectives(OBJECTIVES_JSON)


def _keys_file(path, entries: list[tuple[str, str, object]]) -> str:
    keys = [{"sha256": hash_key(key), "tenant": tenant, "objectives": objectives}
            for key, tenant, objectives in entries]
    path.write_text(json.dumps({"keys": keys}))
    return str(path)


def _headers(**pairs: str) -> list[tuple[bytes, bytes]]:
    return [(k.replace("_", "-").encode(), v.encode()) for k, v in pairs.items()]


def test_the_keys_file_holds_hashes_and_names_its_problems(tmp_path) -> None:
    good = parse_keys(json.dumps({"keys": [{"sha256": hash_key("k1"), "tenant": "a", "objectives": ["batch"]},
                                           {"sha256": hash_key("k2"), "tenant": "b"}]}))
    assert good[hash_key("k1")].objectives == frozenset({"batch"}) and good[hash_key("k2")].objectives is None
    for bad, words in (("[]", "must be"), ('{"keys": [{"sha256": "k1", "tenant": "a"}]}', "64 hex digits"),
                       (json.dumps({"keys": [{"sha256": hash_key("k"), "tenant": ""}]}), "tenant"),
                       (json.dumps({"keys": [{"sha256": hash_key("k"), "tenant": "a", "objectives": []}]}),
                        "objectives"),
                       (json.dumps({"keys": [{"sha256": hash_key("k"), "tenant": "a"}] * 2}), "twice")):
        with pytest.raises(ValueError, match=words):
            parse_keys(bad)
    with pytest.raises(ValueError, match="--api-keys-file"):
        KeyBook(str(tmp_path / "missing.json"))


def test_keys_rotate_without_a_restart_and_a_broken_file_keeps_the_last_good_keys(tmp_path) -> None:
    path = tmp_path / "keys.json"
    book = KeyBook(_keys_file(path, [("old-key", "team", "*")]), recheck_s=0)
    assert book.holder("old-key", 0).tenant == "team" and book.holder("new-key", 0) is None
    _keys_file(path, [("new-key", "team", ["batch"])])
    os.utime(path, ns=(1, 1))  # a change even within the file system's timestamp granularity
    assert book.holder("old-key", 1) is None and book.holder("new-key", 1).objectives == frozenset({"batch"})
    path.write_text("{not json")
    assert book.holder("new-key", 2) is not None and book.failed_reloads == 1
    assert book.holder("x" * 10_000, 3) is None  # never hashed


def test_without_keys_every_client_is_one_tenant_whatever_it_claims() -> None:
    caller = identify(_headers(x_gateway_inference_fairness_id="victim"), None, "admin-token", None, 0)
    assert caller == Caller(ANONYMOUS)


def test_with_keys_the_key_names_the_tenant_and_its_objectives(tmp_path) -> None:
    book = KeyBook(_keys_file(tmp_path / "k.json", [("key-a", "team-a", ["batch"])]))
    for headers, code in ((_headers(), "missing_api_key"), (_headers(authorization="Bearer nope"), "invalid_api_key"),
                          (_headers(authorization="Basic key-a"), "missing_api_key")):
        refused = identify(headers, book, None, None, 0)
        assert isinstance(refused, Unauthorized) and refused.status == 401 and refused.code == code
    caller = identify(_headers(authorization="Bearer key-a", x_gateway_inference_fairness_id="victim"), book, None,
                      None, 0)
    assert caller == Caller("team-a", frozenset({"batch"}))  # its claim of another tenant is ignored
    assert identify(_headers(authorization="Bearer admin-token"), book, "admin-token", None, 0).tenant == "admin"
    # Only the trusted gateway's tenant header counts; a wrong secret is no gateway.
    trusted = _headers(x_stallfree_upstream_secret="gw-secret", x_gateway_inference_fairness_id="user-7")
    assert identify(trusted, book, None, "gw-secret", 0) == Caller("user-7")
    forged = _headers(x_stallfree_upstream_secret="guess", x_gateway_inference_fairness_id="user-7")
    assert isinstance(identify(forged, book, None, "gw-secret", 0), Unauthorized)


def test_an_objective_the_caller_may_not_use_is_a_403_and_no_header_gets_an_allowed_one() -> None:
    batch_only = Caller("t", frozenset({"batch"}))
    interactive, batch = OBJECTIVES.by_name["interactive"], OBJECTIVES.by_name["batch"]
    refused = objective_for(batch_only, interactive, True, OBJECTIVES)
    assert isinstance(refused, Unauthorized) and refused.status == 403 and refused.code == "objective_not_allowed"
    assert objective_for(batch_only, interactive, False, OBJECTIVES) is batch  # the default is not its own
    assert objective_for(batch_only, batch, True, OBJECTIVES) is batch
    assert objective_for(Caller(ANONYMOUS), interactive, True, OBJECTIVES) is interactive


def test_over_http_keys_are_required_tenants_come_from_them_and_objectives_are_checked(tmp_path) -> None:
    keys = _keys_file(tmp_path / "keys.json", [("key-batch", "nightly", ["batch"]), ("key-all", "app", "*")])
    body = {"model": FAKE_MODEL, "prompt": "hello"}
    with fake_replica() as fake, router([fake.url], "--objectives", OBJECTIVES_JSON, "--api-keys-file", keys) as url:
        def post(key: str | None, objective: str | None = None) -> httpx.Response:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            if objective:
                headers["x-stallfree-objective"] = objective
            return httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=10)

        assert post(None).status_code == 401 and post("wrong").json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 401
        denied = post("key-batch", "interactive")
        assert denied.status_code == 403 and denied.json()["error"]["code"] == "objective_not_allowed"
        assert fake.inference() == []  # nothing refused reached a replica
        assert post("key-batch").status_code == 200 and post("key-batch", "batch").status_code == 200
        assert post("key-all", "interactive").status_code == 200
        assert len(fake.inference()) == 3
