"""The InferenceService's spec and status: the one source of truth.

The CRD's OpenAPI schema is generated from these models (crd.py), the operator parses what the API
server hands it with them, and the local runtime (`stallfree up -f`) reads its manifest with them, so
the three can never disagree. Field names are the manifest's (camelCase aliases); Python uses
snake_case. Cross-field limits live in RULES: each is a CEL rule the API server enforces and the
Python twin that `model_validate` enforces, side by side so they cannot drift.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator
from pydantic.alias_generators import to_camel

from stallfree.contracts import MIN_PREFILL_HEADROOM_TOKENS, min_budget_for

GROUP = "serving.stallfree.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
SHORT_NAMES = ["infsvc", "sfis"]  # not "isvc": KServe has it
AUTO = "auto"


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)

    def to_manifest(self) -> dict[str, Any]:
        """The manifest form (camelCase, unset optionals left out)."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


# -- cross-field rules: CEL for the API server, the Python twin for everyone else ---------------------

@dataclass(frozen=True)
class CrossFieldRule:
    """A rule over one object of the spec. `where` names that object: "spec", "spec.engine", ..."""

    where: str
    cel: str
    message: str
    holds: Callable[[Any], bool]


def _headroom_cel(budget: str, seqs: str) -> str:
    # contracts.min_budget_for in CEL: budget >= seqs + max(HEADROOM, seqs / 4) (CEL has no max()).
    return f"{budget} >= {seqs} + {MIN_PREFILL_HEADROOM_TOKENS} && {budget} >= {seqs} + {seqs} / 4"


def _is_auto(value: int | str) -> bool:
    return isinstance(value, str)


