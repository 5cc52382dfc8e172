"""The chart's values.schema.json and its one-error validation, as helm uses them.

helm checks the values against the schema before any template runs and lists every key it
refuses in one error; then templates/validate/values.yaml (the deepest template, so helm
renders it first) lists every problem only the chart can judge, again in one error. So a
misspelt nested key (``host.interfce``) no longer renders a default silently, and a kube2iam
values file with several problems takes one round trip per kind, not one per problem.

The schema must still take every kube2iam values file: every key of kube2iam's charts
(kube2iam-chart's values.yaml and templates, the kube2iam chart 3.2.0's, its 2.x ``probe``),
and every key an older kiamfast release's values had (``helm upgrade --reuse-values``
validates the installed release's values against the new schema).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from test_chart import CHART, VALUES, helm, render_error, values_file

SCHEMA = json.loads((CHART / "values.schema.json").read_text())
KUBE2IAM_SRC = Path(os.environ.get("KUBE2IAM_SRC") or
                    Path(__file__).resolve().parents[3] / "shared/peers/kube2iam")
KUBE2IAM_CHART = KUBE2IAM_SRC / "charts" / "kube2iam"
OLD_CHART = Path(__file__).resolve().parent / "kube2iam-chart-3.2.0"

# Keys the schema takes that kiamfast's values.yaml does not set, and why.
NOT_IN_VALUES_YAML = {
    "global": "kube2iam's charts read global.imagePullSecrets",
    "probe": "the kube2iam chart 2.x's liveness probe",
    "prometheus.metricsPort": "kube2iam's, commented out in values.yaml (unset = host.port)",
    "readinessProbe.path": "an older kiamfast release's value (--reuse-values keeps it)",
    "resources.limits": "a container's resources ({} by default)",
    "resources.requests": "a container's resources",
    "resources.claims": "a container's resources",
    "socketKeeper.resources.claims": "a container's resources",
    "containerCredentials.webhook.resources.claims": "a container's resources",
}


def schema_paths(schema: dict, prefix: str = "") -> set[str]:
    """Every key a closed object of the schema names (an open map names none)."""
    paths = set()
    for name, sub in schema.get("properties", {}).items():
        path = f"{prefix}{name}"
        paths.add(path)
        for branch in [sub, *sub.get("oneOf", [])]:
            if branch.get("additionalProperties") is False:
                paths |= schema_paths(branch, path + ".")
    return paths


def value_paths(values: dict, schema: dict, prefix: str = "") -> set[str]:
    """Every key of ``values`` down to where the schema stops closing objects."""
    paths = set()
    for name, value in values.items():
        path = f"{prefix}{name}"
        paths.add(path)
        sub = schema.get("properties", {}).get(name, {})
        if isinstance(value, dict) and sub.get("additionalProperties") is False:
            paths |= value_paths(value, sub, path + ".")
    return paths


def test_the_schema_names_exactly_the_values_yaml_keys_and_the_listed_others():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    in_values = value_paths(values, SCHEMA)
    in_schema = schema_paths(SCHEMA)
    assert in_values <= in_schema, in_values - in_schema
    others = {p for p in in_schema - in_values
              if not any(p.startswith(f"{listed}.") for listed in NOT_IN_VALUES_YAML)}
    assert others == set(NOT_IN_VALUES_YAML)
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    jsonschema.validate(values, SCHEMA)


def taken(path: str) -> bool:
    """Whether the schema takes the key ``path`` (a.b.c): named by closed objects down to it,
    or inside an open map (global, extraArgs, ...)."""
    schema = SCHEMA
    for name in path.split("."):
        if schema.get("additionalProperties") is not False:
            return True
        if name not in schema.get("properties", {}):
            return False
        schema = schema["properties"][name]
    return True


def kube2iam_files() -> list[Path]:
    files = [*sorted(VALUES.glob("*.yaml")), OLD_CHART / "values.yaml"]
    if not KUBE2IAM_CHART.exists():
        pytest.skip(f"needs kube2iam's source for kube2iam-chart: set KUBE2IAM_SRC "
                    f"({KUBE2IAM_SRC})")
    return [*files, KUBE2IAM_CHART / "values.yaml"]


def test_every_kube2iam_values_file_and_key_is_taken():
    for path in kube2iam_files():
        jsonschema.validate(yaml.safe_load(path.read_text()), SCHEMA)
    # Every value kube2iam-chart's templates read, whether its values.yaml sets it or not.
    read = set()
    for template in (KUBE2IAM_CHART / "templates").iterdir():
        read |= set(re.findall(r"\.Values\.([A-Za-z0-9_.]+)", template.read_text()))
    assert read, "no .Values found in kube2iam-chart's templates"
    assert {path for path in read if not taken(path)} == set()
    assert not taken("host.interfce") and taken("global.imagePullSecrets")
    # The 2.x probe, both of its forms.
    for probe in (True, {"enabled": True, "periodSeconds": 15}):
        jsonschema.validate({"probe": probe}, SCHEMA)


@pytest.mark.parametrize("values, key, at", [
    ({"host": {"interfce": "eni+"}}, "interfce", "/host"),
    ({"prometheus": {"servce": {"enabled": True}}}, "servce", "/prometheus"),
    ({"rbac": {"craete": True}}, "craete", "/rbac"),
    ({"containerCredentials": {"webhook": {"certManger": {"enabled": True}}}}, "certManger",
     "/containerCredentials/webhook"),
    ({"hostNetwrok": True}, "hostNetwrok", ""),
])
def test_a_misspelt_key_is_refused_naming_it(tmp_path, values, key, at):
    error = render_error(tmp_path, values)
    assert f"at '{at}': additional properties '{key}' not allowed" in error, error


def test_every_misspelling_of_a_file_in_one_error(tmp_path):
    error = render_error(tmp_path, {"host": {"interfce": "eni+", "iptables": "true"},
                                    "prometheus": {"servce": {"enabled": True}},
                                    "rbac": {"craete": True}})
    for line in ("at '/host': additional properties 'interfce' not allowed",
                 "at '/host/iptables': got string, want boolean",
                 "at '/prometheus': additional properties 'servce' not allowed",
                 "at '/rbac': additional properties 'craete' not allowed"):
        assert line in error, error


def test_every_problem_the_chart_judges_in_one_error_from_the_validation_template(tmp_path):
    """A realistic kube2iam values file, webhook off, with four problems only the chart can
    judge: one error lists them all, from the template named for it."""
    given = {**yaml.safe_load((VALUES / "eks.yaml").read_text()),
             "extraArgs": {"base-role-arn": "arn:aws:iam::111122223333:role/",
                           "namespace-restrictions": False, "defualt-role": "app"},
             "resources": {"limits": {"memory": "128Mi"}},
             "updateStrategy": "Recreate"}
    error = render_error(tmp_path, given)
    assert "execution error at (kiamfast/templates/validate/values.yaml:" in error, error
    assert "4 value problems" in error, error
    for problem in ("extraArgs.namespace-restrictions: false: kube2iam's chart renders this",
                    "extraArgs.defualt-role: kiamfast has no flag --defualt-role",
                    "resources.limits.memory 128Mi: kiamfast needs at least 160Mi",
                    "updateStrategy Recreate: a DaemonSet updates by"):
        assert f"\n- {problem}" in error, error
    assert "webhook" not in error.split(": ", 1)[0]


def test_one_problem_is_one_line(tmp_path):
    error = render_error(tmp_path, {"workers": 0})
    assert "1 value problem, each with the reason" in error
    assert "\n- workers: 0: a number of worker processes from 1 to 64" in error


def test_helm_lint_checks_the_schema_too(tmp_path):
    assert helm("lint", "--strict", str(CHART)).returncode == 0
    result = helm("lint", "--strict", str(CHART), "-f",
                  str(values_file(tmp_path, {"rbac": {"craete": True}})))
    assert result.returncode != 0
    assert "additional properties 'craete' not allowed" in result.stdout + result.stderr
