#!/usr/bin/env bash
# The checks a platform team runs, with their counts: kubernetes-validate --strict of every rendered child (each
# example, both routing modes, with and without a ServiceMonitor; schemas 1.25, 1.29, 1.37), kubectl kustomize of
# each overlay, promtool on the rules, then the suite's tests of the same. Needs kubernetes-validate, kubectl,
# promtool (.ci/run installs them). Exits non-zero on any failure.
set -uo pipefail
cd "$(dirname "$0")/../.."; PATH=$PWD/.venv/bin:$PATH; T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
fails=0
for ex in manifests/examples/*.yaml; do for mode in slo-aware service; do for mon in "" --no-service-monitor; do
  out=$T/$(basename $ex .yaml)-$mode${mon:+-nomon}.yaml
  stallfree render -f $ex --routing-mode $mode $mon > $out || { echo "render failed: $ex $mode $mon"; fails=$((fails+1)); continue; }
  python - "$out" "$T/split" <<'PY'
import sys, yaml, pathlib
out = pathlib.Path(sys.argv[2]); out.mkdir(exist_ok=True)
custom = {"ServiceMonitor", "PodMonitor", "PrometheusRule", "ScaledObject", "InferenceService"}
for i, o in enumerate(d for d in yaml.safe_load_all(open(sys.argv[1])) if d and d["kind"] not in custom):
    (out / f"{pathlib.Path(sys.argv[1]).stem}-{i}-{o['kind']}.yaml").write_text(yaml.safe_dump(o))
PY
done; done; done
n=$(ls $T/split | wc -l)
for v in 1.25.0 1.29.0 1.37.0; do
  if kubernetes-validate --strict --quiet -k $v $T/split/*.yaml; then echo "kubernetes-validate --strict -k $v: $n rendered children ($(ls manifests/examples/*.yaml | wc -l) examples x 2 routing modes x +/- ServiceMonitor), 0 failures"; else echo "kubernetes-validate $v: FAILURES"; fails=$((fails+1)); fi
done
for k in manifests/operator manifests/overlays/* manifests/monitoring crds; do
  kubectl kustomize $k > $T/k.yaml 2>$T/k.err || { echo "kustomize $k failed: $(cat $T/k.err)"; fails=$((fails+1)); continue; }
  echo "kubectl kustomize $k: $(grep -c '^kind:' $T/k.yaml) objects"
done
python - <<'PY' > $T/rules.yaml
import yaml; d = yaml.safe_load(open("manifests/monitoring/prometheusrule.yaml")); print(yaml.safe_dump({"groups": d["spec"]["groups"]}))
PY
rules=$(promtool check rules $T/rules.yaml 2>&1) || fails=$((fails+1))
echo "promtool check rules: $(echo "$rules" | grep -o "SUCCESS.*\|FAILED.*")"
(cd tests && python -c 'import test_alert_rules as t, test_monitoring_promql as m; a = t.DAEMON_ALERTS + t.OPERATOR_ALERTS; print(f"promtool test rules: {len(a)} alerts, each with a unit test per routing mode: {sorted(a)}"); print(f"dashboard expressions sent to a real Prometheus: {len(m.dashboard_expressions())}")')
python -m pytest -q tests/test_kubernetes_schemas.py tests/test_alert_rules.py tests/test_monitoring_promql.py \
  tests/test_images.py > $T/pytest.txt 2>&1 || fails=$((fails+1))
tail -1 $T/pytest.txt
exit $fails
