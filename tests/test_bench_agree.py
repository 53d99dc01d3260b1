"""bench/agree.py against a fake llama-server: a child answering /health and /completion as llama-server does, with
answers prepared from stallfree's own forward (so the files agree) or altered (so the command exits 1)."""
from __future__ import annotations

import json
import sys

import pytest

from stallfree.bench import agree

FAKE_SERVER = '''
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

with open(os.environ["FAKE_LLAMA_ARGV"], "w") as f:
    json.dump(sys.argv[1:], f)
if os.environ.get("FAKE_LLAMA_FAIL"):
    print("error: failed to load model", flush=True)
    sys.exit(1)
with open(os.environ["FAKE_LLAMA_ANSWERS"]) as f:
    answers = json.load(f)  # json.dumps(prompt) -> {"tokens": [...], "top": [{id: logprob}, ...]}


class Handler(BaseHTTPRequestHandler):
    def reply(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            self.reply(200, {"status": "ok"})
        else:
            self.reply(404, {"error": {"code": 404, "message": "File Not Found"}})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        answer = answers[json.dumps(body["prompt"])]
        steps = [{"id": tok, "token": "", "logprob": top.get(str(tok), min(top.values())), "bytes": [],
                  "top_logprobs": [{"id": int(i), "token": "", "logprob": lp, "bytes": []}
                                   for i, lp in list(top.items())[:body["n_probs"]]]}
                 for tok, top in zip(answer["tokens"], answer["top"])][:body["n_predict"]]
        self.reply(200, {"content": "", "tokens_predicted": len(steps), "completion_probabilities": steps})

    def log_message(self, *args):
        pass


args = sys.argv[1:]
HTTPServer((args[args.index("--host") + 1], int(args[args.index("--port") + 1])), Handler).serve_forever()
'''


LONG_STEPS = 20  # past the default 8: the runner's KV blocks must cover what --steps asks


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A random float32 Qwen3 file, written as `--random qwen3` writes it, and stallfree's traces on it."""
    folder = tmp_path_factory.mktemp("agree")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STALLFREE_WEIGHT_CACHE", "off")
        [path] = agree.write_random(["qwen3"], str(folder))
        runner = agree.load_runner(path, "float32", threads=1, steps=LONG_STEPS, cache=False)
        prompts = agree.fixed_prompts(runner.loaded.shape.vocab_size, runner.loaded.bos_token_id)
        traces = agree.stallfree_traces(runner, prompts, LONG_STEPS)  # the fake answers the n_predict first
    return path, prompts, traces


@pytest.fixture
def fake_server(tmp_path, monkeypatch):
    """The fake binary; answers(traces) gives it what to say."""
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!{sys.executable}\n{FAKE_SERVER}")
    binary.chmod(0o755)
    monkeypatch.setenv("STALLFREE_WEIGHT_CACHE", "off")
    monkeypatch.setenv("FAKE_LLAMA_ARGV", str(tmp_path / "argv.json"))
    monkeypatch.setenv("FAKE_LLAMA_ANSWERS", str(tmp_path / "answers.json"))

    def answers(prompts, traces):
        (tmp_path / "answers.json").write_text(json.dumps(
            {json.dumps(p): {"tokens": t.tokens, "top": t.top} for p, t in zip(prompts, traces)}))
    return binary, answers


def run(argv: list[str], tmp_path) -> tuple[int, dict]:
    out = tmp_path / "agree.json"
    code = agree.main([*argv, "--threads", "1", "--log-dir", str(tmp_path / "logs"), "--json", str(out)])
    return code, json.loads(out.read_text()) if out.exists() else {}


def test_own_logits_agree_and_server_is_started_offline(model, fake_server, tmp_path, capsys):
    path, prompts, traces = model
    binary, answers = fake_server
    answers(prompts, traces)
    code, report = run(["--llama-server", str(binary), "--random", "qwen3"], tmp_path)
    assert code == 0
    [file] = report["files"]
    assert file["agrees"] and file["matched"] == file["total"] == 3 * agree.STEPS
    assert file["worst"] < 1e-9
    assert "1/1 files agree" in capsys.readouterr().out
    argv = json.loads((tmp_path / "argv.json").read_text())
    assert "--offline" in argv and argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("-m") + 1].endswith("random-qwen3-f32.gguf")


def test_a_different_token_exits_non_zero(model, fake_server, tmp_path, capsys):
    path, prompts, traces = model
    binary, answers = fake_server
    changed = [agree.Trace(list(t.tokens), [dict(d) for d in t.top]) for t in traces]
    changed[1].tokens[3] = list(changed[1].top[3])[1]  # the runner-up, as a near tie decided the other way would
    answers(prompts, changed)
    code, report = run([path, "--llama-server", str(binary)], tmp_path)
    assert code == 1
    [file] = report["files"]
    assert not file["agrees"] and [p["matched"] for p in file["prompts"]] == [agree.STEPS, 3, agree.STEPS]
    top = traces[1].top[3]
    assert file["prompts"][1]["tie_gap"] == pytest.approx(top[traces[1].tokens[3]] - top[changed[1].tokens[3]])
    assert "DIFFER" in capsys.readouterr().out


def test_a_logprob_past_the_tolerance_exits_non_zero(model, fake_server, tmp_path):
    path, prompts, traces = model
    binary, answers = fake_server
    changed = [agree.Trace(list(t.tokens), [dict(d) for d in t.top]) for t in traces]
    token = next(iter(changed[2].top[5]))
    changed[2].top[5][token] -= 0.01
    answers(prompts, changed)
    code, report = run([path, "--llama-server", str(binary), "--steps", str(LONG_STEPS)], tmp_path)
    assert code == 1 and report["files"][0]["matched"] == report["files"][0]["total"] == 3 * LONG_STEPS
    assert report["files"][0]["worst"] == pytest.approx(0.01, abs=1e-9)
    assert run([path, "--llama-server", str(binary), "--tolerance", "0.02"], tmp_path)[0] == 0


def test_logprobs_after_the_first_different_token_are_not_compared():
    ours = agree.Trace([5, 6, 7], [{5: -0.1}, {6: -0.2}, {7: -0.3}])
    theirs = agree.Trace([5, 9, 7], [{5: -0.1}, {6: -0.25, 9: -0.2}, {7: -3.0}])
    result = agree.compare_prompt(4, ours, theirs)
    assert result.matched == 1 and result.worst == pytest.approx(0.05)
    assert result.tie_gap is None  # token 9 is not in stallfree's top list
    ours.top[1][9] = -0.21
    assert agree.compare_prompt(4, ours, theirs).tie_gap == pytest.approx(0.01)


def test_a_server_that_fails_to_start_is_reported(model, fake_server, tmp_path, monkeypatch, capsys):
    binary, _ = fake_server
    monkeypatch.setenv("FAKE_LLAMA_FAIL", "1")
    assert run([model[0], "--llama-server", str(binary)], tmp_path)[0] == 2
    assert "failed to load model" in capsys.readouterr().err


def test_bad_input_is_refused_before_any_work(tmp_path, capsys):
    assert agree.main(["--llama-server", "/bin/true", str(tmp_path / "missing.gguf")]) == 2
    assert agree.main(["--llama-server", "/bin/true", "--random", "mistral"]) == 2
    assert agree.main(["--llama-server", str(tmp_path / "no-binary"), "--random", "qwen3"]) == 2
    err = capsys.readouterr().err
    assert "no such file" in err and "not mistral" in err and "no llama-server" in err
