"""Which images the rendered pods run: a serving image per variant for the daemons (CPU, CUDA), the control-plane
image for the router.

The operator's Deployment names all three in its environment (manifests/operator/deployment.yaml), and the
kustomization's `images:` rewrites those values together with the operator's own image, so one
`kustomize edit set image` moves the operator, its routers and every daemon that names no image of its
own (spec.engine.image) to the same build. The defaults are what e2e/cluster/build-images.sh tags: under
`localhost/`, a name no public registry serves, so an unbuilt image fails to pull instead of pulling someone
else's. Each variant has a name of its own, so a CPU and a CUDA build of one commit never share a tag.
"""
from __future__ import annotations

import os

REGISTRY = "localhost/stallfree"
TAG = "0.1.0"
SERVING_IMAGE = f"{REGISTRY}/stallfree-serving-cpu:{TAG}"  # target serving-cpu
SERVING_CUDA_IMAGE = f"{REGISTRY}/stallfree-serving-cuda:{TAG}"  # target serving-cuda
CONTROL_PLANE_IMAGE = f"{REGISTRY}/stallfree-control-plane:{TAG}"  # target control-plane: no torch
SERVING_IMAGE_ENV = "STALLFREE_SERVING_IMAGE"
SERVING_CUDA_IMAGE_ENV = "STALLFREE_SERVING_CUDA_IMAGE"
CONTROL_PLANE_IMAGE_ENV = "STALLFREE_CONTROL_PLANE_IMAGE"


def serving_image(requested: str | None = None, cuda: bool = False) -> str:
    """The daemons' image: the spec's own, else the variant (CPU or CUDA) the operator was deployed with."""
    if requested:
        return requested
    if cuda:
        return os.environ.get(SERVING_CUDA_IMAGE_ENV) or SERVING_CUDA_IMAGE
    return os.environ.get(SERVING_IMAGE_ENV) or SERVING_IMAGE


def control_plane_image() -> str:
    """The router's image: small and torch-free, like the operator's."""
    return os.environ.get(CONTROL_PLANE_IMAGE_ENV) or CONTROL_PLANE_IMAGE
