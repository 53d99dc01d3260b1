"""Read e2e/cluster/Dockerfile as Docker would, enough to rebuild a stage's build context without Docker.

Stages (`FROM ... AS name`), their instructions with line continuations joined, the COPY lines that
take files from the build context (not `--from` another stage), and the Dockerfile's own ignore file
(BuildKit's `Dockerfile.dockerignore`) applied while copying.
"""
from __future__ import annotations

import fnmatch
import pathlib
import shlex
import shutil

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "e2e" / "cluster" / "Dockerfile"
IGNORE_FILE = DOCKERFILE.with_name(DOCKERFILE.name + ".dockerignore")


def instructions(path: pathlib.Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, rest) in order, comments dropped, continuations joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        text = pending + stripped
        pending = ""
        word, _, rest = text.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def stages(path: pathlib.Path = DOCKERFILE) -> dict[str, list[tuple[str, str]]]:
    """Each named stage's instructions (its FROM line first)."""
    out: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    for word, rest in instructions(path):
        if word == "FROM":
            parts = rest.split()
            name = parts[-1] if len(parts) >= 3 and parts[-2].lower() == "as" else f"#{len(out)}"
            current = out.setdefault(name, [])
        if current is not None:
            current.append((word, rest))
    return out


def context_copies(stage: list[tuple[str, str]]) -> list[tuple[list[str], str]]:
    """(sources, destination) of each COPY/ADD from the build context."""
    out = []
    for word, rest in stage:
        if word not in ("COPY", "ADD"):
            continue
        args = shlex.split(rest)
        if any(a.startswith("--from") for a in args):
            continue
        args = [a for a in args if not a.startswith("--")]
        out.append((args[:-1], args[-1]))
    return out


def ignore_patterns() -> list[str]:
    if not IGNORE_FILE.exists():
        return []
    return [line.strip() for line in IGNORE_FILE.read_text().splitlines()
            if line.strip() and not line.startswith("#")]


def ignored(relative: str, patterns: list[str]) -> bool:
    """As Docker reads the ignore file: the last pattern that matches decides, `!` re-includes."""
    parts = relative.split("/")
    out = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        pattern = pattern[1:] if negated else pattern
        if pattern.startswith("**/"):
            matched = any(fnmatch.fnmatch(part, pattern[3:]) for part in parts)
        else:
            matched = fnmatch.fnmatch(relative, pattern) or fnmatch.fnmatch(parts[0], pattern)
        if matched:
            out = not negated
    return out


def rebuild_context(stage: list[tuple[str, str]], workdir: pathlib.Path, root: pathlib.Path = ROOT) -> None:
    """Lay out in `workdir` what the stage's COPY lines put in its WORKDIR, from `root` as the context."""
    patterns = ignore_patterns()
    for sources, destination in context_copies(stage):
        for source in sources:
            src = root / source
            if not src.exists():
                raise FileNotFoundError(f"COPY {source}: not in the build context")  # docker build fails too
            into_folder = destination in (".", "./") or destination.endswith("/") or len(sources) > 1
            target = workdir / destination / src.name if into_folder else workdir / destination
            if src.is_dir():
                shutil.copytree(src, target, ignore=lambda d, names: [
                    n for n in names if ignored(str((pathlib.Path(d) / n).relative_to(root)), patterns)])
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, target)
