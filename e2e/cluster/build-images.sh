#!/usr/bin/env bash
# Build the images the manifests name, with one registry and tag, from e2e/cluster/Dockerfile:
#   REGISTRY/stallfree-control-plane:TAG   (operator, router; no torch)
#   REGISTRY/stallfree-serving-cpu:TAG     (CPU daemons)    VARIANTS=cpu (default), cuda, or "cpu cuda"
#   REGISTRY/stallfree-serving-cuda:TAG    (GPU daemons)
#
#   e2e/cluster/build-images.sh                       # localhost/stallfree/...:0.1.0, the manifests' defaults
#   kind load docker-image localhost/stallfree/stallfree-control-plane:0.1.0 localhost/stallfree/stallfree-serving-cpu:0.1.0
#   REGISTRY=registry.example.com/me TAG=dev VARIANTS="cpu cuda" e2e/cluster/build-images.sh --push
# install.sh takes the same REGISTRY and TAG and points the operator (and what it renders) at them.
# The pip layers install under e2e/cluster/constraints.txt; the base images are pinned by the Dockerfile's ARGs.
set -euo pipefail
cd "$(dirname "$0")/../.."
REGISTRY=${REGISTRY:-localhost/stallfree}
TAG=${TAG:-0.1.0}
VARIANTS=${VARIANTS:-${VARIANT:-cpu}}
PUSH=${1:-}

build() {  # target image
  docker build -f e2e/cluster/Dockerfile --target "$1" -t "$2" .
  if [[ "$PUSH" == "--push" ]]; then docker push "$2"; fi
}
build control-plane "$REGISTRY/stallfree-control-plane:$TAG"
for variant in $VARIANTS; do
  case "$variant" in
    cpu|cuda) build "serving-$variant" "$REGISTRY/stallfree-serving-$variant:$TAG" ;;
    *) echo "build-images.sh: VARIANTS takes cpu and cuda, not $variant" >&2; exit 2 ;;
  esac
done
echo "built $REGISTRY/stallfree-control-plane:$TAG and $REGISTRY/stallfree-serving-{$VARIANTS}:$TAG"
