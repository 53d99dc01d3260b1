"""Which images the rendered pods run: the serving image for the daemons, the control-plane image for the router.

The operator's Deployment names both in its environment (manifests/operator/deployment.yaml), and the
kustomization's `images:` rewrites those values together with the operator's own image, so one
`kustomize edit set image` moves the operator, its routers and every daemon that names no image of its
own (spec.engine.image) to the same build. The defaults are the tags e2e/cluster/Dockerfile builds.
"""
from __future__ import annotations

import os

REGISTRY = "ghcr.io/stallfree"
TAG = "0.1.0"
SERVING_IMAGE = f"{REGISTRY}/stallfree:{TAG}"  # target serving-cpu (serving-cuda: tag it over this one)
CONTROL_PLANE_IMAGE = f"{REGISTRY}/stallfree-control-plane:{TAG}"  # target control-plane: no torch
SERVING_IMAGE_ENV = "STALLFREE_SERVING_IMAGE"
CONTROL_PLANE_IMAGE_ENV = "STALLFREE_CONTROL_PLANE_IMAGE"


def serving_image(requested: str | None = None) -> str:
    """The daemons' image: the spec's own, else the one the operator was deployed with."""
    return requested or os.environ.get(SERVING_IMAGE_ENV) or SERVING_IMAGE


def control_plane_image() -> str:
    """The router's image: small and torch-free, like the operator's."""
    return os.environ.get(CONTROL_PLANE_IMAGE_ENV) or CONTROL_PLANE_IMAGE
