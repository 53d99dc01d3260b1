#!/usr/bin/env bash
# Build the two images the manifests name, with one registry and tag, from e2e/cluster/Dockerfile:
#   REGISTRY/stallfree-control-plane:TAG  (operator, router; no torch)
#   REGISTRY/stallfree:TAG                 (the daemons; VARIANT=cpu or cuda)
#
#   REGISTRY=registry.example.com/me TAG=dev VARIANT=cpu e2e/cluster/build-images.sh [--push]
# install.sh takes the same REGISTRY and TAG and points the operator (and what it renders) at them.
set -euo pipefail
cd "$(dirname "$0")/../.."
REGISTRY=${REGISTRY:-ghcr.io/stallfree}
TAG=${TAG:-0.1.0}
VARIANT=${VARIANT:-cpu}
PUSH=${1:-}

build() {  # target image
  docker build -f e2e/cluster/Dockerfile --target "$1" -t "$2" .
  if [[ "$PUSH" == "--push" ]]; then docker push "$2"; fi
}
build control-plane "$REGISTRY/stallfree-control-plane:$TAG"
build "serving-$VARIANT" "$REGISTRY/stallfree:$TAG"
echo "built $REGISTRY/stallfree-control-plane:$TAG and $REGISTRY/stallfree:$TAG ($VARIANT)"
