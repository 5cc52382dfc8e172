"""What a Prometheus scraper reads of the credential manager."""
from __future__ import annotations


class Samples:
    """The manager's metrics as a scraper reads them: its text, parsed by the Prometheus
    client's own parser (pass as ``h.manager(registry=...)``)."""

    metrics = None

    def get_sample_value(self, name: str, labels: dict[str, str] | None = None):
        from prometheus_client.parser import text_string_to_metric_families

        from kiamfast.metrics_text import render
        text = render(self.metrics.metric_lines()).decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and sample.labels == (labels or {}):
                    return sample.value
        return None
