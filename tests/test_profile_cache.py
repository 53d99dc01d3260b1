"""The profile cache: reused when its key matches, re-measured when any part of the key differs or the file is bad."""
from __future__ import annotations

import json
import logging

import pytest
import torch

from stallfree.contracts import Profile, ProfilePoint
from stallfree.node_daemon.measure import profiler
from stallfree.node_daemon.measure.profile_cache import CACHE_ENV, ProfileCache, cache_key, default_cache_dir, \
    engine_build, file_identity, profile_key
from stallfree.node_daemon.measure.profiler import ProfileSettings
from stallfree.cli.serve import parse_options
from stallfree.node_daemon.daemon import _startup_profile, build_llm_engine

PROFILE = Profile(device="cpu", decode_only=[ProfilePoint(1, 1, 3.0)],
                  mixed=[ProfilePoint(64, 4, 5.0), ProfilePoint(128, 4, 8.5)])


def _key(tmp_path, **changes):
    model = tmp_path / "model.gguf"
    if not model.exists():
        model.write_bytes(b"weights")
    parts = dict(device="cpu", model_config={"model": str(model), "dtype": "float32"},
                 model_file=file_identity(str(model)), threads=2, extra={"block_size": 16})
    parts.update(changes)
    return cache_key(**parts)


def test_a_matching_key_reads_back_the_profile(tmp_path) -> None:
    cache = ProfileCache(tmp_path / "cache")
    key = _key(tmp_path)
    assert cache.load(key)[0] is None
    path = cache.store(key, PROFILE)
    assert path is not None and path.parent == tmp_path / "cache"
    assert cache.load(_key(tmp_path))[0] == PROFILE


@pytest.mark.parametrize("change", ["device", "dtype", "threads", "model_file", "engine_build", "extra"])
def test_any_part_of_the_key_that_differs_misses(tmp_path, change) -> None:
    cache = ProfileCache(tmp_path / "cache")
    key = _key(tmp_path)
    cache.store(key, PROFILE)
    if change == "device":
        other = _key(tmp_path, device="cuda:H100")
    elif change == "dtype":
        other = _key(tmp_path, model_config={"model": key["model"]["model"], "dtype": "bfloat16"})
    elif change == "threads":
        other = _key(tmp_path, threads=1)
    elif change == "model_file":
        (tmp_path / "model.gguf").write_bytes(b"other weights")  # a new file at the same path
        other = _key(tmp_path, model_file=file_identity(str(tmp_path / "model.gguf")))
    elif change == "engine_build":
        other = dict(key, engine_build="0123456789abcdef")
    else:
        other = _key(tmp_path, extra={"block_size": 32})
    assert other != key
    assert cache.load(other)[0] is None


def test_a_file_under_the_right_name_with_another_key_is_ignored(tmp_path) -> None:
    cache = ProfileCache(tmp_path)
    key, other = _key(tmp_path), _key(tmp_path, threads=7)
    cache.store(other, PROFILE)
    cache.path_for(other).rename(cache.path_for(key))  # e.g. a hash collision or a hand-copied file
    profile, why = cache.load(key)
    assert profile is None and "key differs" in why


@pytest.mark.parametrize("body", ["{not json", '{"key": 1}', "", '{"profile": {"mixed": []}}'])
def test_a_corrupt_file_is_ignored(tmp_path, body) -> None:
    cache = ProfileCache(tmp_path)
    key = _key(tmp_path)
    cache.path_for(key).write_text(body)
    profile, why = cache.load(key)
    assert profile is None and why


def test_a_stored_key_with_a_corrupt_profile_is_ignored(tmp_path) -> None:
    cache = ProfileCache(tmp_path)
    key = _key(tmp_path)
    path = cache.store(key, PROFILE)
    data = json.loads(path.read_text())
    data["profile"]["mixed"][0] = {"tokens": 64}
    path.write_text(json.dumps(data))
    profile, why = cache.load(key)
    assert profile is None and "unreadable" in why


def test_the_cache_dir_follows_env_then_xdg(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "env"))
    assert default_cache_dir() == tmp_path / "env"
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "stallfree" / "profiles"


@pytest.fixture()
def quiet_rule(monkeypatch):
    """The busy-machine rules off: a test machine shared with others must not decide what this test sees."""
    monkeypatch.setattr(profiler, "MIN_CPU_SHARE", 0.0)
    monkeypatch.setattr(profiler, "curve_problems", lambda points: [])
    monkeypatch.setattr(profiler, "suspect_points", lambda points: [])


