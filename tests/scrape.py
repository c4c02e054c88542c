"""Read a /metrics page in tests: samples keyed `name{a="x",b="y"}` (labels sorted, the
server-wide model_name label left out), as the tests spell them."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def samples(text: str, keep_model_name: bool = False) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = {k: v for k, v in s.labels.items() if keep_model_name or k != "model_name"}
            inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            out[f"{s.name}{{{inner}}}" if inner else s.name] = s.value
    return out
