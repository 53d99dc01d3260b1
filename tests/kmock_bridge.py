"""kmock 0.8's Kubernetes emulator, bridged to what kopf and the operator's client rely on.

kmock stores objects as JSON and merges patches into them. A real API server does more, and kopf
and our client depend on some of it:
- metadata.uid, resourceVersion, creationTimestamp and generation are set, generateName honoured (kopf's JSON-patches test
  resourceVersion, owner references need a uid, observedGeneration needs a generation);
- a JSON-patch whose `test` fails is a 422 (kmock: 500), and a merge patch that carries a stale
  metadata.resourceVersion is a 409 (optimistic concurrency);
- PUT replaces an object (kmock has no PUT);
- a watch from a resourceVersion streams only what is newer (kmock replays every object, so kopf
  would handle a stale copy after its own patch and wait forever for a newer event); deletions bump
  the resourceVersion as they do in Kubernetes;
- the status subresource changes only status, the main resource never status, /scale only
  spec.replicas;
- kopf only starts watching once namespaces and customresourcedefinitions can be listed (kmock cannot
  parse the cluster-wide /api/v1/namespaces path: fixed below).
Every write is turned into the merge patch kmock understands, so its object history stays usable.
"""
from __future__ import annotations

import asyncio
import copy
import datetime
import uuid
from typing import Any

import attrs
import jsonpatch
import kmock
from kmock._internal import enums, parsing, rendering

from stallfree.operator.api import crd, spec as s

_UNSET = object()


def _parse_path_with_namespaces(path: str, _original=parsing.parse_path) -> parsing.ParsedPath:
    """kmock reads /api/v1/namespaces[/NAME] as a namespace prefix with nothing after it (and fails);
    there `namespaces` is the cluster-scoped resource itself."""
    parts = path.strip("/").split("/")
    if parts[:2] == ["api", "v1"] and parts[2:3] == ["namespaces"] and len(parts) <= 4:
        return parsing.ParsedPath("", "v1", "namespaces", None, parts[3] if len(parts) == 4 else None, None)
    return _original(path)


parsing.parse_path = _parse_path_with_namespaces  # kmock's Request._parse looks it up at call time


