"""The InferenceService a local run serves: read from a YAML file and validated as the operator validates it."""
from __future__ import annotations

from pathlib import Path

import yaml

from stallfree.operator.api.spec import InferenceServiceSpec, parse_spec, spec_errors


def load_manifest(path: str) -> tuple[str, InferenceServiceSpec]:
    """The first InferenceService in the file, validated as the operator validates it."""
    from stallfree.operator.api.checks import problems

    try:
        documents = [d for d in yaml.safe_load_all(Path(path).read_text()) if d]
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{path} is not valid YAML: {exc}") from None
    found = [d for d in documents if isinstance(d, dict) and d.get("kind") == "InferenceService"]
    if not found:
        raise ValueError(f"{path} holds no InferenceService")
    manifest = found[0]
    name = (manifest.get("metadata") or {}).get("name") or "inferenceservice"
    try:
        spec = parse_spec(manifest.get("spec"))
    except Exception as exc:  # pydantic.ValidationError: every problem, one per line
        raise ValueError(f"{path}: invalid InferenceService spec:\n{spec_errors(exc)}") from None
    issues = problems(spec)
    if issues:
        raise ValueError(f"{path}: InferenceService {name} cannot be served: " + "; ".join(issues))
    return name, spec
