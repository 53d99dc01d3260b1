"""What bounds one stream: the weight bytes a decode token reads, in the file's own encoding, against the machine's
measured read bandwidth. `bench engine` puts them beside its one-stream row for any server (stallfree or a peer),
so the row says how close to the memory limit each engine runs: GB/s = bytes per token x tokens per second.

Bytes per token: every matrix of the GGUF file once (a tied embedding is the LM head: read whole; an untied
embedding table only looked up: one row, not counted), norms included. An engine that re-codes its weights reads its
own bytes, more or fewer; the file's are the common yardstick.
"""
from __future__ import annotations

import time
from typing import Any


def gguf_bytes_per_token(path: str) -> int:
    """The bytes of the file's tensors one decode token reads (see the module's note)."""
    from stallfree.node_daemon.models.gguf_file import GGUFFile

    tensors = GGUFFile(path).tensors
    untied = any(t.name == "output.weight" for t in tensors)
    return sum(int(t.data.nbytes) for t in tensors if not (untied and t.name == "token_embd.weight"))


def gguf_of(model: str | None) -> str | None:
    """The GGUF file a --model (or --tokenizer, --gguf) names: a .gguf path, or the embedded model's; else None."""
    if not model:
        return None
    if model.lower() == "smollm2-135m":
        from stallfree.node_daemon.models.gguf_loader import embedded_gguf_path

        return embedded_gguf_path()
    return model if model.endswith(".gguf") else None


def read_bandwidth_gb_s(gib: float = 1.0, repeats: int = 3) -> float:
    """This machine's read bandwidth on this process's threads: a sum over `gib` GiB of float32 (far past every
    cache), best of `repeats`, in GB/s."""
    import torch

    data = torch.ones(int(gib * (1 << 30)) // 4)
    data.sum()  # every page touched first
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return data.numel() * 4 / best / 1e9


def bandwidth_row(tok_s: float | None, bytes_per_token: int | None, machine_gb_s: float | None) -> dict[str, Any]:
    """The one-stream row's reading of the memory limit: GB/s read, and its share of the machine's bandwidth."""
    if not tok_s or not bytes_per_token:
        return {"bytes_per_token": bytes_per_token, "gb_s": None, "machine_read_gb_s": machine_gb_s, "share": None}
    gb_s = bytes_per_token * tok_s / 1e9
    return {"bytes_per_token": bytes_per_token, "gb_s": round(gb_s, 2),
            "machine_read_gb_s": round(machine_gb_s, 2) if machine_gb_s else None,
            "share": round(gb_s / machine_gb_s, 3) if machine_gb_s else None,
            "bound_tok_s": round(machine_gb_s * 1e9 / bytes_per_token, 1) if machine_gb_s else None}


def describe(row: dict[str, Any]) -> str:
    """One line for the printed table."""
    if not row.get("bytes_per_token"):
        return "- (no GGUF file given: --gguf PATH)"
    text = f"{row['bytes_per_token'] / 1e6:,.0f} MB a token"
    if row.get("gb_s") is not None:
        text += f", {row['gb_s']:.1f} GB/s read"
    if row.get("machine_read_gb_s") and row.get("share") is not None:  # no one-stream row (--serving-only): none
        text += (f" of the machine's {row['machine_read_gb_s']:.1f} GB/s ({100 * row['share']:.0f}%; the limit: "
                 f"{row['bound_tok_s']:.0f} tok/s)")
    return text
