"""The forward path is chosen by one object the model runner owns, and a compiled forward that finishes loading on
its build thread is taken up only between iterations (engine/forward_path.py)."""
from __future__ import annotations

import pytest

from stallfree.node_daemon.engine.forward_path import ForwardPath, Path


class Graphs:
    def can_run(self, inputs) -> bool:
        return inputs == "fits"


class Compiled:
    def can_run(self, num_tokens: int, decode_only: bool) -> bool:
        return num_tokens <= 8


def test_the_compiled_forward_is_taken_up_once_between_iterations() -> None:
    loaded, taken = {"now": False}, []
    path = ForwardPath(None, Compiled(), lambda: loaded["now"], lambda: taken.append("switched"))
    assert path.choose(4, True) is Path.EAGER
    loaded["now"] = True  # the build thread finished mid-iteration: this iteration stays on its path
    assert path.choose(4, True) is Path.EAGER and taken == []
    path.begin_iteration()
    assert path.choose(4, True) is Path.COMPILED and path.choose(64, False) is Path.EAGER
    path.begin_iteration()
    assert taken == ["switched"]


def test_graphs_first_then_compiled_then_eager() -> None:
    path = ForwardPath(Graphs(), Compiled(), lambda: True, lambda: None)
    assert path.choose(4, True, "fits") is Path.CUDA_GRAPH
    assert path.choose(4, False, "fits") is Path.COMPILED  # graphs take decode-only iterations only
    assert ForwardPath(None, None, lambda: True, lambda: None).choose(1, True) is Path.EAGER


def test_a_background_build_switches_no_kernel_until_the_runner_takes_it_up(monkeypatch) -> None:
    from stallfree.node_daemon.engine.config import CacheConfig
    from stallfree.node_daemon.engine.model_runner import ModelRunner
    from stallfree.node_daemon.engine.scheduler_output import ScheduledChunk, SchedulerOutput
    from stallfree.node_daemon.engine.request import Request
    from stallfree.node_daemon.engine.sampling_params import SamplingParams
    from stallfree.node_daemon.models import cpu_decode
    from stallfree.node_daemon.models.config import ModelConfig

    if not cpu_decode.ensure_built(background=False):
        pytest.skip(f"compiled decode path unavailable: {cpu_decode.why_not()}")
    saved_state = dict(cpu_decode._state)
    try:
        # A daemon's start while the extension compiles: the Python path serves meanwhile.
        cpu_decode._state.update(loaded=False, why="compiling (the Python path serves meanwhile)")
        monkeypatch.setattr(cpu_decode, "ensure_built", lambda background: False)
        runner = ModelRunner(ModelConfig(model="smollm2-135m", dtype="bfloat16", compiled_decode="background"),
                             CacheConfig(block_size=16, num_blocks=32), max_num_tokens=64, max_num_seqs=4)
        assert runner.cpu_decode is not None and not runner.forward_path.compiled_in_use
        # The build thread loads the library (as _build_quietly does) while an iteration may be running: neither the
        # quantized matmuls' kernel nor torch's int4 packs change under it.
        assert cpu_decode._load_or_build(build=False)
        while cpu_decode._on_load:
            cpu_decode._on_load.pop(0)()
        assert cpu_decode.is_loaded() and not runner.model.code_kernel_in_use
        # The next iteration takes it up first, on the engine thread.
        calls = []
        real = runner.cpu_decode.forward
        monkeypatch.setattr(runner.cpu_decode, "forward", lambda *a: calls.append(a[0].shape[0]) or real(*a))
        req = Request("r", list(range(10, 30)), SamplingParams(max_tokens=1))
        req.block_ids = [1, 2]
        runner.execute_model(SchedulerOutput(chunks=[ScheduledChunk(req, 0, 20, is_prefill=True, samples=True)]))
        assert runner.forward_path.compiled_in_use and calls == [20]
        assert runner.model.code_kernel_in_use == cpu_decode.enabled(cpu_decode.CODE_KERNEL_SWITCH)
    finally:
        cpu_decode._state.update(saved_state)


def test_each_model_has_its_own_kernel_choice():
    """The code kernel is published per model, by the runner that serves it: switching one engine's model to torch's
    int4 kernel (an A/B bench, a test) leaves another model in the same process on the code kernel."""
    import torch

    from stallfree.node_daemon.models.config import ModelConfig
    from stallfree.node_daemon.models.loader import load_model

    a, b = (load_model(ModelConfig(model="smollm2-135m", dtype="bfloat16")).model for _ in range(2))
    kernel = object()
    a.use_code_kernel(kernel, 8, int8_min_rows=9)
    assert a.code_kernel_in_use and not b.code_kernel_in_use
    assert all(w.code_kernel == (kernel, 8, 9) for w in a.int4_weights()) and a.int4_weights()
    b.use_code_kernel(None, 0)
    assert a.code_kernel_in_use
    a.use_code_kernel(None, 0)
    x = torch.ones(1, a.shape.hidden_size, dtype=torch.bfloat16)
    assert a.layers[0].mlp.down_proj.int4.code_kernel is None and a.compute_logits(x).shape == (1, a.shape.vocab_size)
