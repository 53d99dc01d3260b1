#!/usr/bin/env bash
# Install the InferenceService CRD, the stallfree operator and one example InferenceService into the
# cluster KUBECONFIG names, then wait until the example reports Ready. See README.md beside this file.
#
#   e2e/cluster/install.sh [EXAMPLE] [NAMESPACE]
#     EXAMPLE    an InferenceService manifest (default: manifests/examples/smollm2-cpu.yaml)
#     NAMESPACE  where the example goes (default: default)
#   env: REGISTRY, TAG    where build-images.sh put the images (default: the manifests' own, localhost/stallfree
#                         and 0.1.0, loaded into the nodes): REGISTRY/stallfree-control-plane:TAG runs the
#                         operator and its routers, REGISTRY/stallfree-serving-{cpu,cuda}:TAG the daemons
#        TIMEOUT          how long to wait for Ready (default: 900s; the first start loads and profiles)
set -euo pipefail

cd "$(dirname "$0")/../.."
EXAMPLE=${1:-manifests/examples/smollm2-cpu.yaml}
NAMESPACE=${2:-default}
TIMEOUT=${TIMEOUT:-900s}
OPERATOR_NS=stallfree-system
CRD=inferenceservices.serving.stallfree.io

if [[ -z "${KUBECONFIG:-}" && ! -f "$HOME/.kube/config" ]]; then
  echo "install.sh: set KUBECONFIG to the cluster to install into" >&2
  exit 2
fi
command -v kubectl >/dev/null || { echo "install.sh: kubectl is not on PATH" >&2; exit 2; }
echo "cluster: $(kubectl config current-context)"

diagnose() {
  echo "--- the InferenceService" >&2
  kubectl -n "$NAMESPACE" describe inferenceservice "$NAME" >&2 || true
  echo "--- its pods" >&2
  kubectl -n "$NAMESPACE" get pods -l "serving.stallfree.io/inferenceservice=$NAME" -o wide >&2 || true
  echo "--- operator log (tail)" >&2
  kubectl -n "$OPERATOR_NS" logs deployment/stallfree-operator --tail=80 >&2 || true
}

echo "== CRD"
kubectl apply --server-side -f crds/inferenceservice.yaml
kubectl wait --for condition=established --timeout=60s "crd/$CRD"

echo "== operator"
# An overlay, not `kubectl set image`: kustomize rewrites the operator's image and the images it renders
# (manifests/operator/images-config.yaml) in one place, and the next apply of it keeps them.
OVERLAY=$(mktemp -d manifests/overlays/install.XXXXXX)
trap 'rm -rf "$OVERLAY"' EXIT
cat > "$OVERLAY/kustomization.yaml" <<EOF
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources: [../../operator]
images:
- {name: localhost/stallfree/stallfree-serving-cpu, newName: ${REGISTRY:-localhost/stallfree}/stallfree-serving-cpu, newTag: "${TAG:-0.1.0}"}
- {name: localhost/stallfree/stallfree-serving-cuda, newName: ${REGISTRY:-localhost/stallfree}/stallfree-serving-cuda, newTag: "${TAG:-0.1.0}"}
- {name: localhost/stallfree/stallfree-control-plane, newName: ${REGISTRY:-localhost/stallfree}/stallfree-control-plane, newTag: "${TAG:-0.1.0}"}
EOF
kubectl apply -k "$OVERLAY"
kubectl -n "$OPERATOR_NS" rollout status deployment/stallfree-operator --timeout=300s

echo "== example $EXAMPLE into namespace $NAMESPACE"
NAME=$(kubectl create --dry-run=client -f "$EXAMPLE" -o jsonpath='{.metadata.name}')
kubectl get namespace "$NAMESPACE" >/dev/null 2>&1 || kubectl create namespace "$NAMESPACE"
# Secrets and RBAC objects: the operator may make them only in namespaces that grant it this binding.
kubectl -n "$NAMESPACE" apply -f manifests/operator/namespaced/rolebinding.yaml
kubectl -n "$NAMESPACE" apply -f "$EXAMPLE"

echo "== waiting up to $TIMEOUT for $NAME to be Ready"
if ! kubectl -n "$NAMESPACE" wait "inferenceservice/$NAME" --for=condition=Ready --timeout="$TIMEOUT"; then
  diagnose
  exit 1
fi
kubectl -n "$NAMESPACE" get inferenceservice "$NAME" -o wide
echo "ready: kubectl -n $NAMESPACE port-forward service/$NAME 8000:80, then POST /v1/chat/completions"
