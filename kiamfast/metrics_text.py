"""Prometheus text exposition (format 0.0.4), for the workers' counters and the control
process's metrics alike.

The agent has a few dozen series of three shapes (counters, gauges, kube2iam's histograms),
so it renders them itself: ``prometheus_client`` costs the control process about 10 MiB and
a start-up import for what these sixty lines do.  Label values come from pod authors (role
ARNs), so they are escaped as the format requires; series of one family are written in the
order they were first seen.  A leaf module: it imports nothing of the agent's.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

Labels = tuple[tuple[str, str], ...]


def escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def number(value: float) -> str:
    """A sample value: integers without a fraction, infinities and NaN as the format spells
    them, anything else in Python's shortest round-tripping form."""
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def sample(name: str, value: float, labels: Labels = ()) -> str:
    if not labels:
        return f"{name} {number(value)}"
    inner = ",".join(f'{k}="{escape(v)}"' for k, v in labels)
    return f"{name}{{{inner}}} {number(value)}"


def family(name: str, help_text: str, value: float, kind: str = "gauge") -> list[str]:
    """A family of one series without labels: its header and its sample."""
    return [*header(name, help_text, kind), sample(name, value)]


def header(name: str, help_text: str, kind: str) -> list[str]:
    return [f"# HELP {name} {help_text.replace(chr(92), chr(92) * 2).replace(chr(10), ' ')}",
            f"# TYPE {name} {kind}"]


def histogram_samples(name: str, labels: Labels, bounds: Sequence[float],
                      cumulative: Sequence[float], total: float, count: float) -> list[str]:
    """One histogram series: its buckets (cumulative counts, one per bound), +Inf, sum and
    count."""
    lines = [sample(f"{name}_bucket", n, (*labels, ("le", number(float(bound)))))
             for bound, n in zip(bounds, cumulative)]
    lines.append(sample(f"{name}_bucket", count, (*labels, ("le", "+Inf"))))
    lines.append(sample(f"{name}_sum", total, labels))
    lines.append(sample(f"{name}_count", count, labels))
    return lines


def render(lines: Iterable[str]) -> bytes:
    return ("\n".join(lines) + "\n").encode()


class Counter:
    """A counter family (``name`` ends in ``_total``), one value per label set."""

    kind = "counter"

    def __init__(self, name: str, help_text: str, label_names: Sequence[str] = ()) -> None:
        self.name, self.help, self.label_names = name, help_text, tuple(label_names)
        self.values: dict[tuple[str, ...], float] = {} if label_names else {(): 0}

    def inc(self, amount: float = 1, *label_values: str) -> None:
        self.values[label_values] = self.values.get(label_values, 0) + amount

    def set(self, value: float, *label_values: str) -> None:
        self.values[label_values] = value

    def remove(self, *label_values: str) -> None:
        self.values.pop(label_values, None)

    def lines(self) -> list[str]:
        out = header(self.name, self.help, self.kind)
        for values, value in self.values.items():
            out.append(sample(self.name, value, tuple(zip(self.label_names, values))))
        return out


class Gauge(Counter):
    kind = "gauge"


class Histogram:
    """A histogram family with fixed bucket bounds, one series per label set."""

    def __init__(self, name: str, help_text: str, label_names: Sequence[str],
                 bounds: Sequence[float]) -> None:
        self.name, self.help, self.label_names = name, help_text, tuple(label_names)
        self.bounds = tuple(bounds)
        # label values -> [count per bucket (not cumulative)..., sum, count]
        self.series: dict[tuple[str, ...], list[float]] = {}

    def touch(self, *label_values: str) -> None:
        """Make the series exist before any observation (kube2iam shows some empty)."""
        self.series.setdefault(label_values, [0] * (len(self.bounds) + 2))

    def observe(self, value: float, *label_values: str) -> None:
        s = self.series.setdefault(label_values, [0] * (len(self.bounds) + 2))
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                s[i] += 1
                break
        s[-2] += value
        s[-1] += 1

    def remove(self, *label_values: str) -> None:
        self.series.pop(label_values, None)

    def lines(self) -> list[str]:
        out = header(self.name, self.help, "histogram")
        for values, s in self.series.items():
            cumulative, running = [], 0.0
            for n in s[:len(self.bounds)]:
                running += n
                cumulative.append(running)
            out += histogram_samples(self.name, tuple(zip(self.label_names, values)),
                                     self.bounds, cumulative, s[-2], s[-1])
        return out
