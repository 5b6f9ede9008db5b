"""The Prometheus pull's one query (issue 54): a pure builder the benchmark shares, its
label values escaped for PromQL (and alert names for RE2 inside `=~`)."""

from __future__ import annotations

import pytest

from gpuguard.engine.alerting.prometheus import firing_query, promql_string

SELECTOR = 'alertname="GPUOrphanTree",hostname="gpu-node-1",remediate="true"'


def test_one_alert_name_is_matched_exactly() -> None:
    assert firing_query(["GPUOrphanTree"], "gpu-node-1") == (
        f"ALERTS_FOR_STATE{{{SELECTOR}}} and ignoring(alertstate) "
        f'ALERTS{{{SELECTOR},alertstate="firing"}}')


def test_several_names_are_one_sorted_regex_of_literals() -> None:
    query = firing_query(["B.x", "A", "A"], "h")
    assert 'alertname=~"A|B\\\\.x"' in query  # RE2 `\.`, then PromQL's `\\`
    assert query.count("alertname=~") == 2


@pytest.mark.parametrize(("value", "quoted"), [
    ('a"b', '"a\\"b"'), ("a\\b", '"a\\\\b"'), ("a\nb", '"a\\nb"'), ("plain", '"plain"'),
])
def test_label_values_are_promql_strings(value: str, quoted: str) -> None:
    assert promql_string(value) == quoted


def test_a_hostname_cannot_break_out_of_its_matcher() -> None:
    query = firing_query(["GPUOrphanTree"], 'x",hostname=~".*')
    # One string per selector: the quote is escaped, so no second matcher is made.
    assert query.count('hostname="x\\",hostname=~\\".*",remediate="true"') == 2


def test_no_alert_names_is_refused() -> None:
    with pytest.raises(ValueError):
        firing_query([], "h")
