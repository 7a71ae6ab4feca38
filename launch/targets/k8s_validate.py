"""Strict validation of Kubernetes manifests: every key known, every value of the right type.

Core and batch kinds (Service, Deployment, StatefulSet, and the Job template inside a JobSet) are
deserialized with the official `kubernetes` client models (the `k8s` extra), which check required
fields; as the client silently drops unknown keys, each object is also walked against the models'
`attribute_map` / `openapi_types`, so a typo (`contianers`) or a wrong type (`replicas: "2"`) fails.
The JobSet, a custom resource the client has no model for, is checked with a JSON schema written
from the JobSet v1alpha2 Go types (kubernetes-sigs/jobset, api/jobset/v1alpha2/jobset_types.go:
JobSetSpec, ReplicatedJob, Network, SuccessPolicy, FailurePolicy, StartupPolicy, Coordinator,
DependsOn); its Job templates go through the client models as above.

    python -m rlvr.launch.targets.k8s_validate EXPERIMENT/k8s/*.yaml
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

import jsonschema
import kubernetes.client
import yaml

MODELS = {("v1", "Service"): "V1Service", ("apps/v1", "Deployment"): "V1Deployment",
          ("apps/v1", "StatefulSet"): "V1StatefulSet", ("batch/v1", "Job"): "V1Job", ("v1", "Pod"): "V1Pod"}
_PRIMITIVES = {"str": str, "int": int, "float": (int, float), "bool": bool}


class ManifestError(ValueError):
    """A manifest key or value the API would reject; the message gives the path."""


def _obj(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


_STRINGS = {"type": "array", "items": {"type": "string"}}
JOBSET_SCHEMA = _obj({
    "apiVersion": {"const": "jobset.x-k8s.io/v1alpha2"},
    "kind": {"const": "JobSet"},
    "metadata": {"type": "object"},  # checked as V1ObjectMeta
    "spec": _obj({
        "replicatedJobs": {"type": "array", "minItems": 1, "items": _obj({
            "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
            "groupName": {"type": "string"},
            "template": {"type": "object"},  # checked as V1JobTemplateSpec
            "replicas": {"type": "integer", "minimum": 0},
            "dependsOn": {"type": "array", "maxItems": 5, "items": _obj(
                {"name": {"type": "string"}, "status": {"enum": ["Ready", "Complete"]}}, ("name", "status"))},
        }, ("name", "template"))},
        "network": _obj({"enableDNSHostnames": {"type": "boolean"}, "subdomain": {"type": "string"},
                         "publishNotReadyAddresses": {"type": "boolean"}}),
        "successPolicy": _obj({"operator": {"enum": ["All", "Any"]}, "targetReplicatedJobs": _STRINGS},
                              ("operator",)),
        "failurePolicy": _obj({
            "maxRestarts": {"type": "integer", "minimum": 0},
            "restartStrategy": {"enum": ["Recreate", "BlockingRecreate"]},
            "rules": {"type": "array", "items": _obj({
                "name": {"type": "string"},
                "action": {"enum": ["FailJobSet", "RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts"]},
                "onJobFailureReasons": _STRINGS, "onJobFailureMessagePatterns": _STRINGS,
                "targetReplicatedJobs": _STRINGS}, ("name", "action"))}}),
        "startupPolicy": _obj({"startupPolicyOrder": {"enum": ["AnyOrder", "InOrder"]}}, ("startupPolicyOrder",)),
        "suspend": {"type": "boolean"},
        "coordinator": _obj({"replicatedJob": {"type": "string"}, "jobIndex": {"type": "integer"},
                             "podIndex": {"type": "integer"}}, ("replicatedJob",)),
        "managedBy": {"type": "string", "maxLength": 63},
        "ttlSecondsAfterFinished": {"type": "integer", "minimum": 0},
    }),
}, ("apiVersion", "kind", "metadata", "spec"))


def _model(type_name: str):
    return getattr(kubernetes.client, type_name)


def walk(value: Any, type_name: str, path: str) -> None:
    """Raises ManifestError at the first key unknown to `type_name` (a client model or an openapi type
    string like 'List[V1Container]' / 'Dict[str, str]') or value of the wrong type."""
    inner = re.fullmatch(r"(?:List\[|list\[)(.*)\]", type_name)
    if inner:
        if not isinstance(value, list):
            raise ManifestError(f"{path}: expected a list, got {type(value).__name__} {value!r}")
        for i, item in enumerate(value):
            walk(item, inner.group(1), f"{path}[{i}]")
        return
    inner = re.fullmatch(r"(?:Dict\[str, |dict\(str, )(.*)[\])]", type_name)
    if inner:
        if not isinstance(value, dict):
            raise ManifestError(f"{path}: expected a mapping, got {type(value).__name__} {value!r}")
        for key, item in value.items():
            walk(item, inner.group(1), f"{path}.{key}")
        return
    if type_name == "object":  # IntOrString and free-form fields
        return
    if type_name in _PRIMITIVES:
        ok = isinstance(value, _PRIMITIVES[type_name]) and not (type_name != "bool" and isinstance(value, bool))
        if not ok:
            raise ManifestError(f"{path}: expected {type_name}, got {type(value).__name__} {value!r}")
        return
    model = _model(type_name)
    if not isinstance(value, dict):
        raise ManifestError(f"{path}: expected a {type_name} mapping, got {type(value).__name__} {value!r}")
    by_json = {json_key: attr for attr, json_key in model.attribute_map.items()}
    for key, item in value.items():
        if key not in by_json:
            raise ManifestError(f"{path}.{key}: unknown field of {type_name} (known: {sorted(by_json)})")
        walk(item, model.openapi_types[by_json[key]], f"{path}.{key}")


def check_model(obj: dict[str, Any], type_name: str, path: str) -> None:
    """Strict walk, then deserialization by the client (required fields, enums)."""
    walk(obj, type_name, path)
    try:
        kubernetes.client.ApiClient().deserialize(json.dumps(obj), type_name, "application/json")
    except (ValueError, TypeError) as e:
        raise ManifestError(f"{path}: the kubernetes client rejects it as {type_name}: {e}") from None


def validate_object(obj: dict[str, Any], where: str = "") -> None:
    """One manifest object; raises ManifestError naming its kind, name and the bad path."""
    kind = obj.get("kind", "?")
    label = f"{where}{kind}/{obj.get('metadata', {}).get('name', '?')}"
    if (obj.get("apiVersion"), kind) == ("jobset.x-k8s.io/v1alpha2", "JobSet"):
        try:
            jsonschema.validate(obj, JOBSET_SCHEMA)
        except jsonschema.ValidationError as e:
            path = ".".join(str(p) for p in e.absolute_path)
            raise ManifestError(f"{label}: {path}: {e.message}") from None
        check_model(obj["metadata"], "V1ObjectMeta", f"{label}.metadata")
        for i, replicated in enumerate(obj["spec"]["replicatedJobs"]):
            check_model(replicated["template"], "V1JobTemplateSpec", f"{label}.spec.replicatedJobs[{i}].template")
        return
    model = MODELS.get((obj.get("apiVersion"), kind))
    if model is None:
        raise ManifestError(f"{label}: apiVersion {obj.get('apiVersion')!r} kind {kind!r} is not one this "
                            f"validator knows ({sorted(MODELS)} and JobSet)")
    check_model(obj, model, label)


def validate_objects(objects: list[dict[str, Any]], where: str = "") -> None:
    for obj in objects:
        validate_object(obj, where)


def main(paths: list[str]) -> int:
    for path in paths:
        with open(path) as f:
            objects = [o for o in yaml.safe_load_all(f) if o]
        if all("resources" in o and o.get("kind") == "Kustomization" for o in objects):
            continue
        validate_objects(objects, f"{path}: ")
        print(f"{path}: {len(objects)} object(s) valid")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
