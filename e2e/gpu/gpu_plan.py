"""The dry run's plan section: the GPU run's own sizes, built on the CPU. Floors of every decode batch and of the
mixed iteration (nominal H200 ceilings: the GPU run measures its own), every GPU-size attention batch built and
attended by the torch path with its flashinfer indices, every GPU-size engine iteration through the runner's
prepare_inputs on a two-layer model of the same attention shape."""
from __future__ import annotations

from gpu_report import NOMINAL_H200


def plan_section(report, gpu_args) -> None:
    import torch

    from stallfree.kernels import torch_reference
    from stallfree.kernels.flashinfer_index import build_paged_kv_indices
    from stallfree.node_daemon.engine.config import CacheConfig
    from stallfree.node_daemon.models.config import ModelConfig
    from stallfree.node_daemon.engine.model_runner import ModelRunner
    from stallfree.node_daemon.models.llama import LlamaForCausalLM
    from stallfree.node_daemon.models.loader import LoadedModel
    from stallfree.node_daemon.models.random_weights import init_random_weights
    from stallfree.shapes import get_shape

    from batches import CORRECTNESS_CASES, attention_inputs, decode_batch, engine_iteration, mixed_batch
    from roofline import Sequence, decode_floor_s, iteration_flops, kv_bytes_read, weight_bytes_read

    a = gpu_args
    shape = get_shape(a.model)
    bw, rate = NOMINAL_H200["copy_bandwidth_bytes_s"], NOMINAL_H200["bf16_matmul_flop_s"]
    for b in a.decode_batches:
        batch = decode_batch(b, a.engine_context)
        report.info(f"GPU floor {a.model} decode b={b} ctx={a.engine_context}",
                    f"{decode_floor_s(shape, batch, bw) * 1e3:.2f} ms (weights {weight_bytes_read(shape, b) / 1e9:.2f} GB"
                    f" + KV {kv_bytes_read(shape, batch) / 1e9:.2f} GB at nominal {bw / 1e12:.1f} TB/s)")
    mixed = mixed_batch(a.mixed_tokens, a.mixed_decodes, a.engine_context, a.chunk_prefix)
    flops = iteration_flops(shape, mixed, sampled_rows=len(mixed))
    report.info(f"GPU floor {a.model} mixed {a.mixed_tokens} tok",
                f"{flops / rate * 1e3:.2f} ms ({flops / 1e12:.2f} TFLOP at nominal {rate / 1e12:.0f} TFLOP/s)")
    gen = torch.Generator().manual_seed(a.seed)
    for case, specs in CORRECTNESS_CASES.items():
        batch = [Sequence(q, s) for q, s in specs]
        q, k, v, md = attention_inputs(batch, 4, 1, 32, 16, torch.float32, torch.device("cpu"), gen)
        idx = build_paged_kv_indices(md)
        out = torch_reference.paged_attention(q, k, v, md, 32 ** -0.5)
        ref = torch_reference.paged_attention(q.double(), k.double(), v.double(), md, 32 ** -0.5,
                                              compute_dtype=torch.float64)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        pages = sum(-(-s.seq_len // 16) for s in batch)
        report.correct(f"GPU-size batch {case} built", f"{q.shape[0]} tokens, {idx.num_pages} pages, rel err {err:.1e}",
                       err < 1e-5 and idx.num_pages == pages, "fp32 torch path vs float64; pages = ceil(len/16)")
    small = shape.with_(num_layers=2, hidden_size=256, intermediate_size=512, vocab_size=1024,
                        num_heads=8, num_kv_heads=2, head_dim=32)
    model = LlamaForCausalLM(small, torch.float32, "cpu", a.max_model_len)
    init_random_weights(model, a.seed)
    loaded = LoadedModel(model, small, (), None, a.max_model_len, None, "random")
    iterations = [(f"decode b={b}", decode_batch(b, a.engine_context)) for b in a.decode_batches] + [("mixed", mixed)]
    blocks = max(sum(-(-s.seq_len // 16) for s in batch) for _, batch in iterations) + 16
    runner = ModelRunner(ModelConfig(model=a.model, device="cpu", max_model_len=a.max_model_len),
                         CacheConfig(block_size=16, num_blocks=blocks, enable_prefix_caching=False),
                         max_num_tokens=a.mixed_tokens, max_num_seqs=max(a.decode_batches), loaded=loaded)
    for label, batch in iterations:
        output, _ = engine_iteration(batch, 16, small.vocab_size)
        inputs = runner.prepare_inputs(output)
        tokens, seqs = inputs.input_ids.shape[0], inputs.metadata.num_seqs
        ok = tokens == sum(s.q_len for s in batch) and seqs == len(batch) and inputs.is_decode_only == (label != "mixed")
        report.correct(f"GPU-size engine iteration {label} prepared", f"{tokens} tokens, {seqs} sequences", ok,
                       "the batch's tokens and sequences")
