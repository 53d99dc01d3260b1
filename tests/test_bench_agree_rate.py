"""bench/agree_rate.py and its prompt set: the prompts are many, varied and the same on every run; the rates and
logprob differences are computed from the traces as documented; the command exits 1 exactly when stallfree's serving
path agrees with the reference less often than llama.cpp does. No model runs and no llama-server starts here."""
from __future__ import annotations

import json

import pytest

from stallfree.bench import agree_rate
from stallfree.bench.agree import Trace
from stallfree.bench.agree_prompts import SUBJECTS, Prompt, build_prompts


@pytest.fixture(scope="module")
def tokenizer():
    from stallfree.node_daemon.models.gguf_loader import embedded_gguf_path
    from stallfree.node_daemon.text.tokenizer import load_tokenizer

    return load_tokenizer(embedded_gguf_path())


def test_the_prompt_set_is_large_varied_and_deterministic(tokenizer):
    prompts = build_prompts(tokenizer)
    assert len(prompts) >= 100
    assert prompts == build_prompts(tokenizer)  # the same token ids on every run
    assert len({p.tokens for p in prompts}) == len(prompts)
    assert {p.subject for p in prompts} == {s[0] for s in SUBJECTS} and len(SUBJECTS) >= 25
    lengths = [len(p.tokens) for p in prompts]
    assert min(lengths) <= 10 and max(lengths) >= 250
    forms = {p.form for p in prompts}
    assert forms == {f"{size}-{kind}" for size in ("short", "medium", "long") for kind in ("plain", "chat")}
    chat = [p for p in prompts if p.form.endswith("chat")]
    assert len(chat) >= 40 and all(p.text.startswith("<|im_start|>") for p in chat)  # SmolLM2's own template
    assert all(p.tokens == tuple(tokenizer.encode(p.text)) for p in prompts)


def trace(tokens: list[int], top: list[dict[int, float]] | None = None) -> Trace:
    return Trace(tokens, top or [{t: -0.5, t + 100: -1.5} for t in tokens])


def test_rates_matched_prefixes_and_logprob_differences():
    reference = [trace([1, 2, 3]), trace([4, 5, 6]), trace([7, 8, 9])]
    same = agree_rate.score("same", reference, [trace([1, 2, 3]), trace([4, 5, 6]), trace([7, 8, 9])])
    assert (same.identical, same.rate, same.mean_matched, same.max_diff, same.compared) == (3, 1.0, 3.0, 0.0, 18)

    # prompt 2 differs at its second token; past it the contexts differ and the logprobs are not compared
    diverged = [trace([1, 2, 3], [{1: -0.5, 101: -1.5}, {2: -0.4, 102: -1.5}, {3: -0.5}]),
                trace([4, 9, 6], [{4: -0.5, 104: -1.7}, {9: -0.6, 5: -0.7}, {6: -9.0}]),
                trace([7, 8, 9])]
    s = agree_rate.score("diverged", reference, diverged)
    assert s.identical == 2 and s.rate == pytest.approx(2 / 3)
    assert s.matched == [3, 1, 3] and s.mean_matched == pytest.approx(7 / 3)
    # differences: 0.1 (prompt 1, step 2), 0.2 (prompt 2, step 1's runner-up), 0.2 (prompt 2, step 2: token 5);
    # only tokens in both top lists count: prompt 1's step 3 lists one, prompt 2's step 2 shares one
    assert s.max_diff == pytest.approx(0.2)
    assert s.compared == 5 + 3 + 6  # prompt 2: steps 1 and 2 only (step 3's -9.0 follows another context)
    assert s.mean_diff == pytest.approx(0.5 / 14)

    # a shorter continuation is not identical even where every token it has agrees
    assert agree_rate.score("short", [trace([1, 2])], [trace([1])]).identical == 0
    with pytest.raises(ValueError, match="2 short traces against 1"):
        agree_rate.score("short", [trace([1])], [trace([1]), trace([2])])


def scores(serving: int, llama: int, prompts: int = 4) -> list[agree_rate.Score]:
    reference = [trace([k, k + 1]) for k in range(prompts)]

    def agreeing(n):
        return [trace([k, k + 1]) if k < n else trace([k, -1]) for k in range(prompts)]
    return [agree_rate.score(agree_rate.SERVING, reference, agreeing(serving)),
            agree_rate.score(agree_rate.LLAMA, reference, agreeing(llama))]


@pytest.mark.parametrize("serving, llama, code", [(4, 4, 0), (3, 2, 0), (2, 3, 1), (0, 1, 1)])
def test_the_exit_code_is_the_printed_goal(serving, llama, code, tmp_path, monkeypatch, capsys):
    gguf, binary = tmp_path / "model.gguf", tmp_path / "llama-server"
    gguf.write_bytes(b"")
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    prompts = [Prompt("a subject", "short-plain", "text", (1, 2))]
    monkeypatch.setattr(agree_rate, "check_file", lambda path, args, log_dir: (prompts, scores(serving, llama)))
    out = tmp_path / "rate.json"
    assert agree_rate.main([str(gguf), "--llama-server", str(binary), "--json", str(out)]) == code
    printed = capsys.readouterr().out
    assert ("goal: stallfree identical >= llama.cpp's: " + ("met" if code == 0 else "MISSED")) in printed
    assert f"{serving}/4 ({serving / 4:.0%})" in printed
    [file] = json.loads(out.read_text())["files"]
    assert file["goal_met"] is (code == 0)
    assert [s["identical"] for s in file["scores"]] == [serving, llama]


def test_bad_input_is_refused_before_any_work(tmp_path, capsys):
    assert agree_rate.main([str(tmp_path / "missing.gguf"), "--llama-server", "/bin/true"]) == 2
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"")
    assert agree_rate.main([str(gguf), "--llama-server", str(tmp_path / "none")]) == 2
    assert agree_rate.main([str(gguf), "--llama-server", "/bin/true", "--steps", "0"]) == 2
    err = capsys.readouterr().err
    assert "no such file" in err and "no llama-server" in err and "--steps must be" in err


def test_prompts_decoded_together_follow_the_same_greedy_path_as_one_at_a_time(tmp_path, monkeypatch):
    """The batched driver keeps each sequence in its own KV blocks: a random float32 file's traces, three streams at
    a time (a group of three and a group of one), equal the one-request-at-a-time traces of bench/agree.py."""
    from stallfree.bench import agree

    monkeypatch.setenv("STALLFREE_WEIGHT_CACHE", "off")
    [path] = agree.write_random(["qwen3"], str(tmp_path))
    runner = agree_rate.runner_for(path, False, threads=1, longest=35, steps=6, streams=3)
    prompts = agree.fixed_prompts(runner.loaded.shape.vocab_size, runner.loaded.bos_token_id)
    prompts.append(prompts[0][:5])
    together = agree_rate.batched_traces(runner, prompts, steps=6, chunk=8, streams=3)
    alone = agree.stallfree_traces(runner, prompts, steps=6)
    assert [t.tokens for t in together] == [t.tokens for t in alone]
    s = agree_rate.score(agree_rate.SERVING, alone, together)
    assert s.identical == 4 and s.compared == 4 * 6 * agree.TOP_K and s.max_diff < 1e-4
