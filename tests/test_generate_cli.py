"""`stallfree generate`: SmolLM2 answers a chat question; bad input is one clear line and exit code 2."""
from __future__ import annotations

import subprocess
import sys

import pytest

from stallfree.cli import generate as generate_cli


@pytest.fixture(scope="session")
def smollm2_answer() -> tuple[int, str, str]:
    import contextlib
    import io

    import torch

    threads = torch.get_num_threads()
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            # One thread: on a shared CPU, spinning OpenMP workers make every matmul many times slower.
            code = generate_cli.main(["--model", "smollm2-135m", "--chat", "What is the capital of France?",
                                      "--max-tokens", "12", "--stats", "--threads", "1"])
    finally:
        torch.set_num_threads(threads)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.slow
def test_smollm2_chat_answers_paris(smollm2_answer) -> None:
    code, out, err = smollm2_answer
    assert code == 0, err
    assert "Paris" in out
    assert "finish_reason=" in err and "ttft_ms=" in err


@pytest.mark.parametrize("argv, message", [
    (["", "--model", "tiny"], "the prompt is empty"),
    (["hi", "--max-tokens", "0"], "max_tokens must be at least 1"),
    (["hi", "--model", "no-such-model"], "unknown model 'no-such-model'"),
    (["word " * 40, "--model", "tiny", "--max-model-len", "16"], "the prompt has"),
    (["hi", "--temperature", "-1"], "temperature"),
])
def test_bad_input_is_one_clear_line_and_exit_2(argv, message, capsys) -> None:
    assert generate_cli.main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("stallfree generate: error:")
    assert "Traceback" not in captured.err + captured.out


def test_plain_prompt_on_the_tiny_model_with_seed(capsys) -> None:
    argv = ["Once upon a time", "--model", "tiny", "--max-tokens", "8", "--temperature", "0.8", "--seed", "3",
            "--ignore-eos"]
    assert generate_cli.main(argv) == 0
    first = capsys.readouterr().out
    assert generate_cli.main(argv) == 0
    assert capsys.readouterr().out == first and first.strip()


def test_console_script_reports_unknown_model_without_traceback() -> None:
    proc = subprocess.run([sys.executable, "-m", "stallfree.cli", "generate", "--model", "nope", "hi"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "unknown model 'nope'" in proc.stderr and "Traceback" not in proc.stderr