RULES: list[CrossFieldRule] = [
    CrossFieldRule(
        "spec.scaling", "self.minReplicas <= self.maxReplicas",
        "scaling.minReplicas must not exceed scaling.maxReplicas",
        lambda s: s.min_replicas <= s.max_replicas),
    CrossFieldRule(
        "spec.engine.ceilings", _headroom_cel("self.maxTokenBudget", "self.maxNumSeqs"),
        f"ceilings.maxTokenBudget must exceed ceilings.maxNumSeqs by max({MIN_PREFILL_HEADROOM_TOKENS}, "
        "maxNumSeqs/4) tokens of prefill headroom",
        lambda c: c.max_token_budget >= min_budget_for(c.max_num_seqs)),
    CrossFieldRule(
        "spec.engine", "!has(self.tokenBudget.max) || self.tokenBudget.max <= self.ceilings.maxTokenBudget",
        "tokenBudget.max must not exceed ceilings.maxTokenBudget",
        lambda e: e.token_budget.max is None or e.token_budget.max <= e.ceilings.max_token_budget),
    CrossFieldRule(
        "spec.engine", "!has(self.maxNumSeqs.max) || self.maxNumSeqs.max <= self.ceilings.maxNumSeqs",
        "maxNumSeqs.max must not exceed ceilings.maxNumSeqs",
        lambda e: e.max_num_seqs.max is None or e.max_num_seqs.max <= e.ceilings.max_num_seqs),
    CrossFieldRule(
        "spec.engine",
        "self.maxNumSeqs.min <= self.ceilings.maxNumSeqs && "
        "(!has(self.maxNumSeqs.max) || self.maxNumSeqs.min <= self.maxNumSeqs.max)",
        "maxNumSeqs.min must not exceed maxNumSeqs.max (or its ceiling)",
        lambda e: e.max_num_seqs.min <= e.max_num_seqs.upper(e.ceilings)),
    CrossFieldRule(
        "spec.engine",
        "!has(self.tokenBudget.min) || (self.tokenBudget.min <= self.ceilings.maxTokenBudget && "
        "(!has(self.tokenBudget.max) || self.tokenBudget.min <= self.tokenBudget.max))",
        "tokenBudget.min must not exceed tokenBudget.max (or its ceiling)",
        lambda e: e.token_budget.min is None or e.token_budget.min <= e.token_budget.upper(e.ceilings)),
    CrossFieldRule(
        "spec.engine",
        "!has(self.tokenBudget.max) || (" + _headroom_cel("self.tokenBudget.max", "self.maxNumSeqs.min") + ")",
        "tokenBudget.max leaves no prefill headroom beside maxNumSeqs.min decodes",
        lambda e: e.token_budget.max is None or e.token_budget.max >= min_budget_for(e.max_num_seqs.min)),
    CrossFieldRule(
        "spec.engine",
        "type(self.tokenBudget.initial) == string || (self.tokenBudget.initial <= self.ceilings.maxTokenBudget"
        " && (!has(self.tokenBudget.max) || self.tokenBudget.initial <= self.tokenBudget.max)"
        " && (!has(self.tokenBudget.min) || self.tokenBudget.initial >= self.tokenBudget.min))",
        "tokenBudget.initial must lie within tokenBudget.min..max and under its ceiling",
        lambda e: _is_auto(e.token_budget.initial) or (
            e.token_budget.lower() <= e.token_budget.initial <= e.token_budget.upper(e.ceilings))),
    CrossFieldRule(
        "spec.engine",
        "type(self.maxNumSeqs.initial) == string || (self.maxNumSeqs.initial <= self.ceilings.maxNumSeqs"
        " && self.maxNumSeqs.initial >= self.maxNumSeqs.min"
        " && (!has(self.maxNumSeqs.max) || self.maxNumSeqs.initial <= self.maxNumSeqs.max))",
        "maxNumSeqs.initial must lie within maxNumSeqs.min..max and under its ceiling",
        lambda e: _is_auto(e.max_num_seqs.initial) or (
            e.max_num_seqs.min <= e.max_num_seqs.initial <= e.max_num_seqs.upper(e.ceilings))),
    CrossFieldRule(
        "spec.engine",
        "type(self.tokenBudget.initial) == string || type(self.maxNumSeqs.initial) == string || ("
        + _headroom_cel("self.tokenBudget.initial", "self.maxNumSeqs.initial") + ")",
        "tokenBudget.initial leaves no prefill headroom beside maxNumSeqs.initial decodes",
        lambda e: _is_auto(e.token_budget.initial) or _is_auto(e.max_num_seqs.initial)
        or e.token_budget.initial >= min_budget_for(e.max_num_seqs.initial)),
    CrossFieldRule(
        "spec.engine",
        "type(self.tokenBudget.initial) == string || type(self.maxNumSeqs.initial) == int || ("
        + _headroom_cel("self.tokenBudget.initial", "self.maxNumSeqs.min") + ")",
        "tokenBudget.initial leaves no prefill headroom beside maxNumSeqs.min decodes",
        lambda e: _is_auto(e.token_budget.initial) or not _is_auto(e.max_num_seqs.initial)
        or e.token_budget.initial >= min_budget_for(e.max_num_seqs.min)),
    CrossFieldRule(
        "spec.model.volume",
        "(has(self.persistentVolumeClaim) && !has(self.nfs) && !has(self.image)) || "
        "(!has(self.persistentVolumeClaim) && has(self.nfs) && !has(self.image)) || "
        "(!has(self.persistentVolumeClaim) && !has(self.nfs) && has(self.image))",
        "model.volume must name exactly one source: persistentVolumeClaim, nfs or image",
        lambda v: sum(x is not None for x in (v.persistent_volume_claim, v.nfs, v.image)) == 1),
    # Kubernetes' own Toleration checks: each would be a 422 on the Deployment, so the spec is refused first.
    CrossFieldRule(
        "spec.tolerations[]", "self.operator != 'Exists' || !has(self.value) || self.value == ''",
        "a toleration with operator Exists takes no value",
        lambda t: t.operator != "Exists" or not t.value),
    CrossFieldRule(
        "spec.tolerations[]", "self.operator == 'Exists' || (has(self.key) && self.key != '')",
        "a toleration without a key needs operator Exists",
        lambda t: t.operator == "Exists" or bool(t.key)),
    CrossFieldRule(
        "spec.tolerations[]", "!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
        "tolerationSeconds needs effect NoExecute",
        lambda t: t.toleration_seconds is None or t.effect == "NoExecute"),
    CrossFieldRule(
        "spec.model", "self.source == 'embedded' || self.source == 'random' || has(self.path)",
        "model.path is required when model.source is hf-folder or gguf",
        lambda m: m.source in ("embedded", "random") or m.path is not None),
    # Unique objective names: the API server's own list-map check (x-kubernetes-list-map-keys), this twin here.
    CrossFieldRule(
        "spec", "true", "objectives: each name may appear once",
        lambda sp: len({o.name for o in sp.objectives}) == len(sp.objectives)),
    CrossFieldRule(
        "spec", "!has(self.defaultObjective) || "
        "(has(self.objectives) && self.objectives.exists(o, o.name == self.defaultObjective))",
        "defaultObjective must name one of spec.objectives",
        lambda sp: sp.default_objective is None or any(o.name == sp.default_objective for o in sp.objectives)),
    # Kubernetes' rule for extended resources: a GPU request needs the same limit (else a 422 on the Deployment).
    CrossFieldRule(
        "spec.resources",
        "['nvidia.com/gpu', 'amd.com/gpu'].all(r, !has(self.requests) || !(r in self.requests) || "
        "(has(self.limits) && r in self.limits && string(self.limits[r]) == string(self.requests[r])))",
        "a GPU in resources.requests needs the same count in resources.limits",
        lambda r: all(g not in r.requests or (g in r.limits and str(r.limits[g]) == str(r.requests[g]))
                      for g in ("nvidia.com/gpu", "amd.com/gpu"))),
]