def _serve_engine(tmp_path, *extra: str):
    # float32: a Python-path engine (no compiled forward), whose compile the tests stand in for where they need one
    opts = parse_options(["--model", "tiny", "--device", "cpu", "--dtype", "float32", "--max-token-budget", "256",
                          "--max-num-seqs-ceiling",
                          "16", "--max-num-seqs", "8", "--token-budget", "128", "--num-kv-blocks", "512",
                          "--profile-cache-dir", str(tmp_path), "--profile-max-seconds", "20", "--threads", "1", *extra])
    engine, device = build_llm_engine(opts, None)
    return opts, engine, device


def test_serve_measures_once_then_reuses_and_remeasures_for_another_key(tmp_path, quiet_rule, caplog) -> None:
    caplog.set_level(logging.INFO, logger="stallfree.serve")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        opts, engine, device = _serve_engine(tmp_path)
        first, retry = _startup_profile(opts, engine, device)
        assert retry is None and first.mixed
        assert len(list(tmp_path.glob("profile-*.json"))) == 1
        # A second start of the same engine: the profile read back, bit for bit (a new measurement never is).
        opts, engine, device = _serve_engine(tmp_path)
        caplog.clear()
        second, retry = _startup_profile(opts, engine, device)
        assert second == first and retry is None
        assert any("cached profile from" in r.getMessage() for r in caplog.records)
        assert not any("profile point" in r.getMessage() for r in caplog.records)
        # Another thread count is another engine: measured again, a second file beside the first.
        torch.set_num_threads(2)
        caplog.clear()
        third, _ = _startup_profile(opts, engine, device)
        assert any("profile point" in r.getMessage() for r in caplog.records)
        assert len(list(tmp_path.glob("profile-*.json"))) == 2
        # A corrupt file: measured again and rewritten.
        key = profile_key(engine, device, ProfileSettings())
        ProfileCache(tmp_path).path_for(key).write_text("garbage")
        caplog.clear()
        _startup_profile(opts, engine, device)
        assert any("unreadable" in r.getMessage() for r in caplog.records)
        assert ProfileCache(tmp_path).load(key)[0] is not None
    finally:
        torch.set_num_threads(threads)