def merge_diff(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The RFC 7386 merge patch that turns `old` into `new` (None removes a key)."""
    patch: dict[str, Any] = {}
    for key in old.keys() - new.keys():
        patch[key] = None
    for key, value in new.items():
        before = old.get(key, _UNSET)
        if isinstance(value, dict) and isinstance(before, dict):
            sub = merge_diff(before, value)
            if sub:
                patch[key] = sub
        elif before is _UNSET or before != value:
            patch[key] = value
    return patch


def merge_patch(target: Any, patch: Any) -> Any:
    """Apply an RFC 7386 merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _rewritten(request: rendering.Request, action: enums.action, data: Any) -> rendering.Request:
    # kmock matches requests to reactions by identity with the ones it recorded, so the recorded
    # request itself is rewritten (its class is frozen, hence object.__setattr__).
    object.__setattr__(request, "action", action)
    object.__setattr__(request, "data", data)
    return request


def _version_number(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _conflict(message: str) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=409, reason="Conflict", message=message)


@attrs.define(kw_only=True)
class BridgedEmulator(kmock.KubernetesEmulator):
    _last_version: int = attrs.field(default=1000, init=False)
    _write_lock: asyncio.Lock = attrs.field(factory=asyncio.Lock, init=False)

    def install_basics(self, namespace: str) -> None:
        """The built-in resources, our CRD (served and listed), and a namespace to work in."""
        self.resources.load_bundled()
        self.resources[f"{s.GROUP}/{s.VERSION}/{s.PLURAL}"] = kmock.ResourceInfo(
            kind=s.KIND, singular=s.SINGULAR, namespaced=True, shortnames=set(s.SHORT_NAMES),
            verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
            subresources={"status", "scale"})
        definition = crd.custom_resource_definition()
        self.objects["apiextensions.k8s.io/v1/customresourcedefinitions", None, definition["metadata"]["name"]] = \
            self._stamped_new(definition)
        self.objects["v1/namespaces", None, namespace] = self._stamped_new(
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})

    def _stamped_new(self, obj: dict[str, Any]) -> dict[str, Any]:
        obj = copy.deepcopy(obj)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
        meta["generation"] = 1
        meta["resourceVersion"] = self._next_version()
        return obj

    def _has_status_subresource(self, request: rendering.Request) -> bool:
        assert request.resource is not None
        return request.resource in self.resources and "status" in self.resources[request.resource].subresources

    def _bridge_write(self, request: rendering.Request) -> rendering.Request:
        if request.action == enums.action.CREATE:
            return _rewritten(request, enums.action.CREATE, self._stamped_new(request.data or {}))
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            raise kmock.KubernetesObjectNotFoundError()
        current: dict[str, Any] = copy.deepcopy(self.objects[key].raw)
        data = request.data
        content_type = next((v for k, v in request.headers.items() if k.lower() == "content-type"), "")
        if request.method == enums.method.PUT:
            new = copy.deepcopy(data)
            if data.get("metadata", {}).get("resourceVersion") not in (None, current["metadata"]["resourceVersion"]):
                raise _conflict("the object has been modified; please apply your changes to the latest version")
        elif "json-patch" in content_type:
            try:
                new = jsonpatch.apply_patch(current, data, in_place=False)
            except jsonpatch.JsonPatchTestFailed as exc:
                raise kmock.KubernetesError(status=422, reason="Invalid", message=f"the test failed: {exc}")
            except jsonpatch.JsonPatchException as exc:
                raise kmock.KubernetesError(status=422, reason="Invalid", message=str(exc))
        else:  # merge, strategic-merge and apply patches: a recursive merge is close enough here
            expected = (data.get("metadata") or {}).get("resourceVersion")
            if expected is not None and expected != current["metadata"]["resourceVersion"]:
                raise _conflict("the object has been modified; please apply your changes to the latest version")
            new = merge_patch(current, data)

        if request.subresource == "status":
            new = {**current, "status": new.get("status")}
        elif request.subresource == "scale":
            replicas = (new.get("spec") or {}).get("replicas", current.get("spec", {}).get("replicas"))
            new = merge_patch(current, {"spec": {"replicas": replicas}})
        elif self._has_status_subresource(request):
            new["status"] = current.get("status")
        if new.get("status") is None:
            new.pop("status", None)

        meta = new.setdefault("metadata", {})
        for field in ("uid", "creationTimestamp", "generation", "deletionTimestamp"):
            if field in current["metadata"]:
                meta[field] = current["metadata"][field]
        strip = lambda o: {k: v for k, v in o.items() if k not in ("metadata", "status")}  # noqa: E731
        if request.subresource != "status" and strip(new) != strip(current):
            meta["generation"] = int(current["metadata"].get("generation", 1)) + 1
        meta["resourceVersion"] = self._next_version()
        return _rewritten(request, enums.action.UPDATE, merge_diff(current, new))

    def _next_version(self) -> str:
        self._last_version += 1
        return str(self._last_version)

    async def _serve_list(self, request: rendering.Request) -> Any:
        listing = await super()._serve_list(request)
        listing["metadata"]["resourceVersion"] = str(self._last_version)  # kmock says "..."
        return listing

    async def _serve_watch(self, request: rendering.Request) -> Any:
        since = _version_number(request.params.get("resourceVersion"))
        async for event in super()._serve_watch(request):
            if since is not None and isinstance(event, dict) and event.get("type") != "DELETED":
                version = _version_number(event.get("object", {}).get("metadata", {}).get("resourceVersion"))
                if version is not None and version <= since:
                    continue  # the client has seen it already (in its listing)
            yield event

    def _bump_before_delete(self, request: rendering.Request) -> None:
        key = (request.resource, request.namespace, request.name)
        if key in self.objects and not self.objects[key].deleted:
            self.objects[key].patch({"metadata": {"resourceVersion": self._next_version()}})

    async def _handle(self, request: rendering.Request) -> Any:
        writes = (enums.action.CREATE, enums.action.UPDATE)
        is_put = request.method == enums.method.PUT and request.name is not None
        if request.resource is not None and (request.action in writes or is_put):
            async with self._write_lock:  # compute and store each write as one step
                return await super()._handle(self._bridge_write(request))
        if request.resource is not None and request.action == enums.action.DELETE and request.name:
            async with self._write_lock:
                self._bump_before_delete(request)
                return await super()._handle(request)
        return await super()._handle(request)
