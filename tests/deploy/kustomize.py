"""The part of Kustomize that deploy/ uses, in Python, so that the tests render every overlay
without a kustomize binary: `resources` (files and directories), `namespace`, `images`
(newName, newTag) and `patches` by file (strategic merge, as `kubectl kustomize` merges
them: maps key by key, `null` deletes a key; the lists below by their merge key, the
patch's items first in its order (merged into the original's of the same key), then the
original's others; any other list replaced). A kustomization that uses anything else is refused,
so nothing is rendered half-understood; where `kubectl` is installed,
tests/deploy/test_manifests.py checks that it renders the same objects.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

Obj = dict[str, Any]

KNOWN_KEYS = frozenset({"apiVersion", "kind", "namespace", "resources", "images", "patches"})

MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",  # a pod's; a Service's ports are never patched here
}
"""Kubernetes' patch merge keys of the lists deploy/ patches."""


def render(directory: Path) -> list[Obj]:
    """The objects `kubectl kustomize DIRECTORY` prints, in the order of its resources."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(spec) - KNOWN_KEYS
    if unknown:
        raise ValueError(f"{directory}/kustomization.yaml: not rendered here: {sorted(unknown)}")
    objects: list[Obj] = []
    for entry in spec.get("resources", []):
        path = directory / entry
        if path.is_dir():
            objects += render(path)
        else:
            objects += [o for o in yaml.safe_load_all(path.read_text()) if o]
    for patch in spec.get("patches", []):
        if set(patch) != {"path"}:
            raise ValueError(f"{directory}: only patches by path are rendered here: {patch}")
        _apply_patch(objects, yaml.safe_load((directory / patch["path"]).read_text()))
    if "namespace" in spec:
        for obj in objects:
            obj["metadata"]["namespace"] = spec["namespace"]
    for image in spec.get("images", []):
        for obj in objects:
            _set_image(obj, image)
    return objects


def _apply_patch(objects: list[Obj], patch: Obj) -> None:
    targets = [
        o
        for o in objects
        if o["kind"] == patch["kind"] and o["metadata"]["name"] == patch["metadata"]["name"]
    ]
    if len(targets) != 1:
        raise ValueError(f"patch of {patch['kind']}/{patch['metadata']['name']}: no one target")
    merged = merge(targets[0], patch)
    targets[0].clear()
    targets[0].update(merged)


def merge(original: Any, patch: Any, field: str = "") -> Any:
    """`patch` merged into `original` (neither changed), as a strategic merge patch."""
    if isinstance(original, dict) and isinstance(patch, dict):
        out = copy.deepcopy(original)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = merge(out[key], value, key)
            else:
                out[key] = copy.deepcopy(value)
        return out
    key = MERGE_KEYS.get(field)
    if key is not None and isinstance(original, list) and isinstance(patch, list):
        # The order matters: env values see only the variables above them.
        before = {o[key]: o for o in original}
        named = [merge(before[p[key]], p) if p[key] in before else copy.deepcopy(p) for p in patch]
        patched = {p[key] for p in patch}
        return named + [copy.deepcopy(o) for o in original if o[key] not in patched]
    return copy.deepcopy(patch)


def _set_image(obj: Obj, image: Obj) -> None:
    pod = obj.get("spec", {}).get("template", {}).get("spec", {})
    for container in pod.get("containers", []) + pod.get("initContainers", []):
        name, _, tag = container["image"].partition(":")
        if name == image["name"]:
            name = image.get("newName", name)
            tag = image.get("newTag", tag)
            container["image"] = f"{name}:{tag}" if tag else name