def test_serve_does_not_cache_an_untrusted_profile(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(profiler, "MIN_CPU_SHARE", 10.0)  # no run can pass: every one counts as busy
    opts, engine, device = _serve_engine(tmp_path)
    profile, retry = _startup_profile(opts, engine, device)
    assert profile.mixed and retry is not None
    assert list(tmp_path.glob("profile-*.json")) == []
    # The retry runs on an idle engine later; still busy: it spends a try, asks to run again later (backing
    # off), caches nothing.
    given = []
    retry.on_profile = given.append
    tries, delay = retry.tries, retry.delay_s
    again = retry(engine, lambda: False)
    assert again is not None and again > delay and retry.tries == tries - 1
    assert given == [] and list(tmp_path.glob("profile-*.json")) == []
    monkeypatch.setattr(profiler, "MIN_CPU_SHARE", 0.0)  # quiet now
    monkeypatch.setattr(profiler, "curve_problems", lambda points: [])
    assert retry(engine, lambda: False) is None
    assert len(given) == 1 and given[0] is not profile and len(list(tmp_path.glob("profile-*.json"))) == 1


def test_a_profile_measured_while_the_compiled_forward_was_off_is_not_read_once_it_is_on(tmp_path) -> None:
    opts, engine, device = _serve_engine(tmp_path)
    settings = ProfileSettings()
    before = profile_key(engine, device, settings)
    assert before["compiled_forward"] is False  # a float32 engine has none

    class Loaded:
        @staticmethod
        def can_run(rows: int, decode_only: bool) -> bool:
            return True

    engine.executor.runner.cpu_decode = Loaded()
    after = profile_key(engine, device, settings)
    assert after["compiled_forward"] is True
    assert ProfileCache(tmp_path).path_for(before) != ProfileCache(tmp_path).path_for(after)


def test_the_engine_build_hashes_the_compiled_forwards_sources(monkeypatch) -> None:
    from pathlib import Path

    from stallfree.node_daemon.models import cpu_decode

    read = Path.read_bytes
    engine_build.cache_clear()
    try:
        first = engine_build()
        for changed in (cpu_decode.SOURCE, *cpu_decode.HEADERS):  # as if each C++ file were edited
            monkeypatch.setattr(Path, "read_bytes",
                                lambda self, c=changed: read(self) + (b"//" if self == c else b""))
            engine_build.cache_clear()
            assert engine_build() != first, changed
    finally:
        monkeypatch.undo()
        engine_build.cache_clear()


def _compiling(monkeypatch) -> dict[str, bool]:
    """A compiled forward under way while building["now"] (cpu_decode.is_building follows it)."""
    from stallfree.node_daemon.models import cpu_decode

    building = {"now": True}
    monkeypatch.setattr(cpu_decode, "is_building", lambda: building["now"])
    return building


def test_a_start_while_the_compiled_forward_compiles_serves_first_and_profiles_it_once_loaded(
        tmp_path, quiet_rule, monkeypatch) -> None:
    building = _compiling(monkeypatch)
    opts, engine, device = _serve_engine(tmp_path)
    # The starting budget does not come from the profile: nothing is measured (or read) while it compiles.
    profile, retry = _startup_profile(opts, engine, device, serve_first=True)
    assert profile is None and retry is not None and list(tmp_path.glob("profile-*.json")) == []
    given = []
    retry.on_profile = given.append
    assert retry(engine, lambda: False) == retry.delay_s  # still compiling: asks again soon
    assert given == []
    # Loaded: measured on the idle engine, given to the daemon and its engine, cached under the key of now.
    building["now"] = False
    assert retry(engine, lambda: False) is None
    assert len(given) == 1 and given[0].mixed
    assert ProfileCache(tmp_path).load(profile_key(engine, device, ProfileSettings()))[0] == given[0]
    # The next deferred start finds it in the cache: read, not measured.
    building["now"] = True
    _, retry = _startup_profile(opts, engine, device, serve_first=True)
    building["now"], later = False, []
    retry.on_profile = later.append
    monkeypatch.setattr(profiler, "run_profile", lambda *a, **k: pytest.fail("measured although cached"))
    assert retry(engine, lambda: False) is None and later == given


def test_a_first_start_on_a_new_file_serves_first_and_profiles_on_the_idle_engine(tmp_path, quiet_rule,
                                                                                   monkeypatch) -> None:
    """No TPOT SLO, nothing compiling, no profile cached for this engine: nothing measured before serving."""
    _compiling(monkeypatch)["now"] = False
    opts, engine, device = _serve_engine(tmp_path)
    profile, retry = _startup_profile(opts, engine, device, serve_first=True)
    assert profile is None and retry is not None and list(tmp_path.glob("profile-*.json")) == []
    given = []
    retry.on_profile = given.append
    assert retry(engine, lambda: True) is not None and given == []  # a request arrived: stopped, tried again later
    assert retry(engine, lambda: False) is None and len(given) == 1 and given[0].mixed
    # Cached: the next start reads it before serving, measuring nothing.
    monkeypatch.setattr(profiler, "run_profile", lambda *a, **k: pytest.fail("measured although cached"))
    assert _startup_profile(opts, engine, device, serve_first=True)[0] == given[0]


def test_a_start_with_a_tpot_slo_measures_while_compiling_and_measures_again_once_compiled(
        tmp_path, quiet_rule, monkeypatch) -> None:
    building = _compiling(monkeypatch)
    opts, engine, device = _serve_engine(tmp_path)
    # An operator's daemon reads its profile at once (the starting budget, the operator's calibration).
    profile, retry = _startup_profile(opts, engine, device, serve_first=False)
    assert profile is not None and profile.mixed and retry is not None
    given = []
    retry.on_profile = given.append
    assert retry(engine, lambda: False) == retry.delay_s and given == []
    # Compiled: the key changes (here by a stand-in for the compiled forward's part of it), and the profile of
    # the path in use replaces the Python path's.
    from stallfree.node_daemon.measure import profile_cache

    keyed = profile_cache.profile_key
    monkeypatch.setattr(profile_cache, "profile_key",
                        lambda *args: {**keyed(*args), "compiled_forward": not building["now"]})
    building["now"] = False
    assert retry(engine, lambda: False) is None
    assert len(given) == 1 and given[0] is not profile and given[0].mixed
    assert len(list(tmp_path.glob("profile-*.json"))) == 2  # the Python path's and the compiled forward's
