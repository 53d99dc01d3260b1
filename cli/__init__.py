"""The one console script: `stallfree <command> ...`.

Each command lives in its own module with its own argparse and a `main(argv) -> int`; this file only
dispatches, so `stallfree --help` stays instant (no torch import) and each command owns its flags.
"""
from __future__ import annotations

import importlib
import sys

# command -> (module with main(argv), one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("stallfree.cli.serve", "run the serving daemon (OpenAI API, metrics, admin)"),
    "generate": ("stallfree.cli.generate", "run one prompt through the engine and print the text"),
    "router": ("stallfree.cli.router", "route requests to the replica with the lowest predicted TTFT"),
    "operator": ("stallfree.cli.operator", "run the kopf operator against the cluster KUBECONFIG names"),
    "up": ("stallfree.cli.up", "run the closed loop locally: daemons + control loop + load"),
    "bench": ("stallfree.cli.bench", "benchmarks: scheduler, stall, itl, serve, ..."),
    "simulate": ("stallfree.cli.simulate", "simulate a workload in virtual time on the cost model"),
    "profile": ("stallfree.cli.profile", "measure iteration time against tokens per iteration"),
    "crd": ("stallfree.cli.crd", "print the InferenceService CustomResourceDefinition"),
    "render": ("stallfree.cli.render", "print every object the operator would create for an InferenceService"),
    "control": ("stallfree.cli.control", "closed-loop control runs on the sim backend (timelines)"),
}


# What `pip install stallfree` (the control plane) leaves out and `stallfree[daemon]` brings.
DAEMON_EXTRA = frozenset({"torch", "triton", "numpy", "tokenizers", "safetensors", "gguf", "jinja2", "matplotlib"})


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: stallfree <command> [options]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run `stallfree <command> --help` for a command's options."]
    return "\n".join(lines)


def run_module_main(table: dict[str, tuple[str, str]], name: str, argv: list[str], usage: str) -> int:
    """Import the module registered for `name` and hand it the rest of the arguments."""
    if name not in table:
        print(f"stallfree: unknown command {name!r}\n\n{usage}", file=sys.stderr)
        return 2
    module_name = table[name][0]
    try:
        module = importlib.import_module(module_name)
        return int(module.main(argv) or 0)
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]
        if missing in DAEMON_EXTRA:
            print(f"stallfree {name}: needs the serving stack ({missing} is not installed): "
                  "pip install 'stallfree[daemon]'", file=sys.stderr)
            return 2
        if exc.name and module_name.startswith(exc.name):
            print(f"stallfree: command {name!r} is not available in this build ({module_name} missing)", file=sys.stderr)
            return 2
        raise


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] == "--version":
        from importlib.metadata import version

        print(version("stallfree"))
        return 0
    from stallfree.node_daemon.models.cpu_tier import cap_libraries_at_forced_tier

    cap_libraries_at_forced_tier()  # before torch is imported: a forced CPU tier caps torch's kernels too
    return run_module_main(COMMANDS, argv[0], argv[1:], _usage())


if __name__ == "__main__":
    sys.exit(main())