# The InferenceService's name becomes Service names (NAME, NAME-daemons: DNS-1035 labels of at most 63
# characters) and label values: a name the children cannot take is refused at apply (a rule on the root).
NAME_MAX_LENGTH = 63 - len("-daemons")
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
NAME_CEL = f"size(self.metadata.name) <= {NAME_MAX_LENGTH} && self.metadata.name.matches('{NAME_PATTERN}')"
NAME_MESSAGE = (f"metadata.name must be a DNS-1035 label (lower-case letters, digits and '-', starting with a "
                f"letter) of at most {NAME_MAX_LENGTH} characters: the Services it names need one")


def name_problem(name: str) -> str | None:
    """The Python twin of NAME_CEL (the local runtime's and `stallfree render`'s door)."""
    ok = len(name) <= NAME_MAX_LENGTH and re.match(NAME_PATTERN, name) is not None
    return None if ok else f"{name!r}: {NAME_MESSAGE}"


# A resource quantity as Kubernetes writes it (its own CRDs' pattern), and label values: refused at apply.
QUANTITY_PATTERN = (r"^(\+)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+"
                    r"(\.[0-9]*)?)|(\.[0-9]+))))?$")
Quantity = Annotated[int, Field(ge=0)] | Annotated[str, StringConstraints(pattern=QUANTITY_PATTERN)]
LABEL_VALUE = Annotated[str, StringConstraints(max_length=63, pattern=r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")]
# A label key: an optional DNS-subdomain prefix and '/', then a name of at most 63 characters. Checked by the
# Python twin only: a CEL rule over a map's keys costs too much for the API server's estimate to admit the CRD.
LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                       r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")

# The one rule on an int-or-string field ("auto" or a positive integer): attached to the field itself.
AUTO_OR_POSITIVE_CEL = "(type(self) == string && self == 'auto') || (type(self) == int && self >= 1)"
AUTO_OR_POSITIVE_MESSAGE = 'must be a positive integer or "auto"'


def _check_rules(obj: _Model, where: str) -> None:
    for rule in RULES:
        if rule.where == where and not rule.holds(obj):
            raise ValueError(rule.message)


def _auto_or_positive(cls: type, value: int | str) -> int | str:
    if isinstance(value, str) and value != AUTO or isinstance(value, int) and value < 1:
        raise ValueError(AUTO_OR_POSITIVE_MESSAGE)
    return value


_INT_OR_AUTO = {"x-kubernetes-int-or-string": True,
                "x-kubernetes-validations": [{"rule": AUTO_OR_POSITIVE_CEL, "message": AUTO_OR_POSITIVE_MESSAGE}]}
_FREE_FORM = {"x-kubernetes-preserve-unknown-fields": True}


# -- pod fields the spec passes on, typed so a bad value is refused at apply (not a 422 on the child) --------

class PVCSource(_Model):
    claim_name: str = Field(min_length=1, max_length=253)
    read_only: Literal[True] = Field(True, description="always mounted read-only")


class NFSSource(_Model):
    server: str = Field(min_length=1)
    path: str = Field(pattern=r"^/")


class ImageSource(_Model):
    """An OCI image as a read-only volume (Kubernetes 1.31+, the ImageVolume feature)."""

    reference: str = Field(min_length=1)
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"


class ModelVolume(_Model):
    """Where the model's files are: one read-only source. No hostPath: a pod reading its node's disk is
    a privilege this operator does not hand out."""

    persistent_volume_claim: PVCSource | None = None
    nfs: NFSSource | None = None
    image: ImageSource | None = None

    @model_validator(mode="after")
    def _rules(self) -> "ModelVolume":
        _check_rules(self, "spec.model.volume")
        return self

    def to_pod_volume(self) -> dict[str, Any]:
        if self.persistent_volume_claim is not None:
            return {"persistentVolumeClaim": {"claimName": self.persistent_volume_claim.claim_name, "readOnly": True}}
        if self.nfs is not None:
            return {"nfs": {"server": self.nfs.server, "path": self.nfs.path, "readOnly": True}}
        assert self.image is not None
        return {"image": {"reference": self.image.reference, "pullPolicy": self.image.pull_policy}}


class Toleration(_Model):
    key: str | None = Field(None, max_length=316)
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str | None = Field(None, max_length=63)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = Field(None, description="NoExecute only: how long the pod stays bound")

    @model_validator(mode="after")
    def _rules(self) -> "Toleration":
        _check_rules(self, "spec.tolerations[]")
        return self


# Terms stay free-form inside (their selectors are Kubernetes' own, checked by the API server); the shape
# around them is typed, so a misspelt kind of affinity, or a list where an object goes, is refused at apply.
_TERM = dict[str, Any]


class NodeAffinity(_Model):
    required_during_scheduling_ignored_during_execution: _TERM | None = Field(
        None, description="nodeSelectorTerms: where the pods may run at all")
    preferred_during_scheduling_ignored_during_execution: list[_TERM] | None = None


class PodAffinityTerms(_Model):
    required_during_scheduling_ignored_during_execution: list[_TERM] | None = None
    preferred_during_scheduling_ignored_during_execution: list[_TERM] | None = None


class Affinity(_Model):
    """The pod affinity passed on to the daemons (Kubernetes' Affinity)."""

    node_affinity: NodeAffinity | None = None
    pod_affinity: PodAffinityTerms | None = None
    pod_anti_affinity: PodAffinityTerms | None = None


class PlacementSpec(_Model):
    """How replicas land on nodes. By default they pack by their resource requests (GPUs: nvidia.com/gpu),
    spread across nodes and zones where the scheduler can; one per node only when asked."""

    one_per_node: bool = Field(False, description="at most one replica per node (required anti-affinity)")


# -- spec -----------------------------------------------------------------------------------------------

class ModelSpec(_Model):
    """What to serve. `source` decides how `name` and `path` are read."""

    source: Literal["embedded", "hf-folder", "gguf", "random"] = Field(
        "embedded", description="embedded: a model shipped in the image (name); hf-folder: a Hugging Face "
        "model folder at path; gguf: a .gguf file at path; random: random weights of the named shape")
    name: str = Field("smollm2-135m", min_length=1, max_length=253,
                      description="embedded model or shape name; also the served name unless servedModelName")
    path: str | None = Field(None, min_length=1, description="absolute path inside the pod (hf-folder, gguf)")
    served_model_name: str | None = Field(None, min_length=1, max_length=253,
                                          description="the name clients use in the OpenAI API")
    max_model_len: int | None = Field(None, ge=16, le=1 << 20,
                                      description="max context (prompt + output tokens); default the model's own")
    volume: ModelVolume | None = Field(
        None, description="a volume holding the model (persistentVolumeClaim, nfs or image), mounted read-only")
    mount_path: str = Field("/models", pattern=r"^/", description="where the volume is mounted")

    @model_validator(mode="after")
    def _rules(self) -> "ModelSpec":
        _check_rules(self, "spec.model")
        return self

    @property
    def daemon_model(self) -> str:
        """The daemon's --model: a name it knows, `random:<shape>`, or the path."""
        if self.source == "embedded":
            return self.name
        if self.source == "random":
            return f"random:{self.name}"
        assert self.path is not None  # the model rule guarantees it
        return self.path

    @property
    def served_name(self) -> str:
        return self.served_model_name or self.name


class CeilingsSpec(_Model):
    """Fixed at engine start (they size buffers and CUDA graphs); changing them rolls the pods."""

    max_token_budget: int = Field(2048, ge=64, le=65536, description="most tokens one iteration may hold")
    max_num_seqs: int = Field(256, ge=1, le=4096, description="most sequences one iteration may hold")

    @model_validator(mode="after")
    def _rules(self) -> "CeilingsSpec":
        _check_rules(self, "spec.engine.ceilings")
        return self


class TokenBudgetSpec(_Model):
    """The live token budget: where it starts and the bounds the tuner keeps it in."""

    initial: int | str = Field(AUTO, json_schema_extra=_INT_OR_AUTO,
                               description='"auto" (from the profile and the TPOT SLO) or a token count')
    min: int | None = Field(None, ge=1, le=65536, description="default: max_num_seqs floor plus headroom")
    max: int | None = Field(None, ge=1, le=65536, description="default: ceilings.maxTokenBudget")

    _check_initial = field_validator("initial")(_auto_or_positive)

    def lower(self) -> int:
        return self.min if self.min is not None else 1

    def upper(self, ceilings: CeilingsSpec) -> int:
        return self.max if self.max is not None else ceilings.max_token_budget


class MaxNumSeqsSpec(_Model):
    """The live max_num_seqs: where it starts and the bounds the tuner keeps it in."""

    initial: int | str = Field(AUTO, json_schema_extra=_INT_OR_AUTO,
                               description='"auto" (the engine\'s default) or a sequence count')
    min: int = Field(1, ge=1, le=4096)
    max: int | None = Field(None, ge=1, le=4096, description="default: ceilings.maxNumSeqs")

    _check_initial = field_validator("initial")(_auto_or_positive)

    def upper(self, ceilings: CeilingsSpec) -> int:
        return self.max if self.max is not None else ceilings.max_num_seqs


class EngineSpec(_Model):
    image: str | None = Field(None, min_length=1, description="the daemons' image; default: the serving image "
                              "the operator was deployed with (its STALLFREE_SERVING_IMAGE)")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    backend: Literal["model", "sim"] = Field("model", description="sim: the cost model instead of a model")
    hardware: str | None = Field(None, description="hardware preset for the sim backend's cost model")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    attention_backend: Literal["auto", "cpu", "torch", "triton", "flashinfer"] = "auto"
    kv_memory_fraction: float = Field(0.9, ge=0.05, le=0.98, description="share of free device memory for KV")
    num_kv_blocks: int = Field(0, ge=0, description="0: size the KV cache from kvMemoryFraction")
    block_size: Literal[8, 16, 32, 64, 128] = Field(16, description="tokens per KV block")
    prefix_caching: bool = True
    ceilings: CeilingsSpec = Field(default_factory=CeilingsSpec)
    token_budget: TokenBudgetSpec = Field(default_factory=TokenBudgetSpec)
    max_num_seqs: MaxNumSeqsSpec = Field(default_factory=MaxNumSeqsSpec)
    max_partial_prefills: int = Field(1, ge=1, le=64, description="prompts prefilled concurrently (live)")
    long_prefill_threshold: int = Field(0, ge=0, le=65536,
                                        description="most prefill tokens per request per iteration; 0: no cap (live)")
    max_queue_requests: int | None = Field(None, ge=1, description="requests waiting before 429s")
    max_queue_tokens: int | None = Field(None, ge=1, description="prompt tokens waiting before 429s")
    drain_timeout_seconds: float = Field(30.0, ge=1, le=3600, description="how long a stopping pod finishes work")
    api_key_secret: str | None = Field(None, min_length=1, max_length=253,
                                       description="Secret (key api-key) whose value clients must present")

    @model_validator(mode="after")
    def _rules(self) -> "EngineSpec":
        _check_rules(self, "spec.engine")
        return self


class SLOSpec(_Model):
    ttft_p99_ms: float = Field(2000.0, ge=1, le=600000, description="p99 time to first token")
    tpot_p99_ms: float = Field(100.0, ge=1, le=60000, description="p99 time per output token")
    queue_wait_p99_ms: float = Field(1000.0, ge=1, le=600000, description="p99 wait before the first scheduling")
    window_seconds: float = Field(30.0, ge=5, le=3600, description="the window the p99s are taken over")
    priority: list[Literal["tpot", "queueWait", "ttft"]] = Field(
        default_factory=lambda: ["tpot", "queueWait", "ttft"], min_length=3, max_length=3,
        json_schema_extra={"x-kubernetes-list-type": "set"},  # the API server refuses a duplicate
        description="which SLO the control loop holds first when they conflict (each of the three once)")

    @model_validator(mode="after")
    def _priority_once_each(self) -> "SLOSpec":
        if len(set(self.priority)) != 3:
            raise ValueError("spec.slos.priority must name tpot, queueWait and ttft once each")
        return self


# The implicit objective of a spec that lists none: spec.slos at priority 0, what every request had before.
IMPLICIT_OBJECTIVE = "default"
MAX_OBJECTIVES = 16


class ObjectiveSpec(_Model):
    """A class of requests (the request's `x-stallfree-objective` header names it): its priority and targets."""

    name: str = Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
                      description="what requests put in their x-stallfree-objective header")
    priority: int = Field(0, ge=-1000, le=1000, description="higher bands are served first; negative: sheddable "
                          "(refused at arrival when predicted to miss), as the Gateway API Inference Extension has it")
    ttft_p99_ms: float | None = Field(None, ge=1, le=600000, description="default: spec.slos.ttftP99Ms")
    tpot_p99_ms: float | None = Field(None, ge=1, le=60000, description="default: spec.slos.tpotP99Ms")
    queue_wait_p99_ms: float | None = Field(None, ge=1, le=600000, description="default: spec.slos.queueWaitP99Ms")


@dataclass(frozen=True)
class Objective:
    """An objective with its targets resolved against spec.slos (what the router is handed)."""

    name: str
    priority: int
    ttft_p99_ms: float
    tpot_p99_ms: float
    queue_wait_p99_ms: float
    default: bool = False

    @property
    def sheddable(self) -> bool:
        return self.priority < 0


class ScalingSpec(_Model):
    mode: Literal["managed", "external"] = Field(
        "managed", description="managed: the operator sets replicas; external: HPA or KEDA via /scale")
    min_replicas: int = Field(1, ge=0, le=1000)
    max_replicas: int = Field(4, ge=1, le=1000)
    scale_up_stabilization_seconds: int = Field(30, ge=0, le=3600)
    scale_down_stabilization_seconds: int = Field(300, ge=0, le=86400)
    sheddable_scale_out_share: float = Field(
        0.25, ge=0, le=1, description="sheddable objectives (priority < 0) use the capacity the others leave and may "
        "add replicas for their own demand only up to this share of maxReplicas' capacity")

    @model_validator(mode="after")
    def _rules(self) -> "ScalingSpec":
        _check_rules(self, "spec.scaling")
        return self


class TuningSpec(_Model):
    mode: Literal["auto", "off"] = Field("auto", description="auto: the operator re-tunes budget and max_num_seqs")
    interval_seconds: float = Field(10.0, ge=1, le=3600, description="the control interval")


class RoutingSpec(_Model):
    """How clients reach the replicas: through the SLO-aware router, or a plain Service."""

    mode: Literal["slo-aware", "service"] = Field(
        "slo-aware", description="slo-aware: `stallfree router` picks the replica with the lowest predicted TTFT "
        "(with prefix affinity); service: a plain Kubernetes Service spreads requests")
    policy: Literal["slo-aware", "least-outstanding", "round-robin", "random"] = Field(
        "slo-aware", description="the router's policy (the others are baselines)")
    replicas: int = Field(2, ge=1, le=16, description="router pods (each polls every daemon and keeps its own "
                          "queue; 2 by default, with a PodDisruptionBudget, so none is a single point of failure)")
    api_keys_secret: str | None = Field(
        None, min_length=1, max_length=253,
        description="Secret (key keys.json) of the router's API keys: {\"keys\": [{\"sha256\", \"tenant\", "
        "\"objectives\"}]}, SHA-256 hashes of keys mapped to a tenant and the objectives it may use; requests "
        "without one of them are refused. Read again when the Secret changes. Unset: anonymous, one tenant")
    trusted_upstream_secret: str | None = Field(
        None, min_length=1, max_length=253,
        description="Secret (key secret) shared with a gateway in front of the router: only requests carrying it "
        "in x-stallfree-upstream-secret have their tenant header (x-gateway-inference-fairness-id) believed")


class ResourcesSpec(_Model):
    """Container resources, as in a Pod (quantities as integers or strings)."""

    limits: dict[str, Quantity] = Field(default_factory=dict)
    requests: dict[str, Quantity] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _rules(self) -> "ResourcesSpec":
        _check_rules(self, "spec.resources")
        return self


class InferenceServiceSpec(_Model):
    model: ModelSpec = Field(default_factory=ModelSpec)
    engine: EngineSpec = Field(default_factory=EngineSpec)
    slos: SLOSpec = Field(default_factory=SLOSpec)
    scaling: ScalingSpec = Field(default_factory=ScalingSpec)
    tuning: TuningSpec = Field(default_factory=TuningSpec)
    routing: RoutingSpec = Field(default_factory=RoutingSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    node_selector: dict[str, LABEL_VALUE] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    placement: PlacementSpec = Field(default_factory=PlacementSpec)
    affinity: Affinity | None = None
    replicas: int = Field(1, ge=0, le=1000, description="desired replicas (the /scale subresource's)")
    objectives: list[ObjectiveSpec] = Field(
        default_factory=list, max_length=MAX_OBJECTIVES,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
        description="classes of requests by priority and SLOs; none: one objective with spec.slos at priority 0")
    default_objective: str | None = Field(
        None, min_length=1, max_length=63,
        description="the objective of a request that names none; default: the first of spec.objectives")

    @field_validator("node_selector")
    @classmethod
    def _label_keys(cls, value: dict[str, str]) -> dict[str, str]:
        bad = [key for key in value if len(key) > 317 or not LABEL_KEY.match(key)]
        if bad:
            raise ValueError(f"nodeSelector keys must be label keys ([prefix/]name, name of at most 63 "
                             f"characters): {bad}")
        return value

    @model_validator(mode="after")
    def _rules(self) -> "InferenceServiceSpec":
        _check_rules(self, "spec")
        return self

    def resolved_objectives(self) -> list[Objective]:
        """Every objective with its targets filled from spec.slos; exactly one is the default."""
        slos = self.slos
        if not self.objectives:
            return [Objective(IMPLICIT_OBJECTIVE, 0, slos.ttft_p99_ms, slos.tpot_p99_ms, slos.queue_wait_p99_ms,
                              default=True)]
        default = self.default_objective or self.objectives[0].name
        return [Objective(o.name, o.priority,
                          o.ttft_p99_ms if o.ttft_p99_ms is not None else slos.ttft_p99_ms,
                          o.tpot_p99_ms if o.tpot_p99_ms is not None else slos.tpot_p99_ms,
                          o.queue_wait_p99_ms if o.queue_wait_p99_ms is not None else slos.queue_wait_p99_ms,
                          default=o.name == default) for o in self.objectives]

    def desired_replicas(self) -> int:
        """spec.replicas inside the scaling bounds: whoever writes replicas, the bounds hold."""
        return max(self.scaling.min_replicas, min(self.scaling.max_replicas, self.replicas))


# -- status ---------------------------------------------------------------------------------------------

ConditionType = Literal["Ready", "Progressing", "SLOMet", "PrefillCapacityExhausted", "SLOFeasible", "Degraded"]
CONDITION_TYPES: tuple[str, ...] = ("Ready", "Progressing", "SLOMet", "PrefillCapacityExhausted", "SLOFeasible",
                                     "Degraded")


class Condition(_Model):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$", max_length=1024)
    message: str = Field("", max_length=32768)
    last_transition_time: str | None = None
    observed_generation: int | None = None


class InferenceServiceStatus(_Model):
    observed_generation: int | None = None
    replicas: int | None = Field(None, description="pods of the daemons' Deployment")
    ready_replicas: int | None = None
    updated_replicas: int | None = None
    desired_replicas: int | None = Field(None, description="the replica count the operator (or /scale) wants")
    selector: str | None = Field(None, description="label selector of the daemon pods (for /scale)")
    template_hash: str | None = Field(None, description="hash of the rollout-relevant spec the pods run")
    token_budget: int | None = Field(None, description="current token budget (median over replicas)")
    max_num_seqs: int | None = None
    p99_ttft_ms: float | None = None
    p99_tpot_ms: float | None = None
    p99_queue_wait_ms: float | None = None
    goodput: float | None = Field(None, description="share of the requests over the router's window that met every "
                                  "SLO of their objective (per objective: control.objectives)")
    endpoint: str | None = Field(None, description="where clients send requests (the router's or the daemons' Service)")
    conditions: list[Condition] = Field(default_factory=list)
    control: dict[str, Any] | None = Field(
        None, json_schema_extra=_FREE_FORM, description="what the control loop observed and decided last")


def parse_spec(data: dict[str, Any] | None) -> InferenceServiceSpec:
    """Parse a manifest's spec (raises pydantic.ValidationError with every problem)."""
    return InferenceServiceSpec.model_validate(data or {})


def spec_errors(exc: Exception) -> str:
    """One line per problem, with the field path in the manifest's words."""
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return str(exc)
    lines = []
    for err in errors():
        where = ".".join(str(p) for p in err.get("loc", ()))
        message = err.get("msg", "").removeprefix("Value error, ")
        lines.append(f"spec.{where}: {message}" if where else f"spec: {message}")
    return "; ".join(lines)
