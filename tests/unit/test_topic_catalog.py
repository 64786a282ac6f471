"""The topic catalog (schemas.topics) against deploy/topics.yaml, and its prefix."""

from __future__ import annotations

from pathlib import Path

import pytest

from schemas.errors import ConfigError
from schemas.topics import TOPICS, Topics
from services.topics import DEFAULT_SPEC, load_topic_specs, load_topics

PREFIXES = ["", "t1.", "tenant-a_", "telemetry."]


def test_the_catalog_names_every_topic_of_the_spec_file_and_no_other() -> None:
    in_file = [s.name for s in load_topic_specs(DEFAULT_SPEC)]
    names = list(TOPICS.names().values())
    assert len(set(names)) == len(names)  # no two roles share a topic
    assert sorted(names) == sorted(in_file)
    assert set(TOPICS.ingest) == {s.name for s in load_topic_specs() if s.format != "refinery"}


@pytest.mark.parametrize("prefix", PREFIXES)
def test_a_prefix_is_applied_to_each_name_exactly_once(prefix: str) -> None:
    cat = TOPICS.with_prefix(prefix)
    base = TOPICS.names()
    assert cat.prefix == prefix
    assert cat.names() == {role: prefix + name for role, name in base.items()}
    # prefixing again, or a catalog that had another prefix, never stacks prefixes
    assert cat.with_prefix(prefix) == cat
    assert TOPICS.with_prefix("other.").with_prefix(prefix) == cat
    # the spec file read with the prefix names the same topics
    assert load_topics(prefix=prefix) == cat
    assert {s.name for s in load_topic_specs(prefix=prefix)} == set(cat.names().values())
    assert cat.role(prefix + "telemetry.refined") == "refined"


def test_a_spec_file_without_a_topic_of_the_catalog_is_a_config_error(tmp_path: Path) -> None:
    text = DEFAULT_SPEC.read_text().replace("telemetry.episodes:", "telemetry.episodez:")
    spec = tmp_path / "topics.yaml"
    spec.write_text(text)
    with pytest.raises(
        ConfigError, match=r"no topic 'telemetry\.episodes' \(the catalog's episodes\)"
    ):
        load_topics(spec)


def test_a_spec_file_may_declare_more_topics_than_the_catalog(tmp_path: Path) -> None:
    extra = "  site.ingest.own:\n    partitions: 8\n    format: influx\n"
    spec = tmp_path / "topics.yaml"
    spec.write_text(DEFAULT_SPEC.read_text() + extra)
    assert load_topics(spec, prefix="p.") == Topics().with_prefix("p.")
